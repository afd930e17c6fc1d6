"""The fleet simulator: replay a fault trace against a standby policy and report ETTR and cost per useful hour.

This module owns the *what-if*: given the observed faults of a fleet (`FaultTrace`), the cost owner's prices
(`StandbyCosts`) and a standby policy, it replays the faults in time order and says how much of the wall time the
job trained (`ettr`) and what standbys plus downtime cost per productive hour (`cost_per_useful_hour`, DESIGN.md).

Model, in the order the simulator applies it:

- The job runs on `job_nodes` of the trace's `n_nodes` (all of them by default). A fault on a node outside the
  job does not hurt it. A fault that starts while the same node is still down from an earlier fault is not a new
  failure of the job (that node was already replaced).
- A policy is a schedule of target standby counts per tier, piecewise constant in time (`StandbySchedule`).
  A change of target takes effect at once: the policy is assumed to order ahead, the same for every policy.
- A job failure takes the fastest available standby ("covered": downtime = that tier's `takeover_s`); with none
  available it is "uncovered" (downtime = `restart_downtime_s`). A consumed standby leaves a hole in its tier
  for `lead_time_h` (replenishment): available = max(0, target - holes), so re-deciding cannot skip the lead time.
- Standby hours accrue for available standbys only; a replacement still on its way is not yet paid for.
- Downtimes add up (a failure during another failure's downtime adds its own); productive time is the wall time
  minus the total downtime, floored at zero.

The simulation is event-driven: schedule changes, failures and replenishment arrivals are merged in time order
(a heap for arrivals), so its cost grows with the number of events, never with nodes x hours.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

from policy.costs import TIER_NAMES, StandbyCosts, TierName
from policy.decision import FleetState, NodeHazards, decide_standby, poisson_binomial_tail
from policy.traces import FaultTrace

_SECONDS_PER_HOUR = 3600.0
# Event kinds at equal times: a new target applies first, then a replacement arrives, then a failure strikes,
# so a failure exactly at a window start or at a replenishment sees the standbys meant for that instant.
_SCHEDULE, _ARRIVAL, _FAILURE = 0, 1, 2

HazardFn = Callable[[float, tuple[str, ...]], "npt.ArrayLike"]
"""(time in hours, job node ids) -> P(each node fails within the lead time L), one per node."""


# ----------------------------------------------------------------------------------------------- the job's view


@dataclass(frozen=True, slots=True)
class JobView:
    """What a policy may look at: the job's nodes, its failures (for oracles only) and the prices."""

    trace: FaultTrace
    costs: StandbyCosts
    node_ids: tuple[str, ...]
    """The job's nodes; nodes that never failed are named `never-failed-<i>`."""
    failure_times_h: npt.NDArray[np.float64]
    """Sorted start times of the faults that hurt the job. Only an oracle may use these."""
    failure_nodes: tuple[str, ...]
    """The node of each failure, aligned with `failure_times_h`."""

    @property
    def job_nodes(self) -> int:
        return len(self.node_ids)

    @property
    def duration_h(self) -> float:
        return self.trace.duration_h


def job_view(trace: FaultTrace, costs: StandbyCosts, job_nodes: int | None = None, seed: int = 0) -> JobView:
    """Place the job on `job_nodes` of the fleet's nodes (a seeded random choice; all of them by default)."""
    n = trace.n_nodes if job_nodes is None else job_nodes
    if not 1 <= n <= trace.n_nodes:
        raise ValueError(f"job_nodes={job_nodes} must lie in [1, {trace.n_nodes}] (the trace's n_nodes)")
    affected = sorted(trace.affected_nodes())
    fleet = affected + [f"never-failed-{i}" for i in range(trace.n_nodes - len(affected))]
    if n == trace.n_nodes:
        chosen = tuple(fleet)
    else:
        picks = np.sort(np.random.default_rng(seed).choice(trace.n_nodes, size=n, replace=False))
        chosen = tuple(fleet[int(i)] for i in picks)
    members = set(chosen)
    down_until: dict[str, float] = {}
    times: list[float] = []
    nodes: list[str] = []
    for r in trace.records:  # sorted by start time
        if r.node_id not in members:
            continue
        if r.start_h >= down_until.get(r.node_id, -math.inf):
            times.append(r.start_h)
            nodes.append(r.node_id)
        end = math.inf if r.end_h is None else r.end_h
        down_until[r.node_id] = max(down_until.get(r.node_id, -math.inf), end)
    return JobView(trace, costs, chosen, np.asarray(times, dtype=np.float64), tuple(nodes))


# -------------------------------------------------------------------------------------------------- policies


@dataclass(frozen=True, slots=True)
class StandbySchedule:
    """Target standby counts per tier, piecewise constant: row i holds from `times_h[i]` to the next time."""

    times_h: npt.NDArray[np.float64]
    """Sorted change times in hours, the first one 0."""
    counts: npt.NDArray[np.int64]
    """Shape (len(times_h), 3): targets in `TIER_NAMES` order (stopped, warm, hot)."""

    def __post_init__(self) -> None:
        if self.times_h.ndim != 1 or self.counts.shape != (self.times_h.size, len(TIER_NAMES)):
            raise ValueError(f"schedule: {self.times_h.shape} times but counts of shape {self.counts.shape}")
        if self.times_h.size == 0 or self.times_h[0] != 0.0 or np.any(np.diff(self.times_h) < 0):
            raise ValueError("schedule: times_h must be sorted and start at 0")
        if np.any(self.counts < 0):
            raise ValueError("schedule: standby counts must be >= 0")


def constant_schedule(counts: dict[TierName, int]) -> StandbySchedule:
    row = np.array([[counts.get(t, 0) for t in TIER_NAMES]], dtype=np.int64)
    return StandbySchedule(np.zeros(1), row)


class StandbyPolicy(Protocol):
    """A standby policy: a name for tables and the targets it would set over the job's life."""

    @property
    def name(self) -> str: ...

    def schedule(self, job: JobView) -> StandbySchedule: ...


def _check_tier(tier: TierName, costs: StandbyCosts) -> None:
    if tier not in costs.tiers:
        raise ValueError(f"tier {tier!r} is not offered in costs.tiers ({sorted(costs.tiers)}); pick one of those")


@dataclass(frozen=True, slots=True)
class NoStandby:
    """Checkpoint-restart only: every failure costs `restart_downtime_s` of whole-job downtime."""

    name: str = "no-standby"

    def schedule(self, job: JobView) -> StandbySchedule:
        return constant_schedule({})


@dataclass(frozen=True, slots=True)
class StaticFraction:
    """Always hold ceil(fraction x job nodes) standbys of one tier."""

    fraction: float
    tier: TierName = "warm"

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"fraction={self.fraction} must lie in [0, 1], e.g. 0.05 for 5% of the job's nodes")

    @property
    def name(self) -> str:
        return f"static-{self.fraction:.0%}-{self.tier}"

    def schedule(self, job: JobView) -> StandbySchedule:
        _check_tier(self.tier, job.costs)
        # A tiny epsilon keeps 0.05 x 400 at 20, not 21, despite binary rounding.
        return constant_schedule({self.tier: math.ceil(self.fraction * job.job_nodes - 1e-9)})


def static_5pct(tier: TierName = "warm") -> StaticFraction:
    return StaticFraction(0.05, tier)


def static_10pct(tier: TierName = "warm") -> StaticFraction:
    return StaticFraction(0.10, tier)


@dataclass(frozen=True, slots=True)
class BinomialP99:
    """Hold the smallest k with P(failures within L > k) < 1 - quantile, every node failing at the fleet's mean rate."""

    tier: TierName = "warm"
    quantile: float = 0.99

    @property
    def name(self) -> str:
        return f"binomial-p{self.quantile * 100:g}-{self.tier}"

    def schedule(self, job: JobView) -> StandbySchedule:
        _check_tier(self.tier, job.costs)
        trace = job.trace
        node_h = trace.n_nodes * trace.duration_h
        rate_per_node_h = len(trace.records) / node_h if node_h > 0 else 0.0
        p = -math.expm1(-rate_per_node_h * job.costs.lead_time_h)
        tail = poisson_binomial_tail(np.full(job.job_nodes, p))  # tail[k] = P(failures >= k)
        k = next(k for k in range(tail.size) if k + 1 >= tail.size or tail[k + 1] < 1.0 - self.quantile)
        return constant_schedule({self.tier: k})


def best_tier(costs: StandbyCosts) -> TierName | None:
    """The tier with the largest saving per covered failure when held for one lead time; None if none saves."""
    net = {t: costs.avoided_usd(t) - tc.price_usd_per_h * costs.lead_time_h for t, tc in costs.tiers.items()}
    tier = max(net, key=lambda t: net[t])
    return tier if net[tier] > 0 else None


@dataclass(frozen=True, slots=True)
class Oracle:
    """Perfect foresight, for regret: during each lead-time window [jL, (j+1)L) hold exactly as many standbys of
    the best tier as failures will hit in that window, plus targets that fill the holes its own consumptions
    leave, so every failure is covered and no standby is held in a window without failures."""

    name: str = "oracle"

    def schedule(self, job: JobView) -> StandbySchedule:
        tier = best_tier(job.costs)
        f = job.failure_times_h
        if tier is None or f.size == 0:
            return constant_schedule({})
        lead = job.costs.lead_time_h

        def window_of(t_h: npt.NDArray[np.float64]) -> npt.NDArray[np.int64]:
            # The epsilon keeps a window start j x L in window j despite binary rounding of (j x L) / L.
            return np.floor(t_h / lead + 1e-9).astype(np.int64)

        window = window_of(f)
        starts = np.unique(window) * lead
        points = np.unique(np.concatenate([[0.0], starts, starts + lead, f, f + lead]))
        w_of_point = window_of(points)
        # Failures in each point's window, and holes still open at each point (failures in (t - L, t]).
        in_window = np.searchsorted(window, w_of_point, side="right") - np.searchsorted(window, w_of_point)
        holes = np.searchsorted(f, points, side="right") - np.searchsorted(f, points - lead, side="right")
        target = np.where(in_window > 0, in_window + holes, 0)
        counts = np.zeros((points.size, len(TIER_NAMES)), dtype=np.int64)
        counts[:, TIER_NAMES.index(tier)] = target
        return StandbySchedule(points, counts)


@dataclass(frozen=True, slots=True)
class HazardPolicy:
    """Call `decide_standby` every `every_h` hours with per-node hazards from `hazard_fn(time_h, node_ids)`.

    The learned predictor plugs in here; the policy carries its own plan forward as the `FleetState`, so the
    decision's hysteresis and minimum hold time act as they would in production.
    """

    hazard_fn: HazardFn
    every_h: float = 1.0
    name: str = "hazard"

    def __post_init__(self) -> None:
        if not self.every_h > 0:
            raise ValueError(f"every_h={self.every_h} must be > 0 hours")

    def schedule(self, job: JobView) -> StandbySchedule:
        times = np.arange(0.0, max(job.duration_h, self.every_h), self.every_h)
        counts = np.zeros((times.size, len(TIER_NAMES)), dtype=np.int64)
        fleet = FleetState()
        for i, t_h in enumerate(times):
            p = np.asarray(self.hazard_fn(float(t_h), job.node_ids), dtype=np.float64)
            hazards = NodeHazards(node_ids=job.node_ids, p_fail=tuple(float(x) for x in p))
            plan = decide_standby(hazards, job.costs, fleet, now_s=float(t_h) * _SECONDS_PER_HOUR)
            counts[i] = [plan.count(t) for t in TIER_NAMES]
            if any(plan.count(t) != fleet.count(t) for t in TIER_NAMES):
                fleet = FleetState(
                    stopped=plan.stopped, warm=plan.warm, hot=plan.hot, last_change_s=float(t_h) * _SECONDS_PER_HOUR
                )
        return StandbySchedule(times, counts)


# ------------------------------------------------------------------------------------------------ simulation


@dataclass(frozen=True, slots=True)
class SimulationResult:
    """How one policy fared on one trace. Hours throughout; costs in USD."""

    policy: str
    wall_h: float
    productive_h: float
    downtime_h: float
    ettr: float
    """Productive hours / wall hours."""
    standby_hours: dict[TierName, float]
    """Hours of available standbys held, per tier offered."""
    standby_cost_usd: float
    downtime_cost_usd: float
    """Downtime hours x whole-job price."""
    cost_per_useful_hour: float
    """(standby cost + downtime cost) / productive hours; infinite when nothing was productive."""
    covered_failures: int
    uncovered_failures: int
    covered_by_tier: dict[TierName, int] = field(default_factory=dict)

    @property
    def failures(self) -> int:
        return self.covered_failures + self.uncovered_failures


def simulate(
    trace: FaultTrace,
    costs: StandbyCosts,
    policy: StandbyPolicy,
    job_nodes: int | None = None,
    seed: int = 0,
) -> SimulationResult:
    """Replay `trace` with `policy`'s standbys and report ETTR and costs (model: see the module docstring)."""
    job = job_view(trace, costs, job_nodes, seed)
    return _run(job, policy.name, policy.schedule(job))


def _run(job: JobView, name: str, sched: StandbySchedule) -> SimulationResult:
    costs, duration = job.costs, job.duration_h
    if not duration > 0:
        raise ValueError("the trace's duration_h is 0; a simulation needs a window of positive length")
    offered = [TIER_NAMES.index(t) for t in sorted(costs.tiers, key=lambda t: costs.tiers[t].takeover_s)]
    n_tiers = len(TIER_NAMES)
    lead = costs.lead_time_h

    keep = sched.times_h < duration
    s_times, s_counts = sched.times_h[keep], sched.counts[keep]
    f_times = job.failure_times_h
    target = [0] * n_tiers
    holes = [0] * n_tiers
    arrivals: list[tuple[float, int]] = []  # (time_h, tier index)
    standby_h = [0.0] * n_tiers
    covered = [0] * n_tiers
    uncovered = 0
    downtime_s = 0.0
    now = 0.0
    i_s = i_f = 0

    def accrue(until: float) -> None:
        dt = until - now
        if dt > 0:
            for k in offered:
                standby_h[k] += max(0, target[k] - holes[k]) * dt

    while True:
        candidates: list[tuple[float, int]] = []
        if i_s < s_times.size:
            candidates.append((float(s_times[i_s]), _SCHEDULE))
        if arrivals:
            candidates.append((arrivals[0][0], _ARRIVAL))
        if i_f < f_times.size:
            candidates.append((float(f_times[i_f]), _FAILURE))
        if not candidates:
            break
        t, kind = min(candidates)
        if t > duration:
            break
        accrue(t)
        now = t
        if kind == _SCHEDULE:
            target = [int(c) for c in s_counts[i_s]]
            i_s += 1
        elif kind == _ARRIVAL:
            _, k = heapq.heappop(arrivals)
            holes[k] -= 1
        else:
            i_f += 1
            tier = next((k for k in offered if target[k] - holes[k] > 0), None)
            if tier is None:
                uncovered += 1
                downtime_s += costs.restart_downtime_s
            else:
                covered[tier] += 1
                holes[tier] += 1
                heapq.heappush(arrivals, (t + lead, tier))
                downtime_s += costs.tiers[TIER_NAMES[tier]].takeover_s
    accrue(duration)

    downtime_h = downtime_s / _SECONDS_PER_HOUR
    productive_h = max(0.0, duration - downtime_h)
    hours = {TIER_NAMES[k]: standby_h[k] for k in offered}
    standby_usd = sum(h * costs.tiers[t].price_usd_per_h for t, h in hours.items())
    downtime_usd = downtime_h * costs.job_price_usd_per_h
    return SimulationResult(
        policy=name,
        wall_h=duration,
        productive_h=productive_h,
        downtime_h=downtime_h,
        ettr=productive_h / duration,
        standby_hours=hours,
        standby_cost_usd=standby_usd,
        downtime_cost_usd=downtime_usd,
        cost_per_useful_hour=(standby_usd + downtime_usd) / productive_h if productive_h > 0 else math.inf,
        covered_failures=sum(covered),
        uncovered_failures=uncovered,
        covered_by_tier={TIER_NAMES[k]: covered[k] for k in offered},
    )


# ------------------------------------------------------------------------------------------------ comparison


@dataclass(frozen=True, slots=True)
class ComparisonRow:
    """One line of `compare_policies`: a policy's headline figures and its regret against the oracle."""

    name: str
    ettr: float
    cost_per_useful_hour: float
    regret_usd_per_useful_h: float
    """cost_per_useful_hour minus the oracle's: what imperfect foresight costs per productive hour."""
    covered_failures: int
    uncovered_failures: int
    standby_cost_usd: float
    downtime_cost_usd: float
    result: SimulationResult


def default_policies() -> list[StandbyPolicy]:
    """The baselines a cost owner compares against: none, static 5% and 10% warm, binomial p99 warm, oracle."""
    return [NoStandby(), static_5pct(), static_10pct(), BinomialP99(), Oracle()]


def compare_policies(
    trace: FaultTrace,
    costs: StandbyCosts,
    policies: Sequence[StandbyPolicy] | None = None,
    job_nodes: int | None = None,
    seed: int = 0,
) -> list[ComparisonRow]:
    """Simulate each policy on the same job and return one row per policy, with regret against `Oracle`."""
    job = job_view(trace, costs, job_nodes, seed)
    chosen = list(default_policies() if policies is None else policies)
    results = [_run(job, p.name, p.schedule(job)) for p in chosen]
    oracle = next((r for p, r in zip(chosen, results, strict=True) if isinstance(p, Oracle)), None)
    if oracle is None:
        oracle = _run(job, Oracle().name, Oracle().schedule(job))
    return [
        ComparisonRow(
            name=r.policy,
            ettr=r.ettr,
            cost_per_useful_hour=r.cost_per_useful_hour,
            regret_usd_per_useful_h=r.cost_per_useful_hour - oracle.cost_per_useful_hour,
            covered_failures=r.covered_failures,
            uncovered_failures=r.uncovered_failures,
            standby_cost_usd=r.standby_cost_usd,
            downtime_cost_usd=r.downtime_cost_usd,
            result=r,
        )
        for r in results
    ]


def format_table(rows: Sequence[ComparisonRow]) -> str:
    """The comparison as a fixed-width text table, one policy a line."""
    head = (
        f"{'policy':<22} {'ettr':>8} {'usd/useful_h':>13} {'regret':>9} {'covered':>8} {'uncovered':>9} "
        f"{'standby_usd':>12} {'downtime_usd':>13}"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"{r.name:<22} {r.ettr:>8.5f} {r.cost_per_useful_hour:>13.2f} {r.regret_usd_per_useful_h:>9.2f} "
            f"{r.covered_failures:>8d} {r.uncovered_failures:>9d} {r.standby_cost_usd:>12.0f} "
            f"{r.downtime_cost_usd:>13.0f}"
        )
    return "\n".join(lines)
