"""From a standby plan to cloud actions: a pure function, so every case is a row of a table test.

The policy (`policy.decide_standby`) says how many standbys of each tier are worth their price; the run's limits
(`StandbyLimits`) bound them; what the job holds now is a `Pool`. `pool_change` returns what to do about it, and
`flows.supervisor` carries it out (launches, terminations, stops, the coordinator's standby target) and announces it.
A notice that an instance will be reclaimed becomes a planned move of the ranks it holds (`notice_moves`).

Rules, in the order applied:
- warm standbys: the plan's warm and hot together (a hot standby runs as a warm process here), at least
  `min_warm` and at most `max_warm`. More than the coordinator's target: launch the instances missing and raise
  the target. Fewer: lower the target and terminate the surplus running standby instances, newest first.
- parked (stopped) standbys: the plan's, at most `max_stopped`. More than parked: launch that many and stop them.
  Fewer: terminate the surplus, newest first; the plan's hysteresis and minimum hold keep this from flapping.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from cloud.base import Notice
from flows.models import StandbyLimits
from policy.decision import StandbyPlan


@dataclass(frozen=True, slots=True)
class Pool:
    """The standbys a job holds now."""

    warm: tuple[str, ...] = ()
    """Running standby instances, oldest first."""
    parked: tuple[str, ...] = ()
    """Stopped standby instances, oldest first."""
    warm_target: int = 0
    """Standby processes the coordinator keeps warm."""


@dataclass(frozen=True, slots=True)
class PoolChange:
    """What to do to the pool; nothing at all when `empty`."""

    warm_target: int
    """The coordinator's standby target after the change."""
    stopped_target: int
    """Parked standbys after the change."""
    launch_warm: int = 0
    """Standby instances to launch and keep running."""
    release_warm: tuple[str, ...] = ()
    """Running standby instances to terminate."""
    park: int = 0
    """Standby instances to launch and stop at once (cheap cover)."""
    release_parked: tuple[str, ...] = ()
    """Stopped standby instances to terminate."""
    retarget: bool = False
    """Whether the coordinator's standby target changes."""

    @property
    def empty(self) -> bool:
        return not (self.retarget or self.launch_warm or self.release_warm or self.park or self.release_parked)


def targets(plan: StandbyPlan, limits: StandbyLimits) -> tuple[int, int]:
    """(warm, stopped) the run holds for `plan`, within its limits."""
    warm = min(max(plan.warm + plan.hot, limits.min_warm), limits.max_warm)
    return warm, min(plan.stopped, limits.max_stopped)


def pool_change(plan: StandbyPlan, limits: StandbyLimits, pool: Pool) -> PoolChange:
    """What turns `pool` into what `plan` asks for within `limits` (see the module docstring for the rules)."""
    warm, stopped = targets(plan, limits)
    launch_warm = max(0, warm - len(pool.warm)) if warm > pool.warm_target else 0
    release_warm = pool.warm[warm:] if warm < pool.warm_target else ()
    park = max(0, stopped - len(pool.parked))
    release_parked = pool.parked[stopped:]
    return PoolChange(
        warm_target=warm,
        stopped_target=stopped,
        launch_warm=launch_warm,
        release_warm=tuple(reversed(release_warm)),
        park=park,
        release_parked=tuple(reversed(release_parked)),
        retarget=warm != pool.warm_target,
    )


def notice_moves(notices: Iterable[Notice], workers: Mapping[int, str]) -> list[tuple[list[int], Notice]]:
    """The ranks to move to standbys ahead of their instance's reclaim: (every rank the instance holds, in order,
    and its notice), in notice order, so that a host of several slots moves whole in one request; a notice for an
    instance that holds no rank (a standby, or one already released) moves nothing."""
    ranks_of: dict[str, list[int]] = {}
    for rank, instance in sorted(workers.items()):
        ranks_of.setdefault(instance, []).append(rank)
    return [(ranks_of[n.instance_id], n) for n in notices if n.instance_id in ranks_of]
