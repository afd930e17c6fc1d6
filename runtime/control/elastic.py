"""The coordinator's side of elastic width: when a job shrinks or grows, and what a change cost.

- After a loss, `cover_plan` says which lost ranks get standbys: as many as the width target needs (all of them, at
  full width), the lowest ranks first, so that a rank given to a standby keeps its number. With too few standbys
  ready the coordinator waits up to the standby wait, then leaves the rest out (`--shrink`), or stops (`--shrink
  off`, or a sharded job with no replica group to spare).
- A data-parallel job changes width by single members; a sharded job with replica groups (HSDP, DP x TP) by whole
  replica groups (`unit` ranks: shard x tp): a group that lost a rank no standby takes is left out whole, its live
  members released, and every state class still has a home in the groups kept.
- With no loss pending, `resize_plan` moves a running job towards its width target (the logical width, or what a
  resize request set): a planned shrink leaves out the highest ranks; a planned grow adds the standbys that are
  ready. Both are planned generations (`Generation.planned`): the members switch at a step boundary they agree on,
  and no step is abandoned.
- `change_figures` turns the members' reports (`RecoveryReport`) of a planned generation into its cost.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from runtime.wire.protocol import Generation, RecoveryReport


def cover_plan(lost: Iterable[int], world: int, width_target: int, ready: int | None = None,
               unit: int = 1) -> tuple[list[int], list[int]]:
    """(lost ranks that get standbys, ranks left out) after losing `lost` of a generation of `world` members, for
    the job to run at up to `width_target` members with `ready` standbys (None: as many as needed).

    Ranks go in groups of `unit` (a sharded job's replica groups; 1 for a data-parallel job): a group whose lost
    ranks all get standbys is kept, the lowest groups first; any other group that lost a rank is left out whole."""
    lost = sorted(set(lost))
    by_group: dict[int, list[int]] = {}
    for r in lost:
        by_group.setdefault(r // unit, []).append(r)
    intact = world // unit - len(by_group)
    room = max(0, width_target // unit - intact)
    budget = len(lost) if ready is None else ready
    covered: list[int] = []
    left_out: list[int] = []
    for g, ranks in sorted(by_group.items()):
        if room > 0 and len(ranks) <= budget:
            covered += ranks
            budget -= len(ranks)
            room -= 1
        else:
            left_out += range(g * unit, (g + 1) * unit)
    return covered, left_out


def resize_plan(world: int, width_target: int, ready: Sequence[str], unit: int = 1) -> tuple[list[int], list[str]]:
    """(ranks to leave out, standbys to add) that move a generation of `world` members towards `width_target`
    (a multiple of `unit`: whole replica groups of a sharded job)."""
    if world > width_target:
        return list(range(width_target, world)), []
    groups = min(len(ready) // unit, max(0, width_target - world) // unit)
    return [], list(ready[: groups * unit])


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
