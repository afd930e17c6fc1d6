"""The recovery benchmark's `host_loss` section: a whole host killed mid-exchange, across network namespaces.

Two hosts of two workers each and one standby host of two slots per kill, each host a Linux network namespace
running `trainmover agent`, the coordinator beside them (bench.netns). Each kill is the `host` fault action on
whoever holds rank 3 (rank 0, whose commits are timed, survives), mid gradient exchange: its agent and then
itself are SIGKILLed, the host's other process follows its agent, the coordinator sees the host's link close,
and both ranks of the host go to the next standby host in one generation, fed by the other host's members.
Figures have the single-host section's keys (bench.recovery.summarize_trainmover), against a clean run of the
same hosts and world size.
"""

from __future__ import annotations

import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.netns import ROOT, Cluster, Events, cluster, unavailable
from bench.peers.trainmover import OUT_ENV, TM_SCRIPT, JobRun, collect
from bench.workload import SPEC_ENV, WorkloadSpec

SLOTS = 2
TINY_JOB = Path(__file__).resolve().parents[1] / "tests" / "runtime" / "scripts" / "tiny_job.py"
"""The runtime tests' small script: what the standby warm-up measurement trains (its model size is not the point)."""
WORKER_HOSTS = 2


CUT_AFTER_S = 2.0
"""How long the partition run trains (after its start, then after each recovery) before the next host is cut."""


def run_hosts_job(spec: WorkloadSpec, steps: int, faults: str, standby_hosts: int, cuts: int = 0) -> JobRun:
    with tempfile.TemporaryDirectory(prefix="tm-hosts-") as tmp:
        out = Path(tmp) / "rank0.json"
        with cluster(WORKER_HOSTS + standby_hosts, Path(tmp)) as c:
            return _run(c, Path(tmp), out, spec, steps, faults, standby_hosts, cuts)


def _cut_hosts(c: Cluster, events: Events, coord: subprocess.Popen[bytes], cuts: int) -> None:
    """Cut off, one after the other, the host that holds rank 3 (its link down, every process alive), each
    `CUT_AFTER_S` into training or after the previous recovery."""
    for n in range(cuts):
        def generation(ev: list[dict[str, Any]], n: int = n) -> dict[str, Any] | None:
            return next((e for e in ev if e["event"] == "generation" and e["generation"] == n), None)

        def recovered(ev: list[dict[str, Any]], n: int = n) -> bool:
            return len([e for e in ev if e["event"] == "recovered"]) > n

        gen = events.wait_for(f"generation {n}", generation, 600, alive=coord)
        time.sleep(CUT_AFTER_S)  # a stretch of steady training before the cut: the workload, not a synchronisation
        proc = next(m["proc"] for m in gen["members"] if m["rank"] == 3)
        host = [e["host"] for e in events.read() if e["event"] == "placed" and e["proc"] == proc][-1]
        c.cut(int(host[1:]))
        events.wait_for(f"recovery {n + 1}", recovered, 600, alive=coord)


def _start_coordinator(c: Cluster, tmp: Path, args: list[str], env: dict[str, str]
                       ) -> tuple[subprocess.Popen[bytes], int, str, Events]:
    """`trainmover coordinator` for the cluster's hosts with `args` (options, then the script and its arguments),
    a fresh secret, its events in `tmp`; (process, agent port, secret, events)."""
    secret = secrets.token_hex(32)
    with socket.socket() as probe:
        probe.bind((c.coordinator_ip, 0))
        port = probe.getsockname()[1]
    events = Events(tmp / "events.jsonl")
    cmd = [sys.executable, "-m", "trainmover", "coordinator", "--agents", str(len(c.hosts)), "--agent-port",
           str(port), "--host", c.coordinator_ip, "--threads", "1", "--quiet", "--events", str(events.path), *args]
    with open(tmp / "coordinator.log", "wb") as log:
        coord = subprocess.Popen(cmd, env={**os.environ, **env, "TRAINMOVER_JOB_SECRET": secret}, stdout=log,
                                 stderr=subprocess.STDOUT, cwd=ROOT)
    return coord, port, secret, events


def _run(c: Cluster, tmp: Path, out: Path, spec: WorkloadSpec, steps: int, faults: str,
         standby_hosts: int, cuts: int) -> JobRun:
    env = {SPEC_ENV: spec.to_env(), OUT_ENV: str(out)}
    coord, port, secret, events = _start_coordinator(c, tmp, [
        "--nproc", str(WORKER_HOSTS * SLOTS), "--standby", str(standby_hosts * SLOTS), "--no-replenish",
        "--wait-for-standbys", "--hang-timeout", "6", *(["--faults", faults] if faults else []),
        str(TM_SCRIPT), str(steps)], env)
    try:
        for i in range(len(c.hosts)):
            c.start_agent(i, port, secret, SLOTS, "--quiet", env=env)
        _cut_hosts(c, events, coord, cuts)
        code = coord.wait(timeout=1800)
    finally:
        if coord.poll() is None:
            coord.kill()
            coord.wait(timeout=10)
    evs = events.read()
    finished = [e for e in evs if e["event"] == "job_finished"]
    failed = [e for e in evs if e["event"] == "job_failed"]
    message = failed[0]["reason"] if failed else (tmp / "coordinator.log").read_text()[-2000:] if code else "done"
    digests = finished[0]["digests"] if finished else {}
    return collect(out, evs, code, message, digests)


def host_loss(spec: WorkloadSpec, kill_steps: list[int], steps: int, handoff_floor_s: float, floor_s: float
              ) -> dict[str, Any]:
    """The host-loss section, or why it was skipped (network namespaces need root and iproute2)."""
    from bench.recovery import summarize_trainmover

    reason = unavailable()
    if reason:
        return {"skipped": reason}
    clean = run_hosts_job(spec, steps, "", len(kill_steps))
    plan = ";".join(f"host:rank=3,step={k},phase=exchange" for k in kill_steps)  # rank 0 (the recorder) survives
    killed = run_hosts_job(spec, steps, plan, len(kill_steps))
    tm = summarize_trainmover([clean], killed, kill_steps, handoff_floor_s, floor_s)
    tm["settings"] = {"hosts": WORKER_HOSTS, "slots": SLOTS, "standby_hosts": len(kill_steps),
                      "workers": WORKER_HOSTS * SLOTS, "replenish": False, "wait_for_standbys": True,
                      "kills": f"the whole host of whoever holds rank 3 (its agent, then every process), mid "
                               f"gradient exchange, at steps {kill_steps}; each host a network namespace"}
    tm["ranks_per_recovery"] = [len(e["ranks"]) for e in killed.of_kind("recovered")]
    tm["generations_per_recovery"] = [e.get("generations") for e in killed.of_kind("recovered")]
    return tm


PARTITION_STEPS = 150
"""Long enough for two cuts, each found after the host timeout, at about 0.12 s a step."""


def host_partition(spec: WorkloadSpec, cuts: int, handoff_floor_s: float, floor_s: float,
                   host_timeout_s: float) -> dict[str, Any]:
    """The partition section: the host of rank 3 cut off `cuts` times (link down, processes alive), against a clean
    run of the same hosts; or why it was skipped."""
    from bench.recovery import summarize_trainmover

    reason = unavailable()
    if reason:
        return {"skipped": reason}
    clean = run_hosts_job(spec, PARTITION_STEPS, "", cuts)
    cut = run_hosts_job(spec, PARTITION_STEPS, "", cuts, cuts=cuts)
    tm = summarize_trainmover([clean], cut, [0] * cuts, handoff_floor_s, floor_s)
    tm["host_timeout_s"] = host_timeout_s
    tm["target_s"] = host_timeout_s + 0.5
    tm["settings"] = {"hosts": WORKER_HOSTS, "slots": SLOTS, "standby_hosts": cuts, "workers": WORKER_HOSTS * SLOTS,
                      "cuts": f"the host of whoever holds rank 3, its link down with every process alive, "
                              f"{CUT_AFTER_S} s into training and {CUT_AFTER_S} s after each recovery"}
    tm["ranks_per_recovery"] = [len(e["ranks"]) for e in cut.of_kind("recovered")]
    return tm


def standby_warm_across_hosts(asks: int = 3) -> dict[str, Any]:
    """How long a standby takes to be warm on another host once asked for, in steady training: a worker host and a
    standby host (namespaces, `asks + 1` standby slots), one standby at the start; then the standby target is raised
    by one, `asks` times, through `JobControl` across the store's tunnel, each after the previous one is warm.
    Each ask's `standby_ready.ready_after_s` (spawn order to warm), and the start-up standby's for comparison."""
    from runtime.wire.control import JobControl

    reason = unavailable()
    if reason:
        return {"skipped": reason}
    with tempfile.TemporaryDirectory(prefix="tm-warm-") as tmp, cluster(2, Path(tmp)) as c:
        coord, port, secret, events = _start_coordinator(c, Path(tmp), [
            "--nproc", "2", "--standby", "1", "--wait-for-standbys", str(TINY_JOB), "--steps", "100000",
            "--step-ms", "20"], {})
        try:
            c.start_agent(0, port, secret, 2, "--quiet", "--role", "worker")
            c.start_agent(1, port, secret, asks + 1, "--quiet", "--role", "standby")
            def running(ev: list[dict[str, Any]]) -> dict[str, Any] | None:
                if not any(e["event"] == "generation" for e in ev):
                    return None
                return next(e for e in ev if e["event"] == "job_started")

            started = events.wait_for("generation 0", running, 300, alive=coord)
            control = JobControl(c.coordinator_ip, started["port"], timeout_s=30, secret=secret)
            try:
                for n in range(asks):
                    def warm(ev: list[dict[str, Any]], want: int = n + 2) -> bool:
                        return len([e for e in ev if e["event"] == "standby_ready"]) >= want

                    control.set_standby_target(n + 2)
                    events.wait_for(f"standby {n + 2} warm", warm, 120, alive=coord)
            finally:
                control.close()
        finally:
            coord.kill()
            coord.wait(timeout=10)
        ready = [e for e in events.read() if e["event"] == "standby_ready"]
    asked = [round(e["ready_after_s"], 3) for e in ready[1:]]
    return {"asked_ready_after_s": asked, "asked_median_s": round(statistics.median(asked), 3),
            "asked_max_s": max(asked), "warmup_s": [round(e["warmup_s"], 4) for e in ready[1:]],
            "at_start_ready_after_s": round(ready[0]["ready_after_s"], 3),
            "method": "ready_after_s of each standby_ready event: from the coordinator's spawn order to the standby "
                      "warm (forked by the standby host's zygote, its model and buffers built); the standby target "
                      "raised through JobControl across the store's tunnel, one ask at a time, in steady training"}
