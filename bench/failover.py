"""The recovery benchmark's `coordinator_loss` section: the coordinator SIGKILLed, across network namespaces.

Two hosts of two workers and two standby hosts, each a Linux network namespace running `trainmover agent`; the job's
store is `trainmover store` beside them, so the job outlives its coordinator (docs/multihost.md, "The coordinator
can die"). Before each kill a second coordinator waits with `--takeover` on its own agent port (a hot standby
coordinator); the kill is a SIGKILL of the coordinator that holds the job. Four runs of the same job, whose final
states must all be the same bits:

- clean: no fault;
- steady: the coordinator killed `kills` times in steady training, `CUT_AFTER_S` into training or after the
  previous takeover. Lost time per kill = rank 0's step durations inside the outage (from the kill to the takeover)
  minus as many of the run's own steady steps: nothing stops while no coordinator runs;
- worker: the worker holding rank 3 SIGKILLed from outside `kills` times (at whatever phase it is in), with its
  coordinator alive: the baseline;
- both: the same, right after its coordinator was SIGKILLed: nobody declares the death until the standby
  coordinator took the job over (its agent hands over how and when the process exited). Lost time per worker kill
  = the longest gap between rank 0's consecutive commits from its last one before the kill to 30 s after, minus a
  steady step.
"""

from __future__ import annotations

import itertools
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.hostloss import CUT_AFTER_S, SLOTS, WORKER_HOSTS
from bench.netns import ROOT, Cluster, Events, cluster, unavailable
from bench.peers.common import steady_step_s
from bench.peers.trainmover import OUT_ENV, TM_SCRIPT, JobRun, collect
from bench.workload import SPEC_ENV, WorkloadSpec

STANDBY_HOSTS = 2
STEPS = 500
WAITING = "waiting for the job's coordinator to be gone"


def _port(c: Cluster) -> int:
    with socket.socket() as probe:
        probe.bind((c.coordinator_ip, 0))
        return int(probe.getsockname()[1])


class _Job:
    """A job on `trainmover store`, its coordinators started one after the other (each next one with --takeover)."""

    def __init__(self, c: Cluster, tmp: Path, spec: WorkloadSpec) -> None:
        self.c, self.tmp = c, tmp
        self.secret = secrets.token_hex(32)
        self.env = {**os.environ, SPEC_ENV: spec.to_env(), OUT_ENV: str(tmp / "rank0.json"),
                    "TRAINMOVER_JOB_SECRET": self.secret}
        self.events = Events(tmp / "events.jsonl")
        store_port = _port(c)
        self.log = open(tmp / "coordinators.log", "ab")  # noqa: SIM115 - closed in close()
        self.store = subprocess.Popen(
            [sys.executable, "-m", "trainmover", "store", "--host", c.coordinator_ip, "--port", str(store_port)],
            env=self.env, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)
        self.args = ["--agents", str(len(c.hosts)), "--host", c.coordinator_ip, "--threads", "1",
                     "--events", str(self.events.path), "--store", f"{c.coordinator_ip}:{store_port}",
                     "--job-id", "bench-failover", "--nproc", str(WORKER_HOSTS * SLOTS),
                     "--standby", str(STANDBY_HOSTS * SLOTS), "--no-replenish", "--wait-for-standbys",
                     "--hang-timeout", "6", str(TM_SCRIPT), str(STEPS)]
        self.port = _port(c)
        self.coordinators = [self._coordinator(self.port, takeover=False)]
        self.holder = self.coordinators[0]
        """The coordinator that holds the job now."""
        for i in range(len(c.hosts)):
            c.start_agent(i, self.port, self.secret, SLOTS, "--quiet", env=self.env)

    def _coordinator(self, port: int, takeover: bool) -> subprocess.Popen[bytes]:
        cmd = [sys.executable, "-m", "trainmover", "coordinator", *(["--takeover"] if takeover else []),
               "--agent-port", str(port), *self.args]
        return subprocess.Popen(cmd, env=self.env, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)

    def stand_by(self) -> None:
        """Start the next coordinator with --takeover and wait until it watches the lease."""
        waiting = (self.tmp / "coordinators.log").read_text(errors="replace").count(WAITING)
        self.coordinators.append(self._coordinator(_port(self.c), takeover=True))
        self.events.wait_for("the standby coordinator watching the lease", lambda _: (
            self.tmp / "coordinators.log").read_text(errors="replace").count(WAITING) > waiting, 120,
            alive=self.coordinators[-1])

    def kill_holder(self) -> float:
        """SIGKILL the coordinator that holds the job (the standby one takes it over); the moment, wall clock."""
        victim, self.holder = self.holder, self.coordinators[-1]
        at = time.time()
        victim.kill()
        victim.wait(timeout=10)
        return at

    def finish(self) -> JobRun:
        code = self.holder.wait(timeout=1800)
        evs = self.events.read()
        finished = [e for e in evs if e["event"] == "job_finished"]
        failed = [e for e in evs if e["event"] == "job_failed"]
        message = failed[0]["reason"] if failed else "done" if not code else \
            (self.tmp / "coordinators.log").read_text(errors="replace")[-3000:]
        return collect(self.tmp / "rank0.json", evs, code, message, finished[0]["digests"] if finished else {})

    def close(self) -> None:
        for p in [*self.coordinators, self.store]:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        self.log.close()


def _run(spec: WorkloadSpec, mode: str, kills: int) -> tuple[JobRun, list[float]]:
    """One job; `mode`: "clean" (nothing killed), "steady" (the coordinator), "worker" (rank 3's process) or "both"
    (the coordinator, then rank 3's process while none runs). Also the wall moments of the kills (the coordinator's,
    or the worker's in "worker")."""
    with tempfile.TemporaryDirectory(prefix="tm-failover-") as tmp, \
            cluster(WORKER_HOSTS + STANDBY_HOSTS, Path(tmp)) as c:
        job = _Job(c, Path(tmp), spec)
        kill_times: list[float] = []
        try:
            job.events.wait_for("generation 0", lambda ev: any(e["event"] == "generation" for e in ev), 600,
                                alive=job.holder)
            for n in range(kills if mode != "clean" else 0):
                if mode != "worker":
                    job.stand_by()
                time.sleep(CUT_AFTER_S)  # a stretch of steady training before the kill: the workload
                if mode != "worker":
                    kill_times.append(job.kill_holder())
                if mode != "steady":  # the worker that holds rank 3, from outside, at whatever phase it is in
                    gen = [e for e in job.events.read() if e["event"] == "generation"][-1]
                    pid = next(m["pid"] for m in gen["members"] if m["rank"] == 3)
                    at = time.time()
                    os.kill(pid, signal.SIGKILL)
                    if mode == "worker":
                        kill_times.append(at)
                if mode != "worker":
                    job.events.wait_for(f"takeover {n + 1}", _more("coordinator_took_over", n), 120,
                                        alive=job.holder)
                if mode != "steady":
                    job.events.wait_for(f"recovery {n + 1}", _more("recovered", n), 120, alive=job.holder)
            return job.finish(), kill_times
        finally:
            job.close()


def _more(kind: str, n: int) -> Callable[[list[dict[str, Any]]], bool]:
    """Whether the events hold more than `n` of `kind`."""
    return lambda ev: len([e for e in ev if e["event"] == kind]) > n


def _outage_lost(run: JobRun, kills: list[float], steady_s: float) -> list[dict[str, Any]]:
    took = run.of_kind("coordinator_took_over")
    out = []
    for at, t in zip(kills, took, strict=False):
        times = run.step_times
        inside = [b - a for a, b in itertools.pairwise(times) if at <= b <= t["time"]]
        out.append({"outage_s": round(t["time"] - at, 3), "stale_s": round(t["stale_s"], 3),
                    "adopt_s": t["adopt_s"], "steps_during_outage": len(inside),
                    "lost_s": round(sum(inside) - len(inside) * steady_s, 3)})
    return out


def _stalls(run: JobRun, kills: list[float], steady_s: float, window_s: float = 30.0) -> list[float]:
    """Per kill of a worker: the longest gap between two of rank 0's consecutive commits, from its last one before
    the kill to `window_s` after it or the next kill, whichever is first (the kill's stall: the step it interrupted
    may still commit, the stall then comes at the next), less one steady step: the training time the kill cost."""
    times = [c.time for c in run.commits]
    ends = [*kills[1:], float("inf")]
    out = []
    for at, end in zip(kills, ends, strict=True):
        before = [t for t in times if t <= at]
        inside = [t for t in times if before and before[-1] <= t < min(at + window_s, end)]
        if len(inside) > 1:
            out.append(round(max(b - a for a, b in itertools.pairwise(inside)) - steady_s, 3))
    return out


def coordinator_loss(spec: WorkloadSpec, kills: int = 3) -> dict[str, Any]:
    """The coordinator-loss section, or why it was skipped (network namespaces need root and iproute2)."""
    reason = unavailable()
    if reason:
        return {"skipped": reason}
    clean, _ = _run(spec, "clean", kills)
    steady, steady_kills = _run(spec, "steady", kills)
    alive, alive_kills = _run(spec, "worker", kills)
    both, both_kills = _run(spec, "both", kills)
    step_s = steady_step_s(steady.step_times)
    outages = _outage_lost(steady, steady_kills, step_s)
    lost_alive = _stalls(alive, alive_kills, steady_step_s(alive.step_times))
    lost_both = _stalls(both, both_kills, steady_step_s(both.step_times))
    digests = {"clean": clean.digest, "steady": steady.digest, "worker_killed": alive.digest,
               "worker_and_coordinator_killed": both.digest}
    return {
        "steady": {"kills": outages, "steady_step_s": round(step_s, 4),
                   "lost_s_median": statistics.median(o["lost_s"] for o in outages),
                   "outage_s_median": statistics.median(o["outage_s"] for o in outages),
                   "member_failed": len(steady.of_kind("member_failed")),
                   "generations": len(steady.of_kind("generation"))},
        "recovery": {"coordinator_alive_lost_s": lost_alive, "coordinator_lost_lost_s": lost_both,
                     "alive_median_s": statistics.median(lost_alive), "lost_median_s": statistics.median(lost_both),
                     "longer_by_s": round(statistics.median(lost_both) - statistics.median(lost_alive), 3),
                     "recovery_s_alive": [round(e["recovery_s"], 3) for e in alive.of_kind("recovered")],
                     "recovery_s_coordinator_lost": [round(e["recovery_s"], 3) for e in both.of_kind("recovered")],
                     "takeovers": [{"missing": t["missing"], "stale_s": round(t["stale_s"], 3),
                                    "adopt_s": t["adopt_s"]} for t in both.of_kind("coordinator_took_over")],
                     "causes": [e["cause"] for e in both.of_kind("member_failed")]},
        "bitwise_identical": len(set(digests.values())) == 1,
        "digests": digests,
        "settings": {"hosts": WORKER_HOSTS, "slots": SLOTS, "standby_hosts": STANDBY_HOSTS, "steps": STEPS,
                     "kills": f"{kills} per run, {CUT_AFTER_S} s into training or after the previous recovery; the "
                              "worker holding rank 3 SIGKILLed from outside (at whatever phase), alone or right after "
                              "the coordinator",
                     "standby_coordinator": "started with --takeover before each kill, on its own agent port",
                     "lost_method": "the longest gap between rank 0's consecutive commits from its last one "
                                    "before the kill to 30 s after it, minus one steady step of the same run"},
    }


def format_coordinator_loss(r: dict[str, Any]) -> str:
    if "skipped" in r:
        return f"  coordinator loss across namespaces: skipped ({r['skipped']})"
    s, rec = r["steady"], r["recovery"]
    return (f"  coordinator SIGKILLed in steady training ({len(s['kills'])} kills): lost {s['lost_s_median']:.3f} s "
            f"median (target 0), outage {s['outage_s_median']:.2f} s, {s['member_failed']} members lost\n"
            f"  a worker SIGKILLed right after the coordinator: lost {rec['lost_median_s']:.3f} s median against "
            f"{rec['alive_median_s']:.3f} s with the coordinator alive (+{rec['longer_by_s']:.2f} s, target +5 s); "
            f"bit-exact {r['bitwise_identical']}")
