"""Policy tuning: sweep the standby policy's knobs on a trace and find the ETTR-versus-cost frontier.

This module owns the *which setting* question a cost owner asks after `compare_policies`: how much ETTR each
extra dollar buys. `sweep` replays one trace under a grid of settings, two families of them:

- `hazard x m`: `HazardPolicy` fed the fleet-mean failure probability within the lead time (the rate
  `BinomialP99` uses) scaled by `m`. That acts roughly like dividing every tier's decision threshold by `m`
  (not exactly: the decision compares tail probabilities of the failure count), so large `m` holds more standbys.
- `static f`: `StaticFraction(f)` of the tier that saves most per covered failure (`best_tier`), the rule of thumb.

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

import numpy as np

from policy.costs import StandbyCosts, TierName
from policy.simulator import HazardPolicy, StandbyPolicy, StaticFraction, best_tier, simulate
from policy.traces import FaultTrace

DEFAULT_HAZARD_MULTIPLIERS: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 64.0)
"""Hazard scalings swept by default: from a quarter to 64 times the fleet-mean failure probability."""
DEFAULT_STATIC_FRACTIONS: tuple[float, ...] = (0.0, 0.01, 0.02, 0.05, 0.10)
"""Static standby fractions of the job's nodes swept by default."""
DEFAULT_EVERY_H = 24.0
"""How often the hazard policy re-decides in a sweep; a constant hazard needs no finer grid."""

SettingKind = Literal["hazard", "static"]


class NoSettingMeetsFloor(ValueError):
    """No swept setting reaches the ETTR floor a user asked for; the message names the best one reached."""


@dataclass(frozen=True, slots=True)
class FrontierPoint:
    """One swept setting and how it fared on the trace."""

    setting: str
    """Human-readable name, e.g. "hazard x4" or "static 5% warm"."""
    kind: SettingKind
    knob: float
    """The hazard multiplier (kind "hazard") or the standby fraction of the job's nodes (kind "static")."""
    ettr: float
    cost_per_useful_hour: float
    """(standby + downtime cost) / productive hours, USD per hour."""
    standby_usd: float
    downtime_usd: float
    covered_failures: int
    uncovered_failures: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def fleet_mean_p_fail(trace: FaultTrace, lead_time_h: float) -> float:
    """P(one node fails within `lead_time_h`) at the trace's mean fault rate per node-hour."""
    node_h = trace.n_nodes * trace.duration_h
    rate_per_node_h = len(trace.records) / node_h if node_h > 0 else 0.0
    return -math.expm1(-rate_per_node_h * lead_time_h)


def _hazard_policy(p_fail: float, multiplier: float, every_h: float) -> HazardPolicy:
    p = min(1.0, p_fail * multiplier)

    def hazard_fn(_t_h: float, node_ids: tuple[str, ...]) -> np.ndarray:
        return np.full(len(node_ids), p)

    return HazardPolicy(hazard_fn, every_h=every_h, name=f"hazard x{multiplier:g}")


def sweep(
    trace: FaultTrace,
    base_costs: StandbyCosts,
    hazard_multipliers: Sequence[float] = DEFAULT_HAZARD_MULTIPLIERS,
    static_fractions: Sequence[float] = DEFAULT_STATIC_FRACTIONS,
    job_nodes: int | None = None,
    seed: int = 0,
    every_h: float = DEFAULT_EVERY_H,
) -> list[FrontierPoint]:
    """Simulate every setting of the grid on the same job and return one point per setting, in grid order."""
    for m in hazard_multipliers:
        if not m >= 0:
            raise ValueError(f"hazard multiplier {m} must be >= 0")
    p_fail = fleet_mean_p_fail(trace, base_costs.lead_time_h)
    # When no tier saves money, sweep the cheapest anyway so the table shows what holding one costs.
    cheapest: TierName = min(base_costs.tiers, key=lambda t: base_costs.tiers[t].price_usd_per_h)
    tier: TierName = best_tier(base_costs) or cheapest
    runs: list[tuple[SettingKind, float, StandbyPolicy]] = [
        ("hazard", float(m), _hazard_policy(p_fail, m, every_h)) for m in hazard_multipliers
    ]
    runs += [("static", float(f), StaticFraction(float(f), tier)) for f in static_fractions]
    points = []
    for kind, knob, policy in runs:
        name = policy.name if kind == "hazard" else f"static {knob:.0%} {tier}"
        r = simulate(trace, base_costs, policy, job_nodes, seed)
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
            )
        )
    return points


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
    head = f"{'setting':<20} {'frontier':>8} {'ettr':>8} {'usd/useful_h':>13} {'standby_usd':>12} {'downtime_usd':>13}"
    lines = [head]
    for p in points:
        mark = "*" if id(p) in on_frontier else ""
        lines.append(
            f"{p.setting:<20} {mark:>8} {p.ettr:>8.5f} {p.cost_per_useful_hour:>13.2f} {p.standby_usd:>12.0f} "
            f"{p.downtime_usd:>13.0f}"
        )
    return "\n".join(lines)


def plot_frontier(points: Sequence[FrontierPoint], path: str | Path, recommended: FrontierPoint | None = None) -> None:
    """Write a PNG of cost per useful hour against ETTR: every setting, the frontier, and the recommendation."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a server or in CI
    import matplotlib.pyplot as plt

    frontier = pareto_frontier(points)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for kind, marker in (("hazard", "o"), ("static", "s")):
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
