"""Elastic width (`--shrink`, runtime.training.elastic): what a shrink costs when no standby is left, what growing
back costs, against a standby takeover of the same kill, checkpoint-restart and torchft.

The benchmark workload's data-parallel job (`bench.tm_worker`, 2 workers); rank 1 is SIGKILLed during its exchange at
step K, `kills` times (one job each), in three shapes:

- **takeover**: one warm standby takes rank 1 (the runtime's ordinary recovery);
- **shrink, then grow**: no standby (`--standby 0`, `--standby-wait 0`): rank 0 trains on alone at once with both
  ranks' data (accumulation: the same global batch); the standby started to cover the loss warms up, and the job
  grows back onto it at a step boundary;
- **clean**: the same job, nothing killed (the reference for equal work).

Figures, from rank 0's commits (it is never killed). For a change at step r (its first commit in the new generation):

- `gap_s` = T[r] - T[r-1] - step_s(r): the time between two commits not spent computing the second one (step_s is
  the step's own duration, measured inside it: at the new width). For the takeover and the shrink it holds the part
  of step r done before the failure (lost), the detection, the new group and the handoff; for the grow, the switch
  at the boundary (leaving the old group, joining the new one, handing the state to the new member).
- The takeover's floor: state bytes / the measured point-to-point bandwidth + the part of the step the failure
  destroyed (d = failure - T[r-1]); the shrink's target is at most 1.5 x that floor.
- The grow's stall against the steady step at full width (target: at most one step).
- Equal work, inside each killed run (a separate clean run's wall drifts by more than these figures on a shared
  machine): the shrink's gap + the grow's stall + the sum over the shrunk steps of (their duration - the steady
  full-width step). With accumulation a shrunk step runs both ranks' batches on one member, so on a cluster it is
  slower; on this machine it is faster (one member, no 50 MB exchange over loopback), which this term shows.
- torchft 0.2 (bench.peers.torchft_peer): its healthy replica also goes on alone; its lost time charges the samples
  the missing replica did not contribute at the clean throughput (equal work).
- **planned move** (`JobControl.move`, issue 29's target: at most 0.1 s of stall, nothing replayed): with one warm
  standby, an orchestrator moves rank 1 once step K is committed; the members switch at a step boundary. Its stall is
  the gap of rank 0's first commit in the new generation, as above, and the `moved` event's own.
- **sharded** (`_sharded_elastic`): the same shrink and grow for HSDP 2 x 2 and DP 2 x TP 2, by whole replica groups.
"""

from __future__ import annotations

import secrets
import statistics
import threading
import time
from typing import Any

from bench.peers.common import WARMUP_STEPS, rounded, spread
from bench.peers.p2p import measure_p2p_bandwidth
from bench.peers.torchft_peer import lost_time_torchft
from bench.peers.trainmover import Commit, JobRun, kill_plan, run_job
from bench.workload import WorkloadSpec

KILL_STEP = 12


def _by_gen(commits: tuple[Commit, ...]) -> dict[int, list[Commit]]:
    out: dict[int, list[Commit]] = {}
    for c in commits:
        out.setdefault(c.generation, []).append(c)
    return out


def _gap(before: Commit, first: Commit) -> float:
    return first.time - before.time - first.step_s


def _failure_at(run: JobRun) -> float:
    (failed,) = [e for e in run.of_kind("member_failed") if e["proc"] == "w1"]
    return float(failed["failure_at"])


def _components(run: JobRun) -> dict[str, float]:
    """The first recovery's parts, as the coordinator's `recovered` event gives them (reconfigure_s split into the
    members' group build and the rest)."""
    rec = run.of_kind("recovered")[0]
    split = rec.get("reconfigure_split") or {}
    return {k: float(rec[k]) for k in ("detect_s", "reconfigure_s", "handoff_s", "replay_s")} | {
        "group_init_s": float(split.get("group_init_s") or 0.0)}


def _takeover(run: JobRun, bandwidth: float) -> dict[str, Any]:
    gens = _by_gen(run.commits)
    before, first = gens[0][-1], gens[1][0]
    d = _failure_at(run) - before.time
    floor = run.state_bytes / bandwidth + max(d, 0.0)
    return {"gap_s": _gap(before, first), "d_s": d, "floor_s": floor, "replay_step": first.step,
            "recovered": _components(run)}


def _shrink_grow(run: JobRun, bandwidth: float, steady_full: float) -> dict[str, Any]:
    gens = _by_gen(run.commits)
    if sorted(gens) != [0, 1, 2]:
        raise RuntimeError(f"expected a shrink then a grow (generations 0, 1, 2), got {sorted(gens)}")
    before, shrunk = gens[0][-1], gens[1]
    d = _failure_at(run) - before.time
    takeover_floor = run.state_bytes / bandwidth + max(d, 0.0)
    narrow = [c.step_s for c in shrunk[1:]]
    narrow_extra = sum(c.step_s - steady_full for c in shrunk[1:])
    (grew,) = run.of_kind("grew")
    (shrunk_event,) = run.of_kind("shrunk")
    stall = _gap(shrunk[-1], gens[2][0])
    return {"gap_s": _gap(before, shrunk[0]), "d_s": d, "takeover_floor_s": takeover_floor,
            "x_takeover_floor": _gap(before, shrunk[0]) / takeover_floor,
            "shrunk_steps": len(shrunk), "shrunk_step_s": statistics.median(narrow) if narrow else None,
            "grow_stall_s": stall, "grow_stall_steps": stall / steady_full,
            "grew_event_stall_s": grew["stall_s"], "grow_group_s": grew.get("group_s"),
            "grow_handoff_s": grew.get("handoff_s"), "shrunk_event_lost_s": shrunk_event["lost_s"],
            "grow_handoff_bytes": grew["handoff_bytes"], "recovered": _components(run),
            "narrow_steps_extra_s": narrow_extra,
            "equal_work_lost_s": _gap(before, shrunk[0]) + stall + narrow_extra,
            # What a shrink cannot avoid: the part of the step the failure destroyed, its detection and a new group.
            "own_floor_s": max(d, 0.0) + _components(run)["detect_s"] + _components(run)["group_init_s"]}


def _planned_move(spec: WorkloadSpec, steps: int, steady_full: float) -> dict[str, Any]:
    """One job with a warm standby; rank 1 moved by an orchestrator (another thread, through the job's sealed control
    channel) once step KILL_STEP is committed."""
    from bench.peers.common import free_port
    from runtime.wire.control import JobControl

    port, secret = free_port(), secrets.token_hex(32)
    asked: list[float] = []

    def orchestrate() -> None:
        deadline = time.monotonic() + 300.0
        while time.monotonic() < deadline:
            try:
                with JobControl("127.0.0.1", port, timeout_s=30.0, secret=secret) as job:
                    while (job.committed_step() or 0) < KILL_STEP and time.monotonic() < deadline:
                        time.sleep(0.01)
                    outcome = job.wait_move(job.move([1], "bench"), timeout_s=30.0)
                    if outcome.accepted:
                        asked.append(time.time())
                        return
            except Exception:  # the job not up yet, or a refusal while it starts: ask again
                pass
            time.sleep(0.1)

    thread = threading.Thread(target=orchestrate, daemon=True)
    thread.start()
    run = run_job(spec, steps, standby=1, extra={"port": port, "secret": secret})
    thread.join(timeout=5.0)
    gens = _by_gen(run.commits)
    if sorted(gens) != [0, 1] or not run.of_kind("moved"):
        raise RuntimeError(f"expected one planned move (generations 0, 1), got {sorted(gens)}")
    (moved,) = run.of_kind("moved")
    gap = _gap(gens[0][-1], gens[1][0])
    return {"gap_s": gap, "gap_steps": gap / steady_full, "moved_event_stall_s": moved["stall_s"],
            "group_s": moved.get("group_s"), "handoff_s": moved.get("handoff_s"),
            "replayed": [e["step"] for e in run.of_kind("recovered")], "failed": len(run.of_kind("member_failed")),
            "digest": sorted(set(run.runtime_digests.values()))}


def run_elastic_benchmark(quick: bool, kills: int) -> dict[str, Any]:
    spec = WorkloadSpec.quick() if quick else WorkloadSpec.full()
    steps = 40 if quick else 60
    t0 = time.time()
    clean = run_job(spec, steps, standby=0)
    full_steps = [c.step_s for c in clean.commits[WARMUP_STEPS:]]
    steady_full = statistics.median(full_steps)
    bandwidth = measure_p2p_bandwidth(max(clean.state_bytes, 1 << 20))
    plan = kill_plan([KILL_STEP])
    takeovers, shrinks = [], []
    digests = {"clean": set(clean.runtime_digests.values()), "takeover": set(), "shrink_grow": set()}
    for _ in range(kills):
        t = run_job(spec, steps, faults=plan, standby=1)
        takeovers.append(_takeover(t, bandwidth))
        digests["takeover"] |= set(t.runtime_digests.values())
        s = run_job(spec, steps, faults=plan, standby=0, replenish=True, wait_for_standbys=False,
                    extra={"standby_wait_s": 0.0})
        shrinks.append(_shrink_grow(s, bandwidth, steady_full))
        digests["shrink_grow"] |= set(s.runtime_digests.values())
    moves = [_planned_move(spec, steps, steady_full) for _ in range(kills)]
    sharded = _sharded_elastic(quick, kills)
    digests["planned_move"] = {d for m in moves for d in m.pop("digest")}
    tft = lost_time_torchft(spec, steps, KILL_STEP, kills=kills)
    report: dict[str, Any] = {
        "mode": "quick" if quick else "full", "steps": steps, "kill_step": KILL_STEP, "kills": kills,
        "steady_step_s": steady_full, "state_bytes": clean.state_bytes, "p2p_bandwidth": bandwidth,
        "takeover": {"each": takeovers, "gap_s": spread([k["gap_s"] for k in takeovers]),
                     "x_floor": spread([k["gap_s"] / k["floor_s"] for k in takeovers]),
                     "floor_s": spread([k["floor_s"] for k in takeovers])},
        "shrink_grow": {"each": shrinks, "gap_s": spread([k["gap_s"] for k in shrinks]),
                        "x_takeover_floor": spread([k["x_takeover_floor"] for k in shrinks]),
                        "shrunk_step_s": spread([k["shrunk_step_s"] for k in shrinks if k["shrunk_step_s"]]),
                        "own_floor_s": spread([k["own_floor_s"] for k in shrinks]),
                        "x_own_floor": spread([k["gap_s"] / k["own_floor_s"] for k in shrinks]),
                        "detect_s": spread([k["recovered"]["detect_s"] for k in shrinks]),
                        "group_init_s": spread([k["recovered"]["group_init_s"] for k in shrinks]),
                        "grow_group_s": spread([k["grow_group_s"] or 0.0 for k in shrinks]),
                        "grow_handoff_s": spread([k["grow_handoff_s"] or 0.0 for k in shrinks]),
                        "grow_stall_s": spread([k["grow_stall_s"] for k in shrinks]),
                        "grow_stall_steps": spread([k["grow_stall_steps"] for k in shrinks]),
                        "narrow_steps_extra_s": spread([k["narrow_steps_extra_s"] for k in shrinks]),
                        "equal_work_lost_s": spread([k["equal_work_lost_s"] for k in shrinks])},
        "planned_move": {"each": moves, "gap_s": spread([m["gap_s"] for m in moves]),
                         "moved_event_stall_s": spread([m["moved_event_stall_s"] for m in moves]),
                         "replayed_steps": sum(len(m["replayed"]) for m in moves),
                         "failures": sum(m["failed"] for m in moves)},
        "torchft": tft,
        "sharded": sharded,
        # Two members to one with one micro-batch per step is bit-exact (docs/elastic.md): the same final state.
        "bitwise_identical": {k: v == digests["clean"] for k, v in digests.items() if k != "clean"},
    }
    report["wall_s"] = time.time() - t0
    return rounded(report)


def format_report(r: dict[str, Any]) -> str:
    t, s = r["takeover"], r["shrink_grow"]
    lines = [f"Elastic width ({r['mode']}, {r['kills']} kill(s) of rank 1 at step {r['kill_step']}; steady step "
             f"{r['steady_step_s']:.3f} s at full width, state {r['state_bytes'] / 1e6:.1f} MB)",
             f"  takeover by a warm standby: gap {t['gap_s']['median']:.3f} s, floor {t['floor_s']['median']:.3f} s "
             f"(x{t['x_floor']['median']:.2f})",
             f"  shrink (no standby): gap {s['gap_s']['median']:.3f} s = x{s['x_takeover_floor']['median']:.2f} the "
             f"takeover's floor (target <= 1.5), x{s['x_own_floor']['median']:.2f} its own (d + detection "
             f"{s['detect_s']['median']:.3f} + new group {s['group_init_s']['median']:.3f}); shrunk step "
             f"{s['shrunk_step_s']['median'] or 0:.3f} s",
             f"  grow back at a step boundary: stall {s['grow_stall_s']['median']:.3f} s = "
             f"{s['grow_stall_steps']['median']:.2f} steps (target <= 1): new group {s['grow_group_s']['median']:.3f} "
             f"s, handoff {s['grow_handoff_s']['median']:.3f} s",
             f"  equal work (shrink gap + grow stall + the shrunk steps' excess over a full step): "
             f"{s['equal_work_lost_s']['median']:.3f} s, of which the shrunk steps "
             f"{s['narrow_steps_extra_s']['median']:+.3f} s (a takeover: its gap)"]
    m = r["planned_move"]
    lines.append(f"  planned move at a step boundary: gap {m['gap_s']['median']:.3f} s (the moved event's stall "
                 f"{m['moved_event_stall_s']['median']:.3f} s; target <= 0.1 s), steps replayed: "
                 f"{m['replayed_steps']}, failures: {m['failures']}")
    tf = r["torchft"]
    if tf.get("available"):
        ours = s["equal_work_lost_s"]["median"]
        ratio = f"{ours / tf['lost_time_s']:.2f}" if ours > 0 else "below 0 (the shrunk steps ran faster here)"
        lines.append(f"  torchft 0.2 (its healthy replica goes on alone): lost {tf['lost_time_s']:.3f} s at equal "
                     f"work; shrink and grow / torchft = {ratio}")
    else:
        lines.append(f"  torchft: not run ({tf.get('reason')})")
    lines.append(f"  same final state as the clean run: {r['bitwise_identical']}")
    lines.append(format_sharded(r["sharded"]))
    return "\n".join(lines)


SHARDED_KILL_STEP = 10


def _row_gap(before: tuple[int, int, float, float], first: tuple[int, int, float, float]) -> float:
    """`_gap` for the sharded worker's commit rows (step, generation, time, step_s)."""
    return first[2] - before[2] - first[3]


def _sharded_elastic(quick: bool, kills: int) -> dict[str, Any]:
    """HSDP 2 x 2 and DP 2 x TP 2 (the sharded section's decoder, bench.sharded): rank 3 SIGKILLed in its exchange at
    step K with no standby (`--standby-wait 0`): replica group 1 is left out (rank 2, alive, released) and group 0
    trains on at once with both groups' batches (accumulation); the two standbys started for the loss grow the job
    back at a step boundary. Against the same kill taken over by a warm standby. From rank 0's commits (w0 stays
    rank 0), with the gaps of the data-parallel part above. The run is sized to outlast the standbys' start."""
    from bench.sharded import FULL, QUICK, run, steady_step_s

    size = QUICK if quick else FULL
    k = SHARDED_KILL_STEP
    fault = f"kill:rank=3,step={k},phase=exchange"
    out: dict[str, Any] = {}
    for layout in ("hsdp", "dp-tp"):
        probe = steady_step_s(run(layout, size, 20))
        steps = k + max(40, int(15.0 / probe))
        clean = run(layout, size, steps)
        steady = steady_step_s(clean)
        takeover_gaps: list[float] = []
        shrink: list[float] = []
        rows: list[dict[str, float | None]] = []
        exact = True
        for _ in range(kills):
            t = run(layout, size, steps, faults=fault, standby=1)
            gens: dict[int, list[tuple[int, int, float, float]]] = {}
            for c in t.commits:
                gens.setdefault(c[1], []).append(c)
            takeover_gaps.append(_row_gap(gens[0][-1], gens[1][0]))
            s = run(layout, size, steps, faults=fault, standby=0, replenish=True, wait_for_standbys=False,
                    standby_wait_s=0.0)
            gens = {}
            for c in s.commits:
                gens.setdefault(c[1], []).append(c)
            grew = [e for e in s.events if e["event"] == "grew"]
            shrunk_steps = [c[3] for c in gens[1][1:]]
            shrink_gap = _row_gap(gens[0][-1], gens[1][0])
            shrink.append(shrink_gap)
            row: dict[str, float | None] = {"shrink_gap_s": shrink_gap,
                   "shrunk_step_s": statistics.median(shrunk_steps) if shrunk_steps else None,
                   "grow_stall_s": _row_gap(gens[1][-1], gens[2][0]) if 2 in gens else None,
                   "grew_event_stall_s": grew[0]["stall_s"] if grew else None,
                   "grow_group_s": grew[0].get("group_s") if grew else None,
                   "grow_handoff_s": grew[0].get("handoff_s") if grew else None}
            row["grow_stall_steps"] = None if row["grow_stall_s"] is None else row["grow_stall_s"] / steady
            rows.append(row)
            exact = exact and s.digest is not None and s.digest == clean.digest
        grows = [g for r in rows if (g := r["grow_stall_s"]) is not None]
        out[layout] = {
            "steps": steps, "steady_step_s": steady, "each": rows,
            "takeover_gap_s": spread(takeover_gaps), "shrink_gap_s": spread(shrink),
            "shrink_vs_takeover": statistics.median(shrink) / statistics.median(takeover_gaps),
            "shrunk_step_s": spread([r["shrunk_step_s"] for r in rows if r["shrunk_step_s"]]),
            "grow_stall_s": spread(grows), "grow_stall_steps": spread([g / steady for g in grows]),
            "grow_group_s": spread([r["grow_group_s"] for r in rows if r["grow_group_s"] is not None]),
            "grow_handoff_s": spread([r["grow_handoff_s"] for r in rows if r["grow_handoff_s"] is not None]),
            "grown_back": len(grows), "bitwise_identical": exact,
        }
    return out


def format_sharded(r: dict[str, Any]) -> str:
    lines = ["  sharded, by whole replica groups (rank 3 killed with no standby; group 1 left out, then grown back):"]
    for layout, s in r.items():
        g = s["grow_stall_s"]["median"]
        grow = (f"grow stall {g:.3f} s = {s['grow_stall_steps']['median']:.2f} steps (new groups "
                f"{s['grow_group_s']['median'] or 0:.3f} s, handoff {s['grow_handoff_s']['median'] or 0:.3f} s)"
                if g is not None else "not grown back within the run")
        lines.append(f"    {layout:<6} steady step {s['steady_step_s']:.3f} s; takeover gap "
                     f"{s['takeover_gap_s']['median']:.3f} s, shrink gap {s['shrink_gap_s']['median']:.3f} s "
                     f"(x{s['shrink_vs_takeover']:.2f}), shrunk step {s['shrunk_step_s']['median'] or 0:.3f} s; "
                     f"{grow}; bit-exact: {s['bitwise_identical']}")
    return "\n".join(lines)
