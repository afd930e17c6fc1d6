"""The learned policy: predictor scores as hazards, batched tails, tier hysteresis, and the whole pipeline."""

from __future__ import annotations

import math

import numpy as np
import pytest

from policy.costs import StandbyCosts
from policy.decision import FleetState, NodeHazards, decide_standby, poisson_binomial_tail, poisson_binomial_tails
from policy.features import FeatureSet
from policy.learned import HazardTable, hazard_table, learned_policy
from policy.pipeline import evaluate_fleet, fleet_config, train_predictor
from policy.predictor import FailurePredictor


def test_batched_tails_equal_the_exact_tail_row_by_row() -> None:
    rng = np.random.default_rng(3)
    p = rng.uniform(0, 0.3, size=(7, 40)) ** 2
    tails = poisson_binomial_tails(p, k_max=12)
    for i in range(p.shape[0]):
        assert tails[i] == pytest.approx(poisson_binomial_tail(p[i])[:13], abs=1e-12)


def test_batched_tails_refuse_bad_probabilities() -> None:
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        poisson_binomial_tails(np.array([[0.5, 1.5]]), 2)
    with pytest.raises(ValueError, match="matrix"):
        poisson_binomial_tails(np.array([0.5]), 2)


def test_horizon_probability_converts_to_the_lead_time_assuming_a_constant_hazard() -> None:
    table = HazardTable(("a", "b"), 1.0, 24.0, np.array([[0.5, np.nan]]), base_p_horizon=0.1)
    p = table.p_within(1.0, 12.0, ("a", "b", "unknown"))
    assert p[0] == pytest.approx(1 - math.sqrt(0.5))
    assert p[1] == pytest.approx(1 - math.sqrt(0.9))  # no score: the base rate
    assert p[2] == pytest.approx(1 - math.sqrt(0.9))
    before_any_score = table.p_within(0.0, 24.0, ("a",))
    assert before_any_score[0] == pytest.approx(0.1)
    assert table.hazard_fn(12.0, multiplier=100.0)(1.0, ("a",))[0] == 1.0  # capped


def test_hazard_table_lays_rows_out_by_slot_and_node() -> None:
    fs = FeatureSet(
        X=np.zeros((3, 1)),
        y=np.array([0, 1, 0]),
        groups=np.array([0, 1, 0]),
        times=np.array([1.0, 1.0, 3.0]),
        node_ids=("a", "b"),
        horizon_h=24.0,
    )
    table = hazard_table(np.array([0.1, 0.2, 0.3]), fs)
    assert table.p_horizon.shape == (3, 2)
    assert table.p_horizon[0].tolist() == [0.1, 0.2]
    assert np.isnan(table.p_horizon[1]).all()
    assert table.p_horizon[2, 0] == 0.3
    with pytest.raises(ValueError, match="one probability per feature row"):
        hazard_table(np.array([0.1]), fs)


def _two_tier_costs(**kw: float) -> StandbyCosts:
    return StandbyCosts.model_validate({"job_price_usd_per_h": 25_000.0, "min_hold_s": 0.0, **kw})


def test_a_held_fast_standby_is_downgraded_only_below_the_break_even_less_hysteresis() -> None:
    costs = _two_tier_costs(hysteresis=0.2)
    tiers = costs.tiers
    # Break-even between hot and stopped: (c_hot - c_stopped) L / (C_avoid_hot - C_avoid_stopped).
    even = (
        (tiers["hot"].price_usd_per_h - tiers["stopped"].price_usd_per_h)
        * costs.lead_time_h
        / (costs.avoided_usd("hot") - costs.avoided_usd("stopped"))
    )
    held = FleetState(hot=1, last_change_s=0.0)

    def plan(q: float) -> tuple[int, int, int]:
        p = decide_standby(NodeHazards(node_ids=("n",), p_fail=(q,)), costs, held, now_s=1e6)
        return (p.stopped, p.warm, p.hot)

    assert plan(0.9 * even) == (0, 0, 1)  # within the hysteresis band: kept, no extra stopped
    assert plan(0.7 * even) == (1, 0, 0)  # below it: downgraded to the cheap tier
    fresh = decide_standby(NodeHazards(node_ids=("n",), p_fail=(0.9 * even,)), costs, FleetState(), now_s=1e6)
    assert (fresh.stopped, fresh.hot) == (1, 0)  # without a held hot standby the rule picks stopped


@pytest.fixture(scope="module")
def small_pipeline() -> tuple[object, object]:
    model, report = train_predictor(
        [fleet_config(s, n_nodes=32, days=45.0) for s in (11, 12)], predictor=FailurePredictor(max_iter=20)
    )
    return model, report


def test_pipeline_trains_and_replays_a_held_out_fleet(small_pipeline: tuple[object, object]) -> None:
    model, report = small_pipeline
    assert report.rows > 5_000 and report.positives > 0  # type: ignore[attr-defined]
    ev = evaluate_fleet(model, fleet_config(77, n_nodes=32, days=45.0))  # type: ignore[arg-type]
    names = [r.name for r in ev.rows]
    assert "learned" in names and names[-1] == "oracle"
    oracle = ev.rows[-1]
    for r in ev.rows:
        assert r.result.failures == oracle.result.failures == ev.rows[0].uncovered_failures
        assert oracle.cost_per_useful_hour <= r.cost_per_useful_hour + 1e-9, r.name
    v = ev.verdict
    # The reference static is chosen on the first half (at least as available as the learned policy there, or the
    # most available static), never on the judged half. The old check, learned ETTR >= the static's on the judged
    # data, held only because the static used to be picked in hindsight among the less available ones.
    train = {r.name: r for r in ev.train_rows}
    assert v.best_static_train_ettr == train[v.best_static].ettr
    assert v.best_static_train_ettr >= v.learned_train_ettr or v.best_static_train_ettr == max(
        r.ettr for r in ev.train_rows if r.name.startswith(("static-", "binomial-", "no-standby"))
    )
    assert v.cost_ratio == pytest.approx(v.learned_usd_per_useful_h / v.best_static_usd_per_useful_h)
    d = ev.to_dict()
    assert set(d) >= {"seed", "prediction", "policies", "verdict"}
    assert 0.0 <= d["prediction"]["predictor"]["pr_auc"] <= 1.0  # type: ignore[index]


def test_learned_policy_with_more_caution_holds_at_least_as_many_standby_hours(
    small_pipeline: tuple[object, object],
) -> None:
    from policy.pipeline import fleet_features, job_costs
    from policy.simulator import simulate

    model, _ = small_pipeline
    fleet, feats = fleet_features(fleet_config(78, n_nodes=32, days=45.0), drop_censored=False)
    table = hazard_table(model.predict_proba(feats.X)[:, 1], feats)  # type: ignore[attr-defined]
    costs = job_costs(32)
    hours = [
        sum(
            simulate(
                fleet.trace, costs, learned_policy(table, costs.lead_time_h, multiplier=m), node_ids=fleet.node_ids
            ).standby_hours.values()
        )
        for m in (0.5, 4.0)
    ]
    assert hours[1] >= hours[0]
