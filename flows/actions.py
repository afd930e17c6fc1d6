"""From a standby plan to cloud actions: a pure function, so every case is a row of a table test.

The policy (`policy.decide_standby`) says how many standbys of each tier are worth their price; the run's limits
(`StandbyLimits`) bound them; what the job holds now is a `Pool`. `pool_change` returns what to do about it, and
`flows.supervisor` carries it out (launches, terminations, stops, the coordinator's standby target) and announces it.
A notice that an instance will be reclaimed becomes a planned move of the ranks it holds (`notice_moves`).
Before any launch or wake-up the supervisor asks `cap_refusal` whether the run's caps (`max_instances`,
`max_spend_usd`) allow it.

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
from typing import Any, Literal

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


SPEND_LOOKAHEAD_H = 1.0
"""A launch or wake-up is priced as the spend so far plus this many hours of everything the run would then hold
(on the run's clock): a run does not grow a fleet it could not keep for an hour within `max_spend_usd`."""

CapName = Literal["max_instances", "max_spend_usd"]


@dataclass(frozen=True, slots=True)
class Caps:
    """A run's limits on what it holds and spends (`TrainingRun.max_instances`, `.max_spend_usd`); None: no cap."""

    max_instances: int | None = None
    max_spend_usd: float | None = None


@dataclass(frozen=True, slots=True)
class Held:
    """What a run holds and has spent when a launch is checked against its caps."""

    instances: int = 0
    """Instances held now, every role and tier (parked ones too)."""
    usd_per_h: float = 0.0
    """What they cost per hour: workers and warm standbys at the node price, parked ones at the stopped tier's."""
    spent_usd: float = 0.0
    """What the run's instances cost so far, those released since included."""


@dataclass(frozen=True, slots=True)
class CapRefusal:
    """A launch a cap refuses: which cap, its limit, the figure the launch would have reached, and one message."""

    cap: CapName
    limit: float
    would_reach: float
    message: str

    def payload(self) -> dict[str, Any]:
        return {"cap": self.cap, "limit": self.limit, "would_reach": round(self.would_reach, 2),
                "message": self.message}


def cap_refusal(caps: Caps, held: Held, *, instances: int, usd_per_h: float, what: str, also: str = ""
                ) -> CapRefusal | None:
    """Whether `caps` refuse `what`, which adds `instances` instances and `usd_per_h` to `held`; None: allowed.
    A wake-up adds no instance (the parked one is counted already) but its price difference. The message names
    the cap, the figure the launch would reach, and what to change (`also`: a second remedy, e.g. "lower
    run.workers")."""
    fix = "raise run.{cap}" + (f", or {also}" if also else "")
    if caps.max_instances is not None and instances > 0 and held.instances + instances > caps.max_instances:
        total = held.instances + instances
        return CapRefusal(
            "max_instances", caps.max_instances, total,
            f"max_instances={caps.max_instances} refuses {what}: the job would hold {total} instances ({held.instances}"
            f" now + {instances}; workers, standbys of every tier and replacements count together); nothing was "
            f"launched for it; {fix.format(cap='max_instances')}",
        )
    if caps.max_spend_usd is not None and usd_per_h > 0:
        hourly = held.usd_per_h + usd_per_h
        reach = held.spent_usd + SPEND_LOOKAHEAD_H * hourly
        if reach > caps.max_spend_usd:
            return CapRefusal(
                "max_spend_usd", caps.max_spend_usd, reach,
                f"max_spend_usd={caps.max_spend_usd:.2f} refuses {what}: the run would reach {reach:.2f} USD "
                f"({held.spent_usd:.2f} spent so far + {SPEND_LOOKAHEAD_H:g} h of the {held.instances + instances} "
                f"instance(s) it would then hold, at {hourly:.2f} USD/h); nothing was launched for it; "
                f"{fix.format(cap='max_spend_usd')}",
            )
    return None
