"""`trainmover bench recovery --sections overlap`: the handoff overlapped with the replayed step, against the handoff
that precedes it (`--no-handoff-overlap`), on the recovery benchmark's workload and kills.

Each setting is one TrainMover job of `bench.recovery` (2 workers, one warm standby per kill, SIGKILL of rank 1 in
the gradient exchange every 8 steps), run with the overlap off and on, alternated, for two kinds of step:

* **cpu**: the workload as it is, whose forward and backward passes keep this machine's cores busy. Here the
  optimizer's state streaming beside the passes competes with them for the same two cores.
* **device**: the same step with `DEVICE_MS` of each forward pass spent off the CPU (a sleep in the loss function,
  `WorkloadSpec.device_ms`): the premise of an accelerator host, whose cores, links and copy engines are idle while
  the accelerator computes.

Per kill: lost_time_s (`bench.peers.trainmover`: the identity on rank 0, warm-up penalty included), its bound from
the coordinator's clock (`recovery_s - (step_s - redone_s)`, no warm-up penalty) and both floors, sequential
(`state / bandwidth + redone`) and overlapped (`redone + max(model / bandwidth, state / bandwidth - step)`). Every
killed job's final state is compared with one clean job's (the sleep changes no number).
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

from bench.peers.common import spread
from bench.peers.p2p import measure_p2p_bandwidth
from bench.peers.trainmover import KillLoss, kill_losses, kill_plan, kill_schedule, run_job
from bench.workload import WorkloadSpec

DEVICE_MS = 400.0
"""Off-CPU time of each forward pass in the `device` kind (full size; a quarter of it in quick mode)."""
KILL_SPACING = 8


def _job(spec: WorkloadSpec, steps: int, kill_steps: list[int], overlap: bool | None) -> Any:
    extra = None if overlap is None else {"handoff_overlap": overlap}
    return run_job(spec, steps, faults=kill_plan(kill_steps) if overlap is not None else "", standby=len(kill_steps),
                   replenish=False, wait_for_standbys=True, extra=extra)


def _kill(k: KillLoss, state_s: float, model_s: float) -> dict[str, Any]:
    return {"replay_step": k.replay_step, "lost_time_s": k.lost_time_s, "bound_s": k.recovery_bound_s,
            "recovery_s": k.recovery_s, "step_s": k.step_s, "redone_s": k.redone_s,
            "floor_sequential_s": k.with_floor(state_s).floor_s,
            "floor_overlapped_s": k.with_floor(state_s, model_s).floor_s, **k.components}


def _summary(kills: list[dict[str, Any]]) -> dict[str, Any]:
    def med(key: str) -> float:
        return statistics.median(k[key] for k in kills)

    lost = spread([k["lost_time_s"] for k in kills])
    return {"lost_time_s": lost["median"], "lost_time_min_s": lost["min"], "lost_time_max_s": lost["max"],
            **{key: med(key) for key in ("bound_s", "recovery_s", "step_s", "floor_sequential_s", "floor_overlapped_s",
                                         "handoff_s", "handoff_overlapped_s", "replay_s")}}


def run_overlap_benchmark(quick: bool, kills: int, rounds: int = 2) -> dict[str, Any]:
    base = WorkloadSpec.quick() if quick else WorkloadSpec.full()
    kinds = {"cpu": base, "device": dataclasses.replace(base, device_ms=DEVICE_MS / 4 if quick else DEVICE_MS)}
    kill_steps, steps = kill_schedule(kills, spacing=KILL_SPACING)
    clean = _job(base, steps, kill_steps, None)
    bandwidth = measure_p2p_bandwidth(clean.state_bytes)
    state_s, model_s = clean.state_bytes / bandwidth, clean.model_bytes / bandwidth
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {kind: {"off": [], "on": []} for kind in kinds}
    exact: dict[str, bool] = {}
    for _ in range(rounds):
        for kind, spec in kinds.items():
            for setting in ("off", "on"):
                killed = _job(spec, steps, kill_steps, setting == "on")
                exact[f"{kind}/{setting}"] = exact.get(f"{kind}/{setting}", True) and killed.digest == clean.digest
                runs[kind][setting] += [_kill(k, state_s, model_s) for k in kill_losses(killed.commits, killed.events)]
    by_kind: dict[str, Any] = {}
    for kind, settings in runs.items():
        off, on = _summary(settings["off"]), _summary(settings["on"])
        median_on = sorted(settings["on"], key=lambda k: k["lost_time_s"])[len(settings["on"]) // 2]
        by_kind[kind] = {
            "off": off, "on": on,
            "lost_time_on_vs_off": on["lost_time_s"] / off["lost_time_s"],
            "bound_on_vs_off": on["bound_s"] / off["bound_s"],
            "on_vs_overlapped_floor": on["lost_time_s"] / on["floor_overlapped_s"],
            "off_vs_sequential_floor": off["lost_time_s"] / off["floor_sequential_s"],
            "timeline_on": _timeline(median_on),
            "kills": settings,
        }
    return {"mode": "quick" if quick else "full", "kills_per_job": kills, "rounds": rounds,
            "state_bytes": clean.state_bytes, "model_bytes": clean.model_bytes, "p2p_bandwidth_bytes_per_s": bandwidth,
            "device_ms": kinds["device"].device_ms, "bitwise_identical": exact, "by_kind": by_kind}


def _timeline(k: dict[str, Any]) -> dict[str, float]:
    model_in = k["recovery_s"] - k["replay_s"]
    return {"declared": k["detect_s"], "groups_ready": k["detect_s"] + k["reconfigure_s"],
            "model_received": model_in, "optimizer_state_received": model_in + k["handoff_overlapped_s"],
            "replayed_step_committed": k["recovery_s"], "lost_time_s": k["lost_time_s"]}


def kinds_header(title: str, r: dict[str, Any]) -> str:
    """The first line of a report that runs the cpu and device kinds of step (this section's and `bench.hot`'s)."""
    return (f"{title} ({r['mode']}): {r['state_bytes'] / 1e6:.0f} MB of state, of which the model "
            f"{r['model_bytes'] / 1e6:.0f} MB; {r['kills_per_job']} kills per job, {r['rounds']} rounds alternated; "
            f"p2p {r['p2p_bandwidth_bytes_per_s'] / 1e9:.2f} GB/s; device kind: {r['device_ms']:.0f} ms of each "
            "forward pass off the CPU")


def format_report(r: dict[str, Any]) -> str:
    def f(x: float) -> str:
        return f"{x:.3f}"

    lines = [kinds_header("handoff overlap", r),
             f"  {'step':<8}{'overlap':<9}{'lost median':>12}{'min':>8}{'max':>8}{'bound':>8}{'handoff':>9}"
             f"{'beside':>8}{'replay':>8}{'floor seq':>10}{'floor ovl':>10}{'step':>7}"]
    for kind, row in r["by_kind"].items():
        for setting in ("off", "on"):
            s = row[setting]
            lines.append(f"  {kind:<8}{setting:<9}{f(s['lost_time_s']):>12}{f(s['lost_time_min_s']):>8}"
                         f"{f(s['lost_time_max_s']):>8}{f(s['bound_s']):>8}{f(s['handoff_s']):>9}"
                         f"{f(s['handoff_overlapped_s']):>8}{f(s['replay_s']):>8}{f(s['floor_sequential_s']):>10}"
                         f"{f(s['floor_overlapped_s']):>10}{f(s['step_s']):>7}")
        t = row["timeline_on"]
        lines.append(f"  {kind}: on / off lost {row['lost_time_on_vs_off']:.2f}x "
                     f"(bound {row['bound_on_vs_off']:.2f}x); on / its floor {row['on_vs_overlapped_floor']:.2f}x, "
                     "off / its floor "
                     f"{row['off_vs_sequential_floor']:.2f}x")
        lines.append(f"    one recovery, overlapped (the median kill, lost {f(t['lost_time_s'])} s), seconds after the "
                     "failure: " + ", ".join(f"{m.replace('_', ' ')} {f(t[m])}" for m in
                                             ("declared", "groups_ready", "model_received", "optimizer_state_received",
                                              "replayed_step_committed")))
    exact = r["bitwise_identical"]
    lines.append("  bit-exact against the clean job: " + ", ".join(f"{k} {v}" for k, v in exact.items()))
    return "\n".join(lines)
