"""Scenarios for the fleet simulator: hand-made traces with known answers, cost arithmetic, and the baselines."""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import pytest

from policy.costs import StandbyCosts, TierCosts, default_tiers
from policy.decision import binomial_tail, poisson_binomial_tail
from policy.simulator import (
    BinomialP99,
    ConstantHazard,
    HazardPolicy,
    NoStandby,
    Oracle,
    StaticFraction,
    StaticPool,
    compare_policies,
    default_policies,
    format_table,
    job_view,
    simulate,
    static_5pct,
    static_10pct,
    static_pools,
)
from policy.traces import FaultRecord, FaultTrace, load_infinitehbd
from tests.policy.round_costs import round_costs


def costs(**overrides: object) -> StandbyCosts:
    """Round numbers: job 1000 USD/h, restart 1 h, warm takeover 36 s (0.01 h) at 10 USD/h, lead time 2 h."""
    return round_costs(2.0, 36.0, overrides)


def trace(*faults: tuple[str, float, float | None], n_nodes: int = 10, duration_h: float = 100.0) -> FaultTrace:
    records = sorted((FaultRecord(n, s, e, "test") for n, s, e in faults), key=lambda r: (r.start_h, r.node_id))
    return FaultTrace(tuple(records), n_nodes, duration_h)


ONE_WARM = StaticFraction(0.1)  # ceil(0.1 x 10 nodes) = 1 warm standby


def test_one_fault_without_standby_costs_a_restart() -> None:
    r = simulate(trace(("a", 10.0, 20.0)), costs(), NoStandby())
    assert (r.covered_failures, r.uncovered_failures) == (0, 1)
    assert r.downtime_h == pytest.approx(1.0)
    assert r.ettr == pytest.approx(99.0 / 100.0)
    assert r.standby_cost_usd == 0.0
    assert r.downtime_cost_usd == pytest.approx(1000.0)
    assert r.cost_per_useful_hour == pytest.approx(1000.0 / 99.0)


def test_a_job_that_shrinks_rides_an_uncovered_fault_out_at_one_nodes_share_until_the_replacement() -> None:
    shrinking = costs().model_copy(update={"shrink_s": 36.0})
    r = simulate(trace(("a", 10.0, 20.0)), shrinking, NoStandby())
    assert (r.covered_failures, r.uncovered_failures, r.shrunk_failures) == (0, 1, 1)
    # 36 s of downtime, plus one node of ten missing for the lead time (2 h): 0.2 h of the job's throughput.
    assert r.downtime_h == pytest.approx(0.01 + 0.2)
    assert r.downtime_h < simulate(trace(("a", 10.0, 20.0)), costs(), NoStandby()).downtime_h
    # A sharded job drops a whole replica group: 5 of 10 nodes for 2 h is 1 h of the job's time plus 36 s, more
    # than the restart's 1 h, so the simulator restarts; 2 of 10 nodes costs 0.4 h plus 36 s, and it shrinks.
    halves = simulate(trace(("a", 10.0, 20.0)), shrinking.model_copy(update={"shrink_replica_nodes": 5}), NoStandby())
    assert (halves.shrunk_failures, halves.downtime_h) == (0, pytest.approx(1.0))
    quarter = shrinking.model_copy(update={"shrink_replica_nodes": 2})
    assert simulate(trace(("a", 10.0, 20.0)), quarter, NoStandby()).downtime_h == pytest.approx(0.01 + 0.4)
    # A job of one node cannot shrink: it restarts.
    one = simulate(trace(("a", 10.0, 20.0), n_nodes=1), shrinking, NoStandby(), job_nodes=1)
    assert (one.shrunk_failures, one.downtime_h) == (0, pytest.approx(1.0))
    # The oracle weighs the shrink too: here a warm standby (20 USD for its 2 h, 36 s of takeover) still beats a
    # shrink's 756 s of the job's time (210 USD), and the oracle never does worse than shrinking.
    oracle = simulate(trace(("a", 10.0, 20.0)), shrinking, Oracle())
    assert oracle.covered_failures == 1 and oracle.cost_per_useful_hour <= r.cost_per_useful_hour


def test_one_fault_with_a_warm_standby_costs_a_takeover_and_the_standby_hours() -> None:
    r = simulate(trace(("a", 10.0, 20.0)), costs(), ONE_WARM)
    assert (r.covered_failures, r.uncovered_failures) == (1, 0)
    assert r.downtime_h == pytest.approx(0.01)
    # Held 0-10 h, its replacement ordered at 10 h (billed while it comes, 10-12 h), held 12-100 h: 100 hours.
    assert r.standby_hours["warm"] == pytest.approx(100.0)
    assert r.standby_cost_usd == pytest.approx(1000.0)
    assert r.downtime_cost_usd == pytest.approx(10.0)
    assert r.cost_per_useful_hour == pytest.approx(1010.0 / 99.99)


def test_second_fault_within_the_lead_time_is_uncovered() -> None:
    r = simulate(trace(("a", 10.0, 20.0), ("b", 11.0, 20.0)), costs(), ONE_WARM)
    assert (r.covered_failures, r.uncovered_failures) == (1, 1)
    assert r.downtime_h == pytest.approx(0.01 + 1.0)


def test_replenishment_after_the_lead_time_covers_a_later_fault() -> None:
    r = simulate(trace(("a", 10.0, 20.0), ("b", 12.5, 20.0)), costs(), ONE_WARM)
    assert (r.covered_failures, r.uncovered_failures) == (2, 0)
    assert r.standby_hours["warm"] == pytest.approx(100.0)


def test_a_standby_ordered_after_hour_0_arrives_one_lead_time_later() -> None:
    # The target rises to 1 at hour 9: ordered then, billed from 9 h, available at 11 h, too late for 10 h.
    late = HazardPolicy(lambda t_h, nodes: np.full(len(nodes), 0.9 if t_h >= 9.0 else 0.0), every_h=1.0)
    r = simulate(trace(("a", 10.0, 20.0), ("b", 12.0, 20.0)), costs(), late)
    assert (r.covered_failures, r.uncovered_failures) == (1, 1)
    assert r.standby_hours["warm"] > 2.0


def test_a_fault_outside_the_job_or_on_a_node_already_down_does_not_hurt() -> None:
    t = trace(("a", 10.0, 50.0), ("a", 20.0, 30.0), n_nodes=2)
    assert simulate(t, costs(), NoStandby()).uncovered_failures == 1  # the second fault of "a" overlaps the first
    hits = {simulate(t, costs(), NoStandby(), job_nodes=1, seed=s).failures for s in range(20)}
    assert hits == {0, 1}  # a one-node job lands on "a" for some seeds and on the healthy node for others


def test_the_fastest_available_tier_takes_over_first() -> None:
    tiers = {
        "stopped": TierCosts(price_usd_per_h=1.0, takeover_s=360.0),
        "warm": TierCosts(price_usd_per_h=10.0, takeover_s=36.0),
    }
    c = costs(tiers=tiers)
    t = trace(("a", 10.0, 20.0), ("b", 11.0, 20.0), ("c", 11.5, 20.0))
    r = simulate(t, c, HazardPolicy(lambda t_h, nodes: np.full(len(nodes), 0.5), every_h=1000.0))
    # p = 0.5 on 10 nodes: the rule holds several of each tier; the two tiers cover in speed order.
    assert r.covered_by_tier["warm"] >= 1
    assert r.downtime_h == pytest.approx(
        (r.covered_by_tier["warm"] * 36 + r.covered_by_tier["stopped"] * 360 + r.uncovered_failures * 3600) / 3600
    )


def test_oracle_covers_every_failure_holding_one_lead_time_per_failure() -> None:
    t = trace(("a", 10.0, 20.0), ("b", 11.0, 20.0), ("c", 50.0, 60.0))
    r = simulate(t, costs(), Oracle())
    assert (r.covered_failures, r.uncovered_failures) == (3, 0)
    # Each standby is ordered exactly L = 2 h before its failure and consumed by it.
    assert r.standby_hours["warm"] == pytest.approx(3 * 2.0)


def test_oracle_holds_from_hour_0_for_a_failure_earlier_than_the_lead_time() -> None:
    r = simulate(trace(("a", 0.5, 20.0)), costs(), Oracle())
    assert (r.covered_failures, r.standby_hours["warm"]) == (1, pytest.approx(0.5))


def test_oracle_is_a_lower_bound_when_a_fault_starts_at_hour_0() -> None:
    t = trace(("a", 0.0, 5.0), ("b", 0.0, 5.0), ("c", 30.0, 40.0))
    # Holds one warm standby from hour 0 for half an hour only: it covers a fault at hour 0 almost for free.
    brief = HazardPolicy(lambda t_h, nodes: np.full(len(nodes), 0.9 if t_h < 0.5 else 0.0), every_h=0.5)
    r_brief = simulate(t, costs(), brief)
    assert r_brief.covered_failures >= 1
    r = simulate(t, costs(), Oracle())
    # Both faults at hour 0 are covered by standbys provisioned with the job and consumed at once (0 hours each).
    assert (r.covered_failures, r.uncovered_failures) == (3, 0)
    assert r.standby_hours["warm"] == pytest.approx(2.0)  # only the one ordered L = 2 h before hour 30
    assert r.cost_per_useful_hour <= r_brief.cost_per_useful_hour + 1e-12
    for policy in (NoStandby(), ONE_WARM, StaticFraction(0.2)):
        assert r.cost_per_useful_hour <= simulate(t, costs(), policy).cost_per_useful_hour + 1e-12


def test_oracle_leaves_a_failure_uncovered_when_a_standby_costs_more_than_the_restart() -> None:
    c = costs(tiers={"warm": TierCosts(price_usd_per_h=600.0, takeover_s=36.0)})  # 2 h x 600 > 1 h x 1000
    r = simulate(trace(("a", 10.0, 20.0)), c, Oracle())
    assert (r.covered_failures, r.uncovered_failures, r.standby_cost_usd) == (0, 1, 0.0)


def test_binomial_p99_holds_enough_for_the_fleet_rate() -> None:
    # 10 faults on 10 nodes over 100 h: 0.01 per node-hour, p = 1 - exp(-0.02) within L = 2 h.
    t = trace(*((f"n{i}", 5.0 + 9.0 * i, 6.0 + 9.0 * i) for i in range(10)))
    sched = BinomialP99().schedule(job_view(t, costs()))
    k = int(sched.counts[0, 1])
    p = -math.expm1(-0.02)
    p_more = 1.0 - sum(math.comb(10, j) * p**j * (1 - p) ** (10 - j) for j in range(k + 1))
    p_more_fewer = 1.0 - sum(math.comb(10, j) * p**j * (1 - p) ** (10 - j) for j in range(k))
    assert p_more < 0.01 <= p_more_fewer
    assert simulate(t, costs(), BinomialP99()).covered_failures == 10


def test_binomial_p99_and_a_constant_hazard_scale_to_a_million_nodes() -> None:
    t = trace(("a", 10.0, 20.0), ("b", 50.0, 60.0), n_nodes=1_000_000, duration_h=1000.0)
    started = time.perf_counter()
    r = simulate(t, costs(), BinomialP99())
    r_const = simulate(t, costs(), ConstantHazard(1e-4))
    assert time.perf_counter() - started < 5.0
    assert r.failures == r_const.failures == 2
    # The binomial tail agrees with the exact Poisson-binomial dynamic programme where both can run.
    for n, p in ((10, 0.02), (400, 1e-3), (1000, 0.3)):
        fast, exact = binomial_tail(n, p), poisson_binomial_tail(np.full(n, p))
        assert fast == pytest.approx(exact[: fast.size], abs=1e-12)
        assert np.all(exact[fast.size :] < 1e-15)


def test_a_constant_hazard_holds_what_the_hourly_decision_would() -> None:
    t = trace(("a", 10.0, 20.0), ("b", 11.0, 20.0), ("c", 50.0, 60.0))
    for p in (0.0, 0.05, 0.3, 0.9):
        hourly = HazardPolicy(lambda t_h, nodes, p=p: np.full(len(nodes), p), every_h=1.0)
        a, b = simulate(t, costs(), hourly), simulate(t, costs(), ConstantHazard(p))
        assert a.covered_failures == b.covered_failures
        assert a.cost_per_useful_hour == pytest.approx(b.cost_per_useful_hour)


def synthetic_trace(n_nodes: int, days: float, seed: int = 7) -> FaultTrace:
    """Weibull(0.5) gaps per node at about 4 faults per 1,000 node-days; log-normal repairs with a 20 h median."""
    rng = np.random.default_rng(seed)
    duration_h = days * 24.0
    shape = 0.5
    mean_gap_h = 1000.0 / 4.0 * 24.0
    scale_h = mean_gap_h / math.gamma(1.0 + 1.0 / shape)
    records: list[FaultRecord] = []
    per_node = int(4 * duration_h / mean_gap_h) + 40
    gaps = scale_h * rng.weibull(shape, size=(n_nodes, per_node))
    repairs = 20.0 * np.exp(rng.normal(0.0, 1.0, size=(n_nodes, per_node)))
    for i in range(n_nodes):
        start = scale_h * rng.weibull(shape)  # the trace start counts as a renewal of every node
        for gap, repair in zip(gaps[i], repairs[i], strict=True):
            if start >= duration_h:
                break
            records.append(FaultRecord(f"gpu-{i:04d}", float(start), float(start + repair), "synthetic"))
            start += repair + gap
    records.sort(key=lambda r: (r.start_h, r.node_id))
    return FaultTrace(tuple(records), n_nodes, duration_h)


@pytest.fixture(scope="module")
def big_trace() -> FaultTrace:
    return synthetic_trace(1024, 365.0)


def test_1024_nodes_for_a_year_completes_with_consistent_counts(big_trace: FaultTrace) -> None:
    c = StandbyCosts()
    start = time.perf_counter()
    rows = compare_policies(big_trace, c, [*default_policies(), HazardPolicy(lambda t, n: np.full(len(n), 1e-4), 24.0)])
    print(f"\n1024 nodes x 365 days, {len(big_trace.records)} faults: {time.perf_counter() - start:.2f} s")
    print(format_table(rows))
    n_failures = {r.result.failures for r in rows}
    assert len(n_failures) == 1 and n_failures.pop() > 100
    for r in rows:
        assert sum(r.result.covered_by_tier.values()) == r.covered_failures
        assert 0.0 < r.ettr <= 1.0


def _cheating_rows() -> dict[str, Any]:
    small = synthetic_trace(128, 90.0)
    c = StandbyCosts()
    starts = {n: np.array([f.start_h for f in fs]) for n, fs in small.by_node().items()}
    lead = c.lead_time_h
    empty = np.empty(0)

    def cheating(t_h: float, nodes: tuple[str, ...]) -> np.ndarray:
        # Knows the future: 0.9 for a node that will fault within [t, t + 2L): an order placed now arrives at
        # t + L, in time for the faults of the second half.
        return np.array(
            [0.9 if np.any((s >= t_h) & (s < t_h + 2 * lead)) else 0.0 for s in (starts.get(n, empty) for n in nodes)]
        )

    policies = [*default_policies(), HazardPolicy(cheating, every_h=lead, name="hazard-cheat")]
    return {r.name: r for r in compare_policies(small, c, policies, job_nodes=96)}


def test_the_oracle_is_a_lower_bound_even_for_a_policy_that_knows_the_future() -> None:
    rows = _cheating_rows()
    assert rows["oracle"].cost_per_useful_hour <= rows["hazard-cheat"].cost_per_useful_hour + 1e-9


def test_cost_ordering_and_coverage_across_policies() -> None:
    rows = _cheating_rows()
    oracle = rows["oracle"]
    for r in rows.values():
        assert oracle.cost_per_useful_hour <= r.cost_per_useful_hour + 1e-9, r.name
        assert r.regret_usd_per_useful_h >= -1e-9
    assert rows[static_10pct().name].covered_failures >= rows[static_5pct().name].covered_failures
    assert rows["hazard-cheat"].covered_failures > rows["no-standby"].covered_failures


def test_infinitehbd_runs_through_every_policy() -> None:
    t = load_infinitehbd()
    c = StandbyCosts()
    policies = [*default_policies(), HazardPolicy(lambda t_h, n: np.full(len(n), 1e-3), every_h=168.0)]
    rows = compare_policies(t, c, policies)
    assert [r.name for r in rows] == [p.name for p in policies]
    for r in rows:
        assert 0.0 < r.ettr <= 1.0
        assert r.covered_failures + r.uncovered_failures == rows[0].uncovered_failures
        assert math.isfinite(r.cost_per_useful_hour)
    assert rows[0].covered_failures == 0 and rows[0].uncovered_failures > 0


def test_bad_inputs_get_clear_errors() -> None:
    with pytest.raises(ValueError, match="fraction"):
        StaticFraction(1.5)
    with pytest.raises(ValueError, match="job_nodes"):
        simulate(trace(("a", 1.0, 2.0)), costs(), NoStandby(), job_nodes=11)
    with pytest.raises(ValueError, match="not offered"):
        simulate(trace(("a", 1.0, 2.0)), costs(), StaticFraction(0.1, tier="hot"))


def test_an_uncovered_failure_waits_for_a_replacement_host_then_restarts() -> None:
    # Defaults: restart 900 s after a replacement that takes the lead time L = 0.5 h: 2,700 s in all.
    c = StandbyCosts()
    assert c.uncovered_downtime_s == 900.0 + 1800.0
    r = simulate(trace(("a", 10.0, 20.0)), c, NoStandby())
    assert r.downtime_h == pytest.approx(0.75)
    assert StandbyCosts(replacement_h=0.0).uncovered_downtime_s == 900.0
    assert StandbyCosts(replacement_h=2.0, lead_time_h=0.5).uncovered_downtime_s == 900.0 + 7200.0


def test_a_stopped_standby_that_may_not_wake_costs_its_expected_downtime() -> None:
    stopped = TierCosts(price_usd_per_h=1.0, takeover_s=360.0, wake_failure_prob=0.25)
    c = costs(tiers={"stopped": stopped})
    r = simulate(trace(("a", 10.0, 20.0)), c, StaticPool(stopped=1))
    assert r.covered_failures == 1
    # 360 s to start it, and in a quarter of the cases it does not start: then the 1 h restart on top.
    assert r.downtime_h == pytest.approx((360.0 + 0.25 * 3600.0) / 3600.0)
    assert c.avoided_usd("stopped") == pytest.approx((3600.0 - 360.0 - 900.0) / 3600.0 * 1000.0)
    with pytest.raises(ValueError, match="never save time"):
        costs(tiers={"stopped": TierCosts(price_usd_per_h=1.0, takeover_s=360.0, wake_failure_prob=0.95)})


def test_a_reserved_stopped_standby_always_wakes_and_costs_a_node() -> None:
    unreserved, reserved = default_tiers(50.0), default_tiers(50.0, "reserved")
    assert unreserved["stopped"].wake_failure_prob == pytest.approx(0.1)
    assert unreserved["stopped"].price_usd_per_h == pytest.approx(0.5)
    assert reserved["stopped"].wake_failure_prob == 0.0
    assert reserved["stopped"].price_usd_per_h == pytest.approx(50.5)
    assert reserved["warm"].price_usd_per_h == 50.0 and reserved["hot"].price_usd_per_h == 51.0


def test_mixed_tier_pools_cover_fastest_first_and_name_themselves() -> None:
    tiers = {
        "stopped": TierCosts(price_usd_per_h=1.0, takeover_s=360.0),
        "warm": TierCosts(price_usd_per_h=10.0, takeover_s=36.0),
    }
    t = trace(("a", 10.0, 20.0), ("b", 10.5, 20.0), ("c", 11.0, 20.0))
    pool = StaticPool(warm=1, stopped=1)
    assert pool.name == "static-h0-w1-s1"
    r = simulate(t, costs(tiers=tiers), pool)
    assert r.covered_by_tier == {"warm": 1, "stopped": 1} and r.uncovered_failures == 1
    assert r.downtime_h == pytest.approx((36.0 + 360.0 + 3600.0) / 3600.0)
    assert len(static_pools()) == 3 * 3 * 9 - 1
    assert all(p.hot == 0 for p in static_pools(("warm", "stopped")))
    with pytest.raises(ValueError, match="not offered"):
        simulate(t, costs(tiers=tiers), StaticPool(hot=1))
