"""The step transaction and the recovery loop of one training process.

`Trainer.fit(steps)` owns everything between the user's loss function and the next step: the gradient
exchange, the optimizer and scheduler steps, the per-step seeding, and what happens when a peer is lost.
A step is a transaction: the optimizer is applied only after a successful gradient exchange, and a step that
fails is re-run from its start in the next generation, with the same samples and the same random numbers,
so the run continues bit for bit as if nothing had happened.

A standby runs the same script: its `fit` warms up (one sandboxed shadow step that allocates gradients and
optimizer state and sends nothing), waits to be promoted, receives the state into those buffers and goes on.
"""

from __future__ import annotations

import datetime
import logging
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from runtime import store as keys
from runtime.comm import CommFailure, Communicator, GradientBuckets, error_text
from runtime.data import StepData, as_step_data, derive_seed
from runtime.handoff import HandoffError, HandoffSession, MemberStatus, UntrustedReceiver, plan_handoff, run_handoff
from runtime.job import Job, init
from runtime.membership import Generation
from runtime.state import TrainingState

log = logging.getLogger("trainmover.runtime")

POST_RECOVERY_STEPS = 3
STANDBY_WAIT = datetime.timedelta(hours=1)


class GenerationChanged(Exception):
    """The coordinator formed a newer generation while this process was still in an older one."""


@dataclass(frozen=True, slots=True)
class StepResult:
    """What `fit` yields after every committed step."""

    step: int
    loss: float
    rank: int
    world_size: int
    generation: int
    step_s: float


class Trainer:
    """Data-parallel training of any `nn.Module` with any optimizer, surviving the loss of workers."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[nn.Module, Any], torch.Tensor],
        data: StepData | Callable[[int, int, int], Any],
        *,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        seed: int = 0,
        job: Job | None = None,
        bucket_bytes: int = 64 << 20,
    ) -> None:
        """
        Args:
            model: the replica's model, built identically in every process (standbys included).
            optimizer: any `torch.optim` optimizer over the model's parameters.
            loss_fn: `loss_fn(model, batch) -> scalar loss`; forward pass and loss, nothing else.
            data: the batches, addressed by step: `batch_at(step, rank, world_size)` or such a function.
            scheduler: an LR scheduler, stepped once per committed step.
            seed: base of the per-step seeds; step s of rank r runs under seed (seed, s, r).
            job: the joined job; defaults to `runtime.init()`.
            bucket_bytes: size of the flat gradient buffers exchanged as one all-reduce.
        """
        self.job = job or init()
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.loss_fn = loss_fn
        self.data = as_step_data(data)
        self.seed = seed
        self.state = TrainingState(model, optimizer, scheduler)
        self.buckets = GradientBuckets(model.parameters(), bucket_bytes)
        first = next(model.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
        cfg = self.job.cfg
        self.comm = Communicator(cfg.backend, self.job.store, cfg.collective_timeout_s, device)
        self.gen: int | None = None
        self.rank: int | None = None
        self.world_size = 0
        self.committed = 0
        self.has_state = not self.job.is_standby
        self.digest: str | None = None
        self._step_in_flight = 0
        self._step_times: deque[float] = deque(maxlen=20)
        self._report: dict[str, Any] | None = None
        self._post_steps: list[float] = []
        self._warming_up = False
        if self.job.faults:
            optimizer.register_step_post_hook(self._optimizer_fault)
        self.job.heartbeat.on_new_generation.append(self.comm.abort_if_older)

    # -- public --------------------------------------------------------------------------------------
    def fit(self, steps: int) -> Iterator[StepResult]:
        """Train until `steps` steps are committed; yields after each. A standby yields once promoted."""
        if steps < 1:
            raise ValueError(f"steps must be at least 1, got {steps}")
        if self.digest is not None:
            raise RuntimeError("fit() runs once per Trainer: pass the total number of steps to a single fit()")
        store = self.job.store
        if self.gen is None:
            if self.job.is_standby:
                self._warm_up()
                promoted = self._await_promotion()
                if promoted is None:
                    return  # the job ended without needing this standby
                g = promoted
            else:
                keys.wait_keys(store, [keys.k_gen(0)], self.job.cfg.recovery_timeout_s, what="generation 0")
                g = 0
        else:
            g = self.gen
        failure_seen: float | None = None
        while True:
            try:
                self._enter(g, failure_seen)
                failure_seen = None
                while self.committed < steps:
                    yield self._step(self.committed + 1)
                self._finish()
                return
            except keys.Interrupted as stop:
                if str(stop) == "stop":
                    self._stop_requested()
                failure_seen = time.time()
                g = self._recover(g, "a newer generation was formed")
            except (CommFailure, GenerationChanged, HandoffError) as exc:
                failure_seen = time.time()
                message = str(exc) or type(exc).__name__
                untrusted = exc.rank if isinstance(exc, UntrustedReceiver) else None
                del exc
                g = self._recover(g, message, untrusted)

    # -- one step ------------------------------------------------------------------------------------
    def _step(self, step: int) -> StepResult:
        assert self.gen is not None and self.rank is not None
        t0 = time.perf_counter()
        self._step_in_flight = step
        faults = self.job.faults
        batch = self.data.batch_at(step, self.rank, self.world_size)
        torch.manual_seed(derive_seed(self.seed, step, self.rank))
        self.buckets.zero()
        loss = self.loss_fn(self.model, batch)
        loss.backward()
        faults.at("before_exchange", step=step, rank=self.rank, gen=self.gen)
        if self.job.heartbeat.latest_gen > self.gen:
            raise GenerationChanged(f"generation {self.job.heartbeat.latest_gen} formed during step {step}")
        if self.world_size > 1:
            self.buckets.all_reduce_mean(
                self.world_size,
                on_issued=lambda: faults.at("exchange", step=step, rank=self.rank, gen=self.gen),
            )
        faults.at("after_exchange", step=step, rank=self.rank, gen=self.gen)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.committed = step
        self.job.heartbeat.committed_step = step
        step_s = time.perf_counter() - t0
        self._after_commit(step_s)
        return StepResult(step, float(loss.detach()), self.rank, self.world_size, self.gen, step_s)

    def _optimizer_fault(self, *_: Any) -> None:
        if not self._warming_up:
            self.job.faults.at("optimizer", step=self._step_in_flight, rank=self.rank, gen=self.gen)

    def _after_commit(self, step_s: float) -> None:
        if self._report is None:
            self._step_times.append(step_s)
            return
        if "replay_done_at" not in self._report:
            self._report["replay_done_at"] = time.time()
            self._report["replay_step_s"] = step_s
            return
        self._post_steps.append(step_s)
        if len(self._post_steps) >= POST_RECOVERY_STEPS:
            self._publish_report()

    # -- membership ----------------------------------------------------------------------------------
    def _interrupt(self, g: int) -> Callable[[], str | None]:
        store = self.job.store

        def check() -> str | None:
            if store.check([keys.k_stop()]):
                return "stop"
            if keys.get_int(store, keys.k_current_gen()) > g:
                return "newer generation"
            return None

        return check

    def _enter(self, g: int, failure_seen: float | None) -> None:
        """Join generation g: rebuild the group, agree on the newest state, hand it to whoever lacks it."""
        store, cfg = self.job.store, self.job.cfg
        gen_seen = time.time()
        record = Generation.from_json(keys.get_json(store, keys.k_gen(g)))
        rank = record.rank_of(cfg.proc)
        if rank is None:
            sys.stderr.write(f"[trainmover] {cfg.proc} is no longer a member of the job (generation {g}); exiting\n")
            raise SystemExit(1)
        world = record.world_size
        self._flush_report()
        self.comm.teardown()
        interrupt = self._interrupt(g)
        store.set(keys.k_joined(g, rank), "1")
        t_joined = time.time()
        keys.wait_keys(store, [keys.k_joined(g, r) for r in range(world)], cfg.recovery_timeout_s, interrupt,
                       what=f"every member to join generation {g}")
        t_all_joined = time.time()
        self.comm.build(g, rank, world, cfg.connect_timeout_s)
        self.gen, self.rank, self.world_size = g, rank, world
        group_ready = time.time()
        split = {"teardown_s": self.comm.last_teardown_s, "joined_at": t_joined,
                 "join_wait_s": t_all_joined - t_joined, "group_init_s": group_ready - t_all_joined}
        keys.set_json(store, keys.k_status(g, rank), {"step": self.committed, "has_state": self.has_state})
        keys.wait_keys(store, [keys.k_status(g, r) for r in range(world)], cfg.recovery_timeout_s, interrupt,
                       what=f"every member's status in generation {g}")
        statuses = [MemberStatus(r, **keys.get_json(store, keys.k_status(g, r))) for r in range(world)]
        if g == 0:
            self._broadcast_initial_model()
            return
        plan = plan_handoff(statuses)
        if rank in plan.receivers:
            self.has_state = False  # a half-received state is garbage until the handoff completes
        session = HandoffSession(g, record.members, cfg.job_id, cfg.job_token, cfg.chunk_bytes,
                                 fault=lambda phase, **kw: self.job.faults.at(phase, rank=rank, gen=g, **kw))
        stats, _ = run_handoff(plan, session, rank, self.state)
        self.committed = plan.target_step
        self.has_state = True
        self._report = {
            "rank": rank, "proc": cfg.proc, "role": stats.role, "failure_seen_at": failure_seen,
            "gen_seen_at": gen_seen, "group_ready_at": group_ready, "handoff_s": stats.seconds,
            "handoff_bytes": stats.bytes, "handoff_end_at": time.time(), "replay_step": plan.target_step + 1,
            "steady_step_s": statistics.median(self._step_times) if self._step_times else None,
            **split,
        }
        self._post_steps = []

    def _broadcast_initial_model(self) -> None:
        """Generation 0: every replica starts from rank 0's parameters and buffers, as DDP does."""
        failure: str | None = None
        try:
            for _, t in self.state._model_tensors():
                dist.broadcast(t, src=0)
        except RuntimeError as exc:
            failure = error_text(exc)
        if failure is not None:  # raised outside the except block: no traceback may pin the broken group
            raise CommFailure(f"initial broadcast failed: {failure}")

    def _recover(self, g: int, message: str, untrusted: int | None = None) -> int:
        """Leave the broken group, tell the coordinator, wait for the next generation."""
        store, cfg = self.job.store, self.job.cfg
        self.comm.teardown()
        keys.set_json(store, keys.k_failed(g, cfg.proc), {
            "message": message, "time": time.time(), "step": self.committed, "untrusted_rank": untrusted,
        })
        store.add(keys.k_failed_count(g), 1)
        deadline = time.monotonic() + cfg.recovery_timeout_s
        while (newest := keys.get_int(store, keys.k_current_gen())) <= g:
            if store.check([keys.k_stop()]):
                self._stop_requested()
            if time.monotonic() > deadline:
                sys.stderr.write(f"[trainmover] {cfg.proc}: no new generation within {cfg.recovery_timeout_s:.0f} s "
                                 f"after: {message}; exiting\n")
                raise SystemExit(1)
            time.sleep(keys.POLL_S)
        return newest

    def _finish(self) -> None:
        """Stay available as a source until every member has committed the last step."""
        assert self.gen is not None and self.rank is not None
        store = self.job.store
        store.set(keys.k_done(self.gen, self.rank), str(self.committed))
        keys.wait_keys(store, [keys.k_done(self.gen, r) for r in range(self.world_size)],
                       self.job.cfg.recovery_timeout_s, self._interrupt(self.gen), what="every member to finish")
        self._flush_report()
        self.digest = self.state.digest()
        store.set(keys.k_digest(self.job.proc), self.digest)
        self.comm.teardown()

    def _stop_requested(self) -> None:
        self.comm.teardown()
        sys.stderr.write(f"[trainmover] {self.job.proc}: the coordinator stopped the job\n")
        raise SystemExit(1)

    # -- standby -------------------------------------------------------------------------------------
    def _warm_up(self) -> None:
        """One sandboxed shadow step: allocates gradients and optimizer state, warms kernels; sends nothing."""
        t0 = time.perf_counter()
        self._warming_up = True
        try:
            batch = self.data.batch_at(1, 0, self.job.num_workers())
            torch.manual_seed(derive_seed(self.seed, 0, -1))
            self.buckets.zero()
            self.loss_fn(self.model, batch).backward()
            self.optimizer.step()
            self.buckets.zero()
        finally:
            self._warming_up = False
        keys.set_json(self.job.store, keys.k_ready(self.job.proc), {"warmup_s": time.perf_counter() - t0})

    def _await_promotion(self) -> int | None:
        """Block, without polling, until the coordinator assigns a generation (or -1: not needed, leave)."""
        store, key = self.job.store, keys.k_assign(self.job.proc)
        self.job.faults.at("standby_wait")
        while True:
            try:
                store.wait([key], STANDBY_WAIT)
            except dist.DistStoreError:  # an hour passed with nothing to do; the store may be gone
                if self.job.heartbeat.stopping:
                    return None
                continue
            gen = int(store.get(key))
            return gen if gen >= 0 else None

    # -- reports -------------------------------------------------------------------------------------
    def _flush_report(self) -> None:
        if self._report is not None:
            self._publish_report()

    def _publish_report(self) -> None:
        assert self._report is not None and self.gen is not None and self.rank is not None
        self._report["post_steps_s"] = list(self._post_steps)
        keys.set_json(self.job.store, keys.k_report(self.gen, self.rank), self._report)
        self._report = None
        self._post_steps = []
