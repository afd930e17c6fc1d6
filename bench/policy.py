"""`trainmover bench policy`: the learned standby policy against static spares and the oracle, with timings.

In one run:

1. Train the failure predictor on synthetic fleets of development seeds (`TRAIN_SEEDS`).
2. On fleets of held-out seeds (`HELD_OUT_SEEDS`, used for nothing but this report), replay the faults with
   the static baselines (none, 5%, 10%, P99-binomial in warm and stopped, and mixed-tier pools), the learned
   policy and the oracle, and compare the learned policy with the cheapest static at least as available on the
   first half of the window (`policy.verdict.judge`), judged on the second half.
3. Replay the real InfiniteHBD and LANL system 20 traces the same way. They have no telemetry, so their learned
   policy is fed by a history-only predictor (faults of the node in the last 30 days) trained on the synthetic
   fleets. Every verdict chooses its reference static on the first half of the window and judges on the second.
   The burst-aware pool (`policy.bursts`, a compound Poisson count fitted on the first half) is judged the same
   way on every fleet and trace.
4. The chosen policy with its fall-back (`policy.history.evaluate_trace`): on each real trace a history-only model
   fitted on the first half, the burst-aware learned policy, the burst-aware pool and the reactive hold
   (`policy.reactive`) are kept only with an edge
   inside the first half (at three rolling origins, larger than the spread between them), else the static cheapest
   there is run; judged on the second half. The same on bursty synthetic fleets of the held-out seeds
   (`burst_share` 0.3), there with a predictor trained on bursty fleets of the training seeds (telemetry hazards,
   alone and with the burst tail, beside the reactive hold).
5. Spot standbys: the cheapest pool on each real trace with and without the spot tier (`tuning.sweep`, hindsight),
   and the static chosen on the first half with and without spot, judged on the second (`verdict.choose_static`),
   on the real traces and the bursty held-out fleets, with where the chosen static's cost goes and the best that
   a static picked in hindsight and the oracle reach there.
6. Time the simulator on a 1,024-node fleet for 365 days (all baselines; then a year of hourly decisions of the
   learned policy, the reference loop against the fast path, whose results must be identical), and the
   predictor's fit on 1M rows.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from policy.bursts import BurstAwarePool, burst_aware_learned
from policy.costs import StandbyCosts, default_tiers, spot_tier
from policy.features import FEATURE_NAMES, REPAIR_CAP_H
from policy.history import INNER_ORIGINS, TraceEvaluation, evaluate_trace, history_table
from policy.learned import HazardTable, hazard_table, learned_policy
from policy.pipeline import (
    baseline_policies,
    evaluate_fleet,
    fleet_config,
    fleet_features,
    job_costs,
    rows_json,
    train_predictor,
)
from policy.predictor import FailurePredictor
from policy.reactive import fit_reactive_hold
from policy.simulator import (
    HazardPolicy,
    Oracle,
    StandbyPolicy,
    compare_policies,
    fleet_node_ids,
    format_table,
    job_view,
    run_schedule,
    simulate,
)
from policy.synthetic import BURSTS_LIKE_INFINITEHBD, generate_fleet
from policy.traces import FaultTrace, load_shipped, split_trace
from policy.tuning import recommend, sweep
from policy.verdict import DEFAULT_TRAIN_FRACTION, StaticChoice, choose_static, is_static, judge

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
    rows = X.reshape(-1, 3)
    base = float(model.predict_proba(np.array([[0.0, REPAIR_CAP_H, 0.0]]))[0, 1])
    # Most node-hours have no fault in the last 30 days and no repair within the cap: one row, scored once (the
    # model scores each row on its own, so the others' scores are the same as in one big call).
    calm = (rows[:, 0] == 0.0) & (rows[:, 1] == REPAIR_CAP_H) & (rows[:, 2] == 0.0)
    p = np.full(rows.shape[0], base)
    p[~calm] = model.predict_proba(rows[~calm])[:, 1]
    return HazardTable(node_ids, 1.0, horizon_h, p.reshape(n_slots, len(node_ids)), base)


def _burst_aware(trace: FaultTrace, n_nodes: int) -> dict[str, Any]:
    """The burst-aware pool (a compound Poisson count fitted on the first half) judged on the second half."""
    costs = job_costs(n_nodes)
    head, _ = split_trace(trace, DEFAULT_TRAIN_FRACTION * trace.duration_h)
    j = judge(trace, costs, BurstAwarePool.fit(head, costs.lead_time_h), baseline_policies(costs.tiers))
    print(f"  burst-aware pool: {j.verdict.summary}", flush=True)
    return {"policies": rows_json(j.test_rows), "verdict": asdict(j.verdict)}


def _choice(ev: TraceEvaluation) -> dict[str, Any]:
    """The fall-back evaluation, reduced to its figures (the full rows are in the other sections)."""
    full = ev.to_dict()
    return {k: full[k] for k in full if k != "policies"}


def _print_choice(label: str, ev: TraceEvaluation, seconds: float) -> None:
    checks = ", ".join(
        f"{c.candidate} {c.cost_ratio:.3f}{' edge' if c.edge else ' dominated' if c.dominated else ''}"
        for c in ev.edge_checks
    )
    stretches = len(INNER_ORIGINS)
    print(f"  {label} (edge check on the training part, mean of {stretches} stretches: {checks}; {seconds:.1f} s)")
    print(f"    chosen: {ev.summary}", flush=True)


def _bursty_choices(n_nodes: int, days: float, held_out: tuple[int, ...], telemetry: bool = True) -> dict[str, Any]:
    """Bursty fleets: on each held-out bursty fleet the history candidates and (unless `telemetry` is False, as in
    --quick) the telemetry ones of a predictor trained on bursty fleets of the training seeds (learned, learned +
    burst tail), each with the fall-back."""
    out: dict[str, Any] = {"fleets": {}}
    model = None
    if telemetry:
        configs = [fleet_config(s, n_nodes, days, **BURSTS_LIKE_INFINITEHBD) for s in TRAIN_SEEDS]
        model, train = train_predictor(configs)
        out["train"] = asdict(train)
    print(f"\nbursty fleets (burst_share 0.3, {n_nodes} nodes x {days:g} days), fitted on the first half:")
    for seed in held_out:
        config = fleet_config(seed, n_nodes, days, **BURSTS_LIKE_INFINITEHBD)
        synthetic = generate_fleet(config)
        trace, costs = synthetic.trace, job_costs(n_nodes)
        statics = baseline_policies(costs.tiers)
        started = time.perf_counter()
        hist = evaluate_trace(trace, costs, statics, node_ids=synthetic.node_ids)
        _print_choice(f"seed {seed}, history only", hist, time.perf_counter() - started)
        out["fleets"][str(seed)] = {"faults": len(trace.records), "history": _choice(hist)}
        if model is None:
            continue
        fleet, features = fleet_features(config, drop_censored=False)
        table = hazard_table(model.predict_proba(features.X)[:, 1], features)

        def candidates(
            until_h: float, trace: FaultTrace = trace, table: HazardTable = table,
            nodes: tuple[str, ...] = tuple(fleet.node_ids),
        ) -> dict[str, StandbyPolicy]:
            head, _ = split_trace(trace, until_h)
            lead = job_costs(n_nodes).lead_time_h
            return {
                "learned": learned_policy(table, lead),
                "learned-burst": burst_aware_learned(table.hazard_fn(lead), head, lead, name="learned-burst"),
                "reactive-hold": fit_reactive_hold(head, job_costs(n_nodes), nodes),
            }

        started = time.perf_counter()
        tele = evaluate_trace(trace, costs, statics, make_candidates=candidates, node_ids=fleet.node_ids)
        _print_choice(f"seed {seed}, telemetry", tele, time.perf_counter() - started)
        out["fleets"][str(seed)]["telemetry"] = _choice(tele)
    return out


def _with_spot(costs: StandbyCosts) -> StandbyCosts:
    return costs.model_copy(update={"tiers": {**default_tiers(), "spot": spot_tier()}})


def _spot(name: str) -> dict[str, Any]:
    """The cheapest pool on the whole trace (hindsight, like `tune`) with and without spot standbys."""
    trace, _ = load_shipped(name)
    base = job_costs(trace.n_nodes)
    out = {}
    for label, costs in (("without_spot", base), ("with_spot", _with_spot(base))):
        best = recommend(sweep(trace, costs, hazard_multipliers=(1.0,), static_fractions=()))
        out[label] = best.to_dict()
    ratio = out["with_spot"]["cost_per_useful_hour"] / out["without_spot"]["cost_per_useful_hour"]
    out["ratio"] = ratio
    print(
        f"  {name}, hindsight: without spot {out['without_spot']['setting']} "
        f"{out['without_spot']['cost_per_useful_hour']:.2f} (ETTR {out['without_spot']['ettr']:.5f}); with spot "
        f"{out['with_spot']['setting']} {out['with_spot']['cost_per_useful_hour']:.2f} "
        f"(ETTR {out['with_spot']['ettr']:.5f}): ratio {ratio:.3f}",
        flush=True,
    )
    out["temporal_split"] = _spot_split(name, trace)
    return out


def _breakdown(choice: StaticChoice) -> dict[str, Any]:
    """Where the chosen static's cost on the test part goes, and the best any policy could do there: the cheapest
    static picked in hindsight on the test part, and the perfect-foresight oracle (a bound)."""
    test = choice.on_test
    statics = [r for r in choice.test_rows if is_static(r.name)]
    best = min(statics, key=lambda r: (r.cost_per_useful_hour, -r.ettr))
    oracle = next(r for r in choice.test_rows if r.name == "oracle")
    total = test.standby_cost_usd + test.downtime_cost_usd
    return {
        "standby_share": test.standby_cost_usd / total if total > 0 else math.nan,
        "downtime_share": test.downtime_cost_usd / total if total > 0 else math.nan,
        "covered_failures": test.covered_failures,
        "uncovered_failures": test.uncovered_failures,
        "hindsight_static": best.name,
        "hindsight_static_ratio": best.cost_per_useful_hour / test.cost_per_useful_hour,
        "hindsight_static_ettr": best.ettr,
        "oracle_ratio": oracle.cost_per_useful_hour / test.cost_per_useful_hour,
    }


def _spot_split(label: str, trace: FaultTrace, node_ids: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Spot under the temporal split: the static cheapest on the first half with spot offered, and the one without,
    both judged on the second half (no pool chosen in hindsight)."""
    base = job_costs(trace.n_nodes)
    out: dict[str, Any] = {}
    for key, costs in (("without_spot", base), ("with_spot", _with_spot(base))):
        choice = choose_static(trace, costs, baseline_policies(costs.tiers), node_ids=node_ids)
        train = next(r for r in choice.train_rows if r.name == choice.chosen)
        test = choice.on_test
        out[key] = {
            "chosen": choice.chosen,
            "train_usd_per_useful_h": train.cost_per_useful_hour,
            "train_ettr": train.ettr,
            "test_usd_per_useful_h": test.cost_per_useful_hour,
            "test_ettr": test.ettr,
            "spot_reclaims": test.result.spot_reclaims,
            "breakdown": _breakdown(choice),
        }
    ratio = out["with_spot"]["test_usd_per_useful_h"] / out["without_spot"]["test_usd_per_useful_h"]
    out["ratio"] = ratio
    w, s = out["without_spot"], out["with_spot"]
    b = w["breakdown"]
    print(
        f"  {label}, static chosen on the first half ({w['chosen']}), on the second: standby bill "
        f"{b['standby_share']:.0%} of its cost, downtime {b['downtime_share']:.0%} ({b['covered_failures']} failures "
        f"covered, {b['uncovered_failures']} not); best static in hindsight {b['hindsight_static']} "
        f"{b['hindsight_static_ratio']:.3f}x, oracle {b['oracle_ratio']:.3f}x"
    )
    print(
        f"  {label}, chosen on the first half, judged on the second: without spot {w['chosen']} "
        f"{w['test_usd_per_useful_h']:.2f} (ETTR {w['test_ettr']:.5f}); with spot {s['chosen']} "
        f"{s['test_usd_per_useful_h']:.2f} (ETTR {s['test_ettr']:.5f}, {s['spot_reclaims']} reclaims): "
        f"ratio {ratio:.3f}",
        flush=True,
    )
    return out


def _hourly_decisions_speed(model: FailurePredictor) -> dict[str, Any]:
    """A year of hourly decisions at 1,024 nodes: the fast path against the reference loop, side by side, with
    the learned policy (history hazards) and the burst-aware learned policy; the results must be identical."""
    big = generate_fleet(fleet_config(7, 1024, 365.0)).trace
    costs = job_costs(1024)
    nodes = fleet_node_ids(big)
    table = history_table(model, big, nodes)
    head, _ = split_trace(big, big.duration_h / 2)
    lead = costs.lead_time_h
    job = job_view(big, costs, node_ids=nodes)
    out: dict[str, Any] = {"faults": len(big.records), "nodes": 1024, "days": 365}
    print("\nhourly decisions, 1,024 nodes x 365 days (8,760 decisions), reference loop vs fast path:")
    for policy in (
        learned_policy(table, lead, name="learned-history"),
        burst_aware_learned(table.hazard_fn(lead), head, lead, name="learned-burst"),
    ):
        started = time.perf_counter()
        slow = run_schedule(job, policy.name, policy.reference_schedule(job))
        slow_s = time.perf_counter() - started
        started = time.perf_counter()
        fast = simulate(big, costs, policy, node_ids=nodes)
        fast_s = time.perf_counter() - started
        out[policy.name] = {
            "reference_s": slow_s,
            "fast_s": fast_s,
            "speedup": slow_s / fast_s,
            "identical": slow == fast,
            "usd_per_useful_h": fast.cost_per_useful_hour,
        }
        print(
            f"  {policy.name}: reference {slow_s:.2f} s, fast {fast_s:.2f} s ({slow_s / fast_s:.1f}x); "
            f"identical results: {slow == fast}",
            flush=True,
        )
    return out


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
        print(f"  verdict: {v.summary}", flush=True)
        fleets[-1]["burst_aware"] = _burst_aware(generate_fleet(fleet_config(seed, n_nodes, days)).trace, n_nodes)
    ratios = [f["verdict"]["cost_ratio"] for f in fleets]  # type: ignore[index]
    report["held_out"] = fleets
    report["held_out_cost_ratio_mean"] = float(np.mean(ratios))

    # The real traces: a history-only predictor trained on the same synthetic fleets, judged on the second half
    # of each trace against the static chosen on the first half.
    _, feats = fleet_features(fleet_config(TRAIN_SEEDS[0], n_nodes, days))
    history_model = FailurePredictor(max_iter=30).fit(feats.X[:, _HISTORY], feats.y)
    for name in ("infinitehbd", "lanl-system20"):
        trace, _ = load_shipped(name)
        costs = job_costs(trace.n_nodes)
        table = _history_table(history_model, trace, feats.horizon_h)
        learned = learned_policy(table, costs.lead_time_h, name="learned-history")
        j = judge(trace, costs, learned, baseline_policies(costs.tiers))
        print(
            f"\n{name} ({len(trace.records)} faults, {trace.n_nodes} nodes, {trace.duration_h / 24:.0f} days), "
            f"judged on hours {j.split_h:.0f}-{trace.duration_h:.0f}, reference chosen on {j.verdict.chosen_on}:"
        )
        print(format_table(j.test_rows))
        print(f"  verdict: {j.verdict.summary}")
        report[name] = {
            "policies": rows_json(j.test_rows),
            "train_policies": rows_json(j.train_rows),
            "verdict": asdict(j.verdict),
            "burst_aware": _burst_aware(trace, trace.n_nodes),
        }

    # The chosen policy with its fall-back, on the real traces (history only) and on bursty synthetic fleets.
    print("\nchosen policy with fall-back (fitted on the first half, judged on the second):")
    report["choice"] = {}
    for name in () if quick else ("infinitehbd", "lanl-system20"):  # about a minute: full mode only
        trace, _ = load_shipped(name)
        costs = job_costs(trace.n_nodes)
        started = time.perf_counter()
        choice = evaluate_trace(trace, costs, baseline_policies(costs.tiers))
        _print_choice(name, choice, time.perf_counter() - started)
        report["choice"][name] = _choice(choice)
    report["bursty"] = _bursty_choices(n_nodes, days, held_out, telemetry=not quick)

    print("\nspot standbys (assumed spot price and reclaim rate):")
    spot_traces = ("infinitehbd",) if quick else ("infinitehbd", "lanl-system20")
    report["spot"] = {name: _spot(name) for name in spot_traces}
    for seed in held_out:
        synthetic = generate_fleet(fleet_config(seed, n_nodes, days, **BURSTS_LIKE_INFINITEHBD))
        label = f"bursty-{seed}"
        report["spot"][label] = {"temporal_split": _spot_split(label, synthetic.trace, synthetic.node_ids)}

    # Timings.
    big = generate_fleet(fleet_config(7, 1024, 365.0)).trace
    big_costs = job_costs(1024)
    constant = HazardPolicy(lambda t_h, nodes: np.full(len(nodes), 2e-4), every_h=1.0, name="hourly-decisions")
    policies = [*baseline_policies(), constant, Oracle()]
    started = time.perf_counter()
    compare_policies(big, big_costs, policies)
    sim_s = time.perf_counter() - started
    report["simulator_1024x365"] = {"faults": len(big.records), "policies": len(policies), "seconds": sim_s}
    print(
        f"\nsimulator: 1,024 nodes x 365 days, {len(big.records)} faults, "
        f"{len(policies)} policies incl. hourly decisions: {sim_s:.1f} s"
    )
    report["hourly_decisions_1024x365"] = _hourly_decisions_speed(history_model)

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
