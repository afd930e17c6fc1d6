"""The coordinator's side of elastic width: when a job shrinks or grows, and what a change cost.

- After a loss, `standbys_needed` says how many of the lost ranks get standbys: as many as the width target needs
  (all of them, at full width), the lowest ranks first, so that a rank given to a standby keeps its number. With
  too few standbys ready the coordinator waits up to the standby wait, then leaves the rest out (`--shrink`), or
  stops (`--shrink off`, or a sharded job).
- With no loss pending, `resize_plan` moves a running job towards its width target (the logical width, or what a
  resize request set): a planned shrink leaves out the highest ranks; a planned grow adds the standbys that are
  ready. Both are planned generations (`Generation.planned`): the members switch at a step boundary they agree on,
  and no step is abandoned.
- `change_figures` turns the members' reports (`RecoveryReport`) of a planned generation into its cost.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from runtime.wire.protocol import Generation, RecoveryReport


def standbys_needed(lost: int, world: int, width_target: int) -> int:
    """How many of `lost` ranks of a generation of `world` members need standbys for the job to run at
    `width_target` members (every one of them at full width; the lowest ranks get them)."""
    return max(0, min(lost, width_target - (world - lost)))


def resize_plan(world: int, width_target: int, ready: Sequence[str]) -> tuple[list[int], list[str]]:
    """(ranks to leave out, standbys to add) that move a generation of `world` members towards `width_target`."""
    if world > width_target:
        return list(range(width_target, world)), []
    return [], list(ready[: max(0, width_target - world)])


@dataclass
class PlannedChange:
    """A planned generation published and not yet switched to by every member."""

    old: Generation
    new: Generation
    kind: str
    """"grow", "shrink" or "move" (a planned move of a data-parallel job)."""
    cause: str
    left_out: list[tuple[int, str]] = field(default_factory=list)
    """(rank, process) left out, numbered as in `old`."""
    added: list[str] = field(default_factory=list)
    current: bool = False
    """Whether the coordinator made it the current generation (once every member joined it)."""


@dataclass(frozen=True, slots=True)
class ChangeFigures:
    stall_s: float
    """From the first member that held the state leaving the old generation to the last one holding it in the new."""
    first_step_s: float | None
    steady_step_s: float | None
    handoff_bytes: int
    group_s: float
    """Of the stall, the slowest member's new group (built and proven)."""
    handoff_s: float
    """Of the stall, the slowest member's handoff (the new member's receive)."""


def change_figures(reports: Sequence[RecoveryReport]) -> ChangeFigures:
    """The cost of a planned change from its members' first reports (each published once the first step in the
    new generation committed)."""
    # A new member sees the generation long before the others leave theirs (it waits for them): the stall starts
    # when the first member that held the state left its old generation.
    stayed = [r.gen_seen_at for r in reports if r.role != "receiver" and r.gen_seen_at is not None]
    left = min(stayed) if stayed else min(r.handoff_end_at for r in reports)
    holding = max(r.handoff_end_at for r in reports)
    first = [r.replay_step_s for r in reports if r.replay_step_s is not None]
    steady = [r.steady_step_s for r in reports if r.steady_step_s is not None]
    received = sum(r.handoff_bytes for r in reports if r.role == "receiver")
    return ChangeFigures(stall_s=max(0.0, holding - left), first_step_s=max(first) if first else None,
                         steady_step_s=statistics.median(steady) if steady else None, handoff_bytes=received,
                         group_s=max(r.group_init_s for r in reports), handoff_s=max(r.handoff_s for r in reports))
