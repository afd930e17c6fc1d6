"""Policies for a fleet that has only its fault history (no telemetry), chosen on a temporal split with a fall-back.

This module owns `trainmover policy evaluate --trace FILE`: given one fault trace (a CSV of your own, or a shipped
one), it fits on the first part of the window and judges on the rest, and it never runs a model that showed no
edge on the data it was fitted on:

1. History features per node and hour, from the trace itself and only from the past of that hour
   (`history_features`): faults in the last 30 days, hours since the node's last repair ended, faults in the last
   7 days. Labels: the node's next fault starts within `horizon_h`. A `FailurePredictor` is fitted on the rows
   of the training part whose label is known there (`fit_history_model`).
2. Candidates, each fitted on training data only: the learned policy on those hazards (`learned-history`), the
   burst-aware learned policy (the same hazards for the single failures plus a compound-Poisson tail of the
   clusters, `bursts.burst_aware_learned`), the burst-aware pool (`bursts.BurstAwarePool`) and the reactive hold
   (one more warm standby for a while after each failure, `reactive.ReactiveHold`).
3. The edge check, on the training part alone, at several rolling origins (`INNER_ORIGINS`): at each origin every
   candidate is fitted on the training part before it and judged on the stretch up to the next origin (or to the
   end of the training part) against the static it would fall back to there, the one cheapest per useful hour
   before the origin (`verdict.judge`). A candidate has an edge only when no static dominates it on any stretch,
   it costs no more than that static on any stretch, and its mean saving exceeds the spread of its savings from
   stretch to stretch (their standard deviation): an edge that one lucky stretch makes is noise. The candidate
   with the largest mean saving is kept; without any, the policy *falls back* to the static that is cheapest per
   useful hour on the training part.
4. The kept candidate is refitted on the whole training part and judged on the test part (`verdict.judge`); a
   fall-back is the static itself, so its figures on the test part are that static's and its ratio is 1.

Step 3 uses no test data, so a kept model can still lose on the test part; the report says what happened.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import numpy.typing as npt

from policy.bursts import BurstAwarePool, burst_aware_learned
from policy.costs import StandbyCosts
from policy.features import DEFAULT_HORIZON_H, REPAIR_CAP_H
from policy.learned import HazardTable, learned_policy
from policy.predictor import FailurePredictor
from policy.reactive import fit_reactive_hold
from policy.simulator import ComparisonRow, StandbyPolicy, fleet_node_ids
from policy.traces import FaultTrace, split_trace
from policy.verdict import DEFAULT_TRAIN_FRACTION, Judgement, cheapest_static, judge

HISTORY_FEATURES = ("failures_last_30d", "hours_since_last_repair", "faults_last_7d")
INNER_ORIGINS = (0.4, 0.6, 0.8)
"""The edge check's rolling origins, as shares of the training part: at each, candidates are fitted on what lies
before it and judged on the stretch up to the next one (the last up to the end of the training part). Chosen
before any held-out fleet was looked at: three stretches, so that a spread can be measured, each a fifth of the
training part, so that each holds some failures even on a short trace."""
MAX_TRAINING_ROWS = 300_000
"""Training rows are taken every hour per node, or sparser (up to every 6 h) so that they stay about this many:
hourly rows of a year-long fleet are millions and add little."""
CANDIDATES = ("learned-history", "learned-burst", "burst-aware", "reactive-hold")
"""The candidates `evaluate_trace` fits and judges (`--candidates` picks some)."""


def history_features(trace: FaultTrace, hours: npt.ArrayLike, node_ids: Sequence[str]) -> npt.NDArray[np.float64]:
    """(hours, nodes, 3) history features at each hour: faults in the last 30 days, hours since the last repair
    ended (capped at `REPAIR_CAP_H`; 0 while down), faults in the last 7 days. Only faults that started before
    the hour count."""
    t = np.asarray(hours, dtype=np.float64)
    X = np.zeros((t.size, len(node_ids), 3))
    X[:, :, 1] = REPAIR_CAP_H
    column = {n: j for j, n in enumerate(node_ids)}
    for node, faults in trace.by_node().items():
        j = column[node]
        starts = np.array([f.start_h for f in faults])
        ends = np.array([math.inf if f.end_h is None else f.end_h for f in faults])
        before = np.searchsorted(starts, t, side="left")  # faults that started before t
        X[:, j, 0] = before - np.searchsorted(starts, t - 720.0, side="left")
        X[:, j, 2] = before - np.searchsorted(starts, t - 168.0, side="left")
        prev = before - 1
        since = np.where(prev >= 0, t - ends[np.maximum(prev, 0)], REPAIR_CAP_H)
        X[:, j, 1] = np.clip(since, 0.0, REPAIR_CAP_H)
    return X


def _labels(
    trace: FaultTrace, hours: npt.NDArray[np.float64], node_ids: Sequence[str], horizon_h: float
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
    """(hours, nodes) labels (a fault starts in [t, t + horizon_h)) and whether the node is up at t."""
    y = np.zeros((hours.size, len(node_ids)), dtype=np.int64)
    up = np.ones((hours.size, len(node_ids)), dtype=bool)
    column = {n: j for j, n in enumerate(node_ids)}
    for node, faults in trace.by_node().items():
        j = column[node]
        starts = np.array([f.start_h for f in faults])
        ends = np.array([math.inf if f.end_h is None else f.end_h for f in faults])
        nxt = np.searchsorted(starts, hours, side="left")
        y[:, j] = np.searchsorted(starts, hours + horizon_h, side="left") > nxt
        prev = nxt - 1
        up[:, j] = ~((prev >= 0) & (ends[np.maximum(prev, 0)] > hours))
    return y, up


def fit_history_model(
    trace: FaultTrace,
    until_h: float,
    *,
    horizon_h: float = DEFAULT_HORIZON_H,
    step_h: float | None = None,
    max_iter: int = 20,
    node_ids: Sequence[str] | None = None,
) -> FailurePredictor | None:
    """A history-only predictor fitted on the rows before `until_h` whose label is known before it (t + horizon
    <= until_h), time-ordered, every `step_h` hours (default: see `MAX_TRAINING_ROWS`); None when those rows hold
    no fault, or nothing else (nothing to learn from)."""
    nodes = tuple(node_ids) if node_ids is not None else fleet_node_ids(trace)
    if step_h is None:
        step_h = float(min(6, max(1, math.ceil(len(nodes) * until_h / MAX_TRAINING_ROWS))))
    hours = np.arange(step_h, until_h - horizon_h + 1e-9, step_h)
    if hours.size == 0:
        return None
    X = history_features(trace, hours, nodes)
    y, up = _labels(trace, hours, nodes, horizon_h)
    Xr, yr = X[up], y[up]  # row-major: time-ordered
    if yr.size == 0 or yr.min() == yr.max():
        return None
    model = FailurePredictor(max_iter=max_iter, horizon_h=horizon_h)
    return model.fit(Xr, yr)


def decision_every_h(trace: FaultTrace) -> float:
    """How often a history policy decides: hourly, but at most 8,760 times over the window (a decade-long trace
    like LANL system 20 decides every 10 hours), which keeps a replay within seconds."""
    return float(max(1, math.ceil(trace.duration_h / 8760.0)))


def history_table(
    model: FailurePredictor, trace: FaultTrace, node_ids: Sequence[str], *, every_h: float = 1.0
) -> HazardTable:
    """The model's P(fault within its horizon) for every node every `every_h` hours of `trace`.

    Rows repeat a lot (most nodes have no recent fault), so each distinct feature row is scored once; hours since
    the last repair are floored to whole hours for that (the model was fitted on the same features unrounded)."""
    horizon_h = float(model.horizon_h if model.horizon_h is not None else DEFAULT_HORIZON_H)
    n_slots = max(1, math.ceil(trace.duration_h / every_h))
    hours = np.arange(1, n_slots + 1, dtype=np.float64) * every_h
    X = history_features(trace, hours, node_ids).reshape(-1, 3)
    X[:, 1] = np.floor(X[:, 1])
    # One integer key per row (each feature is a whole number within its range), so np.unique sorts a vector.
    top = REPAIR_CAP_H + 1
    keys = (X[:, 0] * top + X[:, 1]) * (X[:, 2].max() + 1) + X[:, 2]
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    p = model.predict_proba(X[first])[:, 1][inverse.ravel()].reshape(n_slots, len(node_ids))
    base = float(model.predict_proba(np.array([[0.0, REPAIR_CAP_H, 0.0]]))[0, 1])
    return HazardTable(tuple(node_ids), every_h, horizon_h, p, base)


def candidates(
    trace: FaultTrace, fit_until_h: float, costs: StandbyCosts, node_ids: Sequence[str], *, horizon_h: float,
    only: Sequence[str] = CANDIDATES,
) -> dict[str, StandbyPolicy]:
    """The candidates in `only`, each fitted on the hours before `fit_until_h` of `trace` (hazards read on the
    trace's clock)."""
    head, _ = split_trace(trace, fit_until_h)
    out: dict[str, StandbyPolicy] = {}
    if "reactive-hold" in only and head.records:
        out["reactive-hold"] = fit_reactive_hold(head, costs, node_ids)
    if not {"learned-history", "learned-burst", "burst-aware"} & set(only):
        return out
    model = fit_history_model(trace, fit_until_h, horizon_h=horizon_h, node_ids=node_ids)
    if model is not None:
        every_h = decision_every_h(trace)
        table = history_table(model, trace, node_ids, every_h=every_h)
        out["learned-history"] = learned_policy(table, costs.lead_time_h, every_h=every_h, name="learned-history")
        out["learned-burst"] = burst_aware_learned(
            table.hazard_fn(costs.lead_time_h), head, costs.lead_time_h, every_h=every_h, name="learned-burst"
        )
    out["burst-aware"] = BurstAwarePool.fit(head, costs.lead_time_h, name="burst-aware")
    return out


@dataclass(frozen=True, slots=True)
class EdgeCheck:
    """One candidate on the training part: at each rolling origin fitted before it, judged on the next stretch."""

    candidate: str
    cost_ratio: float
    """Mean over the stretches of candidate / the static it would fall back to there (the cheapest per useful
    hour before the origin); NaN when the candidate could not be fitted."""
    dominated: bool
    """A static dominated the candidate on at least one stretch."""
    edge: bool
    """Never dearer than the fall-back static on a stretch, never dominated, and a mean saving (1 - cost_ratio)
    larger than `spread`."""
    summary: str
    stretch_ratios: tuple[float, ...] = ()
    """Candidate / fall-back static on each stretch, in time order."""
    spread: float = math.nan
    """Standard deviation of the stretch ratios (ddof 1): how much the saving moves from stretch to stretch."""


def _spread(ratios: Sequence[float]) -> float:
    return float(np.std(ratios, ddof=1)) if len(ratios) > 1 else math.inf


def has_edge(stretch_ratios: Sequence[float], dominated: bool) -> bool:
    """The keep rule: never dominated, never dearer than the fall-back static on a stretch, and a mean saving
    (1 - mean ratio) larger than the stretch-to-stretch spread of the ratios (standard deviation, ddof 1)."""
    ratios = list(stretch_ratios)
    if dominated or len(ratios) < 2 or max(ratios) > 1.0:
        return False
    return 1.0 - float(np.mean(ratios)) > _spread(ratios)


def edge_check(
    name: str,
    trace: FaultTrace,
    split_h: float,
    costs: StandbyCosts,
    statics: Sequence[StandbyPolicy],
    fitted: Sequence[dict[str, StandbyPolicy]],
    origins: Sequence[float],
    node_ids: Sequence[str],
) -> EdgeCheck:
    """The edge check of candidate `name` on the training part [0, `split_h`) of `trace` (see the module
    docstring); `fitted[i]` holds the candidates fitted before origin i (`origins[i]` x `split_h`)."""
    ends = [*origins[1:], 1.0]
    ratios: list[float] = []
    dominated = False
    notes: list[str] = []
    for origin, end, policies in zip(origins, ends, fitted, strict=True):
        if name not in policies:
            return EdgeCheck(
                name, math.nan, False, False, f"{name}: no fault to learn from before hour {origin * split_h:.0f}"
            )
        piece = split_trace(trace, end * split_h)[0]
        j = judge(piece, costs, policies[name], statics, train_fraction=origin / end, node_ids=node_ids)
        fallback = cheapest_static(j.train_rows)
        mine = _row(j.test_rows, name).cost_per_useful_hour
        ratios.append(mine / _row(j.test_rows, fallback.name).cost_per_useful_hour)
        dominated = dominated or bool(j.verdict.dominated_by)
        notes.append(
            f"hours {j.split_h:.0f}-{piece.duration_h:.0f}: {ratios[-1]:.3f}"
            + (" dominated" if j.verdict.dominated_by else "")
        )
    mean, spread = float(np.mean(ratios)), _spread(ratios)
    edge = has_edge(ratios, dominated)
    summary = f"{name}: mean ratio {mean:.3f} (spread {spread:.3f}) to the static it would fall back to; " + "; ".join(
        notes
    )
    return EdgeCheck(name, mean, dominated, edge, summary, tuple(ratios), spread)


@dataclass(frozen=True, slots=True)
class TraceEvaluation:
    """What `evaluate_trace` chose, why, and how the choice fared on the test part. USD per useful hour."""

    chosen: str
    """The kept candidate, or the static it fell back to."""
    fell_back: bool
    static: str
    """The static that is cheapest per useful hour on the training part (the fall-back)."""
    chosen_usd_per_useful_h: float
    chosen_ettr: float
    static_usd_per_useful_h: float
    static_ettr: float
    cost_ratio: float
    """Chosen / `static` on the test part; exactly 1 after a fall-back."""
    oracle_usd_per_useful_h: float
    split_h: float
    chosen_on: str
    edge_checks: tuple[EdgeCheck, ...]
    summary: str
    """One sentence: kept or fell back, and the figures."""
    judgements: dict[str, Judgement]
    """Every candidate refitted on the training part and judged on the test part (for the record)."""
    fitted: dict[str, str] = field(default_factory=dict)
    """What a candidate chose on the training part, in words, where it says (`ReactiveHold.description`)."""

    def to_dict(self) -> dict[str, object]:
        from policy.pipeline import rows_json

        head = {k: v for k, v in asdict(self).items() if k not in ("judgements", "edge_checks")}
        rows = next(iter(self.judgements.values())).test_rows if self.judgements else []
        return head | {
            "edge_checks": [asdict(e) for e in self.edge_checks],
            "verdicts": {name: asdict(j.verdict) for name, j in self.judgements.items()},
            "policies": rows_json(rows),
        }


def _row(rows: Sequence[ComparisonRow], name: str) -> ComparisonRow:
    return next(r for r in rows if r.name == name)


def evaluate_trace(
    trace: FaultTrace,
    costs: StandbyCosts,
    statics: Sequence[StandbyPolicy],
    *,
    train_fraction: float = DEFAULT_TRAIN_FRACTION,
    origins: Sequence[float] = INNER_ORIGINS,
    horizon_h: float = DEFAULT_HORIZON_H,
    only: Sequence[str] = CANDIDATES,
    make_candidates: Callable[[float], dict[str, StandbyPolicy]] | None = None,
    node_ids: Sequence[str] | None = None,
) -> TraceEvaluation:
    """Fit on the first `train_fraction` of `trace`, keep a candidate only if it showed an edge within that part,
    else fall back to the cheapest static there; judge the choice on the rest (see the module docstring).

    `make_candidates(fit_until_h)` replaces the history candidates (e.g. a telemetry predictor's policies, whose
    burst part is fitted before `fit_until_h`); it must use no fault at or after that hour."""
    if not 0.0 < train_fraction < 1.0:
        raise ValueError("train_fraction must lie strictly between 0 and 1, e.g. 0.5")
    if len(origins) < 2 or not all(0.0 < a < b <= 1.0 for a, b in zip(origins, [*origins[1:], 1.0], strict=True)):
        raise ValueError(f"origins {tuple(origins)}: give at least two shares, rising, strictly between 0 and 1")
    nodes = tuple(node_ids) if node_ids is not None else fleet_node_ids(trace)
    custom = make_candidates is not None
    if make_candidates is None:
        unknown = sorted(set(only) - set(CANDIDATES))
        if unknown or not only:
            raise ValueError(f"candidates {unknown or 'none'}: pick from {', '.join(CANDIDATES)}")

        def make_candidates(until_h: float) -> dict[str, StandbyPolicy]:
            return candidates(trace, until_h, costs, nodes, horizon_h=horizon_h, only=only)

    split_h = train_fraction * trace.duration_h
    fitted = [make_candidates(o * split_h) for o in origins]
    if custom:
        only = list(fitted[0])
    checks = [edge_check(name, trace, split_h, costs, statics, fitted, origins, nodes) for name in only]
    with_edge = [c for c in checks if c.edge]
    best = min(with_edge, key=lambda c: c.cost_ratio) if with_edge else None

    final = make_candidates(split_h)
    judgements = {
        name: judge(trace, costs, final[name], statics, train_fraction=train_fraction, node_ids=nodes)
        for name in only
        if name in final
    }
    any_j = next(iter(judgements.values()))
    static_train = cheapest_static(any_j.train_rows)
    static_test = _row(any_j.test_rows, static_train.name)
    oracle = _row(any_j.test_rows, "oracle")
    chosen_on = any_j.verdict.chosen_on
    if best is None:
        chosen = static_test
        why = "; ".join(
            f"{c.candidate} {c.cost_ratio:.3f} +- {c.spread:.3f}" + (" dominated" if c.dominated else "")
            for c in checks
        )
        summary = (
            f"fell back to {static_train.name}: no candidate had an edge on the training part (mean inner ratios "
            f"{why}); on the test part it costs {chosen.cost_per_useful_hour:.2f} USD/useful h at ETTR "
            f"{chosen.ettr:.5f}, the static itself (ratio 1.000)"
        )
    else:
        chosen = _row(judgements[best.candidate].test_rows, best.candidate)
        ratio = chosen.cost_per_useful_hour / static_test.cost_per_useful_hour
        summary = (
            f"kept {best.candidate} (mean inner ratio {best.cost_ratio:.3f} +- {best.spread:.3f} on the training "
            "part): on the test part "
            f"{chosen.cost_per_useful_hour:.2f} USD/useful h at ETTR {chosen.ettr:.5f} vs {static_train.name} "
            f"{static_test.cost_per_useful_hour:.2f} at {static_test.ettr:.5f}: ratio {ratio:.3f}; "
            f"{judgements[best.candidate].verdict.summary}"
        )
    ratio = 1.0 if best is None else chosen.cost_per_useful_hour / static_test.cost_per_useful_hour
    return TraceEvaluation(
        chosen=chosen.name,
        fell_back=best is None,
        static=static_train.name,
        chosen_usd_per_useful_h=chosen.cost_per_useful_hour,
        chosen_ettr=chosen.ettr,
        static_usd_per_useful_h=static_test.cost_per_useful_hour,
        static_ettr=static_test.ettr,
        cost_ratio=ratio,
        oracle_usd_per_useful_h=oracle.cost_per_useful_hour,
        split_h=split_h,
        chosen_on=chosen_on,
        edge_checks=tuple(checks),
        summary=summary,
        judgements=judgements,
        fitted={n: str(p.description) for n, p in final.items() if hasattr(p, "description")},
    )
