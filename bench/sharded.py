"""The sharded section of `trainmover bench recovery`: what a lost rank costs a sharded job, per mesh shape.

One invocation measures, on this machine, for the Llama-style decoder of examples/train_llama.py on 4 ranks:

* per mesh shape (HSDP 2 x 2, DP 2 x TP 2, FSDP over 4 with buddy copies): an uninterrupted run and a run where
  ``kills`` ranks (never rank 0, whose commits are the timeline) are SIGKILLed after their backward pass, one at
  a time; each kill's ``lost_time_s`` (below), its parts from the coordinator, and its floor;
* the buddy copies' steady-state cost: the FSDP job without copies and with a refresh every 1, 10 and 100 steps,
  throughput ratio to the run without, and the host memory the copies hold;
* the reconfiguration at 4, 8 and 16 ranks (HSDP 2 x n/2, and 4 x 4 at 16), delta (only the groups a loss
  touched rebuilt) against the full rebuild (every group), from the coordinator's ``recovered`` events of three
  kills each (also alone: ``--sections reconfiguration``).

``lost_time_s`` of a kill, from rank 0's commits in the killed run: the kill hits step K (its victim dies after
its backward pass); rank 0 committed K - 1 at ``T0`` before it; after the recovery, step K + m commits at ``T1``.
Had nothing failed, that commit would be at ``T0 + (m + 1) * s``, so
the kill cost ``T1 - T0 - (m + 1) * s`` (m = 3: the warm-up after the recovery is counted). ``s`` is the killed
run's own steady step (its steps away from the kills): another run's, on a shared machine, differs by more than
a recovery costs.

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
        extra: tuple[str, ...] = (), **settings: Any) -> Run:
    """One job of the sharded worker (`settings`: more `LaunchConfig` fields); raises if it did not complete."""
    with tempfile.TemporaryDirectory(prefix="tm-bench-sharded-") as tmp:
        out = Path(tmp) / "rank0.json"
        saved = os.environ.get(OUT_ENV)
        os.environ[OUT_ENV] = str(out)
        try:
            cfg = LaunchConfig(script=str(SCRIPT), args=("--layout", layout, "--steps", str(steps), *size.args(),
                                                         *extra),
                               nproc=nproc, standby=standby, faults=faults, num_threads=1, quiet=True,
                               events_path=str(Path(tmp) / "events.jsonl"),
                               **{"replenish": False, "wait_for_standbys": True, **settings})
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


def own_steady_step_s(killed: Run, plan: list[tuple[int, int]], skip: int = 3) -> float:
    """The killed run's own steady step: the median of rank 0's step times away from the kills (not the first
    `skip` steps, not from the step before a kill to AFTER + 1 steps after it, not a step committed twice)."""
    near = {s for _, k in plan for s in range(k - 1, k + AFTER + 2)}
    counts: dict[int, int] = {}
    for c in killed.commits:
        counts[c[0]] = counts.get(c[0], 0) + 1
    steady = [c[3] for c in killed.commits if c[0] > skip and c[0] not in near and counts[c[0]] == 1]
    return statistics.median(steady) if steady else steady_step_s(killed, skip)


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
    # Had nothing failed, the killed run would have gone on at its own pace: its own steady steps, not the clean
    # run's (another run on a shared machine can be slower or faster by more than a recovery costs).
    step_s = own_steady_step_s(killed, plan)
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
        "step_s": step_s, "clean_step_s": steady_step_s(clean), "shard_state_bytes": shard_bytes,
        "p2p_bandwidth_bytes_per_s": bandwidth,
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


def _connections(groups: dict[str, tuple[int, ...]], keys: Any) -> int:
    """Point-to-point connections an eager (full-mesh) build of these groups makes."""
    return sum(len(groups[k]) * (len(groups[k]) - 1) // 2 for k in keys)


def reconfigure_section(size: Size) -> dict[str, Any]:
    """Three HSDP kills per mesh (2 x n/2 at each world size, and 4 x 4 at 16), each job run twice: delta
    reconfiguration (only the groups the loss touched rebuilt) and the full rebuild (every group)."""
    from runtime.training.groups import mesh_groups

    small = Size(dim=64, layers=2, hidden=128, vocab=128, kill_spacing=6, reconfigure_ranks=())
    meshes = [(2, n // 2) for n in size.reconfigure_ranks] + ([(4, 4)] if 16 in size.reconfigure_ranks else [])
    out: dict[str, Any] = {}
    for replicate, shard in meshes:
        n = replicate * shard
        victims = [1, shard + 1, n - 1]  # two replica groups; never rank 0
        faults = ";".join(f"kill:rank={r},step={6 * (i + 1)},phase=exchange" for i, r in enumerate(victims))
        groups = mesh_groups((replicate, shard), ("replicate", "shard"))
        row: dict[str, Any] = {"ranks": n}
        digests = {}
        for mode in ("delta", "full"):
            r = run("hsdp", small, 6 * (len(victims) + 1), nproc=n, standby=len(victims), faults=faults,
                    extra=("--mesh", f"{replicate},{shard},1", "--reconfigure", mode))
            recs = [e for e in r.events if e["event"] == "recovered"]
            splits = [e.get("reconfigure_split") or {} for e in recs]

            def median(key: str, parts: list[dict[str, Any]] = splits) -> float:
                return statistics.median(float(x.get(key, 0.0)) for x in parts)

            row[mode] = {
                "reconfigure_s": statistics.median(e["reconfigure_s"] for e in recs),
                "reconfigure_s_each": [e["reconfigure_s"] for e in recs],
                **{key: median(key) for key in ("teardown_s", "last_joined_after_s", "group_init_s",
                                                "group_build_s")},
                "groups_rebuilt": [x.get("groups_rebuilt") for x in splits],
                "groups": len(groups),
                "recovery_s": statistics.median(e["recovery_s"] for e in recs),
            }
            digests[mode] = r.digest
        touched = [k for k, ranks in groups.items() if 1 in ranks]  # what rank 1's loss touches
        row["eager_connections"] = {"delta": _connections(groups, touched), "full": _connections(groups, groups)}
        row["delta_vs_full"] = row["delta"]["reconfigure_s"] / row["full"]["reconfigure_s"]
        row["group_init_delta_vs_full"] = row["delta"]["group_init_s"] / row["full"]["group_init_s"]
        row["same_final_state"] = digests["delta"] is not None and digests["delta"] == digests["full"]
        out[f"{replicate}x{shard}"] = row
    return {"method": "3 HSDP kills per mesh (ranks 1, shard + 1, n - 1, in the gradient exchange), tiny model, "
                      "each job run with delta reconfiguration and with the full rebuild (every mesh group); "
                      "reconfigure_s: from the last declaration to the last member's groups ready (teardown, the "
                      "members joining, group building, the members' proofs), median of the 3; the world group "
                      "(lazily connected) is new in both",
            "by_shape": out}


def format_reconfiguration(r: dict[str, Any]) -> str:
    lines = ["  reconfiguration, delta / full rebuild (median of 3 kills; groups rebuilt of all):"]
    for name, v in r["by_shape"].items():
        d, f = v["delta"], v["full"]
        lines.append(f"    {name:>5} ({v['ranks']} ranks): {d['reconfigure_s']:.3f} / {f['reconfigure_s']:.3f} s = "
                     f"x{v['delta_vs_full']:.2f} (group init x{v['group_init_delta_vs_full']:.2f}), "
                     f"{d['groups_rebuilt']} of {d['groups']} groups, same final state: {v['same_final_state']}")
    return "\n".join(lines)


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
    lines.append(format_reconfiguration(r["reconfiguration"]))
    lines.append(f"  wall {r['wall_s']:.0f} s")
    return "\n".join(lines)
