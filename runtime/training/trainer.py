"""The step transaction and the recovery loop of one training process.

`Trainer.fit(steps)` owns everything between the user's loss function and the next step: the gradient
exchange, the optimizer and scheduler steps, the per-step seeding, and what happens when a peer is lost.
A step is a transaction: the optimizer is applied only after a successful gradient exchange, and a step that
fails is re-run from its start in the next generation, with the same samples and the same random numbers,
so the run continues bit for bit as if nothing had happened.

What a step may change besides the parameters and the optimizer is made replayable too: the model's buffers
(BatchNorm statistics, counters) are copied at the step's start and restored before a replay, and made equal
across ranks after every exchange (rank 0's, as DDP's `broadcast_buffers` does); torch's, Python's and NumPy's
global generators are seeded from (seed, step, rank, micro-batch) before each batch is fetched, so random
augmentation in a dataset replays too. Extra state (EMA weights, a GradScaler, counters) registered with
`register_state` travels with every handoff.

A standby runs the same script: its `fit` warms up (one sandboxed shadow step that allocates gradients and
optimizer state and sends nothing), waits to be promoted, receives the state into those buffers and goes on.
A standby the job never needed leaves the process when the job ends (the rest of the script is the workers').
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hmac
import logging
import os
import random
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from runtime.config import KNOBS
from runtime.training.backup import (
    BackupError,
    BackupSettings,
    BackupWriter,
    Shards,
    find_backup,
    has_backup,
    load_backup,
)
from runtime.training.comm import CommFailure, Communicator, GradientBuckets, error_text
from runtime.training.data import StepData, as_step_data, derive_seed
from runtime.training.elastic import CURSOR_STATE, DataCursor, Layout
from runtime.training.handoff import (
    GlooLinks,
    Handoff,
    HandoffError,
    HandoffPlan,
    HandoffSession,
    HandoffStats,
    MemberStatus,
    StateLost,
    UntrustedPeer,
    plan_handoff,
    run_handoff,
    start_handoff,
)
from runtime.training.hot import HotMirror, HotSource, Message
from runtime.training.job import Job, init
from runtime.training.state import Stateful, StateMeta, StateMismatchError, TrainingState, spec_difference
from runtime.wire import store as keys
from runtime.wire.auth import prove
from runtime.wire.protocol import (
    Assignment,
    CurrentGeneration,
    FailureReport,
    FinalDigest,
    Finished,
    Generation,
    HoldsState,
    Joined,
    ModelSpec,
    RecoveryReport,
    StandbyReady,
    StepStatus,
    StopOrder,
    SwitchPoint,
)

log = logging.getLogger("trainmover.runtime")

POST_RECOVERY_STEPS = 3
STALE_HANDOFF_S = 5.0
"""How long a member leaving a broken generation waits for the rest of its handoff to end (a newer generation cuts
the group's sockets, which fails it at once)."""
STANDBY_WAIT = datetime.timedelta(hours=1)


class GenerationChanged(Exception):
    """The coordinator formed a newer generation while this process was still in an older one."""


class ScriptMismatch(RuntimeError):
    """Processes of the job built different models or optimizers: a script error no recovery can fix."""


class RecoveryRefused(RuntimeError):
    """The lost rank's state cannot be rebuilt exactly (per-rank buffers): the job stops instead of diverging."""


@dataclass(frozen=True, slots=True)
class StepResult:
    """What `fit` yields after every committed step."""

    step: int
    loss: float
    """This rank's loss (the mean over its micro-batches)."""
    rank: int
    world_size: int
    generation: int
    step_s: float
    global_loss: float | None = None
    """The loss averaged over every rank, where the step computed it (with a ReduceLROnPlateau scheduler)."""


def check_step_options(clip_grad_norm: float | None, clip_grad_value: float | None, accumulation_steps: int) -> None:
    """The step options every trainer takes, refused with a message naming the bad one."""
    if clip_grad_norm is not None and not clip_grad_norm > 0:
        raise ValueError(f"clip_grad_norm must be positive, got {clip_grad_norm}")
    if clip_grad_value is not None and not clip_grad_value > 0:
        raise ValueError(f"clip_grad_value must be positive, got {clip_grad_value}")
    if accumulation_steps < 1:
        raise ValueError(f"accumulation_steps must be at least 1, got {accumulation_steps}")


@contextlib.contextmanager
def scaled_lr(optimizer: torch.optim.Optimizer, factor: float) -> Iterator[None]:
    """Every parameter group's learning rate times `factor` inside the block (a shrunk job's step in an lr-* mode,
    runtime.training.elastic); the rates the scheduler set are put back after it."""
    if factor == 1.0:
        yield
        return
    rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * factor
    try:
        yield
    finally:
        for group, lr in zip(optimizer.param_groups, rates, strict=True):
            group["lr"] = lr


@dataclass(frozen=True, slots=True)
class Joining:
    """What a member learned while joining a generation (`Trainer._join`), with the times of each phase."""

    record: Generation
    rank: int
    world_size: int
    interrupt: Callable[[], str | None]
    statuses: list[MemberStatus]
    gen_seen: float
    t_joined: float
    t_all_joined: float
    group_ready: float


def check_group(comm: Communicator, token: str, job_id: str, record: Generation, rank: int,
                group: dist.ProcessGroup | None = None, ranks: tuple[int, ...] | None = None) -> None:
    """Every peer of a generation's new group proves it holds the job's secret, for the rank it holds in it.

    torch writes the group's rendezvous addresses to the store unsealed: an outsider who won the race for one
    would be a peer of the collectives. Its proof fails here and the group is refused (a collective error: the
    coordinator rebuilds it) before any gradient or state is exchanged. No rank is blamed, since the impostor's
    victim is an honest process. One all-gather of 32 bytes per generation.
    """
    g = record.gen
    ranks = ranks if ranks is not None else tuple(range(record.world_size))

    def proof(r: int) -> bytes:
        return bytes.fromhex(prove(token, "group", job_id, g, r, record.members[r]))

    for r, got in zip(ranks, comm.all_gather_bytes(proof(rank), len(ranks), group=group), strict=True):
        if not hmac.compare_digest(got, proof(r)):
            raise CommFailure(f"the peer holding rank {r} in the group of generation {g} failed to prove it "
                              "belongs to the job; the group was refused")


class Trainer:
    """Data-parallel training of any `nn.Module` with any optimizer, surviving the loss of workers."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[nn.Module, Any], torch.Tensor],
        data: StepData | Callable[[int, int, int], Any],
        *,
        scheduler: torch.optim.lr_scheduler.LRScheduler | torch.optim.lr_scheduler.ReduceLROnPlateau | None = None,
        seed: int = 0,
        job: Job | None = None,
        bucket_bytes: int = 64 << 20,
        clip_grad_norm: float | None = None,
        clip_grad_value: float | None = None,
        accumulation_steps: int = 1,
        amp: Literal["bf16", "fp16"] | None = None,
        broadcast_buffers: bool = True,
    ) -> None:
        """
        Args:
            model: the replica's model, built identically in every process (standbys included).
            optimizer: any `torch.optim` optimizer over the model's parameters.
            loss_fn: `loss_fn(model, batch) -> scalar loss`; forward pass and loss, nothing else.
            data: the batches, addressed by step: `batch_at(step, rank, world_size)` or such a function.
            scheduler: an LR scheduler, stepped once per committed step; a `ReduceLROnPlateau` is stepped with
                the loss averaged over every rank (the same value everywhere, so every replica keeps one LR).
            seed: base of the per-step seeds; micro-batch m of step s on rank r runs under seed (seed, s, r, m).
            job: the joined job; defaults to `runtime.init()`.
            bucket_bytes: size of the flat gradient buffers exchanged as one all-reduce.
            clip_grad_norm: clip the averaged gradients to this total 2-norm before the optimizer step.
            clip_grad_value: clip each averaged gradient element to [-value, value] (after norm clipping).
            accumulation_steps: micro-batches per step; their gradients are summed (each loss divided by this)
                before one exchange. Micro-batch m of step s is `data.micro_batch_at(s, m, rank, world_size)`
                where the data defines it, else `data.batch_at((s - 1) * k + m + 1, rank, world_size)`.
            amp: "bf16" runs the forward pass under bf16 autocast (CPU or GPU); "fp16" under fp16 autocast
                with a GradScaler, whose state is handed over with the rest.
            broadcast_buffers: make the model's buffers (BatchNorm statistics) equal on every rank after each
                exchange, as DDP does before each forward (rank 0's). With False every rank keeps its own
                buffers; a lost rank's buffers cannot then be rebuilt, and its recovery is refused.
        """
        check_step_options(clip_grad_norm, clip_grad_value, accumulation_steps)
        if amp not in (None, "bf16", "fp16"):
            raise ValueError(f"amp must be None, 'bf16' or 'fp16', got {amp!r}")
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
        self.clip_grad_norm = clip_grad_norm
        self.clip_grad_value = clip_grad_value
        self.accumulation_steps = accumulation_steps
        self.broadcast_buffers = broadcast_buffers
        self._plateau = isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
        self._autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}[amp]
        self._device_type = device.type
        self.scaler: torch.amp.GradScaler | None = None
        if amp == "fp16":
            self.scaler = torch.amp.GradScaler(device.type)
            self.state.register("grad_scaler", self.scaler)
        # Buffers a step's forward pass changes (BatchNorm running statistics, num_batches_tracked): copied at
        # the step's start, so that a replayed step starts from the same values instead of counting twice.
        self._buffers = [b for b in model.buffers()]
        self._buffer_snapshot: list[torch.Tensor] = [torch.empty_like(b) for b in self._buffers]
        self._snapshot_step = 0
        self._init_membership(device)
        if self.job.cfg.shrink in ("lr-linear", "lr-sqrt"):
            # How far into the data the job is depends on the widths it ran at: part of the state (elastic.py).
            cursor = DataCursor()
            self.state.register(CURSOR_STATE, cursor)
            self.cursor: DataCursor | None = cursor
        if self.job.faults:
            optimizer.register_step_post_hook(self._optimizer_fault)

    def _init_membership(self, device: torch.device) -> None:
        """What every trainer keeps about its place in the job: its group, generation, rank and progress."""
        cfg = self.job.cfg
        self.comm = Communicator(cfg.backend, self.job.store, cfg.collective_timeout_s, device,
                                 newest_gen=lambda: self.job.heartbeat.latest_gen,
                                 stopping=lambda: self.job.heartbeat.stopping)
        self.gen: int | None = None
        self.rank: int | None = None
        self.world_size = 0
        self.committed = 0
        self.has_state = not self.job.is_standby
        self.digest: str | None = None
        self._step_in_flight = 0
        self._step_times: deque[float] = deque(maxlen=20)
        self._report: RecoveryReport | None = None
        self._post_steps: list[float] = []
        self._warming_up = False
        self._group_build_s = 0.0
        self.backups: BackupWriter | None = None
        """Rank 0's persistent backups (`--backup-dir`), made when this process first commits as rank 0."""
        self.layout: Layout | None = None
        """This member's share of each step at the generation's width (runtime.training.elastic)."""
        self.cursor = None
        """The units of data consumed (lr-* shrink modes only; with accumulation it follows from the step)."""
        self._switch_to: tuple[int, int] | None = None
        """A planned generation the members switch to, and the step after which they do."""
        self._handoff: Handoff | None = None
        """A handoff whose optimizer state still streams beside the replayed step (`_settle_handoff`)."""
        self._hot_source: HotSource | None = None
        """The hot standbys this member serves (runtime.training.hot), with `--hot-standbys`."""
        self._hot_mirror: HotMirror | None = None
        """A standby's mirror of the state while it waits, with `--hot-standbys`."""
        self._mirrored = False
        """Promoted holding a mirrored state, until it joined its first generation (`StepStatus.mirrored`)."""
        self.job.heartbeat.on_new_generation.append(self._on_newer_generation)

    def _on_newer_generation(self, latest_gen: int, records: keys.Records) -> None:
        """From the heartbeat thread (`records`: its own store connection): a newer generation formed."""
        self.comm.abort_if_older(latest_gen)
        self.comm.cut_if_older(latest_gen)

    # -- the generation's groups (a sharded trainer keeps some across generations) ----------------------
    def _joined_record(self) -> Joined:
        return Joined()

    def _form_groups(self, g: int, rank: int, record: Generation, joined: dict[int, Joined]) -> float:
        """Build generation g's group, and prove to every peer of it that this process belongs to the job;
        returns the seconds the building took (the rest is the proofs)."""
        cfg = self.job.cfg
        t0 = time.perf_counter()
        self.comm.build(g, rank, record.world_size, cfg.connect_timeout_s)
        built = time.perf_counter() - t0
        check_group(self.comm, cfg.job_token, cfg.job_id, record, rank)
        return built

    def _leave_groups(self) -> None:
        """Leave the current generation's group (broken, or replaced by a newer generation)."""
        self.comm.teardown()

    def _close_groups(self) -> None:
        """Leave every group for good: the job is over, or stopped, for this process."""
        self._close_hot()
        self.comm.teardown()

    def _close_hot(self) -> None:
        if self._hot_source is not None:
            self._hot_source.close()
            self._hot_source = None

    def _reconfigure_figures(self) -> tuple[float, int, int, int]:
        """(seconds spent leaving the old groups, groups rebuilt, groups in the job, groups rebuilt because a member
        did not hold them) of the last generation."""
        return self.comm.last_teardown_s, 1, 1, 1

    # -- public --------------------------------------------------------------------------------------
    def register_state(self, name: str, obj: Stateful) -> None:
        """Hand `obj` (anything with `state_dict`/`load_state_dict`: EMA weights, a counter) over with the state.

        Its state is taken as of the last committed step: change it only after a step commits (in the body of
        the `for result in trainer.fit(...)` loop), never inside `loss_fn`, and it replays exactly.
        """
        if self.gen is not None or self.digest is not None:
            raise RuntimeError("register_state() must be called before fit()")
        self.state.register(name, obj)

    def fit(self, steps: int) -> Iterator[StepResult]:
        """Train until `steps` steps are committed; yields after each. A standby yields once promoted."""
        if steps < 1:
            raise ValueError(f"steps must be at least 1, got {steps}")
        if self.digest is not None:
            raise RuntimeError("fit() runs once per Trainer: pass the total number of steps to a single fit()")
        if self.gen is None:
            self._check_spec()
            if self.job.is_standby:
                self._warm_up()
                self._start_mirror()
                promoted = self._await_promotion()
                self._stop_mirror(promoted is not None)
                if promoted is None:
                    # The job ended without needing this standby. What follows fit() in the script (saving,
                    # printing results) is the workers' business: leave the process here.
                    self.job.close()
                    raise SystemExit(0)
                g = promoted
            else:
                # The coordinator may hold generation 0 until the standbys are warm (or replaced, up to its startup
                # timeout): a worker waits longer than that, so that the coordinator's message is the one given.
                try:
                    self.job.records.wait_records([keys.k_gen(0)], Generation,
                                                  KNOBS.startup_timeout_s + self.job.cfg.recovery_timeout_s,
                                                  interrupt=lambda: "stop" if self.job.heartbeat.stopping else None,
                                                  what="generation 0")
                except keys.Interrupted:  # the job failed before it started (a standby's script, a placement)
                    self._stop_requested()
                g = 0
        else:
            g = self.gen
        failure_seen: float | None = None
        while True:
            try:
                self._enter(g, failure_seen)
                self._serve_hot()
                failure_seen = None
                switch: int | None = None
                while self.committed < steps and switch is None:
                    if self.job.heartbeat.stopping:  # the job was stopped (a signal to its launcher, a failure)
                        self._stop_requested()  # a peer already in the next collective fails on the closed group
                    yield self._step(self.committed + 1)
                    # The script's loop body ran (an EMA updated after the commit is part of the step's state).
                    self._backup(self.committed)
                    if self._hot_source is not None:
                        self._hot_source.boundary(self.committed, self.state, self.buckets.flats, self._buffers)
                    if self.committed < steps:
                        switch = self._planned_switch()
                if switch is not None:
                    g = switch  # a step boundary every member agreed on: nothing is abandoned or replayed
                    continue
                self._finish()
                return
            except keys.Interrupted as stop:
                if str(stop) == "stop":
                    self._stop_requested()
                failure_seen = time.time()
                g = self._recover(g, "a newer generation was formed")
            except StateLost as exc:
                message = str(exc)
                del exc
                g = self._recover(g, message, kind="state_lost")
            except (CommFailure, GenerationChanged, HandoffError, keys.StoreTimeout) as exc:
                failure_seen = time.time()
                message = str(exc) or type(exc).__name__
                untrusted = exc.rank if isinstance(exc, UntrustedPeer) else None
                del exc
                g = self._recover(g, message, untrusted)

    def _planned_switch(self) -> int | None:
        """At a step boundary: the planned generation (a grow, a requested shrink) to switch to now, if any.

        The coordinator publishes a planned generation without making it current, so no step in flight is
        abandoned. The first member to see it here proposes the step after its own last commit as the switch
        point (compare_set: the first proposal wins, and every member reads it). No member can have committed
        that step yet, since its exchange needs the proposer, and each member looks again after every commit: every
        member leaves after the same step. One store round trip per step while nothing is planned."""
        assert self.gen is not None
        records = self.job.records
        if self._switch_to is None:
            nxt = self.gen + 1
            if not records.store.check([keys.k_gen(nxt)]):
                return None
            record = records.get_record(keys.k_gen(nxt), Generation)
            if record is None or not record.planned:
                return None  # a failure's generation: the heartbeat aborts this one
            key = keys.k_switch_at(nxt)
            ours = records.sealer.seal(key, SwitchPoint(self.committed + 1).to_json())
            current = records.store.compare_set(key, "", ours)
            agreed = records.open_record(key, current, SwitchPoint)
            if agreed is None:
                raise CommFailure(f"the switch point of generation {nxt} in the store is not the job's; the "
                                  "members cannot agree on it")
            self._switch_to = (nxt, agreed.step)
        nxt, at = self._switch_to
        if self.committed < at:
            return None
        if self.committed > at:  # cannot happen (see above); a failure's path rebuilds rather than diverge
            raise CommFailure(f"committed step {self.committed} beyond the switch point {at} of generation {nxt}")
        self.job.faults.at("switch", step=at, rank=self.rank, gen=nxt)
        return nxt

    # -- one step ------------------------------------------------------------------------------------
    def _step(self, step: int) -> StepResult:
        assert self.gen is not None and self.rank is not None
        t0 = time.perf_counter()
        self._step_in_flight = step
        self._snapshot_buffers(step)
        faults = self.job.faults
        layout = self.layout
        assert layout is not None
        self.buckets.zero()
        n_units = layout.units_per_step()
        unit_losses = self._units(layout.units(step, self.cursor), layout.logical_width)
        loss = torch.stack(unit_losses).mean() if len(unit_losses) > 1 else unit_losses[0]
        faults.at("before_exchange", step=step, rank=self.rank, gen=self.gen)
        if self.job.heartbeat.latest_gen > self.gen:
            raise GenerationChanged(f"generation {self.job.heartbeat.latest_gen} formed during step {step}")
        global_loss: float | None = None
        # The sum of the units' losses, for a ReduceLROnPlateau scheduler only (it reads the mean over every unit).
        units_loss = 0.0
        if self._plateau:
            units_loss = float(loss) if len(unit_losses) == 1 else float(torch.stack(unit_losses).sum())
        if self.world_size > 1:
            self.buckets.all_reduce_mean(
                n_units,
                on_issued=lambda: faults.at("exchange", step=step, rank=self.rank, gen=self.gen),
                wait=self.comm.wait,
            )
            if self.broadcast_buffers and self._buffers:
                self.comm.broadcast_from_rank0(self._buffers)
            if self._plateau:
                global_loss = self.comm.mean_scalar(units_loss, n_units)
        else:
            if n_units > 1:
                self.buckets.divide(n_units)
            if self._plateau:
                global_loss = units_loss / n_units
        faults.at("after_exchange", step=step, rank=self.rank, gen=self.gen)
        self._settle_handoff()  # the optimizer's state streamed beside this step's passes, or changes once sent
        if self._hot_source is not None:  # the gradients as exchanged, before clipping or unscaling touch them
            self._hot_source.gradients(step, self.buckets.flats, layout.lr_factor())
            self._hot_source.settle()  # a hot standby's sync read the parameters and the optimizer's state
        self._optimizer_step(layout.lr_factor())
        if self.cursor is not None:
            self.cursor.units += n_units
        if self.scheduler is not None:
            if self._plateau:
                self.scheduler.step(global_loss)  # type: ignore[arg-type]
            else:
                self.scheduler.step()
        self.committed = step
        self.job.heartbeat.committed_step = step
        step_s = time.perf_counter() - t0
        self._after_commit(step_s)
        return StepResult(step, float(loss), self.rank, self.world_size, self.gen, step_s, global_loss)

    # -- persistent backups (runtime.training.backup) ------------------------------------------------------
    def _backup(self, step: int) -> None:
        """Rank 0, every `--backup-every` steps: start a backup of step `step`'s state (written beside training),
        once the script's loop body has run after the commit; report the ones finished since (the coordinator's
        `backup_written` events)."""
        cfg = self.job.cfg
        if not cfg.backup_dir or self.rank != 0:
            return
        if self.backups is None:
            self.backups = BackupWriter(BackupSettings(cfg.backup_dir, cfg.backup_every, cfg.backup_keep),
                                        cfg.job_id, self.state.spec())
        self._report_backups()
        self.backups.after_commit(step, self.state)

    def _report_backups(self) -> None:
        """Tell the coordinator of the backups finished since the last look (rank 0 finishes them)."""
        assert self.backups is not None
        for done in self.backups.finished():
            self.job.records.put(keys.k_backup(), done)

    def _finish_backups(self) -> None:
        """The last backup in flight completes (bounded) before the process leaves, and is reported; a backup due
        at the last step that was skipped (the one before was still being written) is written now."""
        if self.backups is None:
            return
        timeout = self.job.cfg.recovery_timeout_s
        self.backups.wait(timeout)
        if self.backups.due(self.committed) and self.backups.last_started != self.committed:
            self.backups.after_commit(self.committed, self.state)
            self.backups.wait(timeout)
        self._report_backups()

    def _backup_shards(self) -> Shards | None:
        """A sharded job's part of a backup (None: the replica is the whole state, and rank 0 writes it alone)."""
        return None

    def _restore_from_backup(self, where: str, rank: int) -> tuple[int, HandoffStats]:
        """Load the backup at `where` (a step-* folder, or the newest in a directory) into this replica; every
        member loads the same one (rank 0's choice, gathered over the generation's group)."""
        t0 = time.perf_counter()
        try:
            chosen = find_backup(where)
        except BackupError as exc:
            raise StateLost(str(exc)) from None
        steps = self.comm.all_gather_bytes(chosen.step.to_bytes(8, "big"), self.world_size, group=self._world())
        step = int.from_bytes(steps[0], "big")
        if step != chosen.step:  # rank 0 saw another newest (one finished between the two looks)
            try:
                chosen = find_backup(where, step)
            except BackupError as exc:
                raise StateLost(f"rank {rank} could not find rank 0's choice, the backup of step {step}: {exc}") \
                    from None
        assert self.state is not None
        try:
            load_backup(chosen, self.state, self._backup_shards())
        except BackupError as exc:
            raise StateLost(f"rank {rank} could not load {chosen.path}: {exc}") from None
        log.warning("rank %d: state restored from the backup of step %d (%s)", rank, step, chosen.path)
        nbytes = sum(int(f["bytes"]) for f in chosen.manifest["files"].values())
        self.job.heartbeat.committed_step = step
        return step, HandoffStats("backup", nbytes, time.perf_counter() - t0)

    def _world(self) -> dist.ProcessGroup | None:
        """The generation's world group (None: the default group, a data-parallel job's)."""
        return None

    def _seed(self, step: int, micro: int, rank: int) -> None:
        """Every generator a step or its data may draw from, seeded from where the step is, not from history."""
        seed = derive_seed(self.seed, step, rank) if micro == 0 else derive_seed(self.seed, step, rank, micro)
        torch.manual_seed(seed)  # CPU and every CUDA device
        random.seed(seed)
        np.random.seed(seed & 0xFFFF_FFFF)

    def _units(self, units: list[tuple[int, int]], width: int) -> list[torch.Tensor]:
        """The micro-batches of each unit of data (a logical rank's batch of a data step, runtime.training.elastic)
        this member trains on; each unit's loss (the mean over its micro-batches). A member of a shrunk job runs
        several units in a step: each starts from the step's buffers (BatchNorm statistics) as its logical rank
        would at full width, and the member keeps the buffers its first unit left (member 0's first unit is
        logical rank 0's, whose buffers the exchange broadcasts)."""
        kept: list[torch.Tensor] | None = None
        out = []
        for i, (data_step, logical) in enumerate(units):
            if i > 0 and self._buffers:
                if kept is None:
                    kept = [b.clone() for b in self._buffers]
                for snap, b in zip(self._buffer_snapshot, self._buffers, strict=True):
                    b.copy_(snap)
            losses = [self._forward_backward(data_step, micro, logical, width)
                      for micro in range(self.accumulation_steps)]
            out.append(torch.stack(losses).mean() if len(losses) > 1 else losses[0])
        if kept is not None:
            for k, b in zip(kept, self._buffers, strict=True):
                b.copy_(k)
        return out

    def _micro_batch(self, step: int, micro: int, rank: int, world_size: int) -> Any:
        k = self.accumulation_steps
        if k == 1:
            return self.data.batch_at(step, rank, world_size)
        micro_batch_at = getattr(self.data, "micro_batch_at", None)
        if callable(micro_batch_at):
            return micro_batch_at(step, micro, rank, world_size)
        return self.data.batch_at((step - 1) * k + micro + 1, rank, world_size)

    def _forward_backward(self, step: int, micro: int, rank: int, world_size: int,
                          seed_rank: int | None = None) -> torch.Tensor:
        """One micro-batch: seed, fetch, forward (under autocast), backward into the gradient buckets."""
        self._seed(step, micro, rank if seed_rank is None else seed_rank)
        batch = self._micro_batch(step, micro, rank, world_size)
        autocast = (torch.autocast(self._device_type, dtype=self._autocast_dtype)
                    if self._autocast_dtype is not None else contextlib.nullcontext())
        with autocast:
            loss = self.loss_fn(self.model, batch)
        scaled = loss / self.accumulation_steps if self.accumulation_steps > 1 else loss
        if self.scaler is not None:
            self.scaler.scale(scaled).backward()
        else:
            scaled.backward()
        return loss.detach().float()

    def _optimizer_step(self, lr_factor: float = 1.0) -> None:
        """Unscale, clip, step: the gradients are the same bits on every rank, so every replica does the same.
        `lr_factor`: the learning rate's scale for this step (a shrunk job in an lr-* mode); the rates the
        scheduler set are put back after it."""
        if lr_factor != 1.0:
            with scaled_lr(self.optimizer, lr_factor):
                self._optimizer_step()
            return
        if self.scaler is not None and (self.clip_grad_norm is not None or self.clip_grad_value is not None):
            self.scaler.unscale_(self.optimizer)
        params = self.buckets.params
        if self.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, self.clip_grad_norm)
        if self.clip_grad_value is not None:
            torch.nn.utils.clip_grad_value_(params, self.clip_grad_value)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()

    def _snapshot_buffers(self, step: int) -> None:
        for snap, b in zip(self._buffer_snapshot, self._buffers, strict=True):
            snap.copy_(b)
        self._snapshot_step = step

    def _restore_uncommitted(self) -> None:
        """Undo what the interrupted step's forward passes did to the buffers; it is replayed from its start."""
        if self._snapshot_step == self.committed + 1:
            for snap, b in zip(self._buffer_snapshot, self._buffers, strict=True):
                b.copy_(snap)
        self._snapshot_step = 0

    def _optimizer_fault(self, *_: Any) -> None:
        if not self._warming_up:
            self.job.faults.at("optimizer", step=self._step_in_flight, rank=self.rank, gen=self.gen)

    def _after_commit(self, step_s: float) -> None:
        if self._report is None:
            self._step_times.append(step_s)
            return
        if self._report.replay_done_at is None:
            if self.committed < self._report.replay_step:
                return  # replaying the steps since a buddy copy (runtime.training.sharded): the replay is not over yet
            self._report = dataclasses.replace(self._report, replay_done_at=time.time(), replay_step_s=step_s)
            # Published at once (and again, final, after the next steps): a failure from here on is a new
            # recovery, and the coordinator must know this one's replay committed.
            self.job.records.put(keys.k_report(self.gen, self.rank), self._report)  # type: ignore[arg-type]
            return
        self._post_steps.append(step_s)
        if len(self._post_steps) >= POST_RECOVERY_STEPS:
            self._publish_report()

    # -- membership ----------------------------------------------------------------------------------
    def _interrupt(self, g: int) -> Callable[[], str | None]:
        records = self.job.records

        def check() -> str | None:
            if records.get_record(keys.k_stop(), StopOrder) is not None:
                return "stop"
            if _current_gen(records) > g:
                return "newer generation"
            return None

        return check

    def _join(self, g: int, pending: bool = False, own: tuple[int, ...] = (), copies: tuple[int, ...] = ()) -> Joining:
        """Join generation g's group (every member proves it belongs to the job) and learn what each member holds.

        `pending`: this member's gradients of step `committed + 1` are complete (a sharded step's commit point);
        `own`, `copies`: the steps of its buddy copies (`runtime.training.buddy`)."""
        records, cfg = self.job.records, self.job.cfg
        gen_seen = time.time()
        record = records.wait_records([keys.k_gen(g)], Generation, cfg.recovery_timeout_s,
                                      what=f"the record of generation {g}")[keys.k_gen(g)]
        rank = record.rank_of(cfg.proc)
        if rank is None:
            if record.planned or cfg.proc in record.released:  # a resize, a move or a shrink released this member
                why = ("its replica group was left out after a loss" if cfg.proc in record.released else
                       "at a step boundary: its rank moved, or the job was resized")
                sys.stderr.write(f"[trainmover] {cfg.proc} left the job in generation {g} ({why}); exiting\n")
                self._close_groups()
                self.job.close()
                # At once, as a process the job no longer needs: the interpreter's finalization after a group's
                # teardown can abort in torch's C++ destructors ("terminate called"), seen once in eight here.
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(0)
            sys.stderr.write(f"[trainmover] {cfg.proc} is no longer a member of the job (generation {g}); exiting\n")
            raise SystemExit(1)
        world = record.world_size
        self._flush_report()
        self._leave_groups()
        interrupt = self._interrupt(g)
        records.put(keys.k_joined(g, rank), self._joined_record())
        t_joined = time.time()
        joined = records.wait_records([keys.k_joined(g, r) for r in range(world)], Joined, cfg.recovery_timeout_s,
                                      interrupt, what=f"every member to join generation {g}")
        t_all_joined = time.time()
        self._group_build_s = self._form_groups(g, rank, record, {r: joined[keys.k_joined(g, r)] for r in range(world)})
        self.gen, self.rank, self.world_size = g, rank, world
        self.layout = Layout(record.logical_width, world, rank, cfg.shrink)
        self._switch_to = None
        group_ready = time.time()
        records.put(keys.k_status(g, rank), StepStatus(self.committed, self.has_state, pending, own, copies,
                                                       mirrored=self._mirrored))
        self._mirrored = False
        found = records.wait_records([keys.k_status(g, r) for r in range(world)], StepStatus, cfg.recovery_timeout_s,
                                     interrupt, what=f"every member's status in generation {g}")
        statuses = [MemberStatus(r, status.step, status.has_state, status.pending, status.own, status.copies,
                                 status.mirrored)
                    for r, status in enumerate(found[keys.k_status(g, r)] for r in range(world))]
        return Joining(record, rank, world, interrupt, statuses, gen_seen, t_joined, t_all_joined, group_ready)

    def _enter(self, g: int, failure_seen: float | None) -> None:
        """Join generation g: rebuild the group, agree on the newest state, hand it to whoever lacks it."""
        records, cfg = self.job.records, self.job.cfg
        joining = self._join(g)
        record, rank, interrupt, statuses = joining.record, joining.rank, joining.interrupt, joining.statuses
        if g == 0:
            self._enter_generation_0(rank)
            return
        if cfg.backup_dir and not any(s.has_state for s in statuses):
            if not has_backup(cfg.backup_dir):
                raise StateLost(f"every copy of the training state was lost at once, and {cfg.backup_dir} holds no "
                                "complete backup yet")
            self.has_state = False  # until the backup is loaded
            step, stats = self._restore_from_backup(cfg.backup_dir, rank)
            self.committed = step
            self.has_state = True
            records.put(keys.k_holds(g, rank), HoldsState(self.committed))
            self._start_report(joining, stats, step, failure_seen)
            return
        plan = plan_handoff(statuses)
        if plan.receivers and not self.broadcast_buffers and self._buffers:
            raise RecoveryRefused(
                f"rank(s) {list(plan.receivers)} lost their state, and with broadcast_buffers=False each rank's "
                "buffers (BatchNorm statistics) are its own: no surviving replica holds them, so the job cannot "
                "continue exactly. Use broadcast_buffers=True (DDP's default) to make them recoverable.")
        # A survivor behind the newest step keeps its own state whole until the handoff completes (it may be the
        # last copy left if the sources die); any other receiver's half-received state is garbage until then.
        behind = rank in plan.receivers and statuses[rank].keeps_own
        if rank in plan.receivers and not behind:
            self.has_state = False
        session = HandoffSession(g, record.members, cfg.job_id, cfg.job_token, cfg.chunk_bytes,
                                 fault=lambda phase, **kw: self.job.faults.at(phase, rank=rank, gen=g, **kw))
        if cfg.handoff_transport == "tls":
            stats = self._handoff_over_tls(plan, session, rank, g, interrupt, behind)
        else:
            # The optimizer's state streams beside the replayed step's passes, unless a receiver keeps an older
            # state of its own until the end (every member reads that in the same statuses: the same phases).
            overlap = cfg.handoff_overlap and not any(statuses[r].keeps_own for r in plan.receivers)
            handoff = start_handoff(plan, session, rank, self.state, links=GlooLinks(cfg.recovery_timeout_s),
                                    keep_own=behind, on_own_lost=self._lost_own_state, overlap=overlap)
            stats = handoff.stats
            if handoff.pending:
                self.committed = plan.target_step
                self._handoff = handoff
                self._start_report(joining, stats, plan.target_step, failure_seen)
                return  # it holds the state once `_settle_handoff` saw the rest arrive
            handoff.wait()
        self.committed = plan.target_step
        self.has_state = True
        records.put(keys.k_holds(g, rank), HoldsState(self.committed))
        self._start_report(joining, stats, plan.target_step, failure_seen)

    def _settle_handoff(self) -> None:
        """Wait for the optimizer's state still streaming from the last handoff (a receiver then holds the whole
        state); raises `CommFailure` or `HandoffError` if it cannot arrive (a source lost), as a failed step does."""
        handoff = self._handoff
        if handoff is None:
            return
        stats, _ = handoff.wait(self.job.cfg.recovery_timeout_s)  # on failure `_recover` drops it
        self._handoff = None
        if self._report is not None:
            self._report = dataclasses.replace(self._report, handoff_rest_s=stats.rest_s,
                                               handoff_bytes=stats.bytes, refetched_chunks=stats.refetched)
        self.has_state = True
        assert self.gen is not None and self.rank is not None
        self.job.records.put(keys.k_holds(self.gen, self.rank), HoldsState(self.committed))

    def _drop_handoff(self) -> None:
        """A failure ended the generation: the rest of its handoff ends with its group (its sockets are cut when a
        newer generation forms). A receiver holds no state then; a source's was only read."""
        handoff, self._handoff = self._handoff, None
        if handoff is None:
            return
        try:
            handoff.wait(STALE_HANDOFF_S)
        except Exception as exc:  # whatever stopped it, the rest did not arrive
            log.info("%s: the rest of the handoff ended with its generation: %s", self.job.proc, exc)
            if handoff.pending:  # still blocked: the group must outlive the thread (never destroyed under it)
                self.comm.keep_stuck([handoff])

    def _enter_generation_0(self, rank: int) -> None:
        """Every member starts from the backup `--resume-from` names, else from rank 0's model (as DDP does)."""
        if self.job.cfg.resume_from:
            self.committed, _ = self._restore_from_backup(self.job.cfg.resume_from, rank)
        else:
            self._broadcast_initial_model()
        self.job.records.put(keys.k_holds(0, rank), HoldsState(self.committed))

    def _start_report(self, joining: Joining, stats: HandoffStats, target_step: int,
                      failure_seen: float | None) -> None:
        """This member's part of the recovery's timing, completed once its replay commits (`_after_commit`)."""
        teardown_s, rebuilt, total, for_new = self._reconfigure_figures()
        self._report = RecoveryReport(
            rank=joining.rank, proc=self.job.cfg.proc, role=stats.role, failure_seen_at=failure_seen,
            gen_seen_at=joining.gen_seen, group_ready_at=joining.group_ready, handoff_s=stats.seconds,
            handoff_bytes=stats.bytes, handoff_end_at=time.time(), replay_step=target_step + 1,
            refetched_chunks=stats.refetched,
            steady_step_s=statistics.median(self._step_times) if self._step_times else None,
            teardown_s=teardown_s, joined_at=joining.t_joined,
            join_wait_s=joining.t_all_joined - joining.t_joined,
            group_init_s=joining.group_ready - joining.t_all_joined,
            group_build_s=self._group_build_s, groups_rebuilt=rebuilt, groups_total=total,
            groups_for_new_members=for_new,
        )
        self._post_steps = []

    def _lost_own_state(self) -> None:
        self.has_state = False

    def _handoff_over_tls(self, plan: HandoffPlan, session: HandoffSession, rank: int, g: int,
                          interrupt: Callable[[], str | None], behind: bool = False) -> HandoffStats:
        """The handoff over mutual-TLS connections (`--handoff-transport tls`): encrypted, for standbys across a
        trust boundary. Its proofs and MACs are the same as over the group."""
        from runtime.training.tls_transport import TlsConfig, TlsLinkError, open_tls_links

        cfg = self.job.cfg
        tls = TlsConfig(cfg.tls_cert, cfg.tls_key, cfg.tls_ca or None, cfg.bind_host)
        try:
            links = open_tls_links(plan, rank, g, self.job.records, tls, cfg.recovery_timeout_s, interrupt=interrupt)
        except TlsLinkError as exc:
            raise CommFailure(f"could not open the TLS links of generation {g}: {exc}") from None
        with links:
            stats, _ = run_handoff(plan, session, rank, self.state, links=links, keep_own=behind,
                                   on_own_lost=self._lost_own_state)
        return stats

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

    def _recover(self, g: int, message: str, untrusted: int | None = None,
                 kind: Literal["comm", "state_lost"] = "comm") -> int:
        """Leave the broken group, undo the interrupted step, tell the coordinator, wait for the next generation."""
        records, cfg = self.job.records, self.job.cfg
        self._drop_handoff()
        if self._hot_source is not None:  # before a handoff of the next generation writes the state
            self._hot_source.settle(STALE_HANDOFF_S)
        self._leave_groups()
        self._restore_uncommitted()
        records.put(keys.k_failed(g, cfg.proc), FailureReport(
            message=message, time=time.time(), step=self.committed, kind=kind, untrusted_rank=untrusted))
        records.store.add(keys.k_failed_count(g), 1)
        deadline = time.monotonic() + cfg.recovery_timeout_s
        while (newest := _current_gen(records)) <= g:
            if records.get_record(keys.k_stop(), StopOrder) is not None:
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
        records = self.job.records
        self._settle_handoff()
        self._finish_backups()
        records.put(keys.k_done(self.gen, self.rank), Finished(self.committed))
        records.wait_records([keys.k_done(self.gen, r) for r in range(self.world_size)], Finished,
                             self.job.cfg.recovery_timeout_s, self._interrupt(self.gen), what="every member to finish")
        self._flush_report()
        self.digest = self._final_digest()
        records.put(keys.k_digest(self.job.proc), FinalDigest(self.digest))
        self._close_groups()

    def _final_digest(self) -> str:
        """The digest every replica publishes at the end (equal digests: bit-identical replicas)."""
        return self.state.digest()

    def _stop_requested(self) -> None:
        self._close_groups()
        sys.stderr.write(f"[trainmover] {self.job.proc}: the coordinator stopped the job\n")
        raise SystemExit(1)

    # -- hot standbys (runtime.training.hot) -------------------------------------------------------------
    def _hot_capable(self) -> bool:
        """Whether this trainer's state can be mirrored by a hot standby (every member holds the whole state)."""
        return self.job.cfg.hot_standbys > 0

    def _serve_hot(self) -> None:
        """In a generation now: serve the hot slots of this member's rank."""
        if self._hot_source is None and self._hot_capable():
            self._hot_source = HotSource(self.job.cfg, self.job.sealer, self.job.cfg.hot_standbys)
        if self._hot_source is not None:
            assert self.rank is not None
            self._hot_source.place(self.rank, self.world_size)

    def _start_mirror(self) -> None:
        if self._hot_capable():
            self._hot_mirror = HotMirror(self.job.cfg, self.job.sealer, self.job.cfg.hot_standbys,
                                         self._hot_apply_sync, self._hot_apply_step)

    def _stop_mirror(self, promoted: bool) -> None:
        """Promoted (or not needed): the mirror ends between two messages; the step it holds is this member's."""
        mirror, self._hot_mirror = self._hot_mirror, None
        if mirror is None:
            return
        held = mirror.stop()
        if held is not None and promoted:
            self.committed = held
            self.has_state = True
            self._mirrored = True
            self.job.heartbeat.committed_step = held
            sys.stderr.write(f"[trainmover] {self.job.proc} stopped mirroring, holding the state of step {held} "
                             f"({mirror.applied} mirror messages applied)\n")

    def _hot_apply_sync(self, msg: Message) -> None:
        """A mirror's `sync`: the whole state of a step, as a handoff would bring it."""
        meta = StateMeta.from_json(msg.meta)
        receiving = self.state.prepare_receive(meta)
        self._copy_parts(receiving, msg.parts)
        self.state.apply_meta(meta)

    def _hot_apply_step(self, msg: Message) -> None:
        """A mirror's `step`: the optimizer step of the sent gradients, then the buffers and the registered state."""
        grads = [t for k, t in msg.parts if k.startswith("grad.")]
        buffers = [t for k, t in msg.parts if k.startswith("buffer.")]
        self._copy_parts(list(zip((f"grad.{i}" for i in range(len(self.buckets.flats))), self.buckets.flats,
                                  strict=True)), [(f"grad.{i}", g) for i, g in enumerate(grads)])
        self._warming_up = True  # no fault of a member's optimizer phase fires in a standby
        try:
            self._optimizer_step(msg.lr_factor)
        finally:
            self._warming_up = False
        self._copy_parts([(f"buffer.{i}", b) for i, b in enumerate(self._buffers)],
                         [(f"buffer.{i}", b) for i, b in enumerate(buffers)])
        meta = StateMeta.from_json(msg.meta)
        extras = [(k, t) for k, t in self.state.prepare_receive(meta) if k.startswith("extra.")]
        self._copy_parts(extras, [(k, t) for k, t in msg.parts if k.startswith("extra.")])
        self.state.apply_meta(meta)

    @staticmethod
    def _copy_parts(into: list[tuple[str, torch.Tensor]], parts: list[tuple[str, torch.Tensor]]) -> None:
        if [k for k, _ in into] != [k for k, _ in parts]:
            raise StateMismatchError("the mirror's message does not name this replica's tensors; start standbys "
                                     "with the same script and arguments as the workers")
        for (key, dst), (_, src) in zip(into, parts, strict=True):
            if dst.numel() != src.numel() or dst.dtype != src.dtype:
                raise StateMismatchError(f"the mirror's {key} is {tuple(src.shape)} {src.dtype}, this replica's "
                                         f"{tuple(dst.shape)} {dst.dtype}")
            dst.copy_(src.view(dst.shape))

    # -- standby -------------------------------------------------------------------------------------
    def _warm_up(self) -> None:
        """One sandboxed shadow step: allocates gradients and optimizer state, warms kernels; sends nothing.

        It runs the step's own path (micro-batches, autocast, GradScaler, clipping), so whatever the first real
        step allocates is allocated here; everything it changes is overwritten by the handoff.
        """
        t0 = time.perf_counter()
        self.job.faults.at("warmup")
        self._warming_up = True
        try:
            self.buckets.zero()
            for micro in range(self.accumulation_steps):
                self._forward_backward(1, micro, 0, self.job.num_workers(), seed_rank=-1)
            self._optimizer_step()
            self.buckets.zero()
        finally:
            self._warming_up = False
        self.job.records.put(keys.k_ready(self.job.proc), StandbyReady(time.perf_counter() - t0))

    def _check_spec(self) -> None:
        """Every process must build the same model, parameter groups and registered state: compare with the
        job's first, before anything is exchanged. A difference is a script error, not a lost machine."""
        records, proc = self.job.records, self.job.proc
        mine = self.state.spec()
        records.put(keys.k_spec(proc), ModelSpec(mine))
        ours = records.sealer.seal(keys.k_job_spec(), ModelSpec(mine).to_json())
        expected = ""
        for _ in range(10):
            current = records.store.compare_set(keys.k_job_spec(), expected, ours)
            reference = records.open_record(keys.k_job_spec(), current, ModelSpec)
            if reference is not None:
                break
            expected = current.decode(errors="surrogateescape")  # not the job's: replace what an outsider wrote
        else:
            raise keys.StoreTimeout("could not publish the job's spec: something keeps overwriting it")
        if reference.spec == mine:
            return
        difference = spec_difference(mine, reference.spec, proc, "the first process to join")
        if difference is not None:
            raise ScriptMismatch(
                f"this process built a different model or optimizer from the rest of the job: {difference}. "
                "Every process (standbys included) must build the same model, parameter groups and registered "
                "state.")

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
            assignment = self.job.records.get_record(key, Assignment)
            if assignment is not None:
                return assignment.gen if assignment.gen >= 0 else None
            # Not sealed by the coordinator (refused and counted): wait for its own value to replace it.
            if self.job.heartbeat.stopping:
                return None
            time.sleep(0.05)

    # -- reports -------------------------------------------------------------------------------------
    def _flush_report(self) -> None:
        if self._report is not None:
            self._publish_report()

    def _publish_report(self) -> None:
        assert self._report is not None and self.gen is not None and self.rank is not None
        final = dataclasses.replace(self._report, post_steps_s=list(self._post_steps), final=True)
        self.job.records.put(keys.k_report(self.gen, self.rank), final)
        self._report = None
        self._post_steps = []


def _current_gen(records: keys.Records) -> int:
    current = records.get_record(keys.k_current_gen(), CurrentGeneration)
    return current.gen if current is not None else -1
