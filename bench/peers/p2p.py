"""Peer reference: point-to-point bandwidth between two processes over Gloo send/recv.

This module owns ``measure_p2p_bandwidth``: the rate at which one process can hand a buffer of a given
size to another over the same transport the training uses (Gloo over loopback TCP), i.e. the ceiling of
any state handoff between processes on this machine.

Method: two workers (env rendezvous). Each repetition: barrier; rank 0 starts its clock, sends ``nbytes``
and waits for a 1-byte acknowledgement from rank 1 (sent after its ``recv`` completed), then stops its
clock. The acknowledgement makes the time cover delivery, not just the local send; it adds one small
round trip (tens of microseconds) to a transfer of hundreds of milliseconds. One untimed warm-up
repetition first (first-touch of the buffers). The returned figure is the MEDIAN over repetitions;
``measure_p2p`` also reports the best and every repetition.

Smoke check: ``python -m bench.peers.p2p --quick`` prints the result as JSON.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bench.peers.common import (
    ProcessSet,
    free_port,
    read_json,
    rounded,
    run_dir,
    wait_all,
    worker_argv,
    worker_env,
    write_json_atomic,
)
from bench.peers.script import end_worker, parse_peer_args, peer_parser, start_worker
from bench.workload import WorkloadSpec

MODULE = "bench.peers.p2p"


def measure_p2p(nbytes: int, reps: int = 5, timeout_s: float = 120.0) -> dict[str, Any]:
    """Send ``nbytes`` from rank 0 to rank 1 ``reps`` times; bandwidths in bytes/s (median, best, each)."""
    port = free_port()
    with run_dir("p2p") as d, ProcessSet(d) as ps:
        result_path = d / "result.json"
        procs = []
        for rank in range(2):
            env = worker_env(
                WorkloadSpec.quick(),  # unused by the worker; keeps the environment uniform
                {
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                    "RANK": str(rank),
                    "WORLD_SIZE": "2",
                    "TM_P2P_BYTES": str(nbytes),
                    "TM_P2P_REPS": str(reps),
                    "TM_P2P_RESULT": str(result_path),
                },
                ps.pid_dir,
            )
            procs.append(ps.start(f"rank{rank}", worker_argv(MODULE), env))
        wait_all(procs, timeout_s, [d / "rank0.log", d / "rank1.log"])
        seconds: list[float] = read_json(result_path)["seconds"]
    rates = [nbytes / s for s in seconds]
    return rounded(
        {
            "nbytes": nbytes,
            "bytes_per_s": statistics.median(rates),
            "statistic": "median",
            "best_bytes_per_s": max(rates),
            "reps": reps,
            "seconds_each": seconds,
        },
        6,
    )


def measure_p2p_bandwidth(nbytes: int) -> float:
    """Bytes/s of a Gloo send/recv of ``nbytes`` between two processes: the MEDIAN of 5 repetitions."""
    return float(measure_p2p(nbytes)["bytes_per_s"])


def _worker() -> None:
    start_worker()
    rank = int(os.environ["RANK"])
    nbytes = int(os.environ["TM_P2P_BYTES"])
    reps = int(os.environ["TM_P2P_REPS"])
    dist.init_process_group("gloo")
    buf = torch.ones(nbytes, dtype=torch.uint8) if rank == 0 else torch.zeros(nbytes, dtype=torch.uint8)
    ack = torch.zeros(1, dtype=torch.uint8)
    seconds: list[float] = []
    for rep in range(reps + 1):
        dist.barrier()
        if rank == 0:
            t0 = time.perf_counter()
            dist.send(buf, dst=1)
            dist.recv(ack, src=1)
            if rep > 0:  # repetition 0 is the warm-up
                seconds.append(time.perf_counter() - t0)
        else:
            dist.recv(buf, src=0)
            dist.send(ack, dst=0)
    if rank == 1 and int(buf[-1]) != 1:
        raise RuntimeError("received buffer does not hold what was sent")
    if rank == 0:
        write_json_atomic(Path(os.environ["TM_P2P_RESULT"]), {"seconds": seconds})
    end_worker()


def main(argv: list[str] | None = None) -> None:
    parser = peer_parser(__doc__, "64 MiB instead of the full state size")
    parser.add_argument("--nbytes", type=int, default=None)
    args = parse_peer_args(parser, argv, _worker)
    if args is None:
        return
    # Full: about the size of the full workload's model + AdamW state (630 MB).
    nbytes = args.nbytes or (64 << 20 if args.quick else 630_000_000)
    json.dump(measure_p2p(nbytes), sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
