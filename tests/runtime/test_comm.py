"""The communicator on its own: two real processes, a Gloo group over a TCPStore, a failed build, then a good one."""

from __future__ import annotations

import multiprocessing as mp
import socket
from collections.abc import Callable
from typing import Any

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _member(rank: int, port: int, out: Any) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from runtime.training.comm import CommFailure, Communicator

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


def _run_pair(member: Callable[[int, int, Any], None], timeout_s: float) -> dict[int, Any]:
    """Run `member(rank, port, out)` as ranks 0 and 1 in fresh processes; what each put in `out`, by rank."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=member, args=(rank, port, out)) for rank in (0, 1)]
    for p in procs:
        p.start()
    try:
        return dict(out.get(timeout=timeout_s) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def test_a_member_whose_last_build_failed_joins_the_next_generation_with_a_newcomer() -> None:
    results = _run_pair(_member, 90)
    # Both sum 1 + 2: the survivor of the failed build and the newcomer built the same group.
    assert results == {0: 3.0, 1: 3.0}


def _stuck_member(rank: int, port: int, out: Any) -> None:
    import datetime
    import time

    import torch
    import torch.distributed as dist

    from runtime.training.comm import Communicator

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
    newest = [1]
    comm = Communicator("gloo", store, timeout_s=60.0, device=torch.device("cpu"), newest_gen=lambda: newest[0])
    comm.build(1, rank=rank, world_size=2, connect_timeout_s=30.0)
    if rank == 1:  # alive and connected, but never joins the collective: rank 0's receive waits on a live socket
        store.wait(["rank0-done"], datetime.timedelta(seconds=60))
        out.put((1, "left"))
        return
    work = dist.all_reduce(torch.ones(4), async_op=True)
    newest[0] = 2  # a newer generation forms (here: at once)
    t0 = time.monotonic()
    message = comm.wait([work])
    waited = time.monotonic() - t0
    t0 = time.monotonic()
    comm.teardown()  # must not wait for the stuck thread (rank 1 holds its socket open for up to a minute)
    torn = time.monotonic() - t0
    comm.build(2, rank=0, world_size=1, connect_timeout_s=30.0)  # the next generation's group works
    t = torch.tensor([5.0])
    dist.all_reduce(t)
    store.set("rank0-done", "1")
    out.put((0, (message, waited, torn, float(t.item()), comm.abandoned)))


def test_a_collective_stuck_in_a_replaced_group_is_abandoned_and_the_next_group_works() -> None:
    """A Gloo receive posted after its peer's connection failed can wait the whole collective timeout: the
    survivor abandons it once a newer generation exists, without destroying the group (that would join the
    stuck thread), and builds the next generation's group at once."""
    results = _run_pair(_stuck_member, 120)
    message, waited, torn, total, abandoned = results[0]
    assert message is not None and "abandoned" in message and abandoned == 1
    assert waited < 30, "abandoned after the grace, not at the collective timeout"
    assert torn < 20, "the replaced group was left to its stuck thread, not destroyed (which waits for it)"
    assert total == 5.0 and results[1] == "left"


def _published_then_killed(port: int) -> None:
    """Rank 1 of generation 0 as Gloo builds it: it publishes its address, then waits for rank 0's (and is killed
    there by the test). Its address is the highest on loopback, so rank 0 is the side that waits to be connected."""
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=60))
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.255.255.254")]
    options._timeout = datetime.timedelta(seconds=60)
    # The prefixes init_process_group puts before Gloo's keys in the generation's store.
    dist.ProcessGroupGloo(dist.PrefixStore("cpu/", dist.PrefixStore("0/", dist.PrefixStore("g0", store))), 1, 2,
                          options)


def _kill_once_published(store: Any, peer: Any) -> None:
    """Wait (bounded) until `peer` (`_published_then_killed`, a process) has published its address in `store`, then
    kill it there."""
    import os
    import signal
    import time

    deadline = time.monotonic() + 60
    while not store.check(["g0/0//cpu//0/1"]):  # its address, published
        assert peer.is_alive() and time.monotonic() < deadline, "the peer never published its address"
        time.sleep(0.02)
    os.kill(peer.pid, signal.SIGKILL)
    peer.join(timeout=30)


def test_a_member_lost_after_publishing_its_address_holds_the_build_for_the_connect_timeout_at_most(
    monkeypatch: Any,
) -> None:
    """The side of a Gloo connection that waits to be connected waits five times the group's timeout: a member killed
    between publishing its address and connecting held its peers 150 s with a 30 s connect timeout. The build is
    bounded by the connect timeout itself."""
    import datetime
    import time

    import pytest
    import torch
    import torch.distributed as dist

    from runtime.training.comm import CommFailure, Communicator

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # this rank listens on 127.0.0.1, below its peer's address
    port = _free_port()
    store = dist.TCPStore("127.0.0.1", port, 2, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    peer = mp.get_context("spawn").Process(target=_published_then_killed, args=(port,))
    peer.start()
    try:
        _kill_once_published(store, peer)
        comm = Communicator("gloo", store, timeout_s=600.0, device=torch.device("cpu"))
        t0 = time.monotonic()
        with pytest.raises(CommFailure, match="Connect timeout"):
            comm.build(0, rank=0, world_size=2, connect_timeout_s=5.0)
        waited = time.monotonic() - t0
    finally:
        if peer.is_alive():
            peer.kill()
    # Five times the connect timeout (25 s) before; the connect timeout (5 s) now.
    assert waited < 15, f"the build waited {waited:.1f} s"


class _Work:
    """A Work whose wait(timeout) times out `slow` times, then completes (or fails)."""

    def __init__(self, slow: int, fails: bool = False) -> None:
        self.slow, self.fails, self.waits = slow, fails, 0

    def wait(self, timeout: Any = None) -> bool:
        self.waits += 1
        if self.waits <= self.slow:
            raise RuntimeError("Operation timed out!")
        if self.fails:
            raise RuntimeError("Connection closed by peer")
        return True

    def is_completed(self) -> bool:
        return self.waits > self.slow


def test_wait_keeps_waiting_on_a_slow_step_fails_on_a_lost_peer_and_abandons_only_a_replaced_group(
    monkeypatch: Any,
) -> None:
    import pytest
    import torch

    from runtime.training import comm as comm_module
    from runtime.training.comm import Communicator

    monkeypatch.setattr(comm_module, "STALE_GRACE_S", 0.0)
    newest = [3]
    comm = Communicator("gloo", store=None, timeout_s=60.0, device=torch.device("cpu"),  # type: ignore[arg-type]
                        newest_gen=lambda: newest[0])
    comm.gen = 3
    slow = _Work(slow=5)
    assert comm.wait([slow]) is None and slow.waits == 6, "nothing newer: a slow collective is waited for"
    with pytest.raises(RuntimeError, match="closed by peer"):
        comm.wait([_Work(slow=2, fails=True)])
    newest[0] = 4
    stuck = _Work(slow=10**9)
    message = comm.wait([_Work(slow=0), stuck])
    assert message is not None and "generation 3" in message and "generation 4" in message
    assert comm.abandoned == 1 and comm._stuck and stuck.waits <= 2


@pytest.mark.parametrize("peer", ["published-then-killed", "never-came"])
def test_a_build_a_newer_generation_replaced_ends_at_once_whichever_wait_holds_it(monkeypatch: Any,
                                                                                  peer: str) -> None:
    """A member lost while its peers connect holds them in Gloo: waiting to be connected (it published its address
    and died: five times the group's timeout) or waiting for its address in the store (it never published it: the
    group's timeout). Once a newer generation forms, the heartbeat thread ends either wait at once
    (`Connecting.abandon`), instead of the 30 s the connect timeout allows."""
    import datetime
    import threading
    import time

    import torch
    import torch.distributed as dist

    from runtime.training.comm import CommFailure, Communicator

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # this rank listens on 127.0.0.1, below its peer's address
    port = _free_port()
    store = dist.TCPStore("127.0.0.1", port, 2, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    proc = None
    if peer == "published-then-killed":
        proc = mp.get_context("spawn").Process(target=_published_then_killed, args=(port,))
        proc.start()
    try:
        if proc is not None:
            _kill_once_published(store, proc)
        newest = [0]
        comm = Communicator("gloo", store, timeout_s=600.0, device=torch.device("cpu"), newest_gen=lambda: newest[0])

        def heartbeat() -> None:  # what the heartbeat thread does when generation 1 forms, once rank 0 is waiting
            deadline = time.monotonic() + 60
            while not store.check(["g0/0//cpu//0/0"]) and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.3)  # rank 0 is now inside one of the waits (not a synchronisation: either wait is ended)
            newest[0] = 1
            comm.cut_if_older(1)

        beat = threading.Thread(target=heartbeat, daemon=True)
        beat.start()
        t0 = time.monotonic()
        with pytest.raises(CommFailure, match="superseded"):
            comm.build(0, rank=0, world_size=2, connect_timeout_s=30.0)
        waited = time.monotonic() - t0
        beat.join(timeout=10)
    finally:
        if proc is not None and proc.is_alive():
            proc.kill()
    # Before: 30 s (published, then killed) or 6 s (never came). Now: the moment generation 1 formed.
    assert waited < 5, f"the build waited {waited:.1f} s"


def test_a_sharded_jobs_groups_still_connecting_when_a_newer_generation_forms_are_abandoned_at_once() -> None:
    """The same for a sharded job's mesh groups (`GroupSet.enter`): rank 0 of a two-rank data-parallel mesh waits
    for a peer that never comes; generation 1 forms (`GroupSet.abandon_older`, from the heartbeat thread) and the
    building fails at once, instead of after the group's timeout (6 s for a 30 s connect timeout)."""
    import datetime
    import threading
    import time

    import torch.distributed as dist

    from runtime.training.comm import CommFailure
    from runtime.training.groups import GroupSet

    port = _free_port()
    store = dist.TCPStore("127.0.0.1", port, 2, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    newest = [0]
    groups = GroupSet("gloo", store, timeout_s=600.0, newest_gen=lambda: newest[0])
    before = store.num_keys()

    def heartbeat() -> None:  # once rank 0 has published its address, generation 1 forms
        deadline = time.monotonic() + 60
        while store.num_keys() == before and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # rank 0 now waits for its peer's address (not a synchronisation: the wait is ended either way)
        newest[0] = 1
        groups.abandon_older(1)

    beat = threading.Thread(target=heartbeat, daemon=True)
    beat.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(CommFailure, match="superseded"):
            groups.enter(0, 0, 2, (2,), ("dp",), {}, connect_timeout_s=30.0)
        waited = time.monotonic() - t0
    finally:
        beat.join(timeout=10)
        groups.close()
    assert waited < 5, f"the building waited {waited:.1f} s"
