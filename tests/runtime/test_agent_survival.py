"""An agent whose coordinator goes silent decides by the coordinator's lease in the job's store (runtime.host.survival):
in-process, a real agent (a thread) against scripted coordinators on loopback, a real store, real lease records.

- the lease keeps moving: the coordinator lives and this host is cut off from it: fence at once;
- the lease stands still: the coordinator is gone: the process keeps running, and the agent re-attaches, same
  incarnation, with it (and with the process that exited meanwhile) to the coordinator that takes the next epoch;
- the store does not answer: fence.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import socket
import threading
import time

import pytest
import torch.distributed as dist

from runtime.control.lease import Lease
from runtime.host.agent import Agent, AgentConfig
from runtime.wire.auth import Sealer, new_token
from runtime.wire.protocol import Hello, Link, Spawn, Started, Stop, Welcome, new_nonce, session_key

pytestmark = pytest.mark.timeout(60)
SLEEPER = ["-c", "import time; time.sleep(60)"]
BEAT_S, LEASE_S = 0.2, 0.6


class Coordinator:
    """One scripted coordinator: a listener on loopback that admits the agent and can order spawns."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(4)
        self.port = int(self.listener.getsockname()[1])
        self.conn: socket.socket | None = None
        self.link: Link | None = None

    def admit(self, epoch: int, store: str) -> Hello:
        self.listener.settimeout(20)
        self.conn, _ = self.listener.accept()
        self.link = Link(self.conn, "coordinator")
        hello, _ = self.link.recv(5)
        assert isinstance(hello, Hello)
        nonce = new_nonce()
        self.link.key = session_key(self.token, hello.nonce, nonce)
        self.link.send(Welcome(BEAT_S, LEASE_S, "job", store, epoch), {"cn": nonce})
        return hello

    def spawn(self, name: str, slot: int) -> int:
        assert self.link is not None and self.conn is not None
        self.link.send(Spawn(name, "worker", slot, SLEEPER, {}))
        self.conn.settimeout(5)
        while True:
            data = self.conn.recv(65536)
            assert data, "the agent hung up instead of starting the process"
            for msg, _ in self.link.feed(data):
                if isinstance(msg, Started):
                    assert msg.pid > 0, msg.error
                    return msg.pid

    def close(self) -> None:
        for s in (self.conn, self.listener):
            if s is not None:
                s.close()


class Job:
    """A store on loopback with the first coordinator's lease in it, and an agent in a thread."""

    def __init__(self) -> None:
        self.token = new_token()
        self.store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=5),
                                   wait_for_workers=False)
        self.address = f"127.0.0.1:{self.store.port}"
        self.first = Coordinator(self.token)
        self.lease = self._lease(self.first)
        self.lease.create()
        self.agent = Agent(AgentConfig(coordinator=f"127.0.0.1:{self.first.port}", slots=2, secret=self.token,
                                       name="hx", connect_timeout_s=10.0, fork_server=False, rejoin=False))
        self.thread = threading.Thread(target=self.agent.run, daemon=True)
        self.thread.start()

    def _lease(self, c: Coordinator) -> Lease:
        return Lease(self.store, Sealer(self.token, "coordinator"), f"127.0.0.1:{c.port}", clock=time.monotonic,
                     sleep=time.sleep, wall=time.time)

    def assert_fenced(self, pid: int, caplog: pytest.LogCaptureFixture, saying: str, timeout_s: float = 10.0) -> None:
        """Until the agent fenced its host once (bounded), logging `saying`; the process `pid` it ran is gone."""
        deadline = time.monotonic() + timeout_s
        with caplog.at_level(logging.INFO, logger="trainmover.agent"):
            while self.agent.fenced == 0 and time.monotonic() < deadline:
                time.sleep(0.02)  # polling another thread's counter, bounded
        assert self.agent.fenced == 1
        assert saying in caplog.text
        assert not _alive(pid)

    def close(self) -> None:
        self.first.close()
        self.thread.join(timeout=15)
        self.agent.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def test_a_silent_coordinator_that_still_renews_its_lease_gets_this_host_fenced(
        caplog: pytest.LogCaptureFixture) -> None:
    job = Job()
    stop = threading.Event()
    try:
        job.first.admit(1, job.address)
        pid = job.first.spawn("w0", 0)

        def renew() -> None:  # the coordinator lives: only this host's link to it is silent
            while not stop.wait(0.02):
                job.lease.renew()

        renewer = threading.Thread(target=renew, daemon=True)
        renewer.start()
        job.assert_fenced(pid, caplog, "still renews its lease: this host is cut off from it; fencing")
    finally:
        stop.set()
        job.close()


def test_a_coordinator_gone_leaves_the_process_training_and_the_agent_reattaches_to_the_next_epoch(
        caplog: pytest.LogCaptureFixture) -> None:
    job = Job()
    second = Coordinator(job.token)
    try:
        first_hello = job.first.admit(1, job.address)
        pid = job.first.spawn("w0", 0)
        lost = job.first.spawn("w1", 1)
        job.first.close()  # SIGKILLed: its link closes, its lease stands still
        os.kill(lost, signal.SIGKILL)  # a process exits while no coordinator runs
        with caplog.at_level(logging.INFO, logger="trainmover.agent"):
            taken = job._lease(second)
            taken.take_over(stale_s=LEASE_S, timeout_s=10.0)
            hello = second.admit(2, job.address)
        assert "is gone; 1 process(es) train on" in caplog.text or "is gone; 2 process(es) train on" in caplog.text
        assert hello.incarnation == first_hello.incarnation, "the same host, not a new one"
        live = [c for c in hello.children if len(c.split()) == 4]
        exited = [c.split() for c in hello.children if len(c.split()) == 6]
        assert live == [f"w0 worker 0 {pid}"] and _alive(pid), "w0 trained on"
        assert [e[:5] for e in exited] == [["w1", "worker", "1", str(lost), "-9"]]
        assert time.time() - 10 < float(exited[0][5]) <= time.time()
        assert job.agent.fenced == 0
        assert second.link is not None
        second.link.send(Stop(0))
        job.thread.join(timeout=15)
        assert not _alive(pid)
    finally:
        second.close()
        job.close()


def test_an_agent_that_cannot_reach_the_store_fences_at_once(caplog: pytest.LogCaptureFixture) -> None:
    job = Job()
    try:
        with socket.socket() as s:  # nothing listens there
            s.bind(("127.0.0.1", 0))
            nowhere = f"127.0.0.1:{s.getsockname()[1]}"
        job.first.admit(1, nowhere)
        pid = job.first.spawn("w0", 0)
        job.first.close()
        job.assert_fenced(pid, caplog, "the job's store does not answer: fencing this host")
    finally:
        job.close()
