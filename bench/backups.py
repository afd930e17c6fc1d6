"""Persistent backups (`--backup-dir`, runtime.training.backup): what they cost a running job, and what a restore
from one costs when every copy of the state is lost.

- **Steady-state cost**: the benchmark workload's data-parallel job (`bench.tm_worker`, 2 workers) without backups
  and with a backup every k steps, alternated over rounds; each setting's throughput is its steady steps per second
  (mean over every step after warm-up, so the steps that stage a copy count), its best round kept (interference on a
  shared machine only ever slows a run). Reported per k: the period in seconds, throughput against no backups, and
  the cost of one backup (`stage_s` on the training thread; the write runs beside training).
- **Restore**: both workers SIGKILLed at once, before the gradient exchange, `RESTORE_AFTER` steps after a backup; two
  warm standbys load the backup and train those steps again. Lost time = (the new rank 0's commit of the killed
  step) - (the old rank 0's commit of the step before it) - one steady step; floor = the backup's bytes over this
  machine's measured read bandwidth + the steps redone at the steady step. Final state against an uninterrupted run.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import Any

from bench.peers.checkpoint_restart import run_checkpoint_restart
from bench.peers.common import WARMUP_STEPS, rounded, spread
from bench.peers.trainmover import JobRun, kill_plan, run_job
from bench.workload import WorkloadSpec

PERIODS = (5, 10, 25, 50, 100)
"""Backup every k steps, the cost curve's points."""
RESTORE_EVERY = 10
RESTORE_AFTER = 4
"""Steps committed after the backup before the kill (redone by the restore)."""


def mean_step_s(run: JobRun, skip: int = WARMUP_STEPS) -> float:
    """Wall time per step after the first `skip` steps: every step counts, the ones that stage a copy too."""
    times = run.step_times[skip:]
    return (times[-1] - times[0]) / (len(times) - 1)


def _events(run: JobRun, kind: str) -> list[dict[str, Any]]:
    return run.of_kind(kind)


def _job(spec: WorkloadSpec, steps: int, every: int | None, faults: str = "", standby: int = 0) -> JobRun:
    with tempfile.TemporaryDirectory(prefix="tm-backups-") as tmp:
        extra: dict[str, Any] = {} if every is None else {"backup_dir": tmp, "backup_every": every}
        return run_job(spec, steps, faults=faults, standby=standby, extra=extra)


def read_bandwidth(nbytes: int) -> float:
    """Bytes per second of reading a file of `nbytes` just written (the page cache, as a restore finds a recent
    backup on this machine): the restore's floor."""
    with tempfile.NamedTemporaryFile() as f:
        block = b"\0" * (8 << 20)
        written = 0
        while written < nbytes:
            f.write(block)
            written += len(block)
        f.flush()
        best = 0.0
        for _ in range(3):
            t0 = time.perf_counter()
            with open(f.name, "rb") as r:
                while r.read(8 << 20):
                    pass
            best = max(best, written / (time.perf_counter() - t0))
    return best


def steady_cost(spec: WorkloadSpec, steps: int, rounds: int) -> dict[str, Any]:
    """Each round runs the job without backups and with each period in turn; a period's throughput is the median
    over the rounds of (the round's step time without backups / with them), pairs from the same round, so that a
    slow patch of the machine weighs on both sides of a pair."""
    settings: list[int | None] = [None, *PERIODS]
    runs: dict[str, list[JobRun]] = {str(k): [] for k in settings}
    for _ in range(rounds):
        for k in settings:
            runs[str(k)].append(_job(spec, steps, k))
    base = [mean_step_s(r) for r in runs["None"]]
    rows: dict[str, dict[str, Any]] = {}
    costs: list[float] = []
    for k in PERIODS:
        with_k = [mean_step_s(r) for r in runs[str(k)]]
        written = [[e for e in _events(r, "backup_written")] for r in runs[str(k)]]
        counted = steps - WARMUP_STEPS - 1  # the steps `mean_step_s` spans
        # What one backup took from training: the round's extra time over the backups written in its steps.
        per_backup = [(w - b) * counted / len(ws) for w, b, ws in zip(with_k, base, written, strict=True) if ws]
        costs += per_backup
        flat = [e for ws in written for e in ws]
        rows[str(k)] = {
            "period_s": k * statistics.median(with_k),
            "throughput_vs_none": statistics.median(b / w for b, w in zip(base, with_k, strict=True)),
            "throughput_pairs": [b / w for b, w in zip(base, with_k, strict=True)],
            "backups_per_run": statistics.mean(len(ws) for ws in written),
            "cost_per_backup_s": spread(per_backup),
            "stage_s": spread([e["stage_s"] for e in flat]),
            "write_s": spread([e["write_s"] for e in flat]),
            "backup_bytes": flat[-1]["bytes"] if flat else None,
        }
    per_backup_s = statistics.median(costs) if costs else 0.0
    step_s = statistics.median(base)
    return {"step_s_without": step_s, "step_s_without_each": base, "rounds": rounds, "steps": steps,
            "by_period": rows, "per_backup_cost_s": per_backup_s,
            # Throughput = 1 / (1 + cost / period): the period at which it reaches 0.98, and at 10 minutes.
            "period_s_at_0_98": per_backup_s * 49.0, "steps_at_0_98": per_backup_s * 49.0 / step_s,
            "throughput_at_600_s": 1 / (1 + max(per_backup_s, 0.0) / 600.0),
            "same_final_state": len({r.digest for rs in runs.values() for r in rs}) == 1}


def restore(spec: WorkloadSpec, kills: int) -> dict[str, Any]:
    """Both workers killed `RESTORE_AFTER` steps after a backup, `kills` times (one job each)."""
    kill_step = 2 * RESTORE_EVERY + RESTORE_AFTER + 1
    steps = kill_step + 6
    clean = _job(spec, steps, RESTORE_EVERY)
    steady = mean_step_s(clean)
    out: list[dict[str, Any]] = []
    for _ in range(kills):
        # Before the exchange: neither can see the other's loss first and hand its state on (a kill in the exchange
        # can let the slower one leave the step alive).
        plan = ";".join(kill_plan([kill_step], rank=r, phase="before_exchange") for r in (0, 1))
        run = _job(spec, steps, RESTORE_EVERY, faults=plan, standby=2)
        (restored,) = _events(run, "restored_from_backup")
        (recovered,) = _events(run, "recovered")
        before = [c for c in run.proc_commits["w0"] if c.step == kill_step - 1]
        after = [c for p, cs in run.proc_commits.items() if p != "w0" for c in cs
                 if c.step == kill_step and c.generation > 0]
        redone = kill_step - 1 - restored["backup_step"]
        nbytes = recovered["handoff_bytes"] // 2  # each of the two new members read the whole backup
        out.append({"lost_time_s": after[0].time - before[0].time - steady, "backup_step": restored["backup_step"],
                    "steps_redone": redone, "bytes": nbytes, "load_s": recovered["handoff_s"],
                    "detect_s": recovered["detect_s"], "reconfigure_s": recovered["reconfigure_s"],
                    "bitwise_identical": set(run.runtime_digests.values()) == set(clean.runtime_digests.values())})
    # Checkpoint-restart as users run it (torchrun restarts both workers, which load the checkpoint written every
    # RESTORE_EVERY steps): the same kill, the same steps redone.
    ckpt = [run_checkpoint_restart(spec, steps, RESTORE_EVERY, kill_step) for _ in range(kills)]
    bandwidth = read_bandwidth(out[0]["bytes"]) if out else 0.0
    for kill in out:
        kill["floor_s"] = kill["bytes"] / bandwidth + (kill["steps_redone"] + 1) * steady
        kill["x_floor"] = kill["lost_time_s"] / kill["floor_s"]
    return {"every": RESTORE_EVERY, "kill_step": kill_step, "steady_step_s": steady, "read_bandwidth": bandwidth,
            "kills": out, "lost_time_s": spread([k["lost_time_s"] for k in out]),
            "x_floor": spread([k["x_floor"] for k in out]),
            "checkpoint_restart": {"kills": ckpt, "lost_time_s": spread([c["kill_to_back_s"] for c in ckpt])},
            "bitwise_identical": all(k["bitwise_identical"] for k in out)}


def run_backups_benchmark(quick: bool, kills: int) -> dict[str, Any]:
    spec = WorkloadSpec.quick() if quick else WorkloadSpec.full()
    t0 = time.time()
    steady = steady_cost(spec, 130 if quick else 120, 3)
    report: dict[str, Any] = {"mode": "quick" if quick else "full", "steady": steady, "restore": restore(spec, kills)}
    report["wall_s"] = time.time() - t0
    return rounded(report)


def format_report(r: dict[str, Any]) -> str:
    s = r["steady"]
    lines = [f"Persistent backups ({r['mode']}): steady step {s['step_s_without']:.3f} s without backups",
             "  every  period_s  throughput (median of pairs)  stage_s (median)  write_s (median)"]
    for k, row in s["by_period"].items():
        lines.append(f"  {k:>5}  {row['period_s']:8.2f}  {row['throughput_vs_none']:28.3f}  "
                     f"{row['stage_s']['median'] or 0:16.4f}  {row['write_s']['median'] or 0:16.3f}")
    lines.append(f"  one backup costs {s['per_backup_cost_s']:.3f} s of training: throughput 0.98 at a "
                 f"{s['period_s_at_0_98']:.1f} s period ({s['steps_at_0_98']:.0f} steps), "
                 f"{s['throughput_at_600_s']:.4f} at 600 s")
    x = r["restore"]
    lost = x["lost_time_s"]
    lines.append(f"  restore after every copy lost ({len(x['kills'])} kills, {RESTORE_AFTER} steps after the backup): "
                 f"lost {lost['median']:.3f} s (min {lost['min']:.3f}, max {lost['max']:.3f}), "
                 f"x{x['x_floor']['median']:.2f} its floor, bit-exact: {x['bitwise_identical']}")
    c = x["checkpoint_restart"]["lost_time_s"]
    lines.append(f"  checkpoint-restart, same kill and interval: lost {c['median']:.3f} s (min {c['min']:.3f}, "
                 f"max {c['max']:.3f}); TrainMover / checkpoint-restart = {lost['median'] / c['median']:.2f}")
    return "\n".join(lines)
