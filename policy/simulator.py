"""The fleet simulator: replay a fault trace against a standby policy and report ETTR and cost per useful hour.

This module owns the *what-if*: given the observed faults of a fleet (`FaultTrace`), the cost owner's prices
(`StandbyCosts`) and a standby policy, it replays the faults in time order and says how much of the wall time the
job trained (`ettr`) and what standbys plus downtime cost per productive hour (`cost_per_useful_hour`, DESIGN.md).

Model, in the order the simulator applies it:

- The job runs on `job_nodes` of the trace's `n_nodes` (all of them by default). A fault on a node outside the
  job does not hurt it. A fault that starts while the same node is still down from an earlier fault is not a new
  failure of the job (that node was already replaced).
- A policy is a schedule of target standby counts per tier, piecewise constant in time (`StandbySchedule`).
  The targets at hour 0 are provisioned with the job and available at once. After that, a standby is *ordered*:
  it is billed from the order and available `lead_time_h` (L) later, the same lead time a consumed standby's
  replacement takes. So no policy can conjure a standby the instant before a failure: foresight must reach at
  least L ahead to pay off, which is what makes a predictor's lead time worth something.
- When a target falls, pending orders are cancelled first (latest first), then available standbys released.
- A job failure takes the fastest available standby ("covered": downtime = that tier's expected takeover,
  `StandbyCosts.expected_takeover_s`: its `takeover_s` plus, with its `wake_failure_prob`, an uncovered failure's
  downtime); with none available it is "uncovered" (downtime = `StandbyCosts.uncovered_downtime_s`: waiting for a
  replacement host, then the restart). A job that can shrink (`StandbyCosts.shrink_s`: data-parallel, `trainmover
  run --shrink`) rides an uncovered failure out instead: `shrink_s` of downtime plus one node's share of the job's
  throughput until the replacement arrives (`uncovered_cost_s`; lost throughput, not downtime), where that is the
  cheaper. The consumed standby is reordered at once while the target still asks for it. Expected downtimes keep
  the replay deterministic.
- Standby hours accrue for available and ordered standbys (the cloud bills a launching instance too).
- Downtimes add up (a failure during another failure's downtime adds its own); productive time is the wall time
  minus the total downtime, floored at zero.
- The oracle knows every failure time. Each covered failure costs any policy at least min(its start, L) hours
  of the covering standby (it was ordered at least L before, or held from hour 0) and each standby covers one
  failure, so choosing per failure between "uncovered" and "a standby of tier t ordered exactly L before"
  is optimal; the oracle makes that choice for the ratio cost_per_useful_hour itself (Dinkelbach's method), so
  its cost is a lower bound for every policy on the same job.

The simulation is event-driven: schedule changes, failures and replenishment arrivals are merged in time order
(a heap for arrivals), so its cost grows with the number of events, never with nodes x hours.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np
import numpy.typing as npt

from policy.costs import DEFAULT_TIER_NAMES, TIER_NAMES, StandbyCosts, TierName
from policy.decision import (
    CostFigures,
    Counts,
    FleetState,
    StandbyPlan,
    binomial_tail,
    decide_counts,
    decide_from_tail,
    poisson_binomial_tails,
    rule_counts,
)
from policy.traces import FaultTrace

_SECONDS_PER_HOUR = 3600.0
# Event kinds at equal times: an ordered standby arrives first, then a failure strikes, then a new target
# applies, so a standby ordered exactly L before a failure covers it and a target that falls at a failure's
# instant does not release the standby that failure needs.
_ARRIVAL, _FAILURE, _SCHEDULE, _RECLAIM = 0, 1, 2, 3
_SPOT = TIER_NAMES.index("spot")
# Orders placed this much earlier than L before a failure arrive no later than it despite binary rounding.
_ORDER_SLACK_H = 1e-9

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
    seed: int = 0
    """Seed of the job's random draws (its placement, and when the provider reclaims spot standbys)."""

    @property
    def job_nodes(self) -> int:
        return len(self.node_ids)

    @property
    def duration_h(self) -> float:
        return self.trace.duration_h


def fleet_node_ids(trace: FaultTrace) -> tuple[str, ...]:
    """Every node of the fleet: the trace's affected nodes, then `never-failed-<i>` for the others. Pass it as
    `node_ids` to place the same job on two parts of one trace (`split_trace`), whose affected nodes differ."""
    affected = sorted(trace.affected_nodes())
    return (*affected, *(f"never-failed-{i}" for i in range(trace.n_nodes - len(affected))))


def shifted(policy: StandbyPolicy, offset_h: float) -> StandbyPolicy:
    """`policy` for a job that starts `offset_h` hours into the hazards' clock (only `HazardPolicy` has one)."""
    if isinstance(policy, HazardPolicy):
        return replace(policy, offset_h=policy.offset_h + offset_h)
    return policy


def job_view(
    trace: FaultTrace,
    costs: StandbyCosts,
    job_nodes: int | None = None,
    seed: int = 0,
    node_ids: Sequence[str] | None = None,
) -> JobView:
    """Place the job on `job_nodes` of the fleet's nodes (a seeded random choice; all of them by default).

    `node_ids` names every node of the fleet (a synthetic fleet knows them, so a predictor's hazards can be
    looked up by node); without it, nodes that never failed are named `never-failed-<i>`.
    """
    n = trace.n_nodes if job_nodes is None else job_nodes
    if not 1 <= n <= trace.n_nodes:
        raise ValueError(f"job_nodes={job_nodes} must lie in [1, {trace.n_nodes}] (the trace's n_nodes)")
    if node_ids is not None:
        fleet = list(node_ids)
        if len(fleet) != trace.n_nodes or len(set(fleet)) != len(fleet):
            raise ValueError(f"node_ids must name the trace's {trace.n_nodes} nodes once each, got {len(fleet)}")
        missing = trace.affected_nodes() - set(fleet)
        if missing:
            raise ValueError(f"node_ids lacks nodes that appear in the trace, e.g. {sorted(missing)[:3]}")
    else:
        fleet = list(fleet_node_ids(trace))
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
    return JobView(trace, costs, chosen, np.asarray(times, dtype=np.float64), tuple(nodes), seed)


# -------------------------------------------------------------------------------------------------- policies


@dataclass(frozen=True, slots=True)
class StandbySchedule:
    """Target standby counts per tier, piecewise constant: row i holds from `times_h[i]` to the next time."""

    times_h: npt.NDArray[np.float64]
    """Sorted change times in hours, the first one 0."""
    counts: npt.NDArray[np.int64]
    """Shape (len(times_h), 4): targets in `TIER_NAMES` order (stopped, warm, hot, spot)."""

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
    """Checkpoint-restart only: every failure costs `uncovered_downtime_s` of whole-job downtime."""

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


@dataclass(frozen=True, slots=True)
class StaticPool:
    """Always hold a fixed pool that may mix tiers, e.g. one hot standby plus two stopped ones.

    Failures take the fastest available standby first, so a pool like "1 hot + 2 stopped" covers the first
    failure in about a second and a burst of up to three within the lead time in minutes, for little more than
    the price of one standby.
    """

    hot: int = 0
    warm: int = 0
    stopped: int = 0
    label: str | None = None
    """A name for tables (e.g. the rule this pool was frozen from); default `static-h{hot}-w{warm}-s{stopped}`,
    with `-p{spot}` after it for a pool with spot standbys."""
    spot: int = 0

    def __post_init__(self) -> None:
        if min(self.hot, self.warm, self.stopped, self.spot) < 0:
            raise ValueError(
                f"a pool holds >= 0 standbys per tier, got hot={self.hot} warm={self.warm} stopped={self.stopped} "
                f"spot={self.spot}"
            )

    @property
    def name(self) -> str:
        spot = f"-p{self.spot}" if self.spot else ""
        return self.label or f"static-h{self.hot}-w{self.warm}-s{self.stopped}{spot}"

    def counts(self) -> dict[TierName, int]:
        return {"hot": self.hot, "warm": self.warm, "stopped": self.stopped, "spot": self.spot}

    def schedule(self, job: JobView) -> StandbySchedule:
        for tier, n in self.counts().items():
            if n:
                _check_tier(tier, job.costs)
        return constant_schedule(self.counts())


POOL_HOT: tuple[int, ...] = (0, 1, 2)
POOL_WARM: tuple[int, ...] = (0, 1, 2)
POOL_STOPPED: tuple[int, ...] = (0, 1, 2, 3, 4, 6, 8, 12, 16)
"""The grid of mixed-tier pools that `static_pools` offers: few fast standbys for the first failures of a burst,
more cheap stopped ones behind them (a burst of failures within one lead time is what a pool must absorb)."""
POOL_SPOT: tuple[int, ...] = (0, 1, 2, 4)
"""Spot standbys added to every pool of the grid when the spot tier is offered."""


def static_pools(
    tiers: Iterable[TierName] = DEFAULT_TIER_NAMES,
    hot: Sequence[int] = POOL_HOT,
    warm: Sequence[int] = POOL_WARM,
    stopped: Sequence[int] = POOL_STOPPED,
    spot: Sequence[int] = POOL_SPOT,
) -> list[StaticPool]:
    """Every pool of the grid (hot x warm x stopped, x spot when offered) that uses only `tiers` and holds at least
    one standby."""
    offered = set(tiers)
    return [
        StaticPool(hot=h, warm=w, stopped=s, spot=p)
        for p in (spot if "spot" in offered else (0,))
        for h in (hot if "hot" in offered else (0,))
        for w in (warm if "warm" in offered else (0,))
        for s in (stopped if "stopped" in offered else (0,))
        if h + w + s + p > 0
    ]


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
        tail = binomial_tail(job.job_nodes, p)  # tail[k] = P(failures >= k); O(k), not O(nodes^2)
        k = next(k for k in range(tail.size) if k + 1 >= tail.size or tail[k + 1] < 1.0 - self.quantile)
        return constant_schedule({self.tier: k})


@dataclass(frozen=True, slots=True)
class ConstantHazard:
    """The standby decision for a fleet whose every node fails within L with the same probability `p_fail`.

    The decision then never changes, so it is taken once, from the binomial tail (`binomial_tail`, O(standbys)
    rather than O(nodes^2)), and held: the same schedule `HazardPolicy` would produce with a constant hazard,
    for a fleet of any size.
    """

    p_fail: float
    name: str = "constant-hazard"

    def __post_init__(self) -> None:
        if not (math.isfinite(self.p_fail) and 0.0 <= self.p_fail <= 1.0):
            raise ValueError(f"p_fail={self.p_fail} must lie in [0, 1]")

    def schedule(self, job: JobView) -> StandbySchedule:
        plan = decide_from_tail(binomial_tail(job.job_nodes, self.p_fail), job.costs, FleetState(), now_s=0.0)
        return constant_schedule({t: plan.count(t) for t in TIER_NAMES})


def best_tier(costs: StandbyCosts) -> TierName | None:
    """The tier with the largest saving per covered failure when held for one lead time; None if none saves."""
    net = {t: costs.avoided_usd(t) - tc.price_usd_per_h * costs.lead_time_h for t, tc in costs.tiers.items()}
    tier = max(net, key=lambda t: net[t])
    return tier if net[tier] > 0 else None


@dataclass(frozen=True, slots=True)
class Oracle:
    """Perfect foresight, for regret: for each failure, either leave it uncovered or order one standby of the tier
    that pays best exactly L before it (or hold one from hour 0 when the failure comes earlier than L).

    The choice minimizes cost_per_useful_hour itself, a ratio (standby + downtime cost) / (wall - downtime), by
    Dinkelbach's iteration: with lambda the current ratio, each failure independently takes the option with the
    least standby_usd + downtime_h x (job price + lambda); lambda is then recomputed, until it stops moving.
    """

    name: str = "oracle"

    def choices(self, job: JobView) -> list[TierName | None]:
        """The tier chosen for each failure in `job.failure_times_h` (None: leave it uncovered)."""
        costs, f = job.costs, job.failure_times_h
        tiers = sorted(costs.tiers)
        if f.size == 0:
            return []
        held_h = np.minimum(f, costs.lead_time_h)
        # options[:, 0] is "uncovered"; column 1 + i is tiers[i].
        standby_usd = np.column_stack([np.zeros(f.size)] + [held_h * costs.tiers[t].price_usd_per_h for t in tiers])
        down_s = [costs.uncovered_cost_s(job.job_nodes)] + [costs.expected_takeover_s(t) for t in tiers]
        down_h = np.array(down_s) / _SECONDS_PER_HOUR
        duration = job.duration_h
        lam = 0.0
        pick = np.zeros(f.size, dtype=np.int64)
        for _ in range(100):
            pick = np.argmin(standby_usd + down_h[None, :] * (costs.job_price_usd_per_h + lam), axis=1)
            rows = np.arange(f.size)
            downtime_h = float(np.sum(down_h[pick]))
            productive_h = duration - downtime_h
            if productive_h <= 0:
                break
            total = float(np.sum(standby_usd[rows, pick])) + downtime_h * costs.job_price_usd_per_h
            new_lam = total / productive_h
            if abs(new_lam - lam) <= 1e-12 * max(1.0, new_lam):
                break
            lam = new_lam
        return [None if k == 0 else tiers[k - 1] for k in pick.tolist()]

    def schedule(self, job: JobView) -> StandbySchedule:
        f = job.failure_times_h
        chosen = self.choices(job)
        lead = job.costs.lead_time_h
        # Each covered failure contributes +1 to its tier's target from its order time until its own instant
        # (the target falls after the failure, see the event order), so the order arrives exactly in time.
        # A failure earlier than L is covered by a standby provisioned with the job, in the first row; one at
        # hour 0 needs its standby in that row too, so its fall goes into a second row at hour 0, which applies
        # after the failure (failures come before schedule changes at equal times).
        first = [0] * len(TIER_NAMES)
        changes: list[tuple[float, int, int]] = []  # (time, tier index, +1/-1) after hour 0's provisioning
        for t_h, tier in zip(f.tolist(), chosen, strict=True):
            if tier is None:
                continue
            k = TIER_NAMES.index(tier)
            if t_h >= lead:
                changes.append((max(0.0, t_h - lead - _ORDER_SLACK_H), k, +1))
            else:
                first[k] += 1
            changes.append((t_h, k, -1))
        if not changes:
            return constant_schedule({})
        changes.sort()
        times = [0.0]
        rows = [first]
        for t_h, k, d in changes:
            if t_h > times[-1] or len(times) == 1:
                times.append(t_h)
                rows.append(list(rows[-1]))
            rows[-1][k] += d
        return StandbySchedule(np.asarray(times, dtype=np.float64), np.asarray(rows, dtype=np.int64))


def add_independent_count(
    tails: npt.NDArray[np.float64], pmf: Sequence[float], k_top: int | None = None
) -> npt.NDArray[np.float64]:
    """Tails P(A + B >= k), k = 0..K, of a count A with tails `tails` (rows: decision times, possibly truncated at
    K) plus an independent count B with P(B = j) = pmf[j] (mass missing from `pmf` counts as B > K).

    P(A + B >= k) = sum_j P(B = j) P(A >= k - j), with P(A >= m) = 1 for m <= 0; exact for k <= K even when A's
    mass above K is lumped at K. An empty `pmf` (B = 0) returns `tails` unchanged. `k_top`: the K that the result
    stands for when `tails` holds only A's first entries (k <= K' < K); the entries returned are then the first
    K' + 1 of the computation at K, to the last bit (B's mass is lumped at K the same way). Default: `tails`' own.
    """
    if len(pmf) == 0:
        return tails
    last = tails.shape[-1] - 1
    k_top = last if k_top is None else k_top
    b = np.asarray(pmf[: k_top + 1], dtype=np.float64)
    out = np.zeros_like(tails)
    for j, bj in enumerate(b.tolist()):
        if bj == 0.0:
            continue
        out[..., : j + 1] += bj  # k <= j: A >= k - j always holds
        if j < min(k_top, last):
            out[..., j + 1 :] += bj * tails[..., 1 : last + 1 - j]
    out += max(0.0, 1.0 - float(b.sum()))  # B beyond K: at least K failures whatever A is
    return np.clip(out, 0.0, 1.0)


def hazards_at(fn: HazardFn, times_h: npt.NDArray[np.float64], node_ids: tuple[str, ...]) -> npt.NDArray[np.float64]:
    """(times, nodes) hazards: `fn.at_times(times_h, node_ids)` where `fn` has it (a table answers all times in a
    few array operations, `BatchHazardFn`), else one call of `fn` per time, stacked."""
    at_times = getattr(fn, "at_times", None)
    if at_times is not None:
        return np.asarray(at_times(times_h, node_ids), dtype=np.float64)
    return np.stack([np.asarray(fn(float(t_h), node_ids), dtype=np.float64) for t_h in times_h.tolist()])


class BatchHazardFn(Protocol):
    """A `HazardFn` that also answers for many times at once: `at_times(times_h, node_ids)[i]` must equal
    `fn(times_h[i], node_ids)` to the last bit (the same element-wise arithmetic), so a policy's decisions do not
    depend on which of the two it used."""

    def __call__(self, t_h: float, node_ids: tuple[str, ...]) -> npt.ArrayLike: ...

    def at_times(self, times_h: npt.NDArray[np.float64], node_ids: tuple[str, ...]) -> npt.NDArray[np.float64]: ...


@dataclass(frozen=True, slots=True, eq=False)  # compared and hashed by identity, as a function is
class ScaledHazards:
    """`factor` x another hazard function's probabilities, for one time or (`at_times`) many."""

    inner: HazardFn
    factor: float

    def __call__(self, t_h: float, node_ids: tuple[str, ...]) -> npt.NDArray[np.float64]:
        return self.factor * np.asarray(self.inner(t_h, node_ids), dtype=np.float64)

    def at_times(self, times_h: npt.NDArray[np.float64], node_ids: tuple[str, ...]) -> npt.NDArray[np.float64]:
        return self.factor * hazards_at(self.inner, times_h, node_ids)


_TAIL_BATCH = 512
"""Decision times whose tails share one truncation (widened together when one of them needs more)."""
_K_MAX = 32
"""The tails' first truncation (failures within L); widened when a decision could want more standbys."""
_K_QUICK = 12
"""Tails the fast schedule computes first: enough for a pool of up to a dozen standbys."""
_TAIL_SLACK = 1e-12
"""Rounding margin: tails with bursts added (`add_independent_count`) fall with k only up to a few ulps."""
_HAZARD_CHUNK_ENTRIES = 8_000_000
"""Hazards held at once by the fast schedule (times x nodes, 64 MB), so a large fleet's year stays in memory."""


@dataclass(frozen=True, slots=True)
class HazardPolicy:
    """Call the standby decision every `every_h` hours with per-node hazards from `hazard_fn(time_h, node_ids)`.

    `hazard_fn` returns P(node fails within the lead time L) per node; the learned predictor plugs in here
    (`policy.learned`). The policy carries its own plan forward as the `FleetState`, so the decision's hysteresis
    and minimum hold time act as they would in production.

    `schedule` is the fast path; `reference_schedule` is the plain loop it must equal decision for decision (one
    hazard call and one `decide_from_tail` per decision time; `tests/policy/test_fast_schedule.py` holds them equal).
    The fast path asks for the hazards of many times at once where `hazard_fn` can answer so (`BatchHazardFn`),
    computes the Poisson-binomial tails of all of them in one pass over the nodes (`poisson_binomial_tails`), the
    threshold rule's counts for all of them in array operations (`decision.rule_counts`), and calls the full
    decision only where the rule asks for another pool than the one held: where it asks for the same, hysteresis,
    the minimum hold time and the budget (which the held pool already fits) leave it as it is.
    """

    hazard_fn: HazardFn
    every_h: float = 1.0
    name: str = "hazard"
    offset_h: float = 0.0
    """Hour of the hazards' clock at the job's hour 0: a job on the later part of a trace (`split_trace`) asks
    `hazard_fn` for hour t + offset_h."""
    extra_pmf: tuple[float, ...] = ()
    """P(j more failures within L), j = 0.., from a source independent of the per-node hazards (common-cause
    bursts, `bursts.CompoundPoisson.multi`), added to the Poisson-binomial count; empty: none."""

    def __post_init__(self) -> None:
        if not self.every_h > 0:
            raise ValueError(f"every_h={self.every_h} must be > 0 hours")
        if self.extra_pmf and (min(self.extra_pmf) < 0 or sum(self.extra_pmf) > 1 + 1e-9):
            raise ValueError("extra_pmf must hold probabilities >= 0 that sum to at most 1")

    def _times(self, job: JobView) -> npt.NDArray[np.float64]:
        return np.arange(0.0, max(job.duration_h, self.every_h), self.every_h)

    def _tails(
        self, p: npt.NDArray[np.float64], floor: float, pb: npt.NDArray[np.float64] | None = None
    ) -> npt.NDArray[np.float64]:
        """Tails of one batch of decision times: truncated at 32 failures, widened until no decision could want
        more standbys than they cover. `pb`: the batch's Poisson-binomial tails at 32, if already computed."""
        n = p.shape[1]
        k_max = _K_MAX
        tails = add_independent_count(poisson_binomial_tails(p, k_max) if pb is None else pb, self.extra_pmf)
        while k_max < n and np.any(tails[:, -1] > floor):
            k_max *= 4
            tails = add_independent_count(poisson_binomial_tails(p, k_max), self.extra_pmf)
        return tails

    def _check(self, p: npt.NDArray[np.float64], rows: int, job: JobView) -> None:
        if p.shape != (rows, job.job_nodes):
            raise ValueError(f"{self.name}: hazard_fn must return one probability per job node ({job.job_nodes})")

    def schedule(self, job: JobView) -> StandbySchedule:
        times = self._times(job)
        counts = np.zeros((times.size, len(TIER_NAMES)), dtype=np.int64)
        costs = job.costs
        fig = CostFigures.of(costs)
        floor = (1.0 - costs.hysteresis) * min(costs.threshold(t) for t in costs.tiers)
        k_top = min(_K_MAX, job.job_nodes)
        # Tails to k_quick only: the first entries of the tails at k_top, to the last bit (see
        # poisson_binomial_tails and add_independent_count). Enough for every decision that reads no further.
        k_quick = min(_K_QUICK, k_top) if costs.budget_usd_per_h is None else k_top
        held: Counts = dict.fromkeys(TIER_NAMES, 0)
        held_row = tuple(held.values())
        last_change_s = -math.inf
        chunk = max(_TAIL_BATCH, _HAZARD_CHUNK_ENTRIES // max(1, job.job_nodes) // _TAIL_BATCH * _TAIL_BATCH)
        for c0 in range(0, times.size, chunk):
            c_times = times[c0 : c0 + chunk]
            p = hazards_at(self.hazard_fn, c_times + self.offset_h, job.node_ids)
            self._check(p, c_times.size, job)
            quick_all = add_independent_count(poisson_binomial_tails(p, k_quick), self.extra_pmf, k_top)
            for b0 in range(0, c_times.size, _TAIL_BATCH):
                b1 = min(c_times.size, b0 + _TAIL_BATCH)
                tails = quick_all[b0:b1]
                full: npt.NDArray[np.float64] | None = None
                # Past the last entry no position pays (with a margin for rounding where bursts are added), so the
                # rule reads no further and the batch needs no wider truncation; else do what the reference does.
                if not np.all(tails[:, -1] + _TAIL_SLACK <= floor):
                    tails = full = self._tails(p[b0:b1], floor)
                wanted = rule_counts(tails, costs)
                for i, want in enumerate(map(tuple, wanted.tolist())):
                    row = c0 + b0 + i
                    if want == held_row:  # hysteresis, the hold time and a budget the pool fits keep it as it is
                        counts[row] = held_row
                        continue
                    tail = tails[i]
                    if tail.size <= sum(want) + sum(held_row) + 1:  # the decision may read past the quick tails
                        if full is None:
                            full = self._tails(p[b0:b1], floor)
                        tail = full[i]
                    now_s = float(c_times[b0 + i]) * _SECONDS_PER_HOUR
                    plan = decide_counts(tail, fig, held, last_change_s, now_s)
                    if plan != held:
                        held, held_row, last_change_s = plan, tuple(plan.values()), now_s
                    counts[row] = held_row
        return StandbySchedule(times, counts)

    def reference_schedule(self, job: JobView) -> StandbySchedule:
        """The schedule by the plain loop: the hazards and the full decision at every decision time, in turn."""
        times = self._times(job)
        counts = np.zeros((times.size, len(TIER_NAMES)), dtype=np.int64)
        fleet = FleetState()
        costs = job.costs
        floor = (1.0 - costs.hysteresis) * min(costs.threshold(t) for t in costs.tiers)
        for b0 in range(0, times.size, _TAIL_BATCH):
            chunk = times[b0 : b0 + _TAIL_BATCH]
            p = np.stack(
                [
                    np.asarray(self.hazard_fn(float(t_h) + self.offset_h, job.node_ids), dtype=np.float64)
                    for t_h in chunk
                ]
            )
            self._check(p, chunk.size, job)
            tails = self._tails(p, floor)
            for i, t_h in enumerate(chunk.tolist()):
                plan = decide_from_tail(tails[i], costs, fleet, now_s=t_h * _SECONDS_PER_HOUR)
                counts[b0 + i] = [plan.count(t) for t in TIER_NAMES]
                if any(plan.count(t) != fleet.count(t) for t in TIER_NAMES):
                    fleet = _held(plan, t_h)
        return StandbySchedule(times, counts)


def _held(plan: StandbyPlan, t_h: float) -> FleetState:
    return FleetState(
        stopped=plan.stopped, warm=plan.warm, hot=plan.hot, spot=plan.spot, last_change_s=t_h * _SECONDS_PER_HOUR
    )


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
    spot_reclaims: int = 0
    """Spot standbys the provider took back during the run (each replaced one lead time later)."""
    shrunk_failures: int = 0
    """Of the uncovered failures, those the job rode out by shrinking until a replacement arrived (`shrink_s`)."""

    @property
    def failures(self) -> int:
        return self.covered_failures + self.uncovered_failures


def simulate(
    trace: FaultTrace,
    costs: StandbyCosts,
    policy: StandbyPolicy,
    job_nodes: int | None = None,
    seed: int = 0,
    node_ids: Sequence[str] | None = None,
) -> SimulationResult:
    """Replay `trace` with `policy`'s standbys and report ETTR and costs (model: see the module docstring)."""
    job = job_view(trace, costs, job_nodes, seed, node_ids)
    return _run(job, policy.name, policy.schedule(job), reclaim=not isinstance(policy, Oracle))


def run_schedule(job: JobView, name: str, sched: StandbySchedule, *, reclaim: bool = True) -> SimulationResult:
    """Replay `job` with the standby targets of `sched` (what `simulate` does once it has the job and schedule).
    `reclaim=False` replays without spot reclaims (the oracle's bound)."""
    return _run(job, name, sched, reclaim)


def _reclaim_draws(job: JobView, s_counts: npt.NDArray[np.int64]) -> tuple[list[float], list[float], int]:
    """Candidate reclaim times and their uniforms, for thinning: a Poisson process at r x the most spot standbys
    the schedule ever holds (cap); at each candidate one of the n available is reclaimed with probability n / cap,
    which is exactly a reclaim rate of r per available standby. Seeded by the job, so every policy on the same job
    meets the same candidates, and a schedule without spot draws nothing."""
    tier = job.costs.tiers.get("spot")
    cap = int(s_counts[:, _SPOT].max()) if s_counts.size else 0
    if tier is None or tier.interruptions_per_h <= 0 or cap == 0:
        return [], [], 0
    rng = np.random.default_rng([job.seed, 0x5B07])
    n = int(rng.poisson(tier.interruptions_per_h * cap * job.duration_h))
    times = np.sort(rng.uniform(0.0, job.duration_h, n))
    return times.tolist(), rng.uniform(size=n).tolist(), cap


def _run(job: JobView, name: str, sched: StandbySchedule, reclaim: bool = True) -> SimulationResult:
    costs, duration = job.costs, job.duration_h
    if not duration > 0:
        raise ValueError("the trace's duration_h is 0; a simulation needs a window of positive length")
    # Fastest first; between tiers as fast (warm and spot), the cheaper first, as the decision orders them.
    speed = sorted(costs.tiers, key=lambda t: (costs.expected_takeover_s(t), costs.tiers[t].price_usd_per_h))
    offered = [TIER_NAMES.index(t) for t in speed]
    n_tiers = len(TIER_NAMES)
    lead = costs.lead_time_h

    keep = sched.times_h < duration
    s_times, s_counts = sched.times_h[keep], sched.counts[keep]
    f_times = job.failure_times_h
    r_times, r_draws, r_cap = _reclaim_draws(job, s_counts) if reclaim else ([], [], 0)
    i_r = 0
    reclaims = 0
    target = [0] * n_tiers
    avail = [0] * n_tiers
    # Pending orders per tier, arrival times ascending (orders are placed in time order, all with the same L).
    orders: list[deque[float]] = [deque() for _ in range(n_tiers)]
    standby_h = [0.0] * n_tiers
    covered = [0] * n_tiers
    uncovered = shrunk = 0
    downtime_s = 0.0
    now = 0.0
    i_s = i_f = 0
    if s_times.size:  # the first row holds from hour 0: provisioned with the job, available at once
        target = [int(c) for c in s_counts[0]]
        avail = [target[k] if k in offered else 0 for k in range(n_tiers)]
        i_s = 1

    def accrue(until: float) -> None:
        dt = until - now
        if dt > 0:
            for k in offered:
                standby_h[k] += (avail[k] + len(orders[k])) * dt

    def reconcile(k: int, t: float) -> None:
        excess = avail[k] + len(orders[k]) - target[k]
        while excess > 0 and orders[k]:
            orders[k].pop()  # cancel the latest order first
            excess -= 1
        if excess > 0:
            avail[k] -= excess
        for _ in range(-excess):
            orders[k].append(t + lead)

    while True:
        t, kind = math.inf, -1
        if i_s < s_times.size and float(s_times[i_s]) < t:
            t, kind = float(s_times[i_s]), _SCHEDULE
        for k in offered:
            if orders[k] and (orders[k][0], _ARRIVAL) < (t, kind if kind >= 0 else 99):
                t, kind = orders[k][0], _ARRIVAL
        if i_f < f_times.size and (float(f_times[i_f]), _FAILURE) < (t, kind if kind >= 0 else 99):
            t, kind = float(f_times[i_f]), _FAILURE
        if i_r < len(r_times) and (r_times[i_r], _RECLAIM) < (t, kind if kind >= 0 else 99):
            t, kind = r_times[i_r], _RECLAIM
        if kind < 0 or t > duration:
            break
        accrue(t)
        now = t
        if kind == _SCHEDULE:
            target = [int(c) for c in s_counts[i_s]]
            for k in offered:
                reconcile(k, t)
            i_s += 1
        elif kind == _RECLAIM:
            if r_draws[i_r] < avail[_SPOT] / r_cap:
                reclaims += 1
                avail[_SPOT] -= 1
                reconcile(_SPOT, t)  # the replacement is ordered at once and arrives one lead time later
            i_r += 1
        elif kind == _ARRIVAL:
            k = min((k for k in offered if orders[k]), key=lambda k: orders[k][0])
            orders[k].popleft()
            avail[k] += 1
        else:
            i_f += 1
            tier = next((k for k in offered if avail[k] > 0), None)
            if tier is None:
                uncovered += 1
                cost_s = costs.uncovered_cost_s(job.job_nodes)
                if cost_s < costs.uncovered_downtime_s:
                    shrunk += 1  # covered by shrinking until a replacement arrives: lost throughput, not a restart
                downtime_s += cost_s
            else:
                covered[tier] += 1
                avail[tier] -= 1
                reconcile(tier, t)
                downtime_s += costs.expected_takeover_s(TIER_NAMES[tier])
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
        spot_reclaims=reclaims,
        shrunk_failures=shrunk,
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


def default_policies(tiers: Iterable[TierName] = DEFAULT_TIER_NAMES) -> list[StandbyPolicy]:
    """The baselines a cost owner compares against: none, static 5% and 10%, binomial p99 (warm, or the first of
    stopped and hot offered), oracle. The mixed-tier pools are in `static_pools`."""
    offered = list(tiers)
    tier = next(t for t in ("warm", "stopped", "hot") if t in offered)
    return [NoStandby(), static_5pct(tier), static_10pct(tier), BinomialP99(tier), Oracle()]


def compare_policies(
    trace: FaultTrace,
    costs: StandbyCosts,
    policies: Sequence[StandbyPolicy] | None = None,
    job_nodes: int | None = None,
    seed: int = 0,
    node_ids: Sequence[str] | None = None,
) -> list[ComparisonRow]:
    """Simulate each policy on the same job and return one row per policy, with regret against `Oracle`."""
    job = job_view(trace, costs, job_nodes, seed, node_ids)
    chosen = list(default_policies() if policies is None else policies)
    results = [_run(job, p.name, p.schedule(job), reclaim=not isinstance(p, Oracle)) for p in chosen]
    oracle = next((r for p, r in zip(chosen, results, strict=True) if isinstance(p, Oracle)), None)
    if oracle is None:
        oracle = _run(job, Oracle().name, Oracle().schedule(job), reclaim=False)
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


def frontier_names(rows: Sequence[ComparisonRow]) -> list[str]:
    """The policies no other policy beats on both ETTR and cost (the oracle, a bound, left out), cheapest first."""
    ordered = sorted((r for r in rows if r.name != "oracle"), key=lambda r: (r.cost_per_useful_hour, -r.ettr))
    out: list[ComparisonRow] = []
    for r in ordered:
        if not out or r.ettr > out[-1].ettr:
            out.append(r)
    return [r.name for r in out]


def format_table(rows: Sequence[ComparisonRow]) -> str:
    """The comparison as a fixed-width text table, one policy a line; '*' marks the Pareto frontier."""
    front = set(frontier_names(rows))
    width = max([22, *(len(r.name) + 1 for r in rows)])
    head = (
        f"{'policy':<{width}} {'front':>5} {'ettr':>8} {'usd/useful_h':>13} {'regret':>9} {'covered':>8} "
        f"{'uncovered':>9} {'standby_usd':>12} {'downtime_usd':>13}"
    )
    lines = [head]
    for r in rows:
        mark = "*" if r.name in front else ""
        lines.append(
            f"{r.name:<{width}} {mark:>5} {r.ettr:>8.5f} {r.cost_per_useful_hour:>13.2f} "
            f"{r.regret_usd_per_useful_h:>9.2f} {r.covered_failures:>8d} {r.uncovered_failures:>9d} "
            f"{r.standby_cost_usd:>12.0f} {r.downtime_cost_usd:>13.0f}"
        )
    return "\n".join(lines)
