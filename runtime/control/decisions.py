"""The coordinator's pure decisions: no store, no processes, no clock; each a function of what it is given.

Kept apart from the loop (runtime.control.coordinator) so that each rule reads on its own and is tested in-process.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from runtime.wire.protocol import MoveRequest, RecoveryReport


@dataclass(frozen=True, slots=True)
class MoveContext:
    """What a planned move is judged against."""

    last_seq: int
    """The newest move request handled so far."""
    started: bool
    finished: bool
    world: int
    recovering: bool
    """A death is pending or a recovery is not reported yet."""
    ready: int
    """Warm standbys that look alive."""


def move_refusal(request: MoveRequest, ctx: MoveContext) -> str | None:
    """Why a move cannot happen now, or None. A move must never cost more than it saves: no restarts."""
    if request.seq <= ctx.last_seq:
        return f"seq {request.seq} is not newer than {ctx.last_seq}, the last request handled"
    if not ctx.started:
        return "training has not started yet"
    if ctx.finished:
        return "training has finished"
    if any(r >= ctx.world for r in request.ranks):
        return f"ranks {list(request.ranks)} are not all worker ranks (0..{ctx.world - 1})"
    if len(request.ranks) == ctx.world:
        return "moving every rank at once would lose the training state; move them in turns"
    if ctx.recovering:
        return "a recovery is in progress; ask again once it is reported"
    if ctx.ready == 0:
        return "no standby ready"
    if ctx.ready < len(request.ranks):
        return f"only {ctx.ready} standbys ready for {len(request.ranks)} ranks"
    return None


def recovery_metrics(deaths: Sequence[tuple[float, float]], reports: Sequence[RecoveryReport]) -> dict[str, Any]:
    """A recovery's figures (DESIGN.md's metric names) from its deaths, each (failure_at, declared_at) in the order
    they were declared, and its members' reports.

    recovery_s runs from the earliest failure to the replayed step's commit; detect_s from the earliest failure to
    the first declaration; reconfigure_s from the last declaration to the last member's group being ready."""
    failure_at = min(f for f, _ in deaths)
    declared_at = max(d for _, d in deaths)
    group_ready = max(r.group_ready_at for r in reports)
    handoff_end = max(r.handoff_end_at for r in reports)
    replay_done = max((r.replay_done_at or handoff_end) for r in reports)
    penalties = [
        max(0.0, sum(r.post_steps_s) - len(r.post_steps_s) * r.steady_step_s)
        for r in reports if r.steady_step_s and r.post_steps_s
    ]
    return {
        "step": reports[0].replay_step,
        "recovery_s": replay_done - failure_at,
        "detect_s": deaths[0][1] - failure_at,
        "reconfigure_s": group_ready - declared_at,
        "handoff_s": max(r.handoff_s for r in reports),
        "handoff_overlapped_s": max(r.handoff_rest_s for r in reports),
        "replay_s": replay_done - handoff_end,
        "warmup_penalty_s": statistics.mean(penalties) if penalties else 0.0,
        # Where reconfiguration went: the slowest member's teardown of the broken group, the barrier, group init.
        "reconfigure_split": {
            "teardown_s": max(r.teardown_s for r in reports),
            "last_joined_after_s": max(r.joined_at if r.joined_at is not None else declared_at
                                       for r in reports) - declared_at,
            "group_init_s": max(r.group_init_s for r in reports),
            "group_build_s": max(r.group_build_s for r in reports),
            "groups_rebuilt": max(r.groups_rebuilt for r in reports),
            "groups": max(r.groups_total for r in reports),
            "groups_for_new_members": max(r.groups_for_new_members for r in reports),
        },
        # What reached the new members: handed over by a peer, or read from a backup (role "backup").
        "handoff_bytes": sum(r.handoff_bytes for r in reports if r.role in ("receiver", "backup")),
        "sources": sorted(r.rank for r in reports if r.role == "source"),
        "refetched_chunks": sum(r.refetched_chunks for r in reports if r.role == "receiver"),
    }
