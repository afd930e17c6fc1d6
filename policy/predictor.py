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

    A scikit-learn classifier for time-ordered rows. `fit` trains histogram gradient-boosted trees on the
    earlier rows and calibrates their probabilities on the later rows, so calibration sees data from after the
    trees' training period, as the model will when it scores live nodes. Column 1 of `predict_proba` (class 1)
    is then the probability that the node's next fault starts within `horizon_h`: a probability of 0.2 means
    about one in five such rows see a fault. When calibration is off, or the earlier or the later part lacks a
    class (tiny or one-sided data), the trees train on all rows and the probabilities are left uncalibrated.

    Parameters
    ----------
    max_iter : int, default=50
        Number of boosting iterations: one tree each for a binary target (one per class and iteration for
        more classes). Early stopping is off, so exactly this many are grown (`n_iter_`). At least 1.
        `trainmover policy train` uses 100 (`--max-iter`), `history.fit_history_model` 20 by default.

    learning_rate : float, default=0.05
        Shrinkage of each tree's contribution to the log-odds. Greater than 0; a smaller rate needs more
        iterations.

    max_leaf_nodes : int, default=15
        Maximum number of leaves of each tree. At least 2.

    min_samples_leaf : int, default=100
        Minimum number of training rows in a leaf, capped at ``max(5, n_rows // 10)``, where ``n_rows`` is the
        number of rows the trees are fitted on (the earlier part when calibrating, all rows otherwise), so a few
        hundred rows can still split. At least 1.

    l2_regularization : float, default=1.0
        L2 penalty on the leaf values. At least 0; larger values shrink the leaves more.

    calibration : {"sigmoid", "isotonic"} or None, default="sigmoid"
        How the later rows map the trees' scores to probabilities: "sigmoid" (Platt scaling, two parameters,
        steady on few positive rows) or "isotonic" (a monotone step function, more flexible, needs more
        calibration rows). None turns calibration off: the trees train on all rows. `fit` raises ValueError for
        any other value.

    calibration_fraction : float, default=0.2
        Share of the rows, the latest ones, that calibrate: the first ``round(n_rows * (1 - calibration_fraction))``
        rows train the trees and the rest calibrate them. Strictly between 0 and 1, else `fit` raises ValueError
        (it checks this even when `calibration` is None).

    random_state : int or None, default=0
        Seed of the trees' randomness: the subsample that places the bin thresholds when the trees see more
        than 200,000 rows (on fewer rows the fit is deterministic whatever the seed). None draws a fresh seed
        from numpy's global random state on every fit.

    horizon_h : float or None, default=None
        Metadata, not a training knob: the label horizon in hours that the rows were built with
        (`features.build_features`, `history.fit_history_model`), saved with the model so that whoever scores
        with it converts its probabilities with the right horizon. `pipeline.train_predictor` and
        `history.fit_history_model` set it; None means unknown. `fit` does not check it, but
        `load_policy_model` refuses a model whose horizon is None or not greater than 0.

    Attributes
    ----------
    classes_ : ndarray of shape (n_classes,)
        The class labels seen in `fit`, sorted; at least two. For the policy's 0/1 labels ``[0, 1]``: column 1
        of `predict_proba` is P(fault within `horizon_h`).

    n_features_in_ : int
        Number of features (columns of `X`) seen in `fit`; `predict_proba` refuses any other number.
        `load_policy_model` requires ``len(features.FEATURE_NAMES)``.

    feature_names_in_ : ndarray of shape (`n_features_in_`,)
        Names of the features seen in `fit`. Set only when `X` has string column names (a DataFrame).

    model_ : CalibratedClassifierCV or HistGradientBoostingClassifier
        The fitted model that `predict_proba` delegates to. When `calibrated_`, a `CalibratedClassifierCV`
        holding the trees fitted on the earlier rows (frozen, `FrozenEstimator`) and one calibrator fitted on
        the later rows; otherwise the `HistGradientBoostingClassifier` fitted on all rows.

    n_iter_ : int
        Number of boosting iterations of the fitted trees; equal to `max_iter`, since early stopping is off.

    calibrated_ : bool
        Whether the probabilities are calibrated on the later rows. False when `calibration` is None or when
        the earlier or the later part lacks one of the classes.

    See Also
    --------
    policy.features.build_features : The telemetry rows and labels it is trained on.
    policy.history.fit_history_model : Fits it on a trace's history features (no telemetry).
    policy.predictor.evaluate : Scores it against a rule and a logistic baseline on a time split.
    policy.predictor.load_policy_model : Loads a saved model for the standby policy and checks that it fits.
    policy.learned.hazard_table : Lays its probabilities out as the standby policy's hazards.
    sklearn.ensemble.HistGradientBoostingClassifier : The trees.
    sklearn.calibration.CalibratedClassifierCV : The calibration.

    Notes
    -----
    The model is scikit-learn's `HistGradientBoostingClassifier` (log loss, features binned into at most 255
    bins, missing values routed natively) without early stopping: the later rows are for calibration, not for a
    random validation split.

    Calibration is a single time-ordered hold-out, not cross-validation. The trees are fitted on the first
    ``1 - calibration_fraction`` of the rows and frozen; a `CalibratedClassifierCV` over the frozen trees, with
    one "fold" whose test set is every later row, fits one calibrator (`calibration`) on the trees' scores for
    those rows. Uncalibrated probabilities (`calibrated_` False) are the trees' own, which tend to be
    over-confident where the trees overfit.

    Data: `X` is an array-like of shape (n_samples, n_features) of floats, NaN allowed (infinity is not), with
    the rows in time order, earliest first: the split is by position and `fit` does not sort (rows of many
    nodes interleave; sort them by time, as `pipeline.train_predictor` does). `y` holds the class labels, at
    least two classes (ValueError otherwise); the policy's are 1 when the node's next fault starts within
    `horizon_h` of the row's time and 0 otherwise. The telemetry model's columns are `features.FEATURE_NAMES`
    (`FeatureSet.X`); the history-only model's are the three of `history.history_features`. More than two
    classes work too (the scikit-learn estimator checks pass), but the policy uses two.

    `save` and `load` persist a fitted model with skops, loading only `TRUSTED_TYPES`.

    Examples
    --------
    Tiny synthetic data: 500 rows in time order, three features, a fault when the first feature runs high.

    >>> import numpy as np
    >>> from policy.predictor import FailurePredictor
    >>> rng = np.random.default_rng(0)
    >>> X = rng.normal(size=(500, 3))
    >>> y = (X[:, 0] + rng.normal(scale=0.5, size=500) > 1.5).astype(int)
    >>> model = FailurePredictor(max_iter=20, horizon_h=3.0).fit(X, y)
    >>> model.classes_
    array([0, 1])
    >>> model.calibrated_, model.n_iter_, model.n_features_in_
    (True, 20, 3)

    P(fault within 3 h) for a node whose first feature runs high, one where it is low, and one where it is
    missing (NaN):

    >>> p_fault = model.predict_proba([[2.5, 0.0, 0.0], [-1.0, 0.0, 0.0], [np.nan, 0.0, 0.0]])[:, 1]
    >>> p_fault.shape
    (3,)
    >>> bool(p_fault[0] > 0.2 > p_fault[1])
    True

    Without calibration the trees train on every row:

    >>> FailurePredictor(max_iter=20, calibration=None).fit(X, y).calibrated_
    False
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
