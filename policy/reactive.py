"""A reactive policy: hold one more standby for a while after each of the job's failures.

Failures come in bursts on real fleets (racks, switches, rollouts: docs/policy.md), so the hours right after a
failure carry more risk than the others. `ReactiveHold` keeps a base pool (the static a cost owner would pick,
less its warm standby) and orders one warm standby when the job fails, holding it `hold_h` hours after the last
failure. It uses nothing but the failures already seen: its target at hour t depends only on failures at or
before t (the simulator's lead time then delays the order's arrival), which a test checks by cutting the trace.

`fit_reactive_hold` picks the base pool and `hold_h` on the hours before a cut, as every other candidate is fitted
(`policy.history.candidates`); `trainmover policy evaluate --trace NAME` judges it beside the others, kept only
with an edge on the training part (`--candidates reactive-hold` judges it alone).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from policy.costs import TIER_NAMES, StandbyCosts, TierName
from policy.simulator import (
    JobView,
    NoStandby,
    StandbyPolicy,
    StandbySchedule,
    StaticPool,
    compare_policies,
    static_pools,
)
from policy.traces import FaultTrace
from policy.verdict import cheapest_static

HOLDS_H: tuple[float, ...] = (1.0, 3.0, 6.0, 12.0, 24.0, 48.0, 96.0)
"""The hold times `fit_reactive_hold` tries, in hours."""


@dataclass(frozen=True, slots=True)
class ReactiveHold:
    """`base`, plus `extra` standbys of `tier` from each job failure until `hold_h` hours after the latest one."""

    base: StaticPool
    hold_h: float
    tier: TierName = "warm"
    extra: int = 1
    label: str = field(default="reactive-hold")

    def __post_init__(self) -> None:
        if not self.hold_h > 0 or self.extra < 1:
            raise ValueError(f"hold_h={self.hold_h} must be > 0 hours and extra={self.extra} at least 1")

    @property
    def name(self) -> str:
        return self.label

    @property
    def description(self) -> str:
        """What it holds, in words (the evaluation prints it)."""
        return (f"{self.base.name} plus {self.extra} {self.tier} standby held {self.hold_h:g} h after each job "
                "failure")

    def schedule(self, job: JobView) -> StandbySchedule:
        base = np.array([self.base.counts()[t] for t in TIER_NAMES], dtype=np.int64)
        raised = base.copy()
        raised[TIER_NAMES.index(self.tier)] += self.extra
        # Raised at hour t exactly when some failure f <= t has t < f + hold_h: the union of those intervals, each
        # one's end moved only by failures inside it (known by then), so no row looks ahead.
        spans: list[list[float]] = []
        for f in map(float, job.failure_times_h):  # sorted
            if spans and f <= spans[-1][1]:
                spans[-1][1] = max(spans[-1][1], f + self.hold_h)
            else:
                spans.append([f, f + self.hold_h])
        times, rows = [0.0], [base]
        for start_h, end_h in spans:
            if start_h <= times[-1]:
                rows[-1] = raised
            else:
                times.append(start_h)
                rows.append(raised)
            times.append(end_h)
            rows.append(base)
        return StandbySchedule(np.asarray(times, dtype=np.float64), np.vstack(rows))


def _without_one(pool: StaticPool, tier: TierName) -> StaticPool:
    counts = pool.counts()
    if counts[tier] > 0:
        counts[tier] -= 1
    return StaticPool(hot=counts["hot"], warm=counts["warm"], stopped=counts["stopped"], spot=counts["spot"])


def fit_reactive_hold(
    head: FaultTrace,
    costs: StandbyCosts,
    node_ids: Sequence[str],
    *,
    holds_h: Sequence[float] = HOLDS_H,
    tier: TierName = "warm",
    name: str = "reactive-hold",
) -> ReactiveHold:
    """On `head` (the hours it may learn from): the cheapest static per useful hour, less one `tier` standby, as
    the base; then the hold time whose policy is cheapest per useful hour there (ties: the shorter hold)."""
    statics: list[StandbyPolicy] = [NoStandby(), *static_pools(costs.tiers)]
    cheapest = cheapest_static(compare_policies(head, costs, statics, node_ids=node_ids)).name
    pool = next((p for p in statics if p.name == cheapest and isinstance(p, StaticPool)), StaticPool())
    base = _without_one(pool, tier)
    tried = [ReactiveHold(base, h, tier, label=f"{name}-{h:g}h") for h in holds_h]
    scored = compare_policies(head, costs, list(tried), node_ids=node_ids)
    best = min(zip(tried, scored, strict=True), key=lambda pr: (pr[1].cost_per_useful_hour, pr[0].hold_h))[0]
    return ReactiveHold(base, best.hold_h, tier, label=name)


__all__ = ["HOLDS_H", "ReactiveHold", "fit_reactive_hold"]
