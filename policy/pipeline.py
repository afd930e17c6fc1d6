"""End-to-end policy experiments: synthetic fleets -> features -> predictor -> learned policy vs the baselines.

This module owns the sequence that `trainmover policy train|evaluate`, the `train_failure_model` flow and
`bench/policy.py` share, so that they all measure the same thing:

1. `fleet_features`: draw a synthetic fleet (`synthetic.generate_fleet`) and turn its telemetry into features.
2. `train_predictor`: fit a `FailurePredictor` on the fleets of some seeds (time-ordered rows).
3. `evaluate_fleet`: on a fleet of another seed, score the predictor against the rule and logistic baselines,
   then replay the fleet's faults with the baselines, the learned policy and the oracle, and summarise the
   learned policy against the best static policy whose ETTR it matches or beats.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from policy.costs import NODE_PRICE_USD_PER_H, StandbyCosts
from policy.features import DEFAULT_HORIZON_H, FeatureSet, build_features
from policy.learned import hazard_table, learned_policy
from policy.predictor import Evaluation, FailurePredictor, evaluate
from policy.simulator import (
    BinomialP99,
    ComparisonRow,
    NoStandby,
    Oracle,
    StandbyPolicy,
    StaticFraction,
    compare_policies,
)
from policy.synthetic import SyntheticFleet, SyntheticFleetConfig, generate_fleet

STATIC_PREFIXES = ("no-standby", "static-", "binomial-")
"""Names of the policies that hold a fixed count: the comparison set for the learned policy."""


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


def baseline_policies() -> list[StandbyPolicy]:
    """What cost owners run today: none, static 5% and 10%, P99-binomial, each in the warm and the stopped tier."""
    return [
        NoStandby(),
        StaticFraction(0.05, "warm"),
        StaticFraction(0.10, "warm"),
        BinomialP99(tier="warm"),
        StaticFraction(0.05, "stopped"),
        StaticFraction(0.10, "stopped"),
        BinomialP99(tier="stopped"),
    ]


@dataclass(frozen=True, slots=True)
class PolicyVerdict:
    """The learned policy against the cheapest static policy whose ETTR it matches or beats."""

    learned: str
    learned_ettr: float
    learned_usd_per_useful_h: float
    best_static: str
    best_static_ettr: float
    best_static_usd_per_useful_h: float
    cost_ratio: float
    """learned / best static cost per useful hour; below 0.85 meets the issue's 15% target."""
    oracle_usd_per_useful_h: float
    regret_usd_per_useful_h: float


def verdict(rows: Sequence[ComparisonRow], learned: str) -> PolicyVerdict:
    by_name = {r.name: r for r in rows}
    mine = by_name[learned]
    statics = [r for r in rows if r.name.startswith(STATIC_PREFIXES) and r.ettr <= mine.ettr + 1e-12]
    best = min(statics, key=lambda r: r.cost_per_useful_hour)
    oracle = by_name["oracle"]
    return PolicyVerdict(
        learned=learned,
        learned_ettr=mine.ettr,
        learned_usd_per_useful_h=mine.cost_per_useful_hour,
        best_static=best.name,
        best_static_ettr=best.ettr,
        best_static_usd_per_useful_h=best.cost_per_useful_hour,
        cost_ratio=mine.cost_per_useful_hour / best.cost_per_useful_hour if best.cost_per_useful_hour > 0 else math.inf,
        oracle_usd_per_useful_h=oracle.cost_per_useful_hour,
        regret_usd_per_useful_h=mine.regret_usd_per_useful_h,
    )


@dataclass(frozen=True, slots=True)
class FleetEvaluation:
    seed: int
    faults: int
    prediction: Evaluation
    rows: list[ComparisonRow]
    verdict: PolicyVerdict
    simulate_s: float

    def to_dict(self) -> dict[str, object]:
        return {
            "seed": self.seed,
            "faults": self.faults,
            "prediction": asdict(self.prediction),
            "policies": [
                {k: v for k, v in asdict(r).items() if k != "result"}
                | {"standby_hours": r.result.standby_hours, "covered_by_tier": r.result.covered_by_tier}
                for r in self.rows
            ],
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
) -> FleetEvaluation:
    """Score `model` on a fresh fleet and replay that fleet with the baselines, the learned policy and the oracle.

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
    rows = compare_policies(fleet.trace, costs, [*baseline_policies(), learned, Oracle()], node_ids=fleet.node_ids)
    simulate_s = time.perf_counter() - started
    return FleetEvaluation(
        int(config.seed), len(fleet.trace.records), prediction, rows, verdict(rows, learned.name), simulate_s
    )
