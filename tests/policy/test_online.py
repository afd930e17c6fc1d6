"""Online hazards: live samples in, per-node probabilities and the reason behind each out."""

from __future__ import annotations

import pytest

from policy.costs import StandbyCosts
from policy.decision import FleetState, decide_standby
from policy.online import RULE_P_CRITICAL, RULE_P_WARNING, OnlineScorer
from policy.telemetry import TelemetrySample


def sample(node: str, t_h: float, **kw: object) -> TelemetrySample:
    base: dict[str, object] = {
        "node_id": node,
        "t_h": t_h,
        "gpu_temp_c": 45.0,
        "hbm_temp_c": 55.0,
        "power_w": 380.0,
        "ecc_sbe_count": 0,
        "ecc_dbe_count": 0,
        "row_remaps": 0,
        "nvlink_errors": 0,
        "pcie_errors": 0,
        "nic_errors": 0,
        "node_age_days": 300.0,
        "failures_last_30d": 0,
    }
    base.update(kw)
    return TelemetrySample.model_validate(base)


def test_healthy_nodes_get_the_base_rate_and_an_xid_48_raises_its_node() -> None:
    scorer = OnlineScorer(["a", "b"], base_p_horizon=0.004)
    scorer.observe([sample("a", 1.0), sample("b", 1.0), sample("a", 2.0, xid_codes=(48,)), sample("b", 2.0)])
    scores = {s.node_id: s for s in scorer.scores(2.0)}
    assert scores["b"].p_horizon == 0.004 and "base rate" in scores["b"].why
    assert scores["a"].p_horizon == RULE_P_CRITICAL and "XID 48" in scores["a"].why


def test_a_burst_of_corrected_errors_is_a_warning_and_old_signals_expire() -> None:
    scorer = OnlineScorer(["a"], window_h=30.0)
    scorer.observe([sample("a", 1.0, ecc_sbe_count=30)])
    assert scorer.scores(2.0)[0].p_horizon == RULE_P_WARNING
    assert scorer.scores(8.0)[0].p_horizon == scorer.base_p_horizon  # older than 6 h: no longer a burst


def test_hazards_convert_to_the_lead_time_and_drive_a_prewarm() -> None:
    costs = StandbyCosts(job_price_usd_per_h=512 * 55.04, min_hold_s=0.0)
    scorer = OnlineScorer(["a", "b"])
    scorer.observe([sample("a", 1.0), sample("b", 1.0)])
    calm, _ = scorer.hazards(1.0, costs.lead_time_h)
    assert decide_standby(calm, costs, FleetState(), now_s=3600.0).warm == 0
    scorer.observe([sample("a", 2.0, xid_codes=(48,)), sample("b", 2.0)])
    hot, scores = scorer.hazards(2.0, costs.lead_time_h)
    assert hot.p_fail[0] == pytest.approx(1 - (1 - RULE_P_CRITICAL) ** (costs.lead_time_h / 24.0))
    assert scores[0].why.startswith("XID 48")
    plan = decide_standby(hot, costs, FleetState(), now_s=7200.0)
    assert plan.warm + plan.hot >= 1, plan.reasons


def test_bad_samples_are_refused() -> None:
    scorer = OnlineScorer(["a"])
    with pytest.raises(ValueError, match="unknown node"):
        scorer.observe([sample("zzz", 1.0)])
    scorer.observe([sample("a", 2.0)])
    with pytest.raises(ValueError, match="not after"):
        scorer.observe([sample("a", 2.0)])
    with pytest.raises(ValueError, match="distinct"):
        OnlineScorer(["a", "a"])


def test_a_replaced_node_starts_with_a_clean_history() -> None:
    scorer = OnlineScorer(["a", "b"])
    scorer.observe([sample("a", 1.0, xid_codes=(79,))])
    scorer.replace_node("a", "c")
    assert [s.node_id for s in scorer.scores(1.0)] == ["c", "b"]
    assert scorer.scores(1.0)[0].p_horizon == scorer.base_p_horizon


def test_a_fitted_model_scores_live_samples() -> None:
    from policy.pipeline import fleet_config, train_predictor
    from policy.predictor import FailurePredictor

    model, _ = train_predictor([fleet_config(5, n_nodes=64, days=60.0)], predictor=FailurePredictor(max_iter=10))
    scorer = OnlineScorer(["a", "b"], model=model)
    scorer.observe(
        [sample("a", float(h), xid_codes=(48,) if h > 3 else (), ecc_sbe_count=40 * (h > 3)) for h in range(1, 7)]
    )
    scorer.observe([sample("b", float(h)) for h in range(1, 7)])
    scores = {s.node_id: s.p_horizon for s in scorer.scores(6.0)}
    assert 0.0 <= scores["b"] <= 1.0 and 0.0 <= scores["a"] <= 1.0
    assert scores["a"] >= scores["b"]
