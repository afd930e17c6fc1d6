"""The communicator on its own: two real processes, a Gloo group over a TCPStore, a failed build, then a good one."""

from __future__ import annotations

import multiprocessing as mp
import socket
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _member(rank: int, port: int, out: Any) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from runtime.comm import CommFailure, Communicator

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=30))
    comm = Communicator("gloo", store, timeout_s=30.0, device=torch.device("cpu"))
    if rank == 0:
        # Generation 0 never forms: its other member is gone before connecting (here: never comes).
        try:
            comm.build(0, rank=0, world_size=2, connect_timeout_s=1.0)
            out.put((rank, "generation 0 formed without its other member"))
            return
        except CommFailure:
            store.set("gen0-failed", "1")
    else:
        store.wait(["gen0-failed"], datetime.timedelta(seconds=30))  # a replacement that joins afterwards
    try:
        comm.build(1, rank=rank, world_size=2, connect_timeout_s=15.0)
    except CommFailure as exc:
        out.put((rank, str(exc)))
        return
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    comm.teardown()
    out.put((rank, float(t.item())))


def test_a_member_whose_last_build_failed_joins_the_next_generation_with_a_newcomer() -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_member, args=(rank, port, out)) for rank in (0, 1)]
    for p in procs:
        p.start()
    try:
        results = dict(out.get(timeout=90) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    # Both sum 1 + 2: the survivor of the failed build and the newcomer built the same group.
    assert results == {0: 3.0, 1: 3.0}
