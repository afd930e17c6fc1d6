"""The learned failure predictor: a calibrated gradient-boosting classifier, its persistence and its evaluation.

This module owns *predicting node faults from features* (`policy.features`). `FailurePredictor` is a
scikit-learn estimator: it fits a `HistGradientBoostingClassifier` on the earlier rows it is given and
calibrates its probabilities on the later rows (rows are taken to be in time order), so a probability of
0.2 means about one in five such rows see a fault within the horizon. `save`/`load` persist it with skops,
loading only an explicit allowlist of types. `evaluate` compares it with a rule baseline (any XID 48/79 in
the last 24 h) and a logistic regression on a time-ordered, node-grouped split.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import skops.io as sio
from sklearn.base import BaseEstimator, ClassifierMixin, clone
from sklearn.calibration import CalibratedClassifierCV
from sklearn.ensemble import HistGradientBoostingClassifier
from sklearn.frozen import FrozenEstimator
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import average_precision_score, brier_score_loss, precision_recall_curve
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.utils import Tags
from sklearn.utils.multiclass import check_classification_targets
from sklearn.utils.validation import check_is_fitted, validate_data

from policy.features import FEATURE_NAMES, RULE_FEATURE

TRUSTED_TYPES: tuple[str, ...] = (
    "policy.predictor.FailurePredictor",
    "sklearn.calibration.CalibratedClassifierCV",
    "sklearn.calibration._CalibratedClassifier",
    "sklearn.calibration._SigmoidCalibration",
    "sklearn.isotonic.IsotonicRegression",
    "sklearn.frozen._frozen.FrozenEstimator",
    "sklearn.ensemble._hist_gradient_boosting.gradient_boosting.HistGradientBoostingClassifier",
    "sklearn.ensemble._hist_gradient_boosting.binning._BinMapper",
    "sklearn.ensemble._hist_gradient_boosting.predictor.TreePredictor",
    "sklearn._loss.loss.HalfBinomialLoss",
    "sklearn._loss.loss.HalfMultinomialLoss",
    "sklearn._loss.link.LogitLink",
    "sklearn._loss.link.MultinomialLogit",
    "sklearn._loss.link.Interval",
    "sklearn._loss._loss.CyHalfBinomialLoss",
    "sklearn._loss._loss.CyHalfMultinomialLoss",
    "sklearn.preprocessing._label.LabelEncoder",
    "scipy.interpolate._interpolate.interp1d",
    "builtins.slice",
    "numpy.dtype",
    "numpy.ndarray",
    "numpy.float64",
    "numpy.int64",
)
"""Types `load` accepts. `save` refuses to write a model holding any other type, so a file that passes
`load` was written by this code or holds nothing more dangerous than what it would write."""


class UntrustedModelError(ValueError):
    """A model file holds types outside `TRUSTED_TYPES`; it was not written by `save` and is not loaded."""


class IncompatibleModelError(ValueError):
    """A model file was fitted on other features than this version builds, or does not say its horizon."""


class FailurePredictor(ClassifierMixin, BaseEstimator):
    """Gradient boosting calibrated on a later hold-out: probabilities that a node faults within the horizon.

    Rows of `X` must be in time order: the first `1 - calibration_fraction` of them train the trees and the
    rest calibrate the probabilities, so calibration sees data from after the trees' training period.
    When either part lacks a class (tiny or one-sided data), the trees train on all rows, uncalibrated.

    `horizon_h` is metadata, not a training knob: the label horizon the rows were built with (`features.
    build_features`), saved with the model so that whoever scores with it converts its probabilities with the
    right horizon (`pipeline.train_predictor` sets it; None means unknown).
    """

    def __init__(
        self,
        *,
        max_iter: int = 50,
        learning_rate: float = 0.05,
        max_leaf_nodes: int = 15,
        min_samples_leaf: int = 100,
        l2_regularization: float = 1.0,
        calibration: Literal["isotonic", "sigmoid"] | None = "sigmoid",
        calibration_fraction: float = 0.2,
        random_state: int | None = 0,
        horizon_h: float | None = None,
    ) -> None:
        self.max_iter = max_iter
        self.learning_rate = learning_rate
        self.max_leaf_nodes = max_leaf_nodes
        self.min_samples_leaf = min_samples_leaf
        self.l2_regularization = l2_regularization
        self.calibration = calibration
        self.calibration_fraction = calibration_fraction
        self.random_state = random_state
        self.horizon_h = horizon_h

    def __sklearn_tags__(self) -> Tags:
        tags = super().__sklearn_tags__()
        tags.input_tags.allow_nan = True  # the trees route missing values natively
        return tags

    def _trees(self, n_rows: int) -> HistGradientBoostingClassifier:
        return HistGradientBoostingClassifier(
            max_iter=self.max_iter,
            learning_rate=self.learning_rate,
            max_leaf_nodes=self.max_leaf_nodes,
            # Capped on small data so a few hundred rows can still split.
            min_samples_leaf=min(self.min_samples_leaf, max(5, n_rows // 10)),
            l2_regularization=self.l2_regularization,
            early_stopping=False,  # the later rows are for calibration, not a random validation split
            random_state=self.random_state,
        )

    def fit(self, X: Any, y: Any) -> FailurePredictor:
        """Fit the trees on the earlier rows and calibrate them on the later rows; return self."""
        if self.calibration not in ("isotonic", "sigmoid", None):
            raise ValueError(f"calibration must be 'isotonic', 'sigmoid' or None, got {self.calibration!r}")
        if not 0 < self.calibration_fraction < 1:
            raise ValueError(f"calibration_fraction must be in (0, 1), got {self.calibration_fraction}")
        X, y = validate_data(self, X, y, ensure_all_finite="allow-nan")
        check_classification_targets(y)
        self.classes_ = np.unique(y)
        if self.classes_.size < 2:
            raise ValueError(f"FailurePredictor needs at least 2 classes in y; got one class {self.classes_.tolist()}")
        n_fit = round(len(y) * (1 - self.calibration_fraction))
        fit_y, cal_y = y[:n_fit], y[n_fit:]
        splittable = (
            self.calibration is not None
            and np.unique(fit_y).size == self.classes_.size
            and np.unique(cal_y).size == self.classes_.size
        )
        if not splittable:
            self.model_ = self._trees(len(y)).fit(X, y)
            self.n_iter_ = self.model_.n_iter_
            self.calibrated_ = False
            return self
        trees = self._trees(n_fit).fit(X[:n_fit], fit_y)
        self.n_iter_ = trees.n_iter_
        # The frozen trees are scored once on the whole calibration part: one "fold" whose test set is everything.
        whole = np.arange(len(cal_y))
        self.model_ = CalibratedClassifierCV(FrozenEstimator(trees), method=self.calibration, cv=[(whole, whole)])
        self.model_.fit(X[n_fit:], cal_y)
        self.calibrated_ = True
        return self

    def predict_proba(self, X: Any) -> np.ndarray:
        """Probability of each class in `classes_`, one row per row of `X`."""
        check_is_fitted(self)
        X = validate_data(self, X, reset=False, ensure_all_finite="allow-nan")
        proba: np.ndarray = self.model_.predict_proba(X)
        return proba

    def predict(self, X: Any) -> np.ndarray:
        """The most probable class of each row."""
        check_is_fitted(self)
        out: np.ndarray = self.classes_[np.argmax(self.predict_proba(X), axis=1)]
        return out

    def save(self, path: str | Path) -> None:
        """Write the fitted model to `path` with skops, refusing if it holds a type `load` would not trust."""
        check_is_fitted(self)
        data = sio.dumps(self)
        untrusted = set(sio.get_untrusted_types(data=data)) - set(TRUSTED_TYPES)
        if untrusted:
            raise UntrustedModelError(f"model holds types missing from TRUSTED_TYPES: {sorted(untrusted)}")
        Path(path).write_bytes(data)

    @classmethod
    def load(cls, path: str | Path) -> FailurePredictor:
        """Read a model written by `save`; raise `UntrustedModelError` if the file holds any other type."""
        data = Path(path).read_bytes()
        untrusted = set(sio.get_untrusted_types(data=data)) - set(TRUSTED_TYPES)
        if untrusted:
            raise UntrustedModelError(
                f"{path} holds types this project does not trust: {sorted(untrusted)}; "
                "only load model files written by FailurePredictor.save"
            )
        model = sio.loads(data, trusted=list(TRUSTED_TYPES))
        if not isinstance(model, cls):
            raise UntrustedModelError(f"{path} holds a {type(model).__name__}, not a {cls.__name__}")
        return model


def time_split(
    times: np.ndarray, groups: np.ndarray, *, test_fraction: float = 0.3, gap_h: float = 0.0
) -> tuple[np.ndarray, np.ndarray]:
    """Indices of train rows (earlier period) and test rows (later period), with a purge gap between them.

    Test rows are those at or after the cut (the `1 - test_fraction` time quantile); train rows end `gap_h`
    before it (use the label horizon, so no training label looks into the test period). Consequently every
    node (group) has all its test rows at least `gap_h` after its last train row.
    """
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    cut = float(np.quantile(times, 1 - test_fraction))
    train = np.flatnonzero(times < cut - gap_h)
    test = np.flatnonzero(times >= cut)
    if train.size == 0 or test.size == 0 or np.unique(groups[test]).size == 0:
        raise ValueError("time split left the train or test period empty; use a longer window")
    return train, test


@dataclass(frozen=True, slots=True)
class ModelScore:
    """Metrics of one scorer on the test period."""

    pr_auc: float
    """Average precision of the scores."""
    precision_at_recall: float
    """Best precision at a threshold that reaches the target recall."""
    brier: float | None
    """Brier score (None for the rule, whose 0/1 output is not a probability)."""
    mean_lead_h: float | None
    """Mean hours from a node's first alarm to its fault, over the test faults that are alarmed in time."""
    alarmed_faults: int
    test_faults: int


@dataclass(frozen=True, slots=True)
class Evaluation:
    """The predictor against the rule and logistic baselines on one split."""

    predictor: ModelScore
    rule: ModelScore
    logistic: ModelScore
    base_rate: float
    """Share of positive test rows; also the PR-AUC of an uninformative scorer."""
    base_rate_brier: float
    """Brier score of always predicting the training base rate."""
    n_train: int
    n_test: int


def _lead_times(
    scores: np.ndarray, y: np.ndarray, times: np.ndarray, groups: np.ndarray, threshold: float
) -> list[float]:
    """Per alarmed test fault (a run of positive rows of one node): hours from the first alarm to the run's
    last row, which lies within one feature slot before the fault starts."""
    leads: list[float] = []
    for g in np.unique(groups[y == 1]).tolist():
        rows = np.flatnonzero(groups == g)
        t, pos, alarm = times[rows], y[rows] == 1, scores[rows] >= threshold
        # A new positive run starts where a positive row follows a negative one (or a gap between slots).
        starts = np.flatnonzero(pos & ~np.concatenate([[False], pos[:-1]]))
        for s in starts.tolist():
            e = s
            while e + 1 < pos.size and pos[e + 1]:
                e += 1
            hit = np.flatnonzero(alarm[s : e + 1])
            if hit.size:
                leads.append(float(t[e] - t[s + hit[0]]))
    return leads


def _score(
    scores: np.ndarray,
    y: np.ndarray,
    times: np.ndarray,
    groups: np.ndarray,
    *,
    threshold: float,
    recall: float,
    probabilistic: bool,
) -> ModelScore:
    precision, rec, _ = precision_recall_curve(y, scores)
    leads = _lead_times(scores, y, times, groups, threshold)
    n_faults = sum(int(np.sum(np.diff(np.concatenate([[0], y[groups == g]])) == 1)) for g in np.unique(groups).tolist())
    return ModelScore(
        pr_auc=float(average_precision_score(y, scores)),
        precision_at_recall=float(precision[rec >= recall].max()),
        brier=float(brier_score_loss(y, scores)) if probabilistic else None,
        mean_lead_h=float(np.mean(leads)) if leads else None,
        alarmed_faults=len(leads),
        test_faults=n_faults,
    )


def evaluate(
    model: FailurePredictor,
    X: np.ndarray,
    y: np.ndarray,
    times: np.ndarray,
    groups: np.ndarray,
    *,
    horizon_h: float = 24.0,
    test_fraction: float = 0.3,
    threshold: float = 0.5,
    recall: float = 0.5,
    feature_names: tuple[str, ...] = FEATURE_NAMES,
) -> Evaluation:
    """Fit `model` (a clone) and the baselines on the earlier period and score them on the later one.

    Rows are re-sorted by time (then node) first; the split is `time_split` with a purge gap of `horizon_h`.
    An alarm is a score at or above `threshold` (the rule alarms on any XID 48/79 in the last 24 h).
    """
    order = np.lexsort((groups, times))
    X, y, times, groups = X[order], y[order], times[order], groups[order]
    train, test = time_split(times, groups, test_fraction=test_fraction, gap_h=horizon_h)
    y_test = y[test]
    ts, gs = times[test], groups[test]

    def proba(est: Any) -> np.ndarray:
        fitted = est.fit(X[train], y[train])
        p: np.ndarray = fitted.predict_proba(X[test])[:, 1]
        return p

    rule_scores = (X[test][:, feature_names.index(RULE_FEATURE)] > 0).astype(float)
    base = float(np.mean(y[train]))
    return Evaluation(
        predictor=_score(proba(clone(model)), y_test, ts, gs, probabilistic=True, threshold=threshold, recall=recall),
        rule=_score(rule_scores, y_test, ts, gs, probabilistic=False, threshold=threshold, recall=recall),
        logistic=_score(
            proba(make_pipeline(StandardScaler(), LogisticRegression(max_iter=1000))),
            y_test,
            ts,
            gs,
            probabilistic=True,
            threshold=threshold,
            recall=recall,
        ),
        base_rate=float(np.mean(y_test)),
        base_rate_brier=float(brier_score_loss(y_test, np.full(y_test.size, base))),
        n_train=int(train.size),
        n_test=int(test.size),
    )


def load_policy_model(path: str | Path) -> FailurePredictor:
    """Load a model for the standby policy: `FailurePredictor.load`, then check that it was fitted on this
    version's `FEATURE_NAMES` and records its label horizon (`IncompatibleModelError` says how to retrain)."""
    model = FailurePredictor.load(path)
    check_is_fitted(model)
    retrain = f"retrain it with `trainmover policy train --out {path}`"
    if model.n_features_in_ != len(FEATURE_NAMES):
        raise IncompatibleModelError(
            f"{path} was fitted on {model.n_features_in_} features but this version of trainmover builds "
            f"{len(FEATURE_NAMES)} (policy.features.FEATURE_NAMES); {retrain}"
        )
    horizon = getattr(model, "horizon_h", None)
    if horizon is None or not horizon > 0:
        raise IncompatibleModelError(f"{path} does not record the label horizon it predicts; {retrain}")
    return model
