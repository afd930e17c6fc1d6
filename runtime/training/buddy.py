"""Buddy copies: a second home for shards that no replica group holds (FSDP over every rank).

Every `every` committed steps each rank snapshots its own local state (its shards, optimizer state, scheduler,
RNG) into host memory and sends the snapshot to its *keeper*, the rank `offset` places after it, which keeps it
in its own host memory (Gemini, SOSP 2023; checkpointless training's replicated state). The default offset is
half the world: with ranks placed on hosts in consecutive blocks (as the coordinator places them) a rank's
keeper is on another host.

The copy runs beside training: a background thread clones the local tensors while the next step's forward and
backward run (the optimizer waits for the clone before it changes them), then streams the snapshot to the
keeper over a Gloo group of its own while the keeper's thread receives its buddy's. Each side keeps the two
newest complete versions (own snapshots and copies), so a rank lost in the middle of a refresh still leaves a
complete copy of the previous one.

Recovery from copies (`plan_restore`): the newest step s that every rank's state can be rebuilt at, from its own
snapshot (a survivor) or its keeper's copy (a lost rank, or a survivor whose keeper is alive); every rank goes
back to s, and the steps since are replayed exactly (data and RNG are addressed by step).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from runtime.training.handoff import HandoffPlan, StateLost
from runtime.training.state import StateMeta, TrainingState

log = logging.getLogger("trainmover.runtime")

KEEP = 2
"""Complete versions kept of each: the newest, and the one before (a refresh cut short leaves it intact)."""
TAG_HEADER = 1
TAG_META = 2
TAG_TENSOR0 = 16


class Snapshot:
    """One rank's local state at one step, in host memory: a source for a handoff like a live `TrainingState`."""

    def __init__(self, step: int, meta: StateMeta, tensors: list[tuple[str, torch.Tensor]]) -> None:
        self.step = step
        self._meta = meta
        self._tensors = tensors

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        return self._tensors

    def meta(self, step: int = 0, extra: Any = None) -> StateMeta:
        return self._meta

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self._tensors)

    @classmethod
    def of(cls, step: int, meta: StateMeta, tensors: list[tuple[str, torch.Tensor]]) -> Snapshot:
        """Clone `tensors` into host memory (pinned where a GPU is in use)."""
        out = []
        for key, t in tensors:
            if t.device.type == "cpu":
                copy = t.detach().clone(memory_format=torch.contiguous_format)
            else:
                copy = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                copy.copy_(t.detach(), non_blocking=True)
            out.append((key, copy))
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        return cls(step, meta, out)


def _keep_newest(versions: dict[int, Snapshot], snapshot: Snapshot) -> None:
    versions[snapshot.step] = snapshot
    for old in sorted(versions)[:-KEEP]:
        del versions[old]


@dataclass(frozen=True, slots=True)
class BuddyStatus:
    """What a member of a new generation holds: its own snapshots' steps and its copies' (of its buddy)."""

    rank: int
    alive: bool
    """It held state in the previous generation (a survivor); a standby holds no snapshot."""
    own: tuple[int, ...]
    copies: tuple[int, ...]


def keeper_of(rank: int, world: int, offset: int) -> int:
    return (rank + offset) % world


def default_offset(world: int) -> int:
    return max(1, world // 2)


def plan_restore(statuses: list[BuddyStatus], offset: int, target: int, max_replay: int,
                 describe: Callable[[int], str] | None = None) -> tuple[int, dict[int, HandoffPlan]]:
    """The step every rank goes back to, and for each rank that cannot restore itself, who sends it its state.

    `target` is the newest step committed; a step more than `max_replay` steps older is no candidate (the
    copies kept are the two newest: anything older means a copy was lost). Step 0 is every rank's home (each
    process builds the initial state from the same seed). Raises `StateLost` naming a rank whose state exists
    nowhere within reach (it and its keeper lost together)."""
    world = len(statuses)
    by_rank = {s.rank: s for s in statuses}

    def home(rank: int, step: int) -> str | None:
        if step == 0:
            return "build"
        if by_rank[rank].alive and step in by_rank[rank].own:
            return "own"
        keeper = by_rank[keeper_of(rank, world, offset)]
        if keeper.alive and step in keeper.copies:
            return "keeper"
        return None

    held = {step for s in statuses if s.alive for step in (*s.own, *s.copies)}
    candidates = sorted(step for step in held | {0} if 0 <= target - step <= max_replay)[::-1]
    for step in candidates:
        homes = {r: home(r, step) for r in range(world)}
        if all(homes.values()):
            plans = {r: HandoffPlan(step, (keeper_of(r, world, offset),), (r,))
                     for r, where in homes.items() if where == "keeper"}
            return step, plans
    lost = next((r for r in range(world) if not any(home(r, step) for step in candidates)), 0)
    what = describe(lost) if describe is not None else f"rank {lost}'s state"
    raise StateLost(
        f"{what} (rank {lost}) was lost together with its buddy copy on rank {keeper_of(lost, world, offset)}: no "
        f"process holds it within {max_replay} steps of step {target}; restart the job from its last backup "
        "(trainmover run --resume-from DIR)")


class BuddyCopies:
    """This rank's own snapshots and its copies of its buddy's, refreshed in the background every `every` steps."""

    def __init__(self, every: int, offset: int | None = None) -> None:
        if every < 1:
            raise ValueError(f"buddy copies every {every} steps: give a positive number of steps")
        self.every = every
        self.offset = offset
        self.own: dict[int, Snapshot] = {}
        self.copies: dict[int, Snapshot] = {}
        self._thread: threading.Thread | None = None
        self._cloned = threading.Event()
        self._cloned.set()
        self._failure: str | None = None
        self.refreshes = 0
        self.waited_s = 0.0
        """Time the optimizer waited for a clone to finish (the copy's stall on the step)."""

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def memory_bytes(self) -> int:
        return sum(s.state_bytes() for s in (*self.own.values(), *self.copies.values()))

    def steps(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The steps of this rank's complete own snapshots and of its complete copies of its buddy's."""
        return tuple(sorted(self.own)), tuple(sorted(self.copies))

    def refresh(self, state: TrainingState, step: int, rank: int, world: int, group: dist.ProcessGroup) -> None:
        """Start refreshing both copies at `step` (just committed; the previous refresh has ended: `settle`).

        The metadata and the registered extra state (which the script may change right after the step) are
        taken here; the model's and optimizer's tensors are cloned by the refresh's thread."""
        if self._thread is not None:
            raise RuntimeError("a buddy refresh is still running: settle() it first")
        offset = self.offset or default_offset(world)
        keeper, buddy = keeper_of(rank, world, offset), (rank - offset) % world
        meta = state.meta(step).copy()
        tensors = [(k, t.detach().clone() if k.startswith("extra.") else t) for k, t in state.tensors()]
        self._cloned.clear()
        self._thread = threading.Thread(target=self._run, args=(step, meta, tensors, keeper, buddy, group),
                                        name="tm-buddy", daemon=True)
        self._thread.start()
        self.refreshes += 1

    def before_update(self) -> None:
        """Block until the running refresh has cloned the live tensors (the optimizer is about to change them)."""
        if not self._cloned.is_set():
            import time

            t0 = time.perf_counter()
            self._cloned.wait()
            self.waited_s += time.perf_counter() - t0

    def cancel(self, timeout_s: float = 10.0) -> bool:
        """The generation is over: wait (bounded) for the running refresh to end; its transfers fail at once if a
        peer is gone, or when the new generation shuts the old connections."""
        return self.settle(timeout_s)

    def settle(self, timeout_s: float | None = 30.0) -> bool:
        """Wait for the running refresh to end; False if it is still running after `timeout_s`."""
        thread = self._thread
        if thread is None:
            return True
        thread.join(timeout_s)
        if thread.is_alive():
            return False
        self._thread = None
        return True

    def _run(self, step: int, meta: StateMeta, tensors: list[tuple[str, torch.Tensor]], keeper: int, buddy: int,
             group: dist.ProcessGroup) -> None:
        try:
            mine = Snapshot.of(step, meta, tensors)
        finally:
            self._cloned.set()
        _keep_newest(self.own, mine)
        try:
            received = self._exchange(mine, keeper, buddy, group)
        except RuntimeError as exc:  # a peer lost mid-refresh: the previous copies stay the complete ones
            self._failure = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
            return
        if received is not None:
            _keep_newest(self.copies, received)

    @staticmethod
    def _exchange(mine: Snapshot, keeper: int, buddy: int, group: dist.ProcessGroup) -> Snapshot | None:
        """Send `mine` to the keeper and receive the buddy's snapshot, both at once."""
        meta = json.dumps({"meta": mine.meta().to_json(),
                           "tensors": [[k, list(t.shape), str(t.dtype).removeprefix("torch.")]
                                       for k, t in mine.tensors()]}).encode()
        header_out = torch.tensor([mine.step, len(meta)], dtype=torch.int64)
        header_in = torch.zeros(2, dtype=torch.int64)
        sends = [dist.isend(header_out, group=group, group_dst=keeper, tag=TAG_HEADER)]
        _wait_all([dist.irecv(header_in, group=group, group_src=buddy, tag=TAG_HEADER)])
        step_in, meta_len = (int(v) for v in header_in.tolist())
        meta_in = torch.zeros(meta_len, dtype=torch.uint8)
        sends.append(dist.isend(torch.frombuffer(bytearray(meta), dtype=torch.uint8), group=group, group_dst=keeper,
                                tag=TAG_META))
        _wait_all([dist.irecv(meta_in, group=group, group_src=buddy, tag=TAG_META)])
        described = json.loads(meta_in.numpy().tobytes())
        into = [(key, torch.empty(shape, dtype=getattr(torch, dtype))) for key, shape, dtype in described["tensors"]]
        recvs = [dist.irecv(t, group=group, group_src=buddy, tag=TAG_TENSOR0 + i) for i, (_, t) in enumerate(into)]
        sends += [dist.isend(t, group=group, group_dst=keeper, tag=TAG_TENSOR0 + i)
                  for i, (_, t) in enumerate(mine.tensors())]
        _wait_all(list(recvs))
        _wait_all(list(sends))
        return Snapshot(step_in, StateMeta.from_json(described["meta"]), into)

    def take_failure(self) -> str | None:
        failure, self._failure = self._failure, None
        return failure


def _wait_all(works: list[dist.Work | None]) -> None:
    """Wait for every transfer, each bounded by the buddy group's timeout. Not in slices: a Gloo receive whose
    wait times out is over (its buffer given up), so a slow peer would fail the refresh. A peer that is gone
    fails the wait at once; one cut off fails it when the next generation shuts this generation's connections
    (`Communicator.cut_if_older`)."""
    for work in works:
        if work is None:
            raise RuntimeError("a buddy-copy transfer was not started: this rank is not in the group")
        work.wait()
