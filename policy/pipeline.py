"""End-to-end policy experiments: synthetic fleets -> features -> predictor -> learned policy vs the baselines.

This module owns the sequence that `trainmover policy train|evaluate`, the `train_failure_model` flow and
`bench/policy.py` share, so that they all measure the same thing:

1. `fleet_features`: draw a synthetic fleet (`synthetic.generate_fleet`) and turn its telemetry into features.
2. `train_predictor`: fit a `FailurePredictor` on the fleets of some seeds (time-ordered rows).
3. `evaluate_fleet`: on a fleet of another seed, score the predictor against the rule and logistic baselines,
   then judge the learned policy on the second half of the fleet's window against the static pool chosen on
   the first half (`verdict.judge`: the cheapest static at least as available as the learned policy there).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from policy.costs import DEFAULT_TIER_NAMES, NODE_PRICE_USD_PER_H, StandbyCosts, TierName
from policy.features import DEFAULT_HORIZON_H, FeatureSet, build_features
from policy.learned import hazard_table, learned_policy
from policy.predictor import Evaluation, FailurePredictor, evaluate
from policy.simulator import BinomialP99, ComparisonRow, NoStandby, StandbyPolicy, StaticFraction, static_pools
from policy.synthetic import SyntheticFleet, SyntheticFleetConfig, generate_fleet
from policy.verdict import DEFAULT_TRAIN_FRACTION, PolicyVerdict, judge


def fleet_config(seed: int, n_nodes: int = 256, days: float = 180.0, **overrides: object) -> SyntheticFleetConfig:
    """A fleet calibrated to the real trace, with hourly telemetry (plenty for 1-hour feature slots)."""
    return SyntheticFleetConfig.model_validate(
        {"n_nodes": n_nodes, "days": days, "seed": seed, "telemetry_interval_s": 3600.0, **overrides}
    )


def fleet_features(
    config: SyntheticFleetConfig, *, horizon_h: float = DEFAULT_HORIZON_H, drop_censored: bool = True
) -> tuple[SyntheticFleet, FeatureSet]:
    fleet = generate_fleet(config)
    features = build_features(
        fleet.telemetry(chunk_h=240.0), fleet.trace, fleet.node_ids, horizon_h=horizon_h, drop_censored=drop_censored
    )
    return fleet, features


@dataclass(frozen=True, slots=True)
class TrainReport:
    seeds: tuple[int, ...]
    rows: int
    positives: int
    features_s: float
    fit_s: float


def train_predictor(
    configs: Iterable[SyntheticFleetConfig],
    *,
    horizon_h: float = DEFAULT_HORIZON_H,
    predictor: FailurePredictor | None = None,
) -> tuple[FailurePredictor, TrainReport]:
    """Fit a predictor on the fleets of `configs`, rows ordered by time so the calibration part is the latest."""
    configs = list(configs)
    started = time.perf_counter()
    parts = [fleet_features(c, horizon_h=horizon_h)[1] for c in configs]
    if not parts:
        raise ValueError("train_predictor needs at least one fleet config")
    X = np.concatenate([p.X for p in parts])
    y = np.concatenate([p.y for p in parts])
    times = np.concatenate([p.times for p in parts])
    order = np.argsort(times, kind="stable")
    X, y = X[order], y[order]
    features_s = time.perf_counter() - started
    model = predictor if predictor is not None else FailurePredictor(max_iter=100)
    model.set_params(horizon_h=horizon_h)
    started = time.perf_counter()
    model.fit(X, y)
    fit_s = time.perf_counter() - started
    return model, TrainReport(tuple(int(c.seed) for c in configs), int(y.size), int(y.sum()), features_s, fit_s)


def job_costs(n_nodes: int, **overrides: object) -> StandbyCosts:
    """Default prices for a job that spans the whole fleet (its hourly price is n_nodes x the node price)."""
    return StandbyCosts.model_validate({"job_price_usd_per_h": n_nodes * NODE_PRICE_USD_PER_H, **overrides})


def baseline_policies(tiers: Iterable[TierName] = DEFAULT_TIER_NAMES) -> list[StandbyPolicy]:
    """The statics a candidate must beat: none; 5% and 10% of the job and P99-binomial, each in the warm and the
    stopped tier (what cost owners run today); and every mixed-tier pool of `static_pools` (e.g. 1 hot + 2
    stopped), which on real and synthetic fleets are the ones to beat. Only pools of the offered `tiers`."""
    offered = list(tiers)
    singles: list[StandbyPolicy] = [
        policy
        for tier in ("warm", "stopped")
        if tier in offered
        for policy in (StaticFraction(0.05, tier), StaticFraction(0.10, tier), BinomialP99(tier=tier))
    ]
    return [NoStandby(), *singles, *static_pools(offered)]


def rows_json(rows: Sequence[ComparisonRow]) -> list[dict[str, object]]:
    """Comparison rows as JSON-ready dicts (the full `SimulationResult` reduced to its per-tier figures)."""
    return [
        {k: v for k, v in asdict(r).items() if k != "result"}
        | {"standby_hours": r.result.standby_hours, "covered_by_tier": r.result.covered_by_tier}
        for r in rows
    ]


@dataclass(frozen=True, slots=True)
class FleetEvaluation:
    """A held-out fleet: the predictor's scores, and the learned policy judged on the second part of the window
    against the static chosen on the first (`verdict.judge`)."""

    seed: int
    faults: int
    prediction: Evaluation
    rows: list[ComparisonRow]
    """Every policy on the test part of the window."""
    train_rows: list[ComparisonRow]
    """Every policy on the training part, where the reference static was chosen."""
    split_h: float
    verdict: PolicyVerdict
    simulate_s: float

    def to_dict(self) -> dict[str, object]:
        return {
            "seed": self.seed,
            "faults": self.faults,
            "prediction": asdict(self.prediction),
            "split_h": self.split_h,
            "policies": rows_json(self.rows),
            "train_policies": rows_json(self.train_rows),
            "verdict": asdict(self.verdict),
            "simulate_s": self.simulate_s,
        }


def model_horizon(model: FailurePredictor, horizon_h: float | None = None) -> float:
    """The label horizon to score `model` with: its own, else `horizon_h`, else `DEFAULT_HORIZON_H`."""
    own = getattr(model, "horizon_h", None)
    if own is not None and horizon_h is not None and not math.isclose(own, horizon_h):
        raise ValueError(
            f"the model predicts faults within {own:g} h, not {horizon_h:g} h; score it with its own horizon"
        )
    return float(own if own is not None else horizon_h if horizon_h is not None else DEFAULT_HORIZON_H)


def evaluate_fleet(
    model: FailurePredictor,
    config: SyntheticFleetConfig,
    costs: StandbyCosts | None = None,
    *,
    multiplier: float = 1.0,
    horizon_h: float | None = None,
    train_fraction: float = DEFAULT_TRAIN_FRACTION,
) -> FleetEvaluation:
    """Score `model` on a fresh fleet and replay that fleet with the baselines, the learned policy and the oracle:
    the reference static is chosen on the first `train_fraction` of the window, everything is judged on the rest.

    The label horizon is the one the model was trained with (`FailurePredictor.horizon_h`); `horizon_h` is only
    needed for a model that does not record it, and must agree with one that does.
    """
    horizon_h = model_horizon(model, horizon_h)
    fleet, features = fleet_features(config, horizon_h=horizon_h, drop_censored=False)
    costs = costs if costs is not None else job_costs(config.n_nodes)
    uncensored = features.times + horizon_h <= fleet.trace.duration_h
    prediction = evaluate(
        model,
        features.X[uncensored],
        features.y[uncensored],
        features.times[uncensored],
        features.groups[uncensored],
        horizon_h=horizon_h,
    )
    scores = model.predict_proba(features.X)[:, 1]
    table = hazard_table(scores, features)
    learned = learned_policy(table, costs.lead_time_h, multiplier=multiplier)
    started = time.perf_counter()
    statics = baseline_policies(costs.tiers)
    j = judge(fleet.trace, costs, learned, statics, train_fraction=train_fraction, node_ids=fleet.node_ids)
    simulate_s = time.perf_counter() - started
    return FleetEvaluation(
        int(config.seed),
        len(fleet.trace.records),
        prediction,
        j.test_rows,
        j.train_rows,
        j.split_h,
        j.verdict,
        simulate_s,
    )
