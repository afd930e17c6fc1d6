"""Policy tuning: sweep the standby policy's knobs on a trace and find the ETTR-versus-cost frontier.

This module owns the *which setting* question a cost owner asks after `compare_policies`: how much ETTR each
extra dollar buys. `sweep` replays one trace under a grid of settings, three families of them:

- `hazard x m`: the standby decision fed the fleet-mean failure probability within the lead time (the rate
  `BinomialP99` uses) scaled by `m` (`ConstantHazard`). That acts roughly like dividing every tier's decision
  threshold by `m` (not exactly: the decision compares tail probabilities of the failure count), so large `m`
  holds more standbys; the decision mixes tiers itself (hot for the likeliest failures, then warm, then stopped).
- `static f`: `StaticFraction(f)` of the tier that saves most per covered failure (`best_tier`), the rule of thumb.
- `pool`: fixed mixed-tier pools of k_hot, k_warm and k_stopped standbys (`static_pools`), e.g. 1 hot + 2 stopped.

`pareto_frontier` keeps the settings no other setting beats on both ETTR and cost; `recommend` picks the cheapest
setting that meets an ETTR floor. matplotlib is imported inside `plot_frontier` only, so importing `policy` stays
light.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from policy.costs import TIER_NAMES, StandbyCosts, TierName
from policy.simulator import (
    ConstantHazard,
    StandbyPolicy,
    StaticFraction,
    StaticPool,
    best_tier,
    job_view,
    run_schedule,
    static_pools,
)
from policy.traces import FaultTrace

DEFAULT_HAZARD_MULTIPLIERS: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 64.0)
"""Hazard scalings swept by default: from a quarter to 64 times the fleet-mean failure probability."""
DEFAULT_STATIC_FRACTIONS: tuple[float, ...] = (0.0, 0.01, 0.02, 0.05, 0.10)
"""Static standby fractions of the job's nodes swept by default."""

SettingKind = Literal["hazard", "static", "pool"]


class NoSettingMeetsFloor(ValueError):
    """No swept setting reaches the ETTR floor a user asked for; the message names the best one reached."""


@dataclass(frozen=True, slots=True)
class FrontierPoint:
    """One swept setting and how it fared on the trace."""

    setting: str
    """Human-readable name, e.g. "hazard x4" or "static 5% warm"."""
    kind: SettingKind
    knob: float
    """The hazard multiplier (kind "hazard"), the standby fraction of the job's nodes (kind "static"), or the
    number of standbys (kind "pool")."""
    ettr: float
    cost_per_useful_hour: float
    """(standby + downtime cost) / productive hours, USD per hour."""
    standby_usd: float
    downtime_usd: float
    covered_failures: int
    uncovered_failures: int
    pool: tuple[int, int, int] = (0, 0, 0)
    """Standbys held at hour 0 as (hot, warm, stopped); constant over the run for every swept setting."""
    spot: int = 0
    """Spot standbys held at hour 0 (only when the spot tier is offered)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def fleet_mean_p_fail(trace: FaultTrace, lead_time_h: float) -> float:
    """P(one node fails within `lead_time_h`) at the trace's mean fault rate per node-hour."""
    node_h = trace.n_nodes * trace.duration_h
    rate_per_node_h = len(trace.records) / node_h if node_h > 0 else 0.0
    return -math.expm1(-rate_per_node_h * lead_time_h)


def _hazard_policy(p_fail: float, multiplier: float) -> ConstantHazard:
    return ConstantHazard(min(1.0, p_fail * multiplier), name=f"hazard x{multiplier:g}")


def sweep(
    trace: FaultTrace,
    base_costs: StandbyCosts,
    hazard_multipliers: Sequence[float] = DEFAULT_HAZARD_MULTIPLIERS,
    static_fractions: Sequence[float] = DEFAULT_STATIC_FRACTIONS,
    job_nodes: int | None = None,
    seed: int = 0,
    pools: Sequence[StaticPool] | None = None,
) -> list[FrontierPoint]:
    """Simulate every setting of the grid on the same job and return one point per setting, in grid order:
    hazard multipliers, static fractions, then the mixed-tier pools (`static_pools` of the offered tiers unless
    `pools` says otherwise; pass `()` for none)."""
    for m in hazard_multipliers:
        if not m >= 0:
            raise ValueError(f"hazard multiplier {m} must be >= 0")
    p_fail = fleet_mean_p_fail(trace, base_costs.lead_time_h)
    # When no tier saves money, sweep the cheapest anyway so the table shows what holding one costs.
    cheapest: TierName = min(base_costs.tiers, key=lambda t: base_costs.tiers[t].price_usd_per_h)
    tier: TierName = best_tier(base_costs) or cheapest
    runs: list[tuple[SettingKind, float, str, StandbyPolicy]] = [
        ("hazard", float(m), f"hazard x{m:g}", _hazard_policy(p_fail, m)) for m in hazard_multipliers
    ]
    runs += [("static", float(f), f"static {f:.0%} {tier}", StaticFraction(float(f), tier)) for f in static_fractions]
    chosen_pools = static_pools(base_costs.tiers) if pools is None else pools
    runs += [("pool", float(p.hot + p.warm + p.stopped), _pool_setting(p), p) for p in chosen_pools]
    job = job_view(trace, base_costs, job_nodes, seed)  # once: naming a large fleet's nodes is the costly part
    points = []
    for kind, knob, name, policy in runs:
        sched = policy.schedule(job)
        r = run_schedule(job, name, sched)
        hot, warm, stopped, spot = (
            int(sched.counts[0, TIER_NAMES.index(t)]) for t in ("hot", "warm", "stopped", "spot")
        )
        points.append(
            FrontierPoint(
                setting=name,
                kind=kind,
                knob=knob,
                ettr=r.ettr,
                cost_per_useful_hour=r.cost_per_useful_hour,
                standby_usd=r.standby_cost_usd,
                downtime_usd=r.downtime_cost_usd,
                covered_failures=r.covered_failures,
                uncovered_failures=r.uncovered_failures,
                pool=(hot, warm, stopped),
                spot=spot,
            )
        )
    return points


def _pool_setting(pool: StaticPool) -> str:
    parts = [
        f"{n} {t}"
        for t, n in (("hot", pool.hot), ("warm", pool.warm), ("stopped", pool.stopped), ("spot", pool.spot))
        if n
    ]
    return "pool " + " + ".join(parts)


def pareto_frontier(points: Sequence[FrontierPoint]) -> list[FrontierPoint]:
    """The settings that no other setting beats on both ETTR and cost, cheapest first.

    Along the result both cost and ETTR strictly increase: each step buys more ETTR for more money.
    """
    ordered = sorted(points, key=lambda p: (p.cost_per_useful_hour, -p.ettr))
    frontier: list[FrontierPoint] = []
    for p in ordered:
        if not frontier or p.ettr > frontier[-1].ettr:
            frontier.append(p)
    return frontier


def recommend(points: Sequence[FrontierPoint], min_ettr: float | None = None) -> FrontierPoint:
    """The cheapest setting (by cost per useful hour) whose ETTR is at least `min_ettr` (any ETTR if None)."""
    if not points:
        raise ValueError("recommend() needs at least one point; run sweep() first")
    eligible = [p for p in points if min_ettr is None or p.ettr >= min_ettr]
    if not eligible:
        best = max(points, key=lambda p: p.ettr)
        raise NoSettingMeetsFloor(
            f"no swept setting reaches ETTR {min_ettr}; the best is {best.setting} with ETTR {best.ettr:.5f}. "
            "Lower --min-ettr or shorten the lead time"
        )
    return min(eligible, key=lambda p: (p.cost_per_useful_hour, -p.ettr))


def frontier_table(points: Sequence[FrontierPoint]) -> str:
    """The points as a fixed-width text table, frontier members marked with '*'."""
    on_frontier = {id(p) for p in pareto_frontier(points)}
    width = max([20, *(len(p.setting) + 1 for p in points)])
    with_spot = any(p.spot for p in points)
    pools_head = "hot/warm/stopped/spot" if with_spot else "hot/warm/stopped"
    pw = len(pools_head)
    head = (
        f"{'setting':<{width}} {'frontier':>8} {pools_head:>{pw}} {'ettr':>8} {'usd/useful_h':>13} "
        f"{'standby_usd':>12} {'downtime_usd':>13}"
    )
    lines = [head]
    for p in points:
        mark = "*" if id(p) in on_frontier else ""
        pool = "/".join(str(n) for n in (*p.pool, *((p.spot,) if with_spot else ())))
        lines.append(
            f"{p.setting:<{width}} {mark:>8} {pool:>{pw}} {p.ettr:>8.5f} {p.cost_per_useful_hour:>13.2f} "
            f"{p.standby_usd:>12.0f} {p.downtime_usd:>13.0f}"
        )
    return "\n".join(lines)


def plot_frontier(points: Sequence[FrontierPoint], path: str | Path, recommended: FrontierPoint | None = None) -> None:
    """Write a PNG of cost per useful hour against ETTR: every setting, the frontier, and the recommendation."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a server or in CI
    import matplotlib.pyplot as plt

    frontier = pareto_frontier(points)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for kind, marker in (("hazard", "o"), ("static", "s"), ("pool", "^")):
        chosen = [p for p in points if p.kind == kind]
        ax.scatter([p.ettr for p in chosen], [p.cost_per_useful_hour for p in chosen], marker=marker, label=kind)
    ax.plot([p.ettr for p in frontier], [p.cost_per_useful_hour for p in frontier], "k--", label="Pareto frontier")
    if recommended is not None:
        ax.scatter(
            [recommended.ettr],
            [recommended.cost_per_useful_hour],
            marker="*",
            s=250,
            c="red",
            zorder=3,
            label=f"recommended: {recommended.setting}",
        )
    if all(p.cost_per_useful_hour > 0 and math.isfinite(p.cost_per_useful_hour) for p in points):
        ax.set_yscale("log")
    ax.set_xlabel("ETTR (productive / wall time)")
    ax.set_ylabel("standby + downtime USD per useful hour")
    ax.set_title("Standby settings: ETTR vs cost")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(Path(path), format="png", dpi=120)
    plt.close(fig)
