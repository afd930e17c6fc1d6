"""A trained FailurePredictor steering the flow's policy: the drill's degrading node must earn a warm standby.

The training flow scores live telemetry with the model a cost owner trained (`load_scorer`). This checks the
chain the flow runs, without processes: a model trained on synthetic fleets, the drill's telemetry fed through
`OnlineScorer`, and `decide_standby` at the demo's prices.
"""

from __future__ import annotations

import pytest

from flows.drill import DegradingFeed
from flows.models import StandbyLimits, TrainingRun
from policy.decision import FleetState, decide_standby
from policy.online import OnlineScorer
from policy.pipeline import fleet_config, train_predictor
from policy.predictor import FailurePredictor


@pytest.fixture(scope="module")
def model() -> FailurePredictor:
    # One fleet of 256 nodes over 90 days (half the size `trainmover policy train` uses by default, about 5 s
    # here): enough failures (about 250) for a model that pays for a standby on one node's say-so.
    trained, report = train_predictor([fleet_config(11, 256, 90.0)], predictor=FailurePredictor(max_iter=60))
    assert report.positives > 100
    return trained


def test_a_trained_model_prewarms_for_the_degrading_node_and_not_for_healthy_ones(model: FailurePredictor) -> None:
    run = TrainingRun(workers=2, job_nodes=512, standby=StandbyLimits(min_warm=0, max_warm=2, max_stopped=1))
    costs = run.costs()
    feed = DegradingFeed(degrade_rank=1, degrade_from_h=6.0)
    scorer = OnlineScorer(["healthy", "sick"], model=model, horizon_h=float(model.horizon_h))
    nodes = {0: "healthy", 1: "sick"}
    warm_from = None
    for hour in range(0, 14):
        scorer.observe(feed.read(float(hour), nodes))
        hazards, _ = scorer.hazards(float(hour), costs.lead_time_h)
        p = dict(zip(hazards.node_ids, hazards.p_fail, strict=True))
        assert p["healthy"] < costs.threshold("warm"), f"hour {hour}: a healthy node scored {p['healthy']:.4f}"
        plan = decide_standby(hazards, costs, FleetState(), now_s=hour * 3600.0)
        if hour < 6:
            assert plan.warm + plan.hot == 0, f"hour {hour}: pre-warmed before any sign: {plan.reasons}"
        elif plan.warm + plan.hot and warm_from is None:
            warm_from = hour
    assert warm_from is not None, "the degrading node never earned a warm standby within 8 h of its first sign"
