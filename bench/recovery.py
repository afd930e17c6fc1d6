"""`trainmover bench recovery`: what one lost worker costs, side by side, on the same model, over several kills.

One invocation measures, on this machine: a plain all-reduce loop (the throughput baseline); TrainMover without
and with a worker SIGKILLed mid gradient exchange, several times in one job; checkpoint-restart under real torchrun,
killed at points spread over its checkpoint interval; torchft 0.2 with its Lighthouse, one kill per job; and the
floor (a step, plus the part of the handoff that cannot hide behind it: the model over the measured point-to-point
bandwidth, or the whole state minus a step's worth). Each system is killed ``KILLS`` times;
the report gives, per system, the median and the spread (min/max) of ``lost_time_s`` over its kills, and the
ratios of the medians.

A TrainMover kill whose lost time falls below its floor (the part of the step it must redo plus the handoff that
cannot overlap it, at the measured bandwidth: `bench.peers.trainmover`) is physically impossible here, so it can
only be a disturbed measurement: it is flagged ``invalid``, kept in the JSON and left out of the median.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from bench.failover import coordinator_loss, format_coordinator_loss
from bench.hostloss import host_loss, host_partition, standby_warm_across_hosts
from bench.peers.checkpoint_restart import kill_fractions, lost_time_checkpoint_restart
from bench.peers.common import rounded, spread, steady_step_s
from bench.peers.p2p import measure_p2p_bandwidth
from bench.peers.plain import run_plain
from bench.peers.torchft_peer import lost_time_torchft
from bench.peers.trainmover import (
    AFTER_STEPS,
    NPROC,
    JobRun,
    KillLoss,
    kill_losses,
    kill_plan,
    kill_schedule,
    run_job,
)
from bench.workload import WorkloadSpec
from runtime.config import KNOBS

KILLS = 5
"""Kills per system; the brief of the benchmark: at least 5, so that a median and a spread mean something."""

HOST_KILLS = 2
"""Whole hosts killed in the host-loss section (each needs a standby host of two slots)."""

KILL_SPACING = 8
"""Steps between TrainMover's kills in its one killed job (see `kill_schedule`)."""

T = TypeVar("T")


def timeline(kills: list[KillLoss]) -> dict[str, Any] | None:
    """One recovery, the median kill's, as moments from its failure (the coordinator's parts: the slowest member's)."""
    if not kills:
        return None
    k = sorted(kills, key=lambda x: x.lost_time_s)[len(kills) // 2]
    c = k.components
    model_in = k.recovery_s - c["replay_s"]
    return {"replay_step": k.replay_step, "lost_time_s": k.lost_time_s, "failure": 0.0, "declared": c["detect_s"],
            "groups_ready": c["detect_s"] + c["reconfigure_s"], "model_received": model_in,
            "optimizer_state_received": model_in + c["handoff_overlapped_s"], "replayed_step_committed": k.recovery_s}


def summarize_trainmover(
    cleans: list[JobRun], killed: JobRun, kill_steps: list[int], handoff_floor_s: float, floor_s: float
) -> dict[str, Any]:
    """TrainMover's figures: each kill's lost time (floors and validity included), and their median and spread."""
    # The model's share of the state: the handoff's first phase, which the replayed step waits for (the optimizer's
    # state streams beside it).
    first_phase_s = handoff_floor_s * killed.model_bytes / killed.state_bytes \
        if killed.model_bytes and killed.state_bytes else None
    losses = [k.with_floor(handoff_floor_s, first_phase_s) for k in kill_losses(killed.commits, killed.events)]
    if len(losses) != len(kill_steps):
        raise RuntimeError(f"{len(kill_steps)} kills planned, {len(losses)} recoveries reported")
    valid = [k for k in losses if not k.invalid]
    clean_wall = statistics.median(c.loop_wall_s for c in cleans)
    reference = cleans[-1]

    def med(values: list[float]) -> float | None:
        return statistics.median(values) if values else None

    lost = spread([k.lost_time_s for k in valid])
    return {
        "lost_time_s": lost["median"],
        "lost_time_min_s": lost["min"],
        "lost_time_max_s": lost["max"],
        "kills_valid": len(valid),
        "kills_invalid": len(losses) - len(valid),
        "kills_below_step_end_floor": sum(1 for k in losses if k.lost_time_s < floor_s),
        "lost_time_method": (
            "per kill, in the killed job, on rank 0 (a survivor): (commit of the replayed step r - commit of step "
            f"r-1 - one steady step) + max(0, commit of r+{AFTER_STEPS} - commit of r - {AFTER_STEPS} steady steps); "
            "steady step = median of the undisturbed steps next to the window; median and min/max over the valid "
            "kills (a kill below its floor, handoff at the measured bandwidth + the work it redoes, is invalid)"
        ),
        "lost_time_wall_diff_per_kill_s": (killed.loop_wall_s - clean_wall) / len(losses),
        # Medians over the valid kills of each part (the coordinator's, and the in-run decomposition).
        **{key: med([k.components[key] for k in valid])
           for key in ("detect_s", "reconfigure_s", "handoff_s", "handoff_overlapped_s", "replay_s",
                       "warmup_penalty_s")},
        "recovery_s": med([k.recovery_s for k in valid]),
        "timeline": timeline(valid),
        "redone_s": med([k.redone_s for k in valid]),
        "recovery_bound_gap_min_s": min((k.lost_time_s - k.recovery_bound_s for k in losses), default=None),
        "kills_reconciled": sum(1 for k in losses if k.reconciled),
        "reconciled": all(k.reconciled for k in losses),
        "reconciliation": "per kill, lost_time_s = recovery_s - (step_s - redone_s) + max(0, warm-up penalty in the "
                          "run) (bench.peers.trainmover); reconciled when lost_time_s >= recovery_s - (step_s - "
                          "redone_s) - COMMIT_SKEW_S",
        "handoff_bytes": losses[0].handoff_bytes if losses else None,
        "kills": [k.to_json() for k in losses],
        "bitwise_identical": killed.digest == reference.digest,
        "every_member_identical": bool(killed.member_digests)
        and all(d == reference.digest for d in killed.member_digests.values()),
        "clean_wall_s": clean_wall,
        "killed_wall_s": killed.loop_wall_s,
        "step_s": statistics.median(k.step_s for k in losses) if losses else None,
        "state_bytes": reference.state_bytes,
        "digest": reference.digest,
        "settings": {"workers": NPROC, "standby": len(kill_steps), "hang_timeout_s": KNOBS.hang_timeout_s,
                     "replenish": False, "wait_for_standbys": True,
                     "kills": f"SIGKILL of whoever holds rank 1, mid gradient exchange, at steps {kill_steps}"},
    }


def run_recovery_benchmark(quick: bool, kills: int = KILLS) -> dict[str, Any]:
    spec = WorkloadSpec.quick() if quick else WorkloadSpec.full()
    kill_steps, steps = kill_schedule(kills, spacing=KILL_SPACING)
    # torchft keeps its single-kill job shape (one kill per job; see lost_time_torchft).
    tft_steps = 16 if quick else 30
    sections: dict[str, float] = {}
    t0 = time.time()

    def timed(name: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        start = time.time()
        value = fn(*args, **kwargs)
        sections[name] = round(sections.get(name, 0.0) + time.time() - start, 2)
        return value

    # replenish=False with one warm standby per kill: in a fleet a replacement standby starts on another node;
    # here its start-up (import torch, model build, shadow step) would take one of the two cores from the workers
    # in the middle of the next kill's measurement. wait_for_standbys: no standby's start-up shares the cores
    # with a measured step either. The clean runs have the same standbys, so that they differ only by the kills.
    def tm_job(faults: str = "") -> JobRun:
        return run_job(spec, steps, faults=faults, standby=kills, replenish=False, wait_for_standbys=True)

    # Throughput: the plain loop and an uninterrupted TrainMover run alternate (three times in full mode); each
    # system's best steady step time is kept, since interference on a shared machine only ever slows a run.
    plains: list[dict[str, Any]] = []
    cleans: list[JobRun] = []
    for _ in range(1 if quick else 3):
        plains.append(timed("plain", run_plain, spec, steps, nproc=NPROC))
        cleans.append(timed("trainmover", tm_job))
    plain = min(plains, key=lambda r: r["step_s"])
    clean_step_s = [_steady(c) for c in cleans]
    ratios = [p["step_s"] / c for p, c in zip(plains, clean_step_s, strict=True)]
    killed = timed("trainmover", tm_job, kill_plan(kill_steps))
    state_bytes = cleans[-1].state_bytes
    bandwidth = timed("p2p", measure_p2p_bandwidth, state_bytes)
    handoff_floor_s = state_bytes / bandwidth
    model_bytes = cleans[-1].model_bytes or state_bytes
    floor_s = max(model_bytes / bandwidth, handoff_floor_s - plain["step_s"]) + plain["step_s"]
    tm = summarize_trainmover(cleans, killed, kill_steps, handoff_floor_s, floor_s)
    ckpt = timed("checkpoint_restart", lost_time_checkpoint_restart, spec, quick=quick,
                 fractions=kill_fractions(kills))
    tft = timed("torchft", lost_time_torchft, spec, tft_steps, tft_steps // 2, kills=kills)
    report: dict[str, Any] = {
        "mode": "quick" if quick else "full",
        "workload": {"parameters": _parameters(spec), "width": spec.width, "depth": spec.depth,
                     "batch_size_per_worker": spec.batch_size, "optimizer": "AdamW", "workers": NPROC,
                     "steps": steps, "kill_steps": kill_steps, "kills_per_system": kills,
                     "torchft_steps": tft_steps, "torchft_kill_step": tft_steps // 2},
        "trainmover": rounded(tm),
        "checkpoint_restart": ckpt,
        "torchft": tft,
        "plain": plain,
        "floor_s": floor_s,
        "floor_sequential_s": handoff_floor_s + plain["step_s"],
        "model_bytes": model_bytes,
        "floor_method": "max(model bytes / point-to-point bandwidth, state bytes / bandwidth - step) + the plain "
                        "loop's steady step: the floor of a kill at the very end of a step, whose replay waits for "
                        "the model and whose optimizer step for the whole state (the optimizer's state streams beside "
                        "the replayed passes); a kill's own floor counts only the part of the step it redoes "
                        "(trainmover.kills[].floor_s). floor_sequential_s: the whole state, then the step",
        "overhead": statistics.median(ratios),
        "overhead_pairs": ratios,
        "overhead_method": f"median over {len(ratios)} alternated pairs of (plain loop's steady step time / "
                           f"TrainMover's, with {kills} idle warm standbys)",
        "step_s": {"plain": [r["step_s"] for r in plains], "trainmover": clean_step_s},
        "bitwise_identical": tm["bitwise_identical"],
        "bitwise_identical_to_plain_loop": tm["digest"] == plain.get("digest"),
        "state_bytes": state_bytes,
        "p2p_bandwidth_bytes_per_s": bandwidth,
        "benchmark_wall_s": time.time() - t0,
        "section_wall_s": sections,
    }
    hl_steps, hl_total = kill_schedule(HOST_KILLS, spacing=KILL_SPACING)
    hl = timed("host_loss", host_loss, spec, hl_steps, hl_total, handoff_floor_s, floor_s)
    report["host_loss"] = hl if "skipped" in hl else rounded(hl)
    hp = timed("host_partition", host_partition, spec, HOST_KILLS, handoff_floor_s, floor_s, KNOBS.host_timeout_s)
    report["host_partition"] = hp if "skipped" in hp else rounded(hp)
    report["standby_warm_across_hosts"] = timed("standby_warm_across_hosts", standby_warm_across_hosts)
    report["coordinator_loss"] = timed("coordinator_loss", coordinator_loss, spec)
    report["benchmark_wall_s"] = time.time() - t0
    report["ratios"] = _ratios(report)
    return report


def _steady(run: JobRun) -> float:
    return steady_step_s(run.step_times)


def _parameters(spec: WorkloadSpec) -> int:
    return spec.depth * (spec.width * spec.width + spec.width) + spec.width + 1


def _ratios(r: dict[str, Any]) -> dict[str, float | None]:
    """Ratios of the medians over the kills (TrainMover's over the valid kills only)."""
    tm = r["trainmover"]["lost_time_s"]

    def ratio(other: dict[str, Any]) -> float | None:
        value = other.get("lost_time_s")
        return None if tm is None or value in (None, 0) else tm / value

    return {
        "lost_time_vs_checkpoint_restart": ratio(r["checkpoint_restart"]),
        "lost_time_vs_torchft": ratio(r["torchft"]),
        "lost_time_vs_floor": None if tm is None else tm / r["floor_s"],
    }


def _each(values: list[Any] | None) -> list[float]:
    return [float(v) for v in values or []]


def _timeline_line(t: dict[str, Any] | None, f: Callable[[Any], str]) -> str:
    if not t:
        return "  timeline of one recovery: no valid kill"
    marks = ("declared", "groups_ready", "model_received", "optimizer_state_received", "replayed_step_committed")
    return (f"  timeline of one recovery (the median kill, step {t['replay_step']}, lost {f(t['lost_time_s'])} s), "
            "seconds after the failure: " + ", ".join(f"{m.replace('_', ' ')} {f(t[m])}" for m in marks))


def _verdict(kill: dict[str, Any]) -> str:
    words = ["INVALID (below its floor)" if kill["invalid"] else "valid"]
    if not kill.get("reconciled", True):
        words.append("NOT RECONCILED (below recovery_s - (step - redone))")
    return ", ".join(words)


def format_report(r: dict[str, Any]) -> str:
    tm, ck, tf = r["trainmover"], r["checkpoint_restart"], r["torchft"]

    def f(x: Any) -> str:
        return "n/a" if x is None else f"{x:.3f}"

    def row(name: str, values: list[float], median: Any, exact: Any, note: str = "") -> str:
        s = spread(values)
        return (f"  {name:<20}{len(values):>6}{f(median):>10}{f(s['min']):>9}{f(s['max']):>9}{exact!s:>11}"
                + (f"   {note}" if note else ""))

    tm_valid = [k["lost_time_s"] for k in tm["kills"] if not k["invalid"]]
    invalid = tm["kills_invalid"]
    lines = [
        f"recovery benchmark ({r['mode']}): {r['workload']['parameters'] / 1e6:.1f}M parameters + AdamW, "
        f"{r['state_bytes'] / 1e6:.0f} MB of state, {r['workload']['workers']} workers, "
        f"{r['workload']['kills_per_system']} kills per system",
        f"  {'system':<20}{'kills':>6}{'median':>10}{'min':>9}{'max':>9}{'bit-exact':>11}   lost_time_s",
        row("TrainMover", tm_valid, tm["lost_time_s"], tm["bitwise_identical"],
            f"{invalid} invalid (below their floor), left out" if invalid else "none invalid"),
        f"{'':<24}(medians: detect {f(tm['detect_s'])}, reconfigure {f(tm['reconfigure_s'])}, handoff "
        f"{f(tm['handoff_s'])}, replay {f(tm['replay_s'])}, warm-up {f(tm['warmup_penalty_s'])}; redone before the "
        f"failure {f(tm['redone_s'])}, recovery_s {f(tm['recovery_s'])})",
        row("checkpoint-restart", _each(ck.get("lost_time_s_each")), ck.get("lost_time_s"),
            ck.get("bitwise_identical"), f"checkpoint every {ck.get('interval_steps')} steps, kills at "
            + ", ".join(f"{k.get('fraction_of_interval')}" for k in ck.get("kills", [])) + " of it"
            + "".join(f"; NOT MEASURED at {k['fraction_of_interval']}: {k['error']}"
                      for k in ck.get("kills_unmeasured", []))),
        row("torchft 0.2", _each(tf.get("lost_time_s_each")), tf.get("lost_time_s"), tf.get("bitwise_identical")),
        _timeline_line(tm.get("timeline"), f),
        f"  floor_s {f(r['floor_s'])}  (p2p {r['p2p_bandwidth_bytes_per_s'] / 1e9:.2f} GB/s; "
        f"{tm['kills_below_step_end_floor']} TrainMover kills below it, which counts a whole step redone)   "
        f"overhead {r['overhead']:.3f}",
        "  ratios of medians: " + ", ".join(f"{k} {f(v)}" for k, v in r["ratios"].items()),
        f"  TrainMover per kill (lost = recovery_s - (step - redone) + warm-up; {tm.get('kills_reconciled', '?')} of "
        f"{len(tm['kills'])} reconciled with the coordinator):",
        f"    {'step':>5}{'lost_s':>9}{'recovery_s':>12}{'step_s':>9}{'redone_s':>10}{'bound_s':>9}{'floor_s':>9}"
        f"{'warm-up':>9}  verdict",
        *(f"    {k['replay_step']:>5}{f(k['lost_time_s']):>9}{f(k['recovery_s']):>12}{f(k['step_s']):>9}"
          f"{f(k['redone_s']):>10}{f(k['recovery_bound_s']):>9}{f(k['floor_s']):>9}"
          f"{f(k['warmup_penalty_in_run_s']):>9}  {_verdict(k)}" for k in tm["kills"]),
        _host_loss_line(r.get("host_loss", {}), f),
        _host_loss_line(r.get("host_partition", {}), f, "host cut off (link down, processes alive)"),
        _warm_line(r.get("standby_warm_across_hosts", {}), f),
        format_coordinator_loss(r.get("coordinator_loss", {"skipped": "not run"})),
        f"  wall {r['benchmark_wall_s']:.0f} s: " + ", ".join(f"{k} {v:.0f} s" for k, v in r["section_wall_s"].items()),
    ]
    return "\n".join(lines)


def _warm_line(w: dict[str, Any], f: Any) -> str:
    if not w or "skipped" in w:
        return f"  standby warm across hosts: skipped ({w.get('skipped', 'not run')})"
    return (f"  standby warm across hosts once asked for (target 3 s): median {f(w['asked_median_s'])}, max "
            f"{f(w['asked_max_s'])} over {len(w['asked_ready_after_s'])} asks; at the job's start "
            f"{f(w['at_start_ready_after_s'])}")


def _host_loss_line(hl: dict[str, Any], f: Any, what: str = "host loss") -> str:
    if not hl or "skipped" in hl:
        return f"  {what} across namespaces: skipped ({hl.get('skipped', 'not run')})"
    target = f", target {f(hl['target_s'])} (host timeout + 0.5 s)" if "target_s" in hl else ""
    return (f"  {what} (2 hosts x 2 + standby hosts, namespaces){target}: lost_time_s median {f(hl['lost_time_s'])} "
            f"(min {f(hl['lost_time_min_s'])}, max {f(hl['lost_time_max_s'])}) over {hl['kills_valid']} host kills of "
            f"{hl['ranks_per_recovery']} ranks each; detect {f(hl['detect_s'])}, reconfigure {f(hl['reconfigure_s'])}, "
            f"handoff {f(hl['handoff_s'])}, replay {f(hl['replay_s'])}; bit-exact {hl['bitwise_identical']}")


def main(quick: bool, json_path: str | None, kills: int = KILLS,
         sections: tuple[str, ...] | list[str] = ("data-parallel", "sharded")) -> int:
    report: dict[str, Any] = {}
    mismatch = False
    if "data-parallel" in sections:
        report = run_recovery_benchmark(quick, kills)
        print(format_report(report))
        mismatch = not report["bitwise_identical"] or report["host_loss"].get("bitwise_identical") is False
    if "sharded" in sections:
        from bench.sharded import format_report as format_sharded
        from bench.sharded import run_sharded_benchmark

        report["sharded"] = run_sharded_benchmark(quick, kills)
        print(format_sharded(report["sharded"]))
        mismatch = mismatch or not all(s["bitwise_identical"] for s in report["sharded"]["shapes"].values())
    if "coordinator-loss" in sections:
        from bench.workload import WorkloadSpec as Spec

        report["coordinator_loss"] = coordinator_loss(Spec.quick() if quick else Spec.full())
        print(format_coordinator_loss(report["coordinator_loss"]))
        mismatch = mismatch or report["coordinator_loss"].get("bitwise_identical") is False
    if "reconfiguration" in sections:
        from bench.sharded import FULL, QUICK, format_reconfiguration, reconfigure_section

        t0 = time.time()
        report["reconfiguration"] = reconfigure_section(QUICK if quick else FULL)
        report["reconfiguration"]["wall_s"] = time.time() - t0
        print(format_reconfiguration(report["reconfiguration"]))
        mismatch = mismatch or not all(row["same_final_state"]
                                       for row in report["reconfiguration"]["by_shape"].values())
    if "backups" in sections:
        from bench.backups import format_report as format_backups
        from bench.backups import run_backups_benchmark

        report["backups"] = run_backups_benchmark(quick, kills)
        print(format_backups(report["backups"]))
        mismatch = mismatch or not report["backups"]["restore"]["bitwise_identical"]
    if "elastic" in sections:
        from bench.elastic import format_report as format_elastic
        from bench.elastic import run_elastic_benchmark

        report["elastic"] = run_elastic_benchmark(quick, kills)
        print(format_elastic(report["elastic"]))
        mismatch = mismatch or not all(report["elastic"]["bitwise_identical"].values())
    if "overlap" in sections:
        from bench.overlap import format_report as format_overlap
        from bench.overlap import run_overlap_benchmark

        report["overlap"] = run_overlap_benchmark(quick, kills)
        print(format_overlap(report["overlap"]))
        mismatch = mismatch or not all(report["overlap"]["bitwise_identical"].values())
    if "hot" in sections:
        from bench.hot import format_report as format_hot
        from bench.hot import run_hot_benchmark

        report["hot"] = run_hot_benchmark(quick, kills)
        print(format_hot(report["hot"]))
        mismatch = mismatch or not all(report["hot"]["bitwise_identical"].values())
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(report, indent=2, default=str))
    if mismatch:
        print("  MISMATCH: TrainMover's final state differs from the uninterrupted run's")
        return 1
    return 0
