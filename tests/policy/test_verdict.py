"""Honest verdicts: the reference static is chosen on training data, the candidate is judged on test data, and a
static that dominates the candidate is named."""

from __future__ import annotations

import numpy as np
import pytest

from policy.costs import StandbyCosts, TierCosts
from policy.simulator import (
    BinomialP99,
    ComparisonRow,
    HazardPolicy,
    NoStandby,
    SimulationResult,
    StaticFraction,
    StaticPool,
    format_table,
    frontier_names,
    static_pools,
)
from policy.traces import FaultRecord, FaultTrace, split_trace
from policy.verdict import choose_reference, dominators, judge, verdict


def row(name: str, ettr: float, cost: float) -> ComparisonRow:
    result = SimulationResult(name, 100.0, 100.0 * ettr, 100.0 * (1 - ettr), ettr, {}, 0.0, 0.0, cost, 0, 0)
    return ComparisonRow(name, ettr, cost, cost - 1.0, 0, 0, 0.0, 0.0, result)


ORACLE = row("oracle", 0.9999, 1.0)


def test_the_reference_is_chosen_on_training_rows_not_in_hindsight() -> None:
    train = [row("learned", 0.995, 10.0), row("static-a", 0.996, 12.0), row("static-b", 0.990, 5.0), ORACLE]
    # On the test rows static-b would look best in hindsight; the verdict must still use static-a.
    test = [row("learned", 0.995, 10.0), row("static-a", 0.994, 20.0), row("static-b", 0.996, 4.0), ORACLE]
    assert choose_reference(train, "learned").name == "static-a"
    v = verdict(train, test, "learned", "hours 0-50 of 100")
    assert v.best_static == "static-a"
    assert v.cost_ratio == pytest.approx(10.0 / 20.0)
    assert (v.learned_train_ettr, v.best_static_train_ettr) == (0.995, 0.996)
    # ... and it says that static-b, cheaper and more available on the test rows, dominates the candidate.
    assert v.dominated_by == ("static-b",)
    assert v.summary.startswith("learned is dominated: static-b is cheaper")
    assert v.frontier == ("static-b",)


def test_a_static_that_is_cheaper_and_more_available_is_never_dropped() -> None:
    # The old verdict compared only with statics of lower or equal ETTR: it read 0.752 here although "1 hot + 2
    # stopped" dominates (the issue's 512-node case).
    rows = [row("learned", 0.9990, 7.52), row("static-5%-warm", 0.9985, 10.0), row("static-h1-w0-s2", 0.9995, 6.0)]
    assert [r.name for r in dominators([*rows, ORACLE], "learned")] == ["static-h1-w0-s2"]
    v = verdict([*rows, ORACLE], [*rows, ORACLE], "learned", "training seeds")
    assert v.best_static == "static-h1-w0-s2" and v.cost_ratio > 1.0
    assert "dominated" in v.summary


def test_without_a_static_as_available_the_most_available_one_is_the_reference() -> None:
    train = [row("learned", 0.999, 10.0), row("static-a", 0.99, 1.0), row("static-b", 0.995, 3.0), ORACLE]
    assert choose_reference(train, "learned").name == "static-b"
    v = verdict(train, train, "learned", "x")
    assert v.dominated_by == () and "no static dominates it" in v.summary
    assert v.frontier == ("static-a", "static-b", "learned")


def test_the_table_marks_the_pareto_frontier() -> None:
    rows = [row("learned", 0.999, 10.0), row("static-a", 0.99, 1.0), row("static-b", 0.98, 3.0), ORACLE]
    assert frontier_names(rows) == ["static-a", "learned"]
    marked = [line.split()[0] for line in format_table(rows).splitlines()[1:] if " * " in line]
    assert marked == ["learned", "static-a"]


def _trace() -> FaultTrace:
    # First half (0-100 h): one fault. Second half: a burst of three within the lead time, then one more.
    faults = [("a", 40.0), ("b", 130.0), ("c", 130.2), ("d", 130.4), ("e", 170.0)]
    records = tuple(FaultRecord(n, t, t + 5.0, "test") for n, t in faults)
    return FaultTrace(records, 20, 200.0)


def costs() -> StandbyCosts:
    return StandbyCosts(
        job_price_usd_per_h=1000.0,
        restart_downtime_s=3600.0,
        replacement_h=0.0,
        lead_time_h=2.0,
        tiers={
            "warm": TierCosts(price_usd_per_h=10.0, takeover_s=36.0),
            "stopped": TierCosts(price_usd_per_h=1.0, takeover_s=360.0),
        },
        hysteresis=0.0,
        min_hold_s=0.0,
    )


def test_split_trace_restarts_the_clock_of_the_second_part() -> None:
    head, tail = split_trace(_trace(), 100.0)
    assert [r.start_h for r in head.records] == [40.0] and head.duration_h == 100.0
    assert [r.start_h for r in tail.records] == pytest.approx([30.0, 30.2, 30.4, 70.0]) and tail.duration_h == 100.0
    with pytest.raises(ValueError, match="inside"):
        split_trace(_trace(), 200.0)


def test_judge_freezes_rule_statics_on_the_first_part_and_shifts_the_candidate() -> None:
    seen: list[float] = []

    def hazard(t_h: float, nodes: tuple[str, ...]) -> np.ndarray:
        seen.append(t_h)
        return np.full(len(nodes), 0.2 if 127.0 <= t_h < 131.0 else 0.0)

    candidate = HazardPolicy(hazard, every_h=1.0, name="learned")
    statics = [NoStandby(), BinomialP99(tier="warm"), StaticFraction(0.1, "warm"), *static_pools(("warm", "stopped"))]
    j = judge(_trace(), costs(), candidate, statics, train_fraction=0.5)
    assert j.split_h == 100.0 and max(seen) >= 199.0  # the candidate read the hours it was judged on
    test = {r.name: r for r in j.test_rows}
    # P99 at the first half's rate (1 fault in 20 x 100 node-hours) holds 1 warm, whatever the second half brings.
    assert test["binomial-p99-warm"].result.standby_hours["warm"] == pytest.approx(100.0)
    assert test["learned"].covered_failures >= 3  # it saw the burst coming one lead time ahead
    v = j.verdict
    assert v.chosen_on == "hours 0-100 of 200"
    train = {r.name: r for r in j.train_rows}
    assert train[v.best_static].ettr >= train["learned"].ettr
    assert v.cost_ratio == pytest.approx(
        test["learned"].cost_per_useful_hour / test[v.best_static].cost_per_useful_hour
    )


def test_judge_refuses_a_candidate_among_the_statics() -> None:
    with pytest.raises(ValueError, match="unique names"):
        judge(_trace(), costs(), StaticPool(warm=1), [StaticPool(warm=1)])
