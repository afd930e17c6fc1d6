"""The failure predictor: sklearn conformance, skill on synthetic fleets, leak checks, and safe persistence."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
import pytest
import skops.io as sio
from sklearn.utils.estimator_checks import parametrize_with_checks

from policy.features import FEATURE_NAMES, FeatureSet, build_features
from policy.predictor import FailurePredictor, UntrustedModelError, evaluate, time_split
from policy.synthetic import SyntheticFleetConfig, generate_fleet

HORIZON_H = 12.0


@parametrize_with_checks([FailurePredictor()])
def test_sklearn_estimator_checks(estimator: FailurePredictor, check) -> None:  # type: ignore[no-untyped-def]
    check(estimator)


@cache
def _features(precursor_fraction: float) -> FeatureSet:
    fleet = generate_fleet(
        SyntheticFleetConfig(
            n_nodes=128, days=60, precursor_fraction=precursor_fraction, faults_per_1000_node_days=8, seed=3
        )
    )
    return build_features(fleet.telemetry(chunk_h=240), fleet.trace, fleet.node_ids, horizon_h=HORIZON_H)


def test_features_are_time_ordered_and_labels_match_the_horizon() -> None:
    fs = _features(0.8)
    assert fs.X.shape == (fs.y.size, len(FEATURE_NAMES))
    assert np.all(np.diff(fs.times) >= 0)
    assert 0 < fs.y.mean() < 0.05
    assert np.all(fs.times + HORIZON_H <= 60 * 24)  # censored rows are dropped


def test_predictor_beats_the_rule_and_is_calibrated_when_precursors_exist() -> None:
    fs = _features(0.8)
    ev = evaluate(FailurePredictor(), fs.X, fs.y, fs.times, fs.groups, horizon_h=HORIZON_H)
    assert ev.predictor.pr_auc > ev.rule.pr_auc
    assert ev.predictor.pr_auc > 5 * ev.base_rate
    assert ev.predictor.brier is not None and ev.predictor.brier < ev.base_rate_brier
    assert ev.predictor.mean_lead_h is not None and ev.predictor.mean_lead_h > 0


def test_without_precursors_the_predictor_is_no_better_than_chance() -> None:
    # Features that leaked the label (e.g. the next fault's time) would still score well here. The node's fault
    # history is real signal (faults are bursty: a node just back from repair is at high risk), so it is left out
    # for the chance check; the telemetry-only counts of recent faults still allow a few times the base rate.
    fs = _features(0.0)
    history = [FEATURE_NAMES.index(n) for n in ("failures_last_30d", "hours_since_last_repair", "faults_last_7d")]
    names = tuple(n for i, n in enumerate(FEATURE_NAMES) if i not in history)
    X = np.delete(fs.X, history, axis=1)
    ev = evaluate(FailurePredictor(), X, fs.y, fs.times, fs.groups, horizon_h=HORIZON_H, feature_names=names)
    assert ev.base_rate > 0
    assert ev.predictor.pr_auc < 5 * ev.base_rate
    # With the history it does better, yet nowhere near what a leaked label would give.
    with_history = evaluate(FailurePredictor(), fs.X, fs.y, fs.times, fs.groups, horizon_h=HORIZON_H)
    assert with_history.predictor.pr_auc < 0.1


def test_time_split_puts_every_test_row_after_the_purged_train_period() -> None:
    fs = _features(0.8)
    train, test = time_split(fs.times, fs.groups, test_fraction=0.3, gap_h=HORIZON_H)
    assert train.size and test.size and np.intersect1d(train, test).size == 0
    # Per node: its earliest test row is at least the horizon after its latest train row, so no train label
    # (which looks HORIZON_H ahead) sees a fault from the test period.
    for g in np.intersect1d(fs.groups[train], fs.groups[test]).tolist():
        assert fs.times[test][fs.groups[test] == g].min() >= fs.times[train][fs.groups[train] == g].max() + HORIZON_H


def test_skops_round_trip_gives_identical_probabilities(tmp_path: Path) -> None:
    fs = _features(0.8)
    model = FailurePredictor().fit(fs.X[:80_000], fs.y[:80_000])
    assert model.calibrated_
    model.save(tmp_path / "model.skops")
    loaded = FailurePredictor.load(tmp_path / "model.skops")
    np.testing.assert_array_equal(loaded.predict_proba(fs.X[-5000:]), model.predict_proba(fs.X[-5000:]))


class _Payload:
    """A type no allowlist names: stands in for whatever an attacker might pickle into a model file."""

    def __init__(self) -> None:
        self.command = "rm -rf /"


def test_loading_a_file_with_an_untrusted_type_is_refused(tmp_path: Path) -> None:
    model = FailurePredictor().fit(np.arange(40.0).reshape(-1, 1), np.repeat([0, 1], 20))
    model.payload_ = _Payload()
    path = tmp_path / "evil.skops"
    sio.dump(model, path)
    with pytest.raises(UntrustedModelError, match="_Payload"):
        FailurePredictor.load(path)
    with pytest.raises(UntrustedModelError, match="_Payload"):
        model.save(tmp_path / "refused.skops")
