"""`trainmover bench recovery --sections hot`: a hot standby's takeover against a warm one's, and what mirroring the
state every step costs the job (`--hot-standbys`, runtime.training.hot).

Per kind of step (as `bench.overlap`: **cpu**, the workload as it is, whose passes keep this machine's two cores
busy; **device**, the same step with `DEVICE_MS` of each forward pass off the CPU, the premise of an accelerator
host), in alternated rounds:

* **steady state**: one clean job with one warm standby, one with one hot standby (the same standby, mirroring):
  the median steady step of each (`steady_step_of`, every member's commits) and their ratio (throughput);
* **takeover**: one job with one warm standby and one with one hot standby, each with `kills` SIGKILLs of rank 1
  before its gradient exchange (so that no survivor commits the killed step alone and the mirror's last message
  cannot race the kill), `KILL_SPACING` steps apart, a replacement standby started after each (it warms up, links
  and receives the state before the next kill). Per kill: lost_time_s (rank 0's identity, warm-up penalty
  included), the bytes sent to the new member, the stall in steps (lost time / steady step) and the kill's floor
  (the work destroyed, plus the state over the measured bandwidth for a warm standby; nothing more for a hot one).

Every job's final state is compared with the clean warm job's.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

from bench.overlap import kinds_header
from bench.peers.common import spread
from bench.peers.p2p import measure_p2p_bandwidth
from bench.peers.trainmover import JobRun, kill_losses, kill_plan, kill_schedule, run_job, steady_step_of
from bench.workload import WorkloadSpec

DEVICE_MS = 400.0
"""Off-CPU time of each forward pass in the `device` kind (full size; a quarter of it in quick mode)."""
KILL_SPACING = 10


def _job(spec: WorkloadSpec, steps: int, kill_steps: list[int], hot: bool) -> JobRun:
    faults = kill_plan(kill_steps, phase="before_exchange") if kill_steps else ""
    return run_job(spec, steps, faults=faults, standby=1, replenish=bool(kill_steps), wait_for_standbys=True,
                   extra={"hot_standbys": 1 if hot else 0})


def _kills(run: JobRun, state_s: float, hot: bool) -> list[dict[str, Any]]:
    out = []
    for k in kill_losses(run.commits, run.events):
        sent = k.handoff_bytes
        floored = k.with_floor(0.0 if hot and sent == 0 else state_s)
        out.append({"replay_step": k.replay_step, "lost_time_s": k.lost_time_s, "step_s": k.step_s,
                    "stall_steps": k.lost_time_s / k.step_s, "bound_s": k.recovery_bound_s,
                    "takeover_steps": k.recovery_bound_s / k.step_s, "redone_s": k.redone_s, "handoff_bytes": sent,
                    "floor_s": floored.floor_s, "recovery_s": k.recovery_s, **k.components})
    return out


def _summary(kills: list[dict[str, Any]]) -> dict[str, Any]:
    lost = spread([k["lost_time_s"] for k in kills])
    return {"kills": len(kills), "nothing_sent": sum(k["handoff_bytes"] == 0 for k in kills),
            "lost_time_s": lost["median"], "lost_time_min_s": lost["min"], "lost_time_max_s": lost["max"],
            **{key: statistics.median(k[key] for k in kills)
               for key in ("stall_steps", "bound_s", "takeover_steps", "step_s", "floor_s", "handoff_s", "replay_s",
                           "detect_s", "reconfigure_s", "warmup_penalty_s", "handoff_bytes")}}


def run_hot_benchmark(quick: bool, kills: int, rounds: int = 2) -> dict[str, Any]:
    base = WorkloadSpec.quick() if quick else WorkloadSpec.full()
    kinds = {"cpu": base, "device": dataclasses.replace(base, device_ms=DEVICE_MS / 4 if quick else DEVICE_MS)}
    kill_steps, steps = kill_schedule(kills, spacing=KILL_SPACING)
    reference: JobRun | None = None
    bandwidth = 0.0
    steady: dict[str, dict[str, list[float]]] = {kind: {"warm": [], "hot": []} for kind in kinds}
    taken: dict[str, dict[str, list[dict[str, Any]]]] = {kind: {"warm": [], "hot": []} for kind in kinds}
    exact: dict[str, bool] = {}
    for _ in range(rounds):
        for kind, spec in kinds.items():
            for tier in ("warm", "hot"):
                clean = _job(spec, steps, [], tier == "hot")
                if reference is None:
                    reference = clean
                    bandwidth = measure_p2p_bandwidth(clean.state_bytes)
                steady[kind][tier].append(steady_step_of(clean.proc_commits))
                killed = _job(spec, steps, kill_steps, tier == "hot")
                for name, run in ((f"{kind}/{tier}/clean", clean), (f"{kind}/{tier}/killed", killed)):
                    exact[name] = exact.get(name, True) and run.digest == reference.digest
                taken[kind][tier] += _kills(killed, reference.state_bytes / bandwidth, tier == "hot")
    assert reference is not None
    by_kind: dict[str, Any] = {}
    for kind in kinds:
        warm_step, hot_step = (min(steady[kind][t]) for t in ("warm", "hot"))
        warm, hot = _summary(taken[kind]["warm"]), _summary(taken[kind]["hot"])
        by_kind[kind] = {
            "steady_step_s": {"warm": warm_step, "hot": hot_step, "each": steady[kind]},
            "throughput_hot_vs_warm": warm_step / hot_step,
            "warm": warm, "hot": hot,
            "lost_time_hot_vs_warm": hot["lost_time_s"] / warm["lost_time_s"],
            "hot_vs_its_floor": hot["lost_time_s"] / hot["floor_s"],
            "kills": taken[kind],
        }
    return {"mode": "quick" if quick else "full", "kills_per_job": kills, "rounds": rounds,
            "state_bytes": reference.state_bytes, "model_bytes": reference.model_bytes,
            "p2p_bandwidth_bytes_per_s": bandwidth, "device_ms": kinds["device"].device_ms,
            "bitwise_identical": exact, "by_kind": by_kind}


def format_report(r: dict[str, Any]) -> str:
    def f(x: float) -> str:
        return f"{x:.3f}"

    lines = ["takeover: the recovery's stall without the steps after it (recovery_s - (step - redone)); after: the "
             "warm-up penalty, the 3 steps after the replay (a replacement standby warms up, and a hot one is sent "
             "the state, then)",
             kinds_header("hot standbys", r),
             f"  {'step':<8}{'standby':<9}{'steady step':>12}{'lost median':>12}{'min':>8}{'max':>8}{'stall':>7}"
             f"{'takeover':>9}{'(steps)':>8}{'after':>7}{'floor':>8}{'handoff':>9}{'replay':>8}{'sent MB':>9}"
             f"{'nothing sent':>14}"]
    for kind, row in r["by_kind"].items():
        for tier in ("warm", "hot"):
            s = row[tier]
            lines.append(f"  {kind:<8}{tier:<9}{f(row['steady_step_s'][tier]):>12}{f(s['lost_time_s']):>12}"
                         f"{f(s['lost_time_min_s']):>8}{f(s['lost_time_max_s']):>8}{s['stall_steps']:>6.2f}x"
                         f"{f(s['bound_s']):>9}{s['takeover_steps']:>7.2f}x{f(s['warmup_penalty_s']):>7}{f(s['floor_s']):>8}{f(s['handoff_s']):>9}{f(s['replay_s']):>8}"
                         f"{s['handoff_bytes'] / 1e6:>9.0f}{s['nothing_sent']:>9} of {s['kills']}")
        lines.append(f"  {kind}: hot / warm lost {row['lost_time_hot_vs_warm']:.2f}x (the takeover alone "
                     f"{row['hot']['bound_s'] / row['warm']['bound_s']:.2f}x), hot / its floor "
                     f"{row['hot_vs_its_floor']:.2f}x; throughput with a hot standby "
                     f"{row['throughput_hot_vs_warm']:.3f} of the job with a warm one")
    exact = r["bitwise_identical"]
    lines.append("  bit-exact against the clean job: " + ", ".join(f"{k} {v}" for k, v in exact.items()))
    return "\n".join(lines)
