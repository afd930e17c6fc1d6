"""Peer: torchft 0.2.0 (per-step fault tolerance with a Lighthouse and live peer recovery).

This module owns the torchft baseline of the recovery benchmark: a Lighthouse on a free localhost port,
two replica groups of one process each, each with a ``Manager`` over a ``ProcessGroupGloo``. The loop
is torchft's DDP recipe written out by hand (its DDP wrapper crashed the healthy replica in some runs,
see FACTS.md): ``start_quorum()``, forward/backward into one flat gradient buffer,
``manager.allreduce(flat).wait()`` (sum, then divided by the number of participants),
``manager.should_commit()``, and only then ``optimizer.step(); scheduler.step()``. A replica that joins
late heals from a peer through the state_dict callbacks registered with the Manager (model, optimizer
and scheduler), over torchft's default HTTP checkpoint transport.

A fault SIGKILLs replica 1 at the start of a step; the runner (standing in for a scheduler) starts a
fresh replica 1 as soon as it sees the exit. The healthy replica keeps going alone once the Lighthouse
declares the dead one gone (heartbeat timeout), so the samples of the dead and the healing replica are
skipped: ``lost_time_torchft`` charges them at the clean run's throughput to compare at equal work.

Settings (torchft's README/documented defaults): Lighthouse ``--min_replicas 1 --quorum_tick_ms 100
--join_timeout_ms 10000`` (the README's command) and the default ``--heartbeat_timeout_ms 5000``;
Manager defaults (timeout 60 s, quorum_timeout 60 s, heartbeat_interval 100 ms, async quorum, HTTP
checkpoint transport), ``min_replica_size=1`` (as in its train_ddp example) and ``init_sync=False`` (its
docstring: set it when every replica seeds its weights identically, as ``build`` does);
``ProcessGroupGloo()`` with its default 60 s timeout.

Smoke check: ``python -m bench.peers.torchft_peer --quick`` prints the result as JSON.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.peers.common import (
    PeerError,
    ProcessSet,
    attach_flat_grads,
    check_flat_grads,
    fast_exit,
    free_port,
    read_step_log,
    rounded,
    run_dir,
    state_digest,
    steady_step_s,
    step_durations,
    wait_all,
    wait_for_file,
    wait_for_port,
    worker_argv,
    worker_env,
    write_json_atomic,
)
from bench.peers.script import parse_peer_args, peer_parser, start_worker
from bench.workload import WorkloadSpec, batch, build, loss_fn

MODULE = "bench.peers.torchft_peer"
REPLICAS = 2

LIGHTHOUSE_ARGS = {"min_replicas": 1, "quorum_tick_ms": 100, "join_timeout_ms": 10000}
"""The Lighthouse command of torchft's README."""

DEFAULT_HEARTBEAT_TIMEOUT_MS = 5000
"""torchft_lighthouse's default ``--heartbeat_timeout_ms``."""

MIN_REPLICA_SIZE = 1


class LighthouseUnavailable(PeerError):
    """The Lighthouse could not be found or did not start."""


def settings(heartbeat_timeout_ms: int) -> dict[str, Any]:
    return {
        "torchft_version": _torchft_version(),
        "lighthouse": {**LIGHTHOUSE_ARGS, "heartbeat_timeout_ms": heartbeat_timeout_ms},
        "manager": {
            "min_replica_size": MIN_REPLICA_SIZE,
            "init_sync": False,
            "use_async_quorum": True,
            "timeout_s": 60,
            "quorum_timeout_s": 60,
            "heartbeat_interval_ms": 100,
            "checkpoint_transport": "HTTPTransport (default)",
        },
        "process_group": "ProcessGroupGloo(timeout=60 s, default)",
        "gradient_exchange": "manager.allreduce(flat_grads).wait() by hand, then should_commit()",
        "replica_groups": REPLICAS,
        "processes_per_replica_group": 1,
    }


def _torchft_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("torchft")
    except Exception:
        return None


# ----------------------------------------------------------------------------------------- runner


def _lighthouse_argv(port: int, heartbeat_timeout_ms: int) -> list[str]:
    """The ``torchft_lighthouse`` binary next to this interpreter (or on PATH)."""
    binary = Path(sys.executable).with_name("torchft_lighthouse")
    found = str(binary) if binary.exists() else shutil.which("torchft_lighthouse")
    if found is None:
        raise LighthouseUnavailable("torchft_lighthouse binary not found")
    return [
        found,
        "--bind",
        f"127.0.0.1:{port}",
        "--min_replicas",
        str(LIGHTHOUSE_ARGS["min_replicas"]),
        "--quorum_tick_ms",
        str(LIGHTHOUSE_ARGS["quorum_tick_ms"]),
        "--join_timeout_ms",
        str(LIGHTHOUSE_ARGS["join_timeout_ms"]),
        "--heartbeat_timeout_ms",
        str(heartbeat_timeout_ms),
    ]


def _run(
    spec: WorkloadSpec, steps: int, kill_step: int | None, heartbeat_timeout_ms: int, timeout_s: float
) -> dict[str, Any]:
    """One torchft job; raw timelines in absolute wall-clock time."""
    with run_dir("torchft") as d, ProcessSet(d) as ps:
        port = free_port()
        env0 = worker_env(spec, {}, ps.pid_dir)
        lighthouse = ps.start("lighthouse", _lighthouse_argv(port, heartbeat_timeout_ms), env0)
        try:
            wait_for_port(port, 30.0, lighthouse)
        except PeerError as e:
            raise LighthouseUnavailable(f"lighthouse did not start: {e}") from e

        def start(replica: int, attempt: int) -> subprocess.Popen[bytes]:
            env = worker_env(
                spec,
                {
                    "TM_FT_DIR": str(d),
                    "TM_FT_LIGHTHOUSE": f"http://127.0.0.1:{port}",
                    "TM_FT_REPLICA": str(replica),
                    "TM_FT_ATTEMPT": str(attempt),
                    "TM_FT_STEPS": str(steps),
                    "TM_FT_KILL_STEP": "" if kill_step is None else str(kill_step),
                },
                ps.pid_dir,
            )
            return ps.start(f"replica{replica}_a{attempt}", worker_argv(MODULE), env)

        deadline = time.monotonic() + timeout_s
        t_launch = time.time()
        r0 = start(0, 0)
        r1 = start(1, 0)
        t_restart = None
        logs = [d / "replica0_a0.log", d / "replica1_a0.log"]
        if kill_step is not None:
            # Stand in for a scheduler: restart the replica the moment its exit is seen. Poll (2 ms)
            # rather than Popen.wait(timeout), whose internal back-off sleeps up to 50 ms, and watch
            # the healthy replica meanwhile so that its crash fails the run at once.
            while (rc := r1.poll()) is None:
                if r0.poll() is not None:
                    raise PeerError(f"replica 0 exited ({r0.returncode}) before replica 1 was killed")
                if time.monotonic() > deadline:
                    raise PeerError("replica 1 was not killed in time")
                time.sleep(0.002)
            t_exit_seen = time.time()
            if rc != -signal.SIGKILL:
                raise PeerError(f"replica 1 exited with {rc}, not by SIGKILL")
            t_restart = time.time()
            r1 = start(1, 1)
            logs.append(d / "replica1_a1.log")
        wait_all([r0, r1], max(1.0, deadline - time.monotonic()), logs)
        out: dict[str, Any] = {
            "t_launch": t_launch,
            # Training start: the start gate opened (both replicas built and heartbeating). Walls count
            # from here: launch-to-start varies by about a second between identical launches.
            "t_start": max(
                float(json.loads((d / f"ready_rep{r}_a0.json").read_text())["t_ready"]) for r in range(REPLICAS)
            ),
            "r0": read_step_log(d / "steps_rep0_a0.log"),
            "result0": json.loads((d / "result_rep0.json").read_text()),
            "result1": json.loads((d / "result_rep1.json").read_text()),
        }
        if kill_step is not None:
            out["kill"] = json.loads((d / "kill.json").read_text())
            out["t_exit_seen"] = t_exit_seen
            out["t_restart"] = t_restart
            out["r1b"] = read_step_log(d / "steps_rep1_a1.log")
            out["r1b_ready"] = json.loads((d / "ready_rep1_a1.json").read_text())
        return out


def _commits(rows: list[list[float]]) -> list[list[float]]:
    """Committed steps of a step log (rows: step, time, participants, participating, committed)."""
    return [r for r in rows if int(r[4]) == 1]


def lost_time_torchft(
    spec: WorkloadSpec,
    steps: int,
    kill_step: int,
    heartbeat_timeout_ms: int = DEFAULT_HEARTBEAT_TIMEOUT_MS,
    timeout_s: float | None = None,
    kills: int = 1,
) -> dict[str, Any]:
    """A clean torchft run and ``kills`` runs where replica 1 is SIGKILLed at ``kill_step`` and restarted.

    Each kill's ``lost_time_s`` = (wall(killed) - wall(clean)) + skipped_samples / clean throughput, where walls
    run from training start (both replicas ready) to the healthy replica's commit of the last step, and
    ``skipped_samples`` are the samples replica 1 did not contribute (steps replica 0 committed with fewer
    than 2 participants, x batch size); the clean throughput is 2 x batch_size / its steady step time. The
    healthy replica's state therefore differs from the clean run's (``bitwise_identical``). One kill per job:
    a job goes on with one replica until the replacement heals, so kills in one job would overlap. Summary
    values are medians over the kills; ``kills`` holds each.
    """
    if not 1 <= kill_step <= steps:
        raise ValueError(f"kill_step {kill_step} outside 1..{steps}")
    if kills < 1:
        raise ValueError(f"kills must be at least 1, got {kills}")
    try:
        import torchft  # noqa: F401
    except Exception as e:  # not installed, or broken against this torch
        return {"available": False, "reason": f"import torchft failed: {e}"}
    if timeout_s is None:
        size = spec.width * spec.width * spec.depth
        timeout_s = 120.0 + (2.0 if size > 20_000_000 else 0.5) * steps + 3 * heartbeat_timeout_ms / 1000
    try:
        clean = _run(spec, steps, None, heartbeat_timeout_ms, timeout_s)
        killed_runs = [_run(spec, steps, kill_step, heartbeat_timeout_ms, timeout_s) for _ in range(kills)]
    except LighthouseUnavailable as e:
        return {"available": False, "reason": str(e)}

    clean_commits = _commits(clean["r0"])
    clean_times = [r[1] for r in clean_commits]
    step_s = steady_step_s(clean_times)
    wall_clean = clean_times[-1] - clean["t_start"]
    samples_per_s = REPLICAS * spec.batch_size / step_s
    clean_skipped = sum((REPLICAS - int(r[2])) * spec.batch_size for r in clean_commits)
    each = [_kill_result(killed, kill_step, spec.batch_size, wall_clean, samples_per_s, step_s,
                         clean["result0"]["digest"]) for killed in killed_runs]
    keys = ("lost_time_s", "stall_s", "skipped_samples_charge_s", "incident_s")
    summary = {k: statistics.median(float(e[k]) for e in each) for k in keys}

    return rounded(
        {
            "available": True,
            **summary,
            "lost_time_s_each": [e["lost_time_s"] for e in each],
            "wall_clean_s": wall_clean,
            "clean_samples_per_s": samples_per_s,
            "clean_skipped_samples": clean_skipped,
            "step_s": step_s,
            "bitwise_identical": all(e["bitwise_identical"] for e in each),
            "clean_replicas_agree": clean["result0"]["digest"] == clean["result1"]["digest"],
            "replacement_rejoined": all(e["replacement_rejoined"] for e in each),
            "kills": [rounded(e) for e in each],
            "digest_clean": clean["result0"]["digest"],
            "steps": steps,
            "kill_step": kill_step,
            "lost_time_method": "per kill (one killed job each): wall(killed) - wall(clean) from training start, "
            "plus the samples replica 1 did not contribute at the clean throughput; summary values are medians",
            "settings": settings(heartbeat_timeout_ms),
        }
    )


def _kill_result(
    killed: dict[str, Any],
    kill_step: int,
    batch_size: int,
    wall_clean: float,
    samples_per_s: float,
    step_s: float,
    clean_digest: str,
) -> dict[str, Any]:
    """The cost of one kill (one killed job), against the clean job's wall and throughput."""
    k_commits = _commits(killed["r0"])
    wall_killed = k_commits[-1][1] - killed["t_start"]
    skipped = sum((REPLICAS - int(r[2])) * batch_size for r in k_commits)
    t_kill = float(killed["kill"]["t_kill"])
    # The incident, seen by the healthy replica: from its last commit before the kill to its first
    # commit with both replicas participating again; its longest step in there is the stall.
    # By step number, not time: the healthy replica may log its commit of the step before the kill a
    # moment after the victim took its kill timestamp.
    before = [r for r in k_commits if int(r[0]) < kill_step]
    t_prev = before[-1][1] if before else killed["t_start"]
    after = [r for r in k_commits if int(r[0]) >= kill_step]
    back = next((i for i, r in enumerate(after) if int(r[2]) == REPLICAS), len(after) - 1)
    incident = [t_prev] + [r[1] for r in after[: back + 1]]
    gaps = step_durations(incident)
    failed = [r for r in killed["r0"] if int(r[4]) == 0 and int(r[0]) >= kill_step - 1]
    first_alone = next((r for r in after if int(r[2]) < REPLICAS), None)
    r1b_commits = _commits(killed["r1b"])
    rejoined = next((r for r in r1b_commits if int(r[3]) == 1), None)
    healed = r1b_commits[0] if r1b_commits else None
    t_restart = float(killed["t_restart"])
    return {
        "lost_time_s": (wall_killed - wall_clean) + skipped / samples_per_s,
        "wall_killed_s": wall_killed,
        "skipped_samples": skipped,
        "skipped_samples_charge_s": skipped / samples_per_s,
        "stall_s": (max(gaps) if gaps else 0.0) - step_s,
        "incident_s": incident[-1] - t_kill,
        "steps_committed_alone": sum(1 for r in k_commits if int(r[2]) < REPLICAS),
        "failed_steps_healthy": len(failed),
        "error_seen_s": (failed[0][1] - t_kill) if failed else None,
        "kill_to_first_commit_s": (after[0][1] - t_kill) if after else None,
        "first_commit_alone_s": (first_alone[1] - t_kill) if first_alone else None,
        "exit_seen_s": float(killed["t_exit_seen"]) - t_kill,
        "restart_to_ready_s": float(killed["r1b_ready"]["t_ready"]) - t_restart,
        "heal_s": (healed[1] - t_restart) if healed else None,
        "rejoin_s": (rejoined[1] - t_restart) if rejoined else None,
        "bitwise_identical": killed["result0"]["digest"] == clean_digest,
        "replacement_rejoined": bool(killed["result1"]["rejoined"]),
        "killed_replicas_agree": killed["result0"]["digest"] == killed["result1"]["digest"],
    }


# ----------------------------------------------------------------------------------------- worker


def _worker() -> None:
    start_worker()
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo

    spec = WorkloadSpec.from_env()
    d = Path(os.environ["TM_FT_DIR"])
    replica = int(os.environ["TM_FT_REPLICA"])
    attempt = int(os.environ["TM_FT_ATTEMPT"])
    steps = int(os.environ["TM_FT_STEPS"])
    kill_raw = os.environ.get("TM_FT_KILL_STEP", "")
    kill_step = int(kill_raw) if kill_raw else -1

    model, optimizer, scheduler = build(spec)
    flats = attach_flat_grads(model)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": optimizer.state_dict(), "sched": scheduler.state_dict()}

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        optimizer.load_state_dict(sd["optim"])
        scheduler.load_state_dict(sd["sched"])

    # Each replica group (one process here) needs its own TCPStore for the Manager; torchrun would
    # host it, we host it in-process.
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=MIN_REPLICA_SIZE,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=os.environ["TM_FT_LIGHTHOUSE"],
        replica_id=f"bench_{replica}",
        init_sync=False,
    )
    write_json_atomic(d / f"ready_rep{replica}_a{attempt}.json", {"t_ready": time.time()})
    if attempt == 0:
        # Start gate: both managers heartbeat before either asks for a quorum, so the Lighthouse waits
        # for both and the first step has both replicas (else the first to arrive starts alone).
        wait_for_file(d / f"ready_rep{1 - replica}_a0.json", 120.0, what="the other replica")
    steplog = open(d / f"steps_rep{replica}_a{attempt}.log", "a", buffering=1)  # noqa: SIM115
    first = True
    rejoined = attempt == 0
    while manager.current_step() < steps:
        if not rejoined and (d / "result_rep0.json").exists():
            # The healthy replica finished before this replacement got into a quorum: stop rather than
            # train on alone from a stale state once the Lighthouse forgets the finished peer.
            break
        step = manager.current_step() + 1
        if attempt == 0 and replica == 1 and step == kill_step:
            write_json_atomic(d / "kill.json", {"t_kill": time.time(), "step": step})
            os.kill(os.getpid(), signal.SIGKILL)
        manager.start_quorum()
        for flat in flats:
            flat.zero_()
        loss_fn(model, batch(spec, step, replica)).backward()
        if first:
            check_flat_grads(model, flats)
            first = False
        for flat in flats:
            manager.allreduce(flat).wait()  # averages over participants; errors are reported, not raised
        participants = manager.num_participants()
        participating = manager.is_participating()  # False while healing: our gradient was zeroed
        committed = manager.should_commit()  # applies a peer's state first when healing
        rejoined = rejoined or (committed and participating)
        if committed:
            optimizer.step()
            scheduler.step()
        steplog.write(f"{manager.current_step()} {time.time()} {participants} {int(participating)} {int(committed)}\n")
    steplog.close()
    write_json_atomic(
        d / f"result_rep{replica}.json",
        {"digest": state_digest(model, optimizer), "step": manager.current_step(), "rejoined": rejoined},
    )
    manager.shutdown(wait=False)
    fast_exit()


def main(argv: list[str] | None = None) -> None:
    parser = peer_parser(__doc__, "small model, 25 steps")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--kill-step", type=int, default=None)
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=DEFAULT_HEARTBEAT_TIMEOUT_MS)
    args = parse_peer_args(parser, argv, _worker)
    if args is None:
        return
    spec = WorkloadSpec.quick() if args.quick else WorkloadSpec.full()
    # The kill comes early so that, after the Lighthouse's heartbeat timeout and the replacement's cold
    # start (seconds), the healthy replica still has steps left for the replacement to rejoin.
    steps = args.steps or (25 if args.quick else 30)
    kill_step = args.kill_step or 5
    result = lost_time_torchft(spec, steps, kill_step, args.heartbeat_timeout_ms)
    json.dump(result, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
