"""The standby decision: how many standbys to keep in each tier, as a pure function of typed inputs.

`decide_standby` owns the rule of DESIGN.md ("Policy, in one paragraph"): the number of failures within the
replenishment lead time L is Poisson-binomial over the per-node probabilities, and the k-th standby of tier t
is kept while P(failures >= k) > c_t * L / C_avoid_t. No I/O and no clocks: the caller passes `now_s`.

Allocation across tiers. Standbys take over failures fastest tier first, so the j-th failure within L is covered
by the j-th standby in speed order (hot, then warm, then stopped). Position k is therefore worth
P(failures >= k) * C_avoid_t - c_t * L to a standby of tier t, and each position goes to the tier for which that
expected net saving is largest, provided it is positive (which is exactly the threshold rule). The saving is a
line in q = P(failures >= k) with slope C_avoid_t; faster tiers have steeper lines, and q only falls with k, so
the best tier only ever moves from faster to slower as k grows: the most likely failures get hot standbys while
their premium pays, then warm, then stopped. Each position holds one standby, so no failure is counted twice.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field, model_validator

from policy.costs import TIER_NAMES, StandbyCosts, TierName

_MAX_TIER_COUNT = 100_000


def poisson_binomial_tail(p: npt.ArrayLike) -> npt.NDArray[np.float64]:
    """Return t with t[k] = P(at least k of n independent events happen), k = 0..n, for probabilities `p`.

    Exact dynamic programming over the nodes, O(n^2) with the inner loop vectorised.
    """
    probs = np.asarray(p, dtype=np.float64)
    if probs.ndim != 1:
        raise ValueError(f"failure probabilities must be a 1-D array, got shape {probs.shape}")
    if not np.all(np.isfinite(probs)):
        raise ValueError("failure probabilities must be finite numbers; got NaN or infinity")
    if np.any((probs < 0.0) | (probs > 1.0)):
        raise ValueError(f"failure probabilities must lie in [0, 1]; got min {probs.min()}, max {probs.max()}")
    n = probs.size
    pmf = np.zeros(n + 1, dtype=np.float64)
    pmf[0] = 1.0
    for i, pi in enumerate(probs):
        # After node i, at most i + 1 failures are possible: update only that prefix.
        head = pmf[: i + 2].copy()
        pmf[: i + 2] = head * (1.0 - pi)
        pmf[1 : i + 2] += head[: i + 1] * pi
    # Summing from the top keeps tiny tail probabilities accurate (no 1 - (almost 1) cancellation).
    tail = np.cumsum(pmf[::-1])[::-1]
    tail[0] = 1.0
    return np.clip(tail, 0.0, 1.0)


def binomial_tail(n: int, p: float, floor: float = 1e-15) -> npt.NDArray[np.float64]:
    """Return t with t[k] = P(at least k of n independent events of probability p happen), k = 0..K.

    The same as `poisson_binomial_tail(np.full(n, p))` but in O(K) time and memory rather than O(n^2), so a fleet
    of a million nodes costs nothing: K stops where the tail falls below `floor` (entries beyond K are below it).
    The pmf is built in log space from the ratio pmf(k+1)/pmf(k) = (n-k)/(k+1) x p/(1-p), so it cannot underflow
    for a large n x p.
    """
    if n < 0:
        raise ValueError(f"n={n} must be >= 0")
    if not (math.isfinite(p) and 0.0 <= p <= 1.0):
        raise ValueError(f"p={p} must lie in [0, 1]")
    if n == 0 or p == 0.0:
        return np.ones(1)
    if p == 1.0:
        return np.ones(n + 1)
    mean, sd = n * p, math.sqrt(n * p * (1.0 - p))
    k_hi = int(min(n, math.ceil(mean + 40.0 * sd + 60.0)))
    k = np.arange(k_hi, dtype=np.float64)
    log_pmf = np.empty(k_hi + 1)
    log_pmf[0] = n * math.log1p(-p)
    log_pmf[1:] = log_pmf[0] + np.cumsum(np.log((n - k) / (k + 1.0)) + math.log(p / (1.0 - p)))
    pmf = np.exp(log_pmf - log_pmf.max())
    pmf /= pmf.sum()  # the mass beyond k_hi (40 sd above the mean) is far below double precision
    tail = np.cumsum(pmf[::-1])[::-1]
    tail[0] = 1.0
    keep = int(np.searchsorted(-tail, -floor, side="right"))  # tail is non-increasing
    return np.clip(tail[: max(keep, 1)], 0.0, 1.0)


class NodeHazards(BaseModel):
    """Per-node probability of failing within the lead time L, as the failure predictor reports it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    node_ids: tuple[str, ...] = Field(description="Training nodes, one id each, unique.")
    p_fail: tuple[float, ...] = Field(description="P(node fails within the lead time L), one per node, in [0, 1].")

    @model_validator(mode="after")
    def _consistent(self) -> NodeHazards:
        if len(self.node_ids) != len(self.p_fail):
            raise ValueError(
                f"hazards: {len(self.node_ids)} node ids but {len(self.p_fail)} probabilities; give one each"
            )
        dupes = sorted(node for node, n in Counter(self.node_ids).items() if n > 1)
        if dupes:
            raise ValueError(f"hazards: duplicate node ids {dupes}; each node must appear once")
        for node, p in zip(self.node_ids, self.p_fail, strict=True):
            if not math.isfinite(p) or not 0.0 <= p <= 1.0:
                raise ValueError(f"hazards: node {node!r} has failure probability {p}; it must lie in [0, 1]")
        return self


class FleetState(BaseModel):
    """The standbys held now, per tier, and when the fleet last changed (for the minimum hold time)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    stopped: int = Field(default=0, description="Stopped standbys held now.", ge=0, le=_MAX_TIER_COUNT)
    warm: int = Field(default=0, description="Warm standbys held now.", ge=0, le=_MAX_TIER_COUNT)
    hot: int = Field(default=0, description="Hot standbys held now.", ge=0, le=_MAX_TIER_COUNT)
    spot: int = Field(default=0, description="Spot standbys held now.", ge=0, le=_MAX_TIER_COUNT)
    last_change_s: float = Field(
        default=-math.inf, description="Time of the last change to the standby counts, seconds (same clock as now_s)."
    )

    def count(self, tier: TierName) -> int:
        return int(getattr(self, tier))


class StandbyPlan(BaseModel):
    """What to hold after this decision, what it costs, and why."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    stopped: int = Field(description="Stopped standbys to hold.", ge=0)
    warm: int = Field(description="Warm standbys to hold.", ge=0)
    hot: int = Field(description="Hot standbys to hold.", ge=0)
    spot: int = Field(default=0, description="Spot standbys to hold.", ge=0)
    cost_usd_per_h: float = Field(description="Hourly price of all standbys in the plan, USD per hour.", ge=0.0)
    expected_covered_failures: float = Field(
        description="Expected number of failures within L that a standby covers: E[min(failures, standbys)].",
        ge=0.0,
    )
    reasons: tuple[str, ...] = Field(description="One human-readable line per decision.")

    def count(self, tier: TierName) -> int:
        return int(getattr(self, tier))

    @property
    def total(self) -> int:
        return self.stopped + self.warm + self.hot + self.spot


Counts = dict[TierName, int]


def poisson_binomial_tails(p: npt.ArrayLike, k_max: int) -> npt.NDArray[np.float64]:
    """Row-wise `poisson_binomial_tail` for a (times, nodes) matrix, truncated at `k_max` failures.

    Returns (times, k_max + 1) with t[i, k] = P(at least k failures at time i). The dynamic programme runs over
    nodes with all times at once, keeping only k <= k_max (exact there: mass above k_max is never needed to
    compute the pmf below it, so t[:, :k + 1] is the same to the last bit for any k_max >= k). A row equal to the
    row before it (a constant hazard, a table of coarse slots) is computed once.
    """
    probs = np.asarray(p, dtype=np.float64)
    if probs.ndim != 2:
        raise ValueError(f"failure probabilities must be a (times, nodes) matrix, got shape {probs.shape}")
    if not np.all(np.isfinite(probs)) or np.any((probs < 0.0) | (probs > 1.0)):
        raise ValueError("failure probabilities must be finite numbers in [0, 1]")
    n_times, n_nodes = probs.shape
    k_max = max(0, min(k_max, n_nodes))
    new_row = np.ones(n_times, dtype=bool)
    new_row[1:] = np.any(probs[1:] != probs[:-1], axis=1)
    distinct = probs[new_row]
    # Times along the last axis: each node's update is three passes over contiguous (k, times) memory. The
    # arithmetic per entry is that of the textbook update pmf[k] = pmf[k] (1 - p) + pmf[k - 1] p, in that order.
    by_node = np.ascontiguousarray(distinct.T)
    pmf = np.zeros((k_max + 1, distinct.shape[0]), dtype=np.float64)
    pmf[0] = 1.0
    moved = np.empty((k_max, distinct.shape[0]), dtype=np.float64)
    for pj in by_node:
        np.multiply(pmf[:-1], pj, out=moved)
        np.multiply(pmf, 1.0 - pj, out=pmf)
        np.add(pmf[1:], moved, out=pmf[1:])
    tail = np.empty((distinct.shape[0], k_max + 1), dtype=np.float64)
    tail[:, 0] = 1.0
    tail[:, 1:] = 1.0 - np.cumsum(pmf[:-1].T, axis=1)
    return np.clip(tail, 0.0, 1.0)[np.cumsum(new_row) - 1]


def rule_counts(tails: npt.NDArray[np.float64], costs: StandbyCosts) -> npt.NDArray[np.int64]:
    """The threshold rule's counts (before hysteresis, the minimum hold time and the budget) for many tails at
    once: row i of the result, in `TIER_NAMES` order, is what `decide_from_tail` starts from for `tails[i]`, the
    same comparisons of the same floats, vectorised over rows and positions."""
    fig = CostFigures.of(costs)
    q = np.asarray(tails, dtype=np.float64)[:, 1:]
    best = np.full(q.shape, -1, dtype=np.int64)
    best_net = np.zeros(q.shape)
    best_price = np.zeros(q.shape)
    for i, tier in enumerate(fig.order):
        price = fig.price[tier]
        net = q * fig.avoided[tier] - price * fig.lead_time_h  # `_net_usd`, entry by entry
        # `max(paying, key=(net, -price))`: the first tier in speed order with the largest key.
        better = (q > fig.threshold[tier]) & (
            (best < 0) | (net > best_net) | ((net == best_net) & (-price > -best_price))
        )
        best = np.where(better, i, best)
        best_net = np.where(better, net, best_net)
        best_price = np.where(better, price, best_price)
    held = np.cumprod(best >= 0, axis=1).astype(bool)  # the rule stops at the first position no tier pays
    out = np.zeros((q.shape[0], len(TIER_NAMES)), dtype=np.int64)
    for i, tier in enumerate(fig.order):
        out[:, TIER_NAMES.index(tier)] = np.sum(held & (best == i), axis=1)
    return out


def decide_standby(hazards: NodeHazards, costs: StandbyCosts, fleet: FleetState, now_s: float) -> StandbyPlan:
    """Decide the standbys to hold: the threshold rule, then hysteresis, the minimum hold time and the budget.

    The budget is applied last because it is the cost owner's hard cap: it overrides hysteresis and the hold time.
    """
    return decide_from_tail(poisson_binomial_tail(np.asarray(hazards.p_fail, dtype=np.float64)), costs, fleet, now_s)


def decide_from_tail(
    tail: npt.NDArray[np.float64], costs: StandbyCosts, fleet: FleetState, now_s: float
) -> StandbyPlan:
    """`decide_standby` from the failure-count tail P(failures >= k), k = 0.. (possibly truncated: a missing k
    counts as probability 0). The simulator computes tails for many decision times at once and calls this."""
    fig = CostFigures.of(costs)
    reasons: list[str] = []
    counts = _decide(tail, fig, {t: fleet.count(t) for t in TIER_NAMES}, fleet.last_change_s, now_s, reasons)
    total = sum(counts.values())
    if total == 0 and not reasons:
        cheapest = min(fig.order, key=lambda t: fig.threshold[t])
        reasons.append(
            f"no standby: P(>=1 failures in {costs.lead_time_h:g} h) = {_q(tail, 1):.3g} <= lowest threshold "
            f"{fig.threshold[cheapest]:.3g} ({cheapest})"
        )
    covered = float(np.sum(tail[1 : min(total, tail.size - 1) + 1]))
    return StandbyPlan(
        stopped=counts["stopped"],
        warm=counts["warm"],
        hot=counts["hot"],
        spot=counts["spot"],
        cost_usd_per_h=_cost(counts, fig),
        expected_covered_failures=covered,
        reasons=tuple(reasons),
    )


def decide_counts(
    tail: npt.NDArray[np.float64], fig: CostFigures, held: Counts, last_change_s: float, now_s: float
) -> Counts:
    """The counts `decide_from_tail` returns for a fleet holding `held` since `last_change_s`, without its reasons:
    the same rule for a caller that decides thousands of times (the simulator)."""
    return _decide(tail, fig, held, last_change_s, now_s, None)


@dataclass(frozen=True, slots=True)
class CostFigures:
    """The figures of one `StandbyCosts` that the rule reads, computed once (`of`) rather than per comparison."""

    order: tuple[TierName, ...]
    """Tiers offered, fastest first (expected takeover, then price)."""
    price: dict[TierName, float]
    """Price per tier, USD per hour, in the order `StandbyCosts.tiers` lists them."""
    avoided: dict[TierName, float]
    """`StandbyCosts.avoided_usd` per tier."""
    threshold: dict[TierName, float]
    """`StandbyCosts.threshold` per tier."""
    lead_time_h: float
    hysteresis: float
    min_hold_s: float
    budget_usd_per_h: float | None

    @classmethod
    def of(cls, costs: StandbyCosts) -> CostFigures:
        order = sorted(costs.tiers, key=lambda t: (costs.expected_takeover_s(t), costs.tiers[t].price_usd_per_h))
        return cls(
            order=tuple(order),
            price={t: tier.price_usd_per_h for t, tier in costs.tiers.items()},
            avoided={t: costs.avoided_usd(t) for t in order},
            threshold={t: costs.threshold(t) for t in order},
            lead_time_h=costs.lead_time_h,
            hysteresis=costs.hysteresis,
            min_hold_s=costs.min_hold_s,
            budget_usd_per_h=costs.budget_usd_per_h,
        )


def _decide(
    tail: npt.NDArray[np.float64],
    fig: CostFigures,
    held: Counts,
    last_change_s: float,
    now_s: float,
    reasons: list[str] | None,
) -> Counts:
    """The threshold rule, then hysteresis, the minimum hold time and the budget; `reasons` (if given) collects
    one line per step taken."""
    target = _rule_counts(tail, fig, reasons)
    counts = _apply_hysteresis(target, held, tail, fig, reasons)
    counts = _apply_min_hold(counts, held, last_change_s, fig, now_s, reasons)
    if reasons is not None:
        for tier in TIER_NAMES:
            for j in range(counts[tier] + 1, held[tier] + 1):
                reasons.append(f"{tier} #{j} released: the rule no longer pays for it")
    return _apply_budget(counts, tail, fig, reasons)


def _q(tail: npt.NDArray[np.float64], k: int) -> float:
    return float(tail[k]) if k < tail.size else 0.0


def _net_usd(fig: CostFigures, tier: TierName, q: float) -> float:
    """Expected saving over the lead time of a standby of `tier` covering a failure that happens with prob. q."""
    return q * fig.avoided[tier] - fig.price[tier] * fig.lead_time_h


def _cost(counts: Counts, fig: CostFigures) -> float:
    return float(sum(n * fig.price[t] for t, n in counts.items() if n and t in fig.price))


def _positions(counts: Counts, order: Sequence[TierName]) -> list[TierName]:
    return [t for t in order for _ in range(counts.get(t, 0))]


def _config_value(counts: Counts, tail: npt.NDArray[np.float64], fig: CostFigures) -> float:
    return sum(_net_usd(fig, t, _q(tail, k)) for k, t in enumerate(_positions(counts, fig.order), start=1))


def _why(tier: TierName, k: int, q: float, fig: CostFigures, factor: float = 1.0) -> str:
    price = fig.price[tier]
    scale = "" if factor == 1.0 else f"{factor:g} x "
    return (
        f"P(>={k} failures in {fig.lead_time_h:g} h) = {q:.3g} > {scale}threshold {fig.threshold[tier]:.3g} = "
        f"{price:.2f} USD/h x {fig.lead_time_h:g} h / {fig.avoided[tier] / 1000:.3g} kUSD avoided"
    )


def _rule_counts(tail: npt.NDArray[np.float64], fig: CostFigures, reasons: list[str] | None) -> Counts:
    counts: Counts = dict.fromkeys(TIER_NAMES, 0)
    for k in range(1, tail.size):
        q = _q(tail, k)
        paying = [t for t in fig.order if q > fig.threshold[t]]
        if not paying:
            break  # q only falls with k: no later position pays either
        # Largest expected net saving; on a tie the cheaper tier.
        best = max(paying, key=lambda t: (_net_usd(fig, t, q), -fig.price[t]))
        counts[best] += 1
        if reasons is not None:
            reasons.append(f"{best} #{counts[best]} (failure #{k}): {_why(best, k, q, fig)}")
    return counts


def _apply_hysteresis(
    target: Counts, held: Counts, tail: npt.NDArray[np.float64], fig: CostFigures, reasons: list[str] | None
) -> Counts:
    """Keep a held standby that the rule would release or downgrade while it is nearly worth it.

    Tiers are walked fastest first. A held standby of tier t beyond the rule's count takes the next position k.
    If the plan has a slower standby there, keeping t is a *downgrade avoided*: it stays while P(>=k) exceeds
    (1 - hysteresis) x the break-even probability between the two tiers, (c_t - c_s) L / (C_avoid_t - C_avoid_s),
    and replaces the plan's last (slowest) standby. Otherwise it is a *release avoided*: it stays while P(>=k)
    exceeds (1 - hysteresis) x its own threshold.
    """
    counts = dict(target)
    factor = 1.0 - fig.hysteresis
    order = fig.order
    for ti, tier in enumerate(order):
        while counts[tier] < held[tier]:
            k = sum(counts[t] for t in order[: ti + 1]) + 1
            q = _q(tail, k)
            slower = [s for s in order[ti + 1 :] if counts[s] > 0]
            if slower:
                s = slower[0]
                gain_usd = fig.avoided[tier] - fig.avoided[s]
                extra_usd = (fig.price[tier] - fig.price[s]) * fig.lead_time_h
                even = extra_usd / gain_usd if gain_usd > 0 else math.inf
                if not q > factor * even:
                    break
                counts[slower[-1]] -= 1
                if reasons is not None:
                    reasons.append(
                        f"{tier} #{counts[tier] + 1} kept instead of a {s} (hysteresis, failure #{k}): P = {q:.3g} > "
                        f"{factor:g} x break-even {even:.3g}"
                    )
            else:
                if not q > factor * fig.threshold[tier]:
                    break
                if reasons is not None:
                    reasons.append(
                        f"{tier} #{counts[tier] + 1} kept (hysteresis, failure #{k}): {_why(tier, k, q, fig, factor)}"
                    )
            counts[tier] += 1
    return counts


def _apply_min_hold(
    counts: Counts, held: Counts, last_change_s: float, fig: CostFigures, now_s: float, reasons: list[str] | None
) -> Counts:
    age_s = now_s - last_change_s
    if age_s >= fig.min_hold_s:
        return counts
    out = dict(counts)
    for tier in fig.price:
        if out[tier] < held[tier]:
            if reasons is not None:
                reasons.append(
                    f"{tier}: holding {held[tier]} instead of {out[tier]}: last change {age_s:.0f} s ago "
                    f"< min hold {fig.min_hold_s:.0f} s"
                )
            out[tier] = held[tier]
    return out


def _apply_budget(counts: Counts, tail: npt.NDArray[np.float64], fig: CostFigures, reasons: list[str] | None) -> Counts:
    """Drop the standby whose loss costs least until the plan fits the budget, then refill what still fits."""
    budget = fig.budget_usd_per_h
    if budget is None or _cost(counts, fig) <= budget:
        return counts
    out = dict(counts)
    while _cost(out, fig) > budget:
        cost_before = _cost(out, fig)

        def value_without(t: TierName, base: Counts = out) -> tuple[float, float]:
            return (_config_value({**base, t: base[t] - 1}, tail, fig), fig.price[t])

        victim = max((t for t in fig.order if out[t] > 0), key=value_without)
        if reasons is not None:
            reasons.append(
                f"{victim} #{out[victim]} dropped: standbys cost {cost_before:.2f} USD/h > budget {budget:.2f} USD/h "
                "and it is the least valuable"
            )
        out[victim] -= 1
    # Dropping an expensive standby can leave room for a cheaper one in its place (e.g. stopped for warm).
    while True:
        room = budget - _cost(out, fig)
        base_value = _config_value(out, tail, fig)
        gains = {
            t: _config_value({**out, t: out[t] + 1}, tail, fig) - base_value
            for t in fig.order
            if fig.price[t] <= room and sum(out.values()) < tail.size - 1
        }
        best = max(gains, key=lambda t: gains[t], default=None)
        if best is None or gains[best] <= 0.0:
            return out
        out[best] += 1
        if reasons is not None:
            reasons.append(f"{best} #{out[best]} added within budget: expected saving {gains[best]:.0f} USD over L")
