"""`trainmover bench policy`: the learned standby policy against static spares and the oracle, with timings.

In one run:

1. Train the failure predictor on synthetic fleets of development seeds (`TRAIN_SEEDS`).
2. On fleets of held-out seeds (`HELD_OUT_SEEDS`, used for nothing but this report), replay the faults with
   the static baselines (none, 5%, 10%, P99-binomial; warm and stopped), the learned policy and the oracle, and
   compare the learned policy with the cheapest static policy whose ETTR it matches or beats.
3. Replay the real InfiniteHBD trace the same way. It has no telemetry, so its learned policy is fed by a
   history-only predictor (faults of the node in the last 30 days) trained on the synthetic fleets.
4. Time the simulator on a 1,024-node fleet for 365 days, and the predictor's fit on 1M rows.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from policy.features import FEATURE_NAMES, REPAIR_CAP_H
from policy.learned import HazardTable, learned_policy
from policy.pipeline import (
    baseline_policies,
    evaluate_fleet,
    fleet_config,
    fleet_features,
    job_costs,
    train_predictor,
    verdict,
)
from policy.predictor import FailurePredictor
from policy.simulator import HazardPolicy, Oracle, compare_policies, format_table
from policy.synthetic import generate_fleet
from policy.traces import FaultTrace, load_infinitehbd

TRAIN_SEEDS = (101, 102)
HELD_OUT_SEEDS = (9001, 9002, 9003)
_HISTORY = [FEATURE_NAMES.index(n) for n in ("failures_last_30d", "hours_since_last_repair", "faults_last_7d")]


def _history_table(model: FailurePredictor, trace: FaultTrace, horizon_h: float) -> HazardTable:
    """Scores of a history-only model for every node of `trace` and hour, from the node's own fault history:
    faults in the last 30 days, hours since its last repair ended, faults in the last 7 days."""
    affected = sorted(trace.affected_nodes())
    node_ids = tuple(affected + [f"never-failed-{i}" for i in range(trace.n_nodes - len(affected))])
    n_slots = math.ceil(trace.duration_h)
    hours = np.arange(1, n_slots + 1, dtype=np.float64)
    X = np.zeros((n_slots, len(node_ids), 3))
    X[:, :, 1] = REPAIR_CAP_H
    for j, (_node, faults) in enumerate(sorted(trace.by_node().items())):
        starts = np.array([f.start_h for f in faults])
        ends = np.array([trace.duration_h * 10 if f.end_h is None else f.end_h for f in faults])
        X[:, j, 0] = np.searchsorted(starts, hours, side="right") - np.searchsorted(starts, hours - 720.0, "right")
        X[:, j, 2] = np.searchsorted(starts, hours, side="left") - np.searchsorted(starts, hours - 168.0, "left")
        prev = np.searchsorted(starts, hours, side="left") - 1
        since = np.where(prev >= 0, hours - ends[np.maximum(prev, 0)], REPAIR_CAP_H)
        X[:, j, 1] = np.clip(since, 0.0, REPAIR_CAP_H)
    p = model.predict_proba(X.reshape(-1, 3))[:, 1].reshape(n_slots, len(node_ids))
    base = float(model.predict_proba(np.array([[0.0, REPAIR_CAP_H, 0.0]]))[0, 1])
    return HazardTable(node_ids, 1.0, horizon_h, p, base)


def _rows_json(rows: Any) -> list[dict[str, Any]]:
    return [
        {k: v for k, v in asdict(r).items() if k != "result"}
        | {"standby_hours": r.result.standby_hours, "covered_by_tier": r.result.covered_by_tier}
        for r in rows
    ]


def run(quick: bool = False) -> dict[str, Any]:
    n_nodes, days = (64, 90.0) if quick else (256, 180.0)
    held_out = HELD_OUT_SEEDS[:1] if quick else HELD_OUT_SEEDS
    report: dict[str, Any] = {"mode": "quick" if quick else "full", "n_nodes": n_nodes, "days": days}

    print(f"training on seeds {TRAIN_SEEDS}: {len(TRAIN_SEEDS)} fleets of {n_nodes} nodes x {days:g} days", flush=True)
    model, train = train_predictor([fleet_config(s, n_nodes, days) for s in TRAIN_SEEDS])
    report["train"] = asdict(train)
    print(
        f"  {train.rows} rows ({train.positives} positive): features {train.features_s:.1f} s, fit {train.fit_s:.1f} s"
    )

    fleets = []
    for seed in held_out:
        ev = evaluate_fleet(model, fleet_config(seed, n_nodes, days))
        fleets.append(ev.to_dict())
        v = ev.verdict
        print(f"\nheld-out seed {seed}: {ev.faults} faults, simulated in {ev.simulate_s:.1f} s")
        print(format_table(ev.rows))
        print(
            f"  learned {v.learned_usd_per_useful_h:.2f} USD/useful h at ETTR {v.learned_ettr:.5f} vs {v.best_static} "
            f"{v.best_static_usd_per_useful_h:.2f} at {v.best_static_ettr:.5f}: ratio {v.cost_ratio:.3f}; "
            f"oracle {v.oracle_usd_per_useful_h:.2f}",
            flush=True,
        )
    ratios = [f["verdict"]["cost_ratio"] for f in fleets]  # type: ignore[index]
    report["held_out"] = fleets
    report["held_out_cost_ratio_mean"] = float(np.mean(ratios))

    # The real trace: a history-only predictor trained on the same synthetic fleets.
    _, feats = fleet_features(fleet_config(TRAIN_SEEDS[0], n_nodes, days))
    history_model = FailurePredictor(max_iter=30).fit(feats.X[:, _HISTORY], feats.y)
    trace = load_infinitehbd()
    costs = job_costs(trace.n_nodes)
    table = _history_table(history_model, trace, feats.horizon_h)
    learned = learned_policy(table, costs.lead_time_h, name="learned-history")
    rows = compare_policies(trace, costs, [*baseline_policies(), learned, Oracle()])
    print(
        f"\nInfiniteHBD trace ({len(trace.records)} faults, {trace.n_nodes} nodes, {trace.duration_h / 24:.0f} days):"
    )
    print(format_table(rows))
    real = verdict(rows, learned.name)
    print(f"  learned-history vs {real.best_static}: ratio {real.cost_ratio:.3f}")
    report["infinitehbd"] = {"policies": _rows_json(rows), "verdict": asdict(real)}

    # Timings.
    big = generate_fleet(fleet_config(7, 1024, 365.0)).trace
    big_costs = job_costs(1024)
    constant = HazardPolicy(lambda t_h, nodes: np.full(len(nodes), 2e-4), every_h=1.0, name="hourly-decisions")
    started = time.perf_counter()
    compare_policies(big, big_costs, [*baseline_policies(), constant, Oracle()])
    sim_s = time.perf_counter() - started
    report["simulator_1024x365"] = {"faults": len(big.records), "policies": 9, "seconds": sim_s}
    print(
        f"\nsimulator: 1,024 nodes x 365 days, {len(big.records)} faults, "
        f"9 policies incl. hourly decisions: {sim_s:.1f} s"
    )

    rows_needed = 1_000_000
    parts = [feats]
    seed = 500
    while sum(p.y.size for p in parts) < rows_needed:
        parts.append(fleet_features(fleet_config(seed, 256, 180.0))[1])
        seed += 1
    X = np.concatenate([p.X for p in parts])[:rows_needed]
    y = np.concatenate([p.y for p in parts])[:rows_needed]
    started = time.perf_counter()
    FailurePredictor(max_iter=100).fit(X, y)
    fit_s = time.perf_counter() - started
    report["fit_1m_rows"] = {"rows": int(y.size), "features": int(X.shape[1]), "max_iter": 100, "seconds": fit_s}
    print(f"predictor fit on {y.size} rows x {X.shape[1]} features: {fit_s:.1f} s")
    return report


def main(quick: bool = False, json_path: str | None = None) -> int:
    report = run(quick=quick)
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2, default=float) + "\n", encoding="utf-8")
        print(f"wrote {json_path}")
    return 0
