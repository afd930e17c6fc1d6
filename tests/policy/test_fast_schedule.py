"""The fast path of the hourly decisions makes the reference loop's decisions, bit for bit.

`HazardPolicy.schedule` batches the hazards, the tails and the threshold rule and calls the full decision only
where the rule asks for another pool; `HazardPolicy.reference_schedule` calls the full decision every hour. They
must agree on every count of every hour, so every pool, cost and ETTR the simulator reports is unchanged.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest

from policy.bursts import burst_aware_learned
from policy.costs import StandbyCosts, default_tiers, spot_tier
from policy.decision import (
    CostFigures,
    FleetState,
    decide_counts,
    decide_from_tail,
    poisson_binomial_tails,
    rule_counts,
)
from policy.learned import HazardTable, learned_policy
from policy.pipeline import fleet_config, job_costs
from policy.simulator import HazardPolicy, JobView, add_independent_count, job_view, run_schedule, shifted
from policy.synthetic import BURSTS_LIKE_INFINITEHBD, SyntheticFleet, generate_fleet


def row_major_tails(p: npt.NDArray[np.float64], k_max: int) -> npt.NDArray[np.float64]:
    """The dynamic programme as it was first written (times along rows): the reference for the faster layout."""
    k_max = max(0, min(k_max, p.shape[1]))
    pmf = np.zeros((p.shape[0], k_max + 1))
    pmf[:, 0] = 1.0
    for j in range(p.shape[1]):
        pj = p[:, j : j + 1]
        shifted = pmf[:, :-1] * pj
        pmf *= 1.0 - pj
        pmf[:, 1:] += shifted
    tail = np.empty_like(pmf)
    tail[:, 0] = 1.0
    tail[:, 1:] = 1.0 - np.cumsum(pmf[:, :-1], axis=1)
    return np.clip(tail, 0.0, 1.0)


def table(n_nodes: int, hours: int, seed: int, ids: tuple[str, ...] = ()) -> HazardTable:
    """Scores with calm hours, flaky nodes, unscored cells, a bad day, and a storm in which most of the fleet may
    fail."""
    rng = np.random.default_rng(seed)
    p = rng.uniform(0.0, 0.004, (hours, n_nodes))
    flaky = rng.random(p.shape) < 0.02
    p[flaky] = rng.uniform(0.05, 0.9, size=int(flaky.sum()))
    p[rng.random(p.shape) < 0.01] = np.nan
    p[100:124] = rng.uniform(0.1, 0.2, (24, n_nodes))  # pools of half a dozen
    p[530:536] = 0.995  # a storm (in the second batch of 512 hours): every node likely down within the lead time
    ids = ids or tuple(f"n{i:03d}" for i in range(n_nodes))
    return HazardTable(ids, 1.0, 3.0, p, base_p_horizon=0.002)


def test_the_tails_equal_the_first_layout_bit_for_bit_and_are_exact_prefixes() -> None:
    rng = np.random.default_rng(0)
    p = rng.uniform(0, 0.3, (50, 40)) ** 2
    p[10:20] = p[9]  # repeated rows are computed once
    for k in (0, 3, 12, 32, 60):
        assert np.array_equal(poisson_binomial_tails(p, k), row_major_tails(p, k))
    full = poisson_binomial_tails(p, 32)
    assert np.array_equal(poisson_binomial_tails(p, 8), full[:, :9])
    bursts = (0.5 ** np.arange(1, 41)).tolist()  # longer than the tails: its mass beyond them is lumped at 32
    assert np.array_equal(
        add_independent_count(poisson_binomial_tails(p, 8), bursts, 32), add_independent_count(full, bursts)[:, :9]
    )


def test_table_hazards_for_many_hours_equal_one_hour_at_a_time() -> None:
    t = table(30, 600, seed=1)
    nodes = (*t.node_ids[:25], "unknown-node")
    times = np.arange(0.0, 620.0, 1.0) + 0.5  # past the table's last slot: the base rate
    for fn in (t.hazard_fn(0.5), t.hazard_fn(0.5, multiplier=3.0)):
        stacked = np.stack([fn(float(h), nodes) for h in times])
        assert np.array_equal(fn.at_times(times, nodes), stacked)


def test_the_vectorised_rule_counts_what_the_decision_starts_from() -> None:
    rng = np.random.default_rng(2)
    tails = poisson_binomial_tails(rng.uniform(0, 0.4, (300, 24)) ** 3, 24)
    for costs in (job_costs(24), job_costs(24, tiers={**default_tiers(), "spot": spot_tier()})):
        fig = CostFigures.of(costs)
        empty = dict.fromkeys(("stopped", "warm", "hot", "spot"), 0)
        want = [tuple(decide_counts(row, fig, empty, -np.inf, 0.0).values()) for row in tails]
        assert rule_counts(tails, costs).tolist() == [list(w) for w in want]
        plans = [decide_from_tail(row, costs, FleetState(), 0.0) for row in tails[:20]]
        assert [[p.stopped, p.warm, p.hot, p.spot] for p in plans] == rule_counts(tails[:20], costs).tolist()


COSTS = {
    "default": {},
    "no hysteresis, no hold": {"hysteresis": 0.0, "min_hold_s": 0.0},
    "long hold": {"min_hold_s": 36_000.0},
    "budget": {"budget_usd_per_h": 120.0},
    "spot": {"tiers": {**default_tiers(), "spot": spot_tier()}},
}


def assert_same_decisions(policy: HazardPolicy, job: JobView) -> int:
    fast, slow = policy.schedule(job), policy.reference_schedule(job)
    assert np.array_equal(fast.times_h, slow.times_h)
    assert np.array_equal(fast.counts, slow.counts), policy.name
    assert run_schedule(job, policy.name, fast) == run_schedule(job, policy.name, slow)
    return int(np.any(np.diff(slow.counts, axis=0) != 0, axis=1).sum())


@pytest.fixture(scope="module")
def fleet() -> SyntheticFleet:
    return generate_fleet(fleet_config(5, 48, 25.0, **BURSTS_LIKE_INFINITEHBD))


@pytest.mark.parametrize("overrides", COSTS.values(), ids=COSTS.keys())
def test_the_fast_schedule_makes_the_reference_loops_decisions(
    fleet: SyntheticFleet, overrides: dict[str, object]
) -> None:
    costs: StandbyCosts = job_costs(48, **overrides)
    t = table(48, 600, seed=3, ids=fleet.node_ids)
    job = job_view(fleet.trace, costs, node_ids=t.node_ids)
    changes = assert_same_decisions(learned_policy(t, costs.lead_time_h), job)
    assert changes > 5  # the pools move: the comparison is not between two constant schedules


def test_every_kind_of_hazard_policy_takes_the_same_decisions_on_either_path(fleet: SyntheticFleet) -> None:
    costs = job_costs(48)
    t = table(48, 600, seed=4, ids=fleet.node_ids)
    lead = costs.lead_time_h
    job = job_view(fleet.trace, costs, node_ids=t.node_ids)
    for policy in (
        learned_policy(t, lead, multiplier=2.0, every_h=3.0),
        burst_aware_learned(t.hazard_fn(lead), fleet.trace, lead),  # a burst tail added to the count
        HazardPolicy(lambda t_h, ids: t.hazard_fn(lead)(t_h, ids), name="plain-callable"),  # no batch form
        shifted(learned_policy(t, lead), 100.0),  # hazards read on a later clock
    ):
        assert_same_decisions(policy, job)
    # A job of 8 nodes: its tails end before the fast path's first truncation.
    assert_same_decisions(learned_policy(t, lead), job_view(fleet.trace, job_costs(8), 8, node_ids=t.node_ids))
