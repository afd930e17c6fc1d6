"""`trainmover bench chaos`: a soak of many consecutive interruptions in ONE TrainMover job.

This module owns the soak: the runtime's chaos monkey (``LaunchConfig.chaos``, `runtime.control.chaos`) sends real
signals at random moments (exponential gaps, mean ``every_s``), ``interruptions`` times, while the job trains the
benchmark workload (quick size, 2 workers, warm standbys replenished after every promotion, one torch thread per
process). By default it SIGKILLs workers; ``signals`` and ``targets`` add hangs (SIGSTOP, caught by the heartbeat)
and standbys. It reports:

* per recovery, ``lost_time_s`` by the identity of `bench.peers.trainmover`: ``recovery_s - (step_s - redone_s) +
  warmup_penalty_s``, where ``recovery_s`` runs from the chaos event's own time (the signal), so the true detection
  is included; ``redone_s`` is the part of the interrupted step done before the failure (from the commit logs every
  member keeps, killed ones included); its p50, p99 and max. ``recovery_s + warmup_penalty_s`` (the whole replayed
  step counted) is reported beside it;
* the whole-run figure: (training wall time with chaos - training wall time of a clean job of the same steps) /
  worker deaths, both walls from generation 0 (every standby warm) to rank 0's last commit, in one invocation;
* interruptions injected (by signal and by the victim's role and state), worker deaths, standbys lost, recoveries
  (two deaths close together make one recovery), and every injection the events do not account for;
* whether anything was lost: every rank's final state digest (the runtime's and the benchmark's own) must equal
  the clean job's; otherwise it prints MISMATCH and the command exits non-zero.

The number of steps comes from a short calibration job: enough that the injections fit inside the training with a
margin, since the monkey stops once training starts finishing.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.peers.common import PeerError, steady_step_s
from bench.peers.trainmover import JobRun, interruptions, run_job, steady_step_of
from bench.workload import WorkloadSpec
from runtime.launcher import LaunchConfig

DEFAULT_INTERRUPTIONS = 100
EVERY_S = 1.5
"""Mean gap between injections (exponential): a signal every 1.5 s on average."""
STANDBY = 3
"""Warm standbys at the start, replenished after every promotion: a standby's start-up takes a few seconds of a
shared core, so with one injection every 1.5 s a pool of 2 can run dry and the soak would measure the wait."""
CALIBRATION_STEPS = 40
MARGIN = 1.5
"""Training lasts MARGIN x interruptions x every_s (at the clean step time; recoveries only lengthen it): 100
exponential gaps of mean 1.5 s sum to 150 s with a standard deviation of 15 s, so a margin of 1.5 leaves five."""
PARTS = ("detect_s", "reconfigure_s", "handoff_s", "replay_s", "warmup_penalty_s")


class ChaosUnavailable(RuntimeError):
    """This runtime has no chaos monkey (no ``LaunchConfig.chaos``)."""


def chaos_plan(interruptions: int, every_s: float, seed: int, signals: Sequence[str] = ("kill",),
               targets: Sequence[str] = ("worker",)) -> str:
    """The chaos monkey's setting (runtime.control.chaos): ``interruptions`` signals, on average every ``every_s``.

    Covered: a worker is hit only while a warm standby can take its rank, so each interruption measures a
    recovery, not the start-up of a replacement process on a machine whose cores are busy (the stalls that still
    wait for one are reported apart)."""
    return (f"seed={seed},every_s={every_s},max={interruptions},signals={'|'.join(signals)},"
            f"targets={'|'.join(targets)},covered=1")


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear between the closest ranks (None for no values)."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def training_wall_s(run: JobRun) -> float:
    """Generation 0 (every standby warm, training starts) to rank 0's last commit."""
    return run.commits[-1].time - run.training_start()


def final_members(run: JobRun) -> list[str]:
    """Process holding each rank in the last generation (index = rank)."""
    last = max(run.of_kind("generation"), key=lambda e: int(e["generation"]))
    return [m["proc"] for m in sorted(last["members"], key=lambda m: int(m["rank"]))]


def compare_states(clean: JobRun, chaos: JobRun) -> list[str]:
    """Every difference between the final states of the two jobs, rank by rank (empty when none)."""
    problems: list[str] = []
    clean_procs, chaos_procs = final_members(clean), final_members(chaos)
    if len(clean_procs) != len(chaos_procs):
        return [f"{len(chaos_procs)} ranks at the end, the clean job had {len(clean_procs)}"]
    for rank, (cp, xp) in enumerate(zip(clean_procs, chaos_procs, strict=True)):
        for what, clean_d, chaos_d in (("runtime digest", clean.runtime_digests, chaos.runtime_digests),
                                       ("state digest", clean.member_digests, chaos.member_digests)):
            want, got = clean_d.get(cp), chaos_d.get(xp)
            if want is None or got is None or want != got:
                problems.append(f"rank {rank} ({xp}): {what} {got or 'missing'} != clean {want or 'missing'}")
    return problems


def unaccounted(events: Sequence[Mapping[str, Any]]) -> list[str]:
    """Injections the job's events do not answer: no member_failed or standby_lost for the process hit."""
    answered = {e["proc"] for e in events if e["event"] in ("member_failed", "standby_lost")}
    return [f"{e['signal']} {e['proc']} ({e['role']}, {e['state']}) at {e['time']:.3f}"
            for e in events if e["event"] == "chaos_injected" and e["proc"] not in answered]


def _count(values: Iterable[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return dict(sorted(out.items()))


def summarize(clean: JobRun, chaos: JobRun, steps: int, plan: str, requested: int, standby: int = STANDBY
              ) -> dict[str, Any]:
    injected = chaos.of_kind("chaos_injected")
    deaths = chaos.of_kind("member_failed")
    recoveries = chaos.of_kind("recovered")
    recovered_procs = {r["old"] for e in recoveries for r in e["ranks"]}
    completed = chaos.exit_code == 0 and bool(chaos.commits) and chaos.commits[-1].step == steps
    problems = compare_states(clean, chaos) if completed else [f"the chaos job did not complete: {chaos.message}"]
    wall_chaos, wall_clean = (training_wall_s(chaos), training_wall_s(clean)) if completed else (None, None)
    try:
        step_s: float | None = steady_step_of(chaos.proc_commits)
    except PeerError:
        step_s = None
    stalls = interruptions(chaos.proc_commits, chaos.events, step_s) if step_s is not None else []
    hit = [k for k in stalls if k.deaths]
    lost = [k.lost_time_s for k in hit]
    lost_ready = [k.lost_time_s for k in hit if k.waited_for_standby_s == 0]
    whole = [float(e["recovery_s"]) + max(0.0, float(e.get("warmup_penalty_s") or 0.0)) for e in recoveries]
    return {
        "workload": {**json.loads(WorkloadSpec.quick().to_env()), "workers": 2,
                     "standby": standby, "replenish": True, "num_threads": 1, "steps": steps},
        "chaos": plan,
        "interruptions_requested": requested,
        "interruptions_injected": len(injected),
        "injected_by_signal": _count(e["signal"] for e in injected),
        "injected_by_target": _count(f"{e['role']}/{e['state']}" for e in injected),
        "worker_deaths": len(deaths),
        "standbys_lost": len(chaos.of_kind("standby_lost")),
        "recoveries": len(recoveries),
        "interruptions_survived": sum(1 for d in deaths if d["proc"] in recovered_procs),
        "unaccounted_injections": unaccounted(chaos.events),
        "job_completed": completed,
        "step_s": step_s,
        "stalls": len(hit),
        "stalls_without_death": len(stalls) - len(hit),
        "lost_time_s_p50": percentile(lost, 50),
        "lost_time_s_p99": percentile(lost, 99),
        "lost_time_s_max": max(lost) if lost else None,
        "lost_time_s_total": sum(lost),
        "lost_time_method": "per stall (one or more deaths before training resumed), from the commit logs of every "
                            "member: commit of the first step of the generation that resumed minus the last commit "
                            "of the step before it, minus one steady step, plus the warm-up penalty of up to 3 steps "
                            "after it (= recovery_s from the chaos signal - (step_s - redone_s) + penalty: true "
                            "detection included); step_s = median step of the chaos job",
        "stalls_waiting_for_a_standby": sum(1 for k in hit if k.waited_for_standby_s > 0),
        "lost_time_s_p50_standby_ready": percentile(lost_ready, 50),
        "lost_time_s_p99_standby_ready": percentile(lost_ready, 99),
        "reconciled": all(k.reconciled for k in hit),
        "stalls_compared_with_coordinator": sum(1 for k in hit if k.recovery_s is not None),
        "stalls_detail": [k.to_json() for k in stalls],
        "recovery_s_p50": percentile([float(e["recovery_s"]) for e in recoveries], 50),
        "recovery_s_p99": percentile([float(e["recovery_s"]) for e in recoveries], 99),
        "recovery_plus_penalty_s_p50": percentile(whole, 50),
        "recovery_plus_penalty_s_p99": percentile(whole, 99),
        "recovery_parts_p50": {k: percentile([float(e[k]) for e in recoveries], 50) for k in PARTS},
        "recovery_parts_p99": {k: percentile([float(e[k]) for e in recoveries], 99) for k in PARTS},
        "wall_chaos_s": wall_chaos,
        "wall_clean_s": wall_clean,
        "lost_time_whole_run_per_interruption_s": (
            (wall_chaos - wall_clean) / len(deaths) if wall_chaos is not None and wall_clean is not None and deaths
            else None
        ),
        "whole_run_method": "(training wall with chaos - training wall of a clean job of the same steps) / worker "
                            "deaths; walls from generation 0 to rank 0's last commit",
        "standbys_spawned": len(chaos.of_kind("standby_spawned")),
        "state_identical": completed and not problems,
        "state_problems": problems,
        "final_digest": chaos.digest,
        "clean_digest": clean.digest,
    }


def run_chaos_benchmark(interruptions: int, every_s: float = EVERY_S, seed: int = 1,
                        signals: Sequence[str] = ("kill",), targets: Sequence[str] = ("worker",)) -> dict[str, Any]:
    if "chaos" not in {f.name for f in dataclasses.fields(LaunchConfig)}:
        raise ChaosUnavailable("this runtime has no chaos monkey (LaunchConfig.chaos, runtime/control/chaos.py)")
    spec = WorkloadSpec.quick()
    t0 = time.time()

    def job(steps: int, chaos: str = "") -> JobRun:
        # replenish=True: over a hundred kills the pool must refill, as it would in a fleet; here the replacement's
        # start-up shares the two cores with the workers, which the lost time then carries (honestly).
        return run_job(spec, steps, standby=STANDBY, replenish=True, wait_for_standbys=True,
                       extra={"chaos": chaos} if chaos else None, check=not chaos)

    calibration = job(CALIBRATION_STEPS)
    step_s = steady_step_s(calibration.step_times)
    steps = math.ceil(MARGIN * interruptions * every_s / step_s)
    plan = chaos_plan(interruptions, every_s, seed, signals, targets)
    chaos = job(steps, plan)
    clean = job(steps)
    report = summarize(clean, chaos, steps, plan, interruptions)
    report["calibration_step_s"] = step_s
    report["benchmark_wall_s"] = time.time() - t0
    return report


def ok(r: Mapping[str, Any]) -> bool:
    return bool(r["job_completed"] and r["state_identical"] and not r["unaccounted_injections"]
                and r["interruptions_injected"] >= r["interruptions_requested"])


def format_report(r: Mapping[str, Any]) -> str:
    def f(x: Any) -> str:
        return "n/a" if x is None else f"{x:.3f}"

    w = r["workload"]
    merged = r["worker_deaths"] - r["recoveries"]
    lines = [
        f"chaos soak: {r['chaos']} in one job of {w['steps']} steps ({w['workers']} workers, {w['standby']} warm "
        f"standbys, replenished)",
        f"  interruptions: {r['interruptions_injected']} injected of {r['interruptions_requested']} "
        f"({', '.join(f'{k} {v}' for k, v in r['injected_by_signal'].items()) or 'none'}; "
        f"{', '.join(f'{k} {v}' for k, v in r['injected_by_target'].items()) or 'none'})",
        f"  {r['worker_deaths']} worker deaths, {r['standbys_lost']} standbys lost, {r['recoveries']} recoveries"
        + (f" ({merged} deaths shared a recovery)" if merged > 0 else "")
        + f", {r['interruptions_survived']} deaths survived; job {'completed' if r['job_completed'] else 'FAILED'}",
        f"  lost_time_s over {r['stalls']} stalls (from the last commit before the signal; detection included): "
        f"p50 {f(r['lost_time_s_p50'])}  p99 {f(r['lost_time_s_p99'])}  max {f(r['lost_time_s_max'])}  "
        f"total {f(r['lost_time_s_total'])}  (step {f(r['step_s'])} s)",
        f"    {r['stalls_waiting_for_a_standby']} stalls waited for a standby to warm up (the pool ran dry); "
        f"the others: p50 {f(r['lost_time_s_p50_standby_ready'])}  p99 {f(r['lost_time_s_p99_standby_ready'])}",
        f"  coordinator: recovery_s (signal -> replayed step committed) p50 {f(r['recovery_s_p50'])}  p99 "
        f"{f(r['recovery_s_p99'])}; + warm-up p50 {f(r['recovery_plus_penalty_s_p50'])}  p99 "
        f"{f(r['recovery_plus_penalty_s_p99'])}; "
        + ("reconciled" if r["reconciled"] else "NOT RECONCILED")
        + f" with the commit logs ({r['stalls_compared_with_coordinator']} stalls comparable, the others merged by it)",
        "  parts p50: " + ", ".join(f"{k} {f(v)}" for k, v in r["recovery_parts_p50"].items()),
        "  parts p99: " + ", ".join(f"{k} {f(v)}" for k, v in r["recovery_parts_p99"].items()),
        f"  whole run: {f(r['wall_chaos_s'])} s with chaos, {f(r['wall_clean_s'])} s clean -> "
        f"{f(r['lost_time_whole_run_per_interruption_s'])} s per worker death",
    ]
    if r["state_identical"]:
        lines.append("  final state: identical to the clean job's on every rank (runtime and benchmark digests)")
    else:
        lines.append("  MISMATCH: " + "; ".join(r["state_problems"]))
    if r["unaccounted_injections"]:
        lines.append("  UNACCOUNTED: " + "; ".join(r["unaccounted_injections"]))
    if r["interruptions_injected"] < r["interruptions_requested"]:
        lines.append(f"  SHORT: only {r['interruptions_injected']} of {r['interruptions_requested']} injections "
                     "happened before training ended")
    lines.append(f"  wall {r['benchmark_wall_s']:.0f} s (calibration step {r['calibration_step_s']:.3f} s)")
    return "\n".join(lines)


def main(interruptions: int, json_path: str | None, every_s: float = EVERY_S, seed: int = 1,
         signals: Sequence[str] = ("kill",), targets: Sequence[str] = ("worker",)) -> int:
    try:
        report = run_chaos_benchmark(interruptions, every_s, seed, signals, targets)
    except ChaosUnavailable as exc:
        print(f"trainmover bench chaos: {exc}; update the runtime")
        return 2
    print(format_report(report))
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(report, indent=2, default=str))
    return 0 if ok(report) else 1
