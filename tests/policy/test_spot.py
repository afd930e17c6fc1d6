"""Spot standbys: a cheap running standby that the provider may reclaim; a reclaimed one is gone for a lead time."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from policy.cli import main
from policy.costs import SPOT_INTERRUPTIONS_PER_H, StandbyCosts, default_tiers, spot_tier
from policy.decision import FleetState, decide_from_tail
from policy.pipeline import job_costs
from policy.simulator import Oracle, StaticPool, compare_policies, simulate, static_pools
from policy.traces import FaultRecord, FaultTrace, write_csv
from policy.tuning import sweep


def with_spot(rate: float = SPOT_INTERRUPTIONS_PER_H, n_nodes: int = 64) -> StandbyCosts:
    base = job_costs(n_nodes)
    return base.model_copy(update={"tiers": {**default_tiers(), "spot": spot_tier(interruptions_per_h=rate)}})


def steady_trace(n_failures: int = 200, every_h: float = 10.0) -> FaultTrace:
    records = tuple(FaultRecord(f"n{i % 64}", 5.0 + every_h * i, 6.0 + every_h * i, "x") for i in range(n_failures))
    return FaultTrace(records, 64, 5.0 + every_h * n_failures)


def test_spot_is_offered_only_when_asked_and_priced_with_its_availability() -> None:
    assert "spot" not in StandbyCosts().tiers
    costs = with_spot(rate=2.0)
    assert costs.availability("spot") == pytest.approx(1 / (1 + 2.0 * 0.5))
    assert costs.availability("warm") == 1.0
    # Same takeover as warm, so per failure held for it saves availability x warm's saving.
    assert costs.avoided_usd("spot") == pytest.approx(costs.avoided_usd("warm") / 2)
    assert spot_tier().price_usd_per_h == pytest.approx(0.35 * 55.04)


def test_the_decision_takes_spot_over_warm_unless_it_is_reclaimed_too_often() -> None:
    tail = np.array([1.0, 0.2, 0.03, 0.004, 1e-4, 1e-6])
    cheap = decide_from_tail(tail, with_spot(), FleetState(), now_s=0.0)
    assert cheap.spot >= 1 and cheap.warm == 0
    assert any(r.startswith("spot #1 ") for r in cheap.reasons)
    flaky = decide_from_tail(tail, with_spot(rate=200.0), FleetState(), now_s=0.0)  # there 1% of the time
    assert flaky.spot == 0 and flaky.hot + flaky.warm >= 1


def test_reclaimed_spot_standbys_leave_failures_uncovered_and_the_oracle_stays_a_bound() -> None:
    trace = steady_trace()
    pool = StaticPool(spot=1)
    calm = simulate(trace, with_spot(rate=0.0), pool)
    assert calm.spot_reclaims == 0 and calm.uncovered_failures == 0
    stormy_costs = with_spot(rate=1.0)  # reclaimed every hour on average: there a third of the time (L = 0.5 h)
    stormy = simulate(trace, stormy_costs, pool)
    assert stormy.spot_reclaims > 500
    assert 0.5 * 200 / 3 < stormy.uncovered_failures < 1.5 * 200 / 3  # about 1 - availability of them
    assert stormy.ettr < calm.ettr
    assert simulate(trace, stormy_costs, pool) == stormy  # seeded: the same reclaims every time
    # Reclaims happen at r per available standby: the count matches r x the hours it was there.
    there_h = stormy.standby_hours["spot"] - stormy.spot_reclaims * 0.5  # orders are billed while they come
    assert stormy.spot_reclaims == pytest.approx(1.0 * there_h, rel=0.1)
    pools = static_pools(stormy_costs.tiers, hot=(0, 1), warm=(0,), stopped=(0, 2), spot=(0, 1, 2))
    rows = compare_policies(trace, stormy_costs, [*pools, Oracle()])
    oracle = next(r for r in rows if r.name == "oracle")
    assert all(r.cost_per_useful_hour >= oracle.cost_per_useful_hour for r in rows)


def test_a_policy_without_spot_is_unchanged_when_spot_is_offered() -> None:
    trace = steady_trace(50)
    plain = simulate(trace, job_costs(64), StaticPool(hot=1, stopped=2))
    offered = simulate(trace, with_spot(rate=5.0), StaticPool(hot=1, stopped=2))
    assert (plain.ettr, plain.cost_per_useful_hour, offered.spot_reclaims) == (
        offered.ettr,
        offered.cost_per_useful_hour,
        0,
    )


def test_tune_sweeps_spot_pools_and_the_flags_are_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    points = sweep(steady_trace(60), with_spot(), hazard_multipliers=(1.0,), static_fractions=(0.0,))
    assert any(p.spot for p in points) and any(p.kind == "pool" and p.spot == 0 for p in points)
    out, csv_path = tmp_path / "t.json", tmp_path / "steady.csv"
    write_csv(steady_trace(60), csv_path)
    assert main(["tune", "--trace", str(csv_path), "--nodes", "64", "--tiers", "hot,spot", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "hot/warm/stopped/spot" in text and "spot 19.264 USD/h, 5 s, reclaimed 0.000306/h" in text
    report = json.loads(out.read_text())
    assert report["recommended"]["spot"] >= 1  # a failure every 10 h: a spot standby pays, and beats a hot one
    assert main(["simulate", "--trace", "infinitehbd", "--tiers", "spot", "--spot-interruptions-per-h", "-1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--spot-interruptions-per-h" in err
