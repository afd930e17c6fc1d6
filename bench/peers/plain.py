"""Peer: plain data-parallel training with no fault tolerance, the baseline of the overhead measurement.

This module owns ``run_plain``: ``nproc`` worker processes rendezvous through environment variables
(``init_process_group("gloo")``, env://), and every step does forward/backward into one flat gradient
buffer, one all-reduce (sum) per dtype, a division by the world size, ``optimizer.step()`` and
``scheduler.step()``. Nothing else runs in the loop (no I/O, no extra collective, no timing sync): each
worker keeps its per-step timestamps in memory and rank 0 writes them with the final state digest once
training is over.

Smoke check: ``python -m bench.peers.plain --quick`` prints the result as JSON.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from bench.peers.common import (
    ProcessSet,
    attach_flat_grads,
    check_flat_grads,
    free_port,
    read_json,
    rounded,
    run_dir,
    state_digest,
    steady_step_s,
    wait_all,
    worker_argv,
    worker_env,
    write_json_atomic,
)
from bench.peers.script import end_worker, parse_peer_args, peer_parser, start_worker
from bench.workload import WorkloadSpec, batch, build, loss_fn

MODULE = "bench.peers.plain"


def run_plain(spec: WorkloadSpec, steps: int, nproc: int = 2, timeout_s: float | None = None) -> dict[str, Any]:
    """Train ``steps`` steps with ``nproc`` plain Gloo workers.

    Returns ``wall_s`` (launch to the end of the last step on rank 0, so process start-up is included),
    ``train_s`` (first step start to last step end), ``step_s`` (median step after the first 3),
    ``steps_per_s`` (1 / step_s) and ``digest`` (rank 0's state digest after the last step).
    """
    if timeout_s is None:
        # Generous: start-up (seconds) plus a full-size step (about a second) per step.
        timeout_s = 60.0 + 3.0 * steps
    port = free_port()
    with run_dir("plain") as d, ProcessSet(d) as ps:
        result_path = d / "result.json"
        t_launch = time.time()
        procs = []
        for rank in range(nproc):
            env = worker_env(
                spec,
                {
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                    "RANK": str(rank),
                    "WORLD_SIZE": str(nproc),
                    "TM_PLAIN_STEPS": str(steps),
                    "TM_PLAIN_RESULT": str(result_path),
                },
                ps.pid_dir,
            )
            procs.append(ps.start(f"rank{rank}", worker_argv(MODULE), env))
        wait_all(procs, timeout_s, [d / f"rank{r}.log" for r in range(nproc)])
        res = read_json(result_path)
    times: list[float] = res["step_times"]
    step_s = steady_step_s(times)
    return rounded(
        {
            "wall_s": times[-1] - t_launch,
            "train_s": times[-1] - res["t_train_start"],
            "step_s": step_s,
            "steps_per_s": 1.0 / step_s,
            "steps": steps,
            "nproc": nproc,
            "digest": res["digest"],
        }
    )


def _worker() -> None:
    start_worker()
    spec = WorkloadSpec.from_env()
    steps = int(os.environ["TM_PLAIN_STEPS"])
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    model, optimizer, scheduler = build(spec)
    flats = attach_flat_grads(model)
    times: list[float] = []
    t_train_start = time.time()
    for step in range(1, steps + 1):
        for flat in flats:
            flat.zero_()
        loss_fn(model, batch(spec, step, rank)).backward()
        if step == 1:
            check_flat_grads(model, flats)  # once: proves the exchange below covers every gradient
        for flat in flats:
            dist.all_reduce(flat)
            flat.div_(world)
        optimizer.step()
        scheduler.step()
        times.append(time.time())
    if rank == 0:
        write_json_atomic(
            Path(os.environ["TM_PLAIN_RESULT"]),
            {"step_times": times, "t_train_start": t_train_start, "digest": state_digest(model, optimizer)},
        )
    end_worker()


def main(argv: list[str] | None = None) -> None:
    parser = peer_parser(__doc__, "small model (WorkloadSpec.quick())")
    parser.add_argument("--steps", type=int, default=None, help="steps (default: 30 quick, 20 full)")
    args = parse_peer_args(parser, argv, _worker)
    if args is None:
        return
    spec = WorkloadSpec.quick() if args.quick else WorkloadSpec.full()
    steps = args.steps or (30 if args.quick else 20)
    json.dump(run_plain(spec, steps), sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
