"""The sharded section of `trainmover bench recovery`: what a lost rank costs a sharded job, per mesh shape.

One invocation measures, on this machine, for the Llama-style decoder of examples/train_llama.py on 4 ranks:

* per mesh shape (HSDP 2 x 2, DP 2 x TP 2, FSDP over 4 with buddy copies): an uninterrupted run and a run where
  ``kills`` ranks (never rank 0, whose commits are the timeline) are SIGKILLed after their backward pass, one at
  a time; each kill's ``lost_time_s`` (below), its parts from the coordinator, and its floor;
* the buddy copies' steady-state cost: the FSDP job without copies and with a refresh every 1, 10 and 100 steps,
  throughput ratio to the run without, and the host memory the copies hold;
* the reconfiguration (a full rebuild: every group and the model rebuilt on the new mesh) at 4, 8 and 16 ranks,
  from the coordinator's ``recovered`` events of one HSDP kill each.

``lost_time_s`` of a kill, from rank 0's commits in the killed run: the kill hits step K (its victim dies after
its backward pass); rank 0 committed K - 1 at ``T0`` before it; after the recovery, step K + m commits at ``T1``.
Had nothing failed, that commit would be at ``T0 + (m + 1) * s`` (``s``: the uninterrupted run's steady step), so
the kill cost ``T1 - T0 - (m + 1) * s`` (m = 3: the warm-up after the recovery is counted).

Its floor: the bytes the recovery moved over the measured point-to-point bandwidth, plus the steps it must redo at
full speed: the killed step's forward and backward (about a step) and, from a buddy copy, every step since the
copy. A kill below its floor is a disturbed measurement, flagged ``invalid`` and left out of the median.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.peers.common import spread
from bench.peers.p2p import measure_p2p_bandwidth
from runtime.launcher import LaunchConfig, launch

SCRIPT = Path(__file__).resolve().parent / "sharded_worker.py"
OUT_ENV = "TM_BENCH_OUT"
LAYOUTS = ("hsdp", "dp-tp", "fsdp")
AFTER = 3
"""Steps after the replayed one counted in a kill's lost time (its warm-up penalty)."""
BUDDY_EVERY = 10
"""The FSDP job's buddy-copy interval in the per-shape runs (the runtime's default)."""


@dataclass(frozen=True, slots=True)
class Size:
    """The model and the schedule of one benchmark mode."""

    dim: int
    layers: int
    hidden: int
    vocab: int
    kill_spacing: int
    reconfigure_ranks: tuple[int, ...]

    def args(self) -> tuple[str, ...]:
        return ("--dim", str(self.dim), "--layers", str(self.layers), "--hidden", str(self.hidden),
                "--vocab", str(self.vocab))


FULL = Size(dim=512, layers=4, hidden=1408, vocab=4096, kill_spacing=14, reconfigure_ranks=(4, 8, 16))
QUICK = Size(dim=128, layers=2, hidden=352, vocab=512, kill_spacing=12, reconfigure_ranks=(4, 8))


@dataclass
class Run:
    wall_s: float
    events: list[dict[str, Any]]
    commits: list[tuple[int, int, float, float]]
    """Rank 0's commits: (step, generation, wall time, step seconds)."""
    summary: dict[str, Any]
    digest: str | None


def run(layout: str, size: Size, steps: int, *, faults: str = "", standby: int = 0, nproc: int = 4,
        extra: tuple[str, ...] = ()) -> Run:
    """One job of the sharded worker; raises if it did not complete."""
    with tempfile.TemporaryDirectory(prefix="tm-bench-sharded-") as tmp:
        out = Path(tmp) / "rank0.json"
        saved = os.environ.get(OUT_ENV)
        os.environ[OUT_ENV] = str(out)
        try:
            cfg = LaunchConfig(script=str(SCRIPT), args=("--layout", layout, "--steps", str(steps), *size.args(),
                                                         *extra),
                               nproc=nproc, standby=standby, faults=faults, num_threads=1, quiet=True,
                               replenish=False, wait_for_standbys=True, events_path=str(Path(tmp) / "events.jsonl"))
            t0 = time.perf_counter()
            result = launch(cfg)
            wall = time.perf_counter() - t0
        finally:
            if saved is None:
                os.environ.pop(OUT_ENV, None)
            else:
                os.environ[OUT_ENV] = saved
        if result.exit_code != 0:
            raise RuntimeError(f"the {layout} benchmark job failed: {result.message}")
        commits = [(int(a), int(b), float(c), float(d)) for a, b, c, d in
                   (line.split() for line in (Path(f"{out}.w0.commits").read_text().splitlines()))]
        summary = json.loads(out.read_text()) if out.exists() else {}
        digests = set(result.digests.values())
        events = [e.to_dict() for e in result.events]
        return Run(wall, events, commits, summary, digests.pop() if len(digests) == 1 else None)


def steady_step_s(run: Run, skip: int = 3) -> float:
    durations = [c[3] for c in run.commits[skip:]] or [c[3] for c in run.commits]
    return statistics.median(durations)


def kill_plan(kills: int, spacing: int) -> tuple[list[tuple[int, int]], int]:
    """(rank, step) of each kill, never rank 0, and the steps the job needs."""
    plan = [(1 + i % 3, spacing * (i + 1)) for i in range(kills)]
    return plan, spacing * (kills + 1)


def kill_losses(killed: Run, plan: list[tuple[int, int]], step_s: float, bandwidth: float) -> list[dict[str, Any]]:
    """Each kill's lost time from rank 0's commits, with the coordinator's parts and the kill's floor."""
    recovered = [e for e in killed.events if e["event"] == "recovered"]
    if len(recovered) != len(plan):
        raise RuntimeError(f"{len(plan)} kills planned, {len(recovered)} recoveries reported")
    out = []
    for (rank, step), rec in zip(plan, recovered, strict=True):
        gen_after = rec["generation"]
        before = [c for c in killed.commits if c[0] == step - 1 and c[1] < gen_after]
        after = [c for c in killed.commits if c[0] == step + AFTER and c[1] >= gen_after]
        if not before or not after:
            raise RuntimeError(f"rank 0's commits do not bracket the kill at step {step}")
        lost = after[0][2] - before[0][2] - (AFTER + 1) * step_s
        # Steps re-run before the killed one (a buddy copy older than the failure): the recovery's first commit.
        first = min(c[0] for c in killed.commits if c[1] >= gen_after)
        replayed = step - first
        moved = rec["handoff_bytes"] or 0
        floor = moved / bandwidth + (replayed + 1) * step_s
        out.append({"rank": rank, "step": step, "lost_time_s": lost, "floor_s": floor, "invalid": lost < floor,
                    "replayed_steps": replayed, "handoff_bytes": moved, "sources": rec["sources"],
                    **{k: rec[k] for k in ("detect_s", "reconfigure_s", "handoff_s", "replay_s", "recovery_s")}})
    return out


def shape_section(layout: str, size: Size, kills: int, bandwidth_for: Any) -> dict[str, Any]:
    plan, steps = kill_plan(kills, size.kill_spacing)
    extra = ("--buddy-every", str(BUDDY_EVERY)) if layout == "fsdp" else ()
    clean = run(layout, size, steps, standby=kills, extra=extra)
    killed = run(layout, size, steps, standby=kills, extra=extra,
                 faults=";".join(f"kill:rank={r},step={s},phase=exchange" for r, s in plan))
    step_s = steady_step_s(clean)
    shard_bytes = clean.summary["state_bytes"]
    bandwidth = bandwidth_for(shard_bytes)
    losses = kill_losses(killed, plan, step_s, bandwidth)
    valid = [k for k in losses if not k["invalid"]]
    lost = spread([k["lost_time_s"] for k in valid])
    floors = [k["floor_s"] for k in losses]
    return {
        "lost_time_s": lost["median"], "lost_time_min_s": lost["min"], "lost_time_max_s": lost["max"],
        "kills_valid": len(valid), "kills_invalid": len(losses) - len(valid),
        "floor_s": statistics.median(floors),
        "lost_time_vs_floor": None if lost["median"] is None else lost["median"] / statistics.median(floors),
        "bitwise_identical": killed.digest is not None and killed.digest == clean.digest,
        "step_s": step_s, "shard_state_bytes": shard_bytes, "p2p_bandwidth_bytes_per_s": bandwidth,
        "lost_time_wall_diff_per_kill_s": (killed.wall_s - clean.wall_s) / kills,
        **{k: statistics.median(x[k] for x in losses) for k in ("detect_s", "reconfigure_s", "handoff_s",
                                                                 "replay_s", "recovery_s")},
        "kills": losses,
    }


def buddy_section(size: Size, steps: int) -> dict[str, Any]:
    """Steady step time of the FSDP job with buddy copies every k steps against none; three alternated rounds,
    each setting's best kept (interference on a shared machine only ever slows a run)."""
    settings = (0, 1, 10, 100)
    best: dict[int, float] = {}
    memory: dict[int, int] = {}
    waited: dict[int, float] = {}
    for _ in range(3):
        for k in settings:
            r = run("fsdp", size, steps, extra=("--buddy-every", str(k)))
            s = steady_step_s(r)
            if k not in best or s < best[k]:
                best[k], memory[k], waited[k] = s, r.summary["buddy_memory_bytes"], r.summary["buddy_waited_s"]
            state = r.summary["state_bytes"]
    return {
        "steps": steps, "local_state_bytes": state,
        "by_every": {str(k): {"step_s": best[k], "throughput_vs_none": best[0] / best[k],
                              "host_memory_bytes": memory[k], "host_memory_vs_local_state": memory[k] / state,
                              "optimizer_waited_s": waited[k]} for k in settings},
    }


def reconfigure_section(size: Size) -> dict[str, Any]:
    """One HSDP kill at each world size; the coordinator's reconfiguration split (full rebuild)."""
    out: dict[str, Any] = {}
    small = Size(dim=64, layers=2, hidden=128, vocab=128, kill_spacing=6, reconfigure_ranks=())
    for n in size.reconfigure_ranks:
        r = run("hsdp", small, 12, nproc=n, standby=1, faults="kill:rank=1,step=6,phase=exchange",
                extra=("--mesh", f"2,{n // 2},1"))
        (rec,) = [e for e in r.events if e["event"] == "recovered"]
        out[str(n)] = {"reconfigure_s": rec["reconfigure_s"], "split": rec.get("reconfigure_split"),
                       "recovery_s": rec["recovery_s"]}
    return {"method": "full rebuild (world group, mesh groups and model rebuilt on the new mesh), one HSDP "
                      "(2 x n/2) kill per world size, tiny model; delta reconfiguration is not implemented yet",
            "by_ranks": out}


def run_sharded_benchmark(quick: bool, kills: int) -> dict[str, Any]:
    size = QUICK if quick else FULL
    t0 = time.time()
    cache: dict[int, float] = {}

    def bandwidth_for(nbytes: int) -> float:
        if nbytes not in cache:
            cache[nbytes] = measure_p2p_bandwidth(nbytes)
        return cache[nbytes]

    shapes = {layout: shape_section(layout, size, kills, bandwidth_for) for layout in LAYOUTS}
    report: dict[str, Any] = {
        "mode": "quick" if quick else "full",
        "model": {"dim": size.dim, "layers": size.layers, "hidden": size.hidden, "vocab": size.vocab, "ranks": 4},
        "shapes": shapes,
        "buddy_copies": buddy_section(size, 40 if quick else 60),
        "reconfiguration": reconfigure_section(size),
        "method": __doc__,
    }
    report["wall_s"] = time.time() - t0
    return report


def format_report(r: dict[str, Any]) -> str:
    def f(x: Any) -> str:
        return "n/a" if x is None else f"{x:.3f}"

    lines = [f"sharded recovery ({r['mode']}): Llama-style decoder dim {r['model']['dim']}, {r['model']['layers']} "
             "layers, 4 ranks",
             f"  {'shape':<8}{'kills':>6}{'median':>9}{'min':>8}{'max':>8}{'floor':>8}{'x floor':>9}{'exact':>7}"
             f"{'shard MB':>10}   detect/reconfigure/handoff/replay"]
    for name, s in r["shapes"].items():
        lines.append(
            f"  {name:<8}{s['kills_valid']:>6}{f(s['lost_time_s']):>9}{f(s['lost_time_min_s']):>8}"
            f"{f(s['lost_time_max_s']):>8}{f(s['floor_s']):>8}{f(s['lost_time_vs_floor']):>9}"
            f"{s['bitwise_identical']!s:>7}{s['shard_state_bytes'] / 1e6:>10.1f}   {f(s['detect_s'])}/"
            f"{f(s['reconfigure_s'])}/{f(s['handoff_s'])}/{f(s['replay_s'])}")
    b = r["buddy_copies"]
    lines.append(f"  buddy copies (fsdp, local state {b['local_state_bytes'] / 1e6:.1f} MB):")
    for k, v in b["by_every"].items():
        lines.append(f"    every {k:>3}: step {f(v['step_s'])} s, throughput x{v['throughput_vs_none']:.3f} of none, "
                     f"host memory {v['host_memory_bytes'] / 1e6:.1f} MB ({v['host_memory_vs_local_state']:.1f}x "
                     f"the local state), optimizer waited {f(v['optimizer_waited_s'])} s")
    lines.append("  reconfiguration (full rebuild): " + ", ".join(
        f"{n} ranks {f(v['reconfigure_s'])} s" for n, v in r["reconfiguration"]["by_ranks"].items()))
    lines.append(f"  wall {r['wall_s']:.0f} s")
    return "\n".join(lines)
