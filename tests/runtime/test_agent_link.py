"""The agent link in-process: the protocol's frames, HostPool against real agents (threads) and raw outsiders."""

from __future__ import annotations

import os
import socket
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import TypeVar

import pytest

from runtime.control.hosts import HostPool, NoSlot
from runtime.host.agent import ORPHANED_EXIT, Agent, AgentConfig, AgentError
from runtime.wire.auth import new_token
from runtime.wire.event_records import AgentRefused, Event, HostLost
from runtime.wire.events import of_type
from runtime.wire.protocol import (
    VERSION,
    Beat,
    Fence,
    Hello,
    Link,
    ProtocolError,
    Spawn,
    Started,
    Welcome,
    decode,
    new_nonce,
    session_key,
    to_json,
)

E = TypeVar("E", bound=Event)


def _pair() -> tuple[Link, Link]:
    a, c = socket.socketpair()
    agent, coord = Link(a, "agent"), Link(c, "coordinator")
    agent.key = coord.key = session_key(new_token(), "a", "c")
    return agent, coord


def test_decode_refuses_other_versions_unknown_types_and_bad_fields() -> None:
    assert decode(to_json(Beat())) == Beat()
    with pytest.raises(ProtocolError, match="version"):
        decode({**to_json(Beat()), "v": VERSION + 1})
    with pytest.raises(ProtocolError, match="unknown message type"):
        decode({"v": VERSION, "t": "format_disk"})
    with pytest.raises(ProtocolError, match="slot"):
        decode({**to_json(Spawn("w0", "worker", 0, [], {})), "slot": "0"})
    with pytest.raises(ProtocolError, match="strings"):
        decode({**to_json(Spawn("w0", "worker", 0, [], {})), "env": {"A": 1}})
    with pytest.raises(ProtocolError, match="missing"):
        decode({"v": VERSION, "t": "started"})


def test_sealed_frames_refuse_tampering_replays_and_other_sessions() -> None:
    agent, coord = _pair()
    frame = agent.encode(Started("w0", 42))
    assert coord.feed(frame)[0][0] == Started("w0", 42)
    with pytest.raises(ProtocolError, match="sequence"):
        coord.feed(frame)  # the same frame again
    agent2, coord2 = _pair()
    tampered = bytearray(agent2.encode(Started("w0", 42)))
    tampered[tampered.index(b"42")] = ord("7")
    with pytest.raises(ProtocolError, match="sealed"):
        coord2.feed(bytes(tampered))
    _, coord3 = _pair()
    agent4, _ = _pair()
    with pytest.raises(ProtocolError, match="sealed"):
        coord3.feed(agent4.encode(Beat()))  # a valid frame of another session (another key)


def _agent(port: int, token: str, slots: int = 2, **kw: object) -> tuple[Agent, threading.Thread]:
    """A real agent in a thread; without a fork server (these tests start plain scripts, test_zygote forks)."""
    agent = Agent(AgentConfig(coordinator=f"127.0.0.1:{port}", slots=slots, secret=token, name="hx",
                              connect_timeout_s=5.0, **{"fork_server": False, **kw}))  # type: ignore[arg-type]
    t = threading.Thread(target=agent.run, daemon=True)
    t.start()
    return agent, t


def _events(pool: HostPool, kind: type[E], timeout_s: float = 10.0) -> list[E]:
    seen: list[E] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        seen += of_type(pool.take_events(), kind)
        if seen:
            return seen
        time.sleep(0.01)  # polling another thread's state
    raise AssertionError(f"no {kind} event within {timeout_s} s")


def test_a_real_agent_starts_kills_and_reports_and_its_death_loses_the_host(pool: tuple[HostPool, str],
                                                                              tmp_path: Path) -> None:
    p, token = pool
    script = tmp_path / "idle.py"
    script.write_text(textwrap.dedent("""
        import os, sys, time
        out = sys.argv[1] + "-" + os.environ["TM_PROC"]
        open(out + ".tmp", "w").write(os.environ["TM_JOB_TOKEN"] + " " + os.environ["LOCAL_RANK"])
        os.rename(out + ".tmp", out)
        time.sleep(60)
    """))
    p.argv = [str(script), str(tmp_path / "seen")]
    agent, thread = _agent(p.port, token, rejoin=False)
    p.wait_for_hosts(1, 10)
    w = p.spawn("w0", "worker")
    s = p.spawn("s0", "standby")
    assert w.pid > 0 and s.pid > 0 and w.slot == 0 and s.slot == 1
    with pytest.raises(NoSlot):
        p.spawn("s1", "standby")
    w.kill()
    assert p.wait_exit(w, 10) == -9 and w.exit_cause() is None  # a plain kill: the agent reports the signal
    seen = tmp_path / "seen-s0"
    deadline = time.monotonic() + 20
    while not seen.exists() and time.monotonic() < deadline:
        time.sleep(0.01)  # polling for another process's file
    assert seen.read_text() == f"{token} 1", "the agent gives its process the job's secret and its slot"
    # The agent dies (its link closes): the host is lost at once, with the process still on it.
    agent_sock = next(h.link.sock for h in p.hosts)
    t0 = time.monotonic()
    agent_sock.shutdown(socket.SHUT_RDWR)
    assert p.wait_exit(s, 5) == -9 and "lost" in (s.exit_cause() or "")
    assert time.monotonic() - t0 < 5
    lost = _events(p, HostLost)
    assert lost[0].procs == ["s0"]
    thread.join(timeout=15)
    assert not thread.is_alive() and agent.fenced >= 1


def test_an_agent_kept_busy_past_its_lease_while_its_coordinator_beats_fences_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent's loop is held past its lease and past the coordinator's host timeout: its fork server answers a
    standby's fork 2 s late, as a fork of a big process on a loaded machine can. (It is stopped here for those 2 s,
    and made to look runnable: an agent gives up at once on a zygote it sees stopped, test_zygote.py.) The agent
    beats while it waits, and the coordinator's beats, which waited in the socket, count before it judges the
    silence: it neither fences itself nor is its host lost."""
    import signal

    from runtime.control.hosts import HostTiming

    token = new_token()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    script = tmp_path / "idle.py"
    script.write_text("import time\ntime.sleep(60)\n")
    p = HostPool(listener, token, "job1", [str(script)], {"TM_X": "1"},
                 HostTiming(heartbeat_s=0.05, lease_s=0.5, host_timeout_s=1.0))
    agent, thread = _agent(p.port, token, rejoin=False, fork_server=True)
    resume: threading.Timer | None = None
    try:
        p.wait_for_hosts(1, 10)
        zygote = agent.zygote
        assert zygote is not None and zygote.pid is not None
        deadline = time.monotonic() + 60
        while not zygote.ready():  # the agent leaves the zygote alone until a standby is to be forked
            assert time.monotonic() < deadline, "the zygote did not finish its imports within 60 s"
            time.sleep(0.05)
        monkeypatch.setattr(zygote, "_stopped", lambda: False)  # a slow fork, not a stopped zygote
        os.kill(zygote.pid, signal.SIGSTOP)
        resume = threading.Timer(2.0, os.kill, (zygote.pid, signal.SIGCONT))  # the fault: 2 host timeouts late
        resume.start()
        standby = p.spawn("s0", "standby")
        resume.join()
        assert standby.pid > 0 and standby.exit_cause() is None
        assert zygote.pid is not None and standby.pid in zygote.forked, "forked, after the 2 s wait"
        worker = p.spawn("w0", "worker")  # the link is still up
        assert worker.pid > 0
        assert agent.fenced == 0 and of_type(p.take_events(), HostLost) == []
        assert [h.name for h in p.live_hosts()] == ["hx"]
    finally:
        if resume is not None:
            resume.cancel()
        p.close()
        thread.join(timeout=15)


def test_a_silent_host_is_lost_after_the_timeout_and_an_outsider_is_refused(pool: tuple[HostPool, str]) -> None:
    p, token = pool
    # A raw agent that completes the handshake and then never beats again (a partition).
    sock = socket.create_connection(("127.0.0.1", p.port))
    link = Link(sock, "agent")
    nonce = new_nonce()
    link.send(Hello("job1", "mute", "1", 1, "127.0.0.1", 1, nonce))
    welcome, raw = link.recv(5)
    assert isinstance(welcome, Welcome)
    link.key = session_key(token, nonce, raw["cn"])
    assert link.check_last()
    link.send(Beat())
    p.wait_for_hosts(1, 5)
    lost = _events(p, HostLost, 10)
    assert lost[0].host == "mute" and lost[0].cause.startswith("no heartbeat")
    # An outsider without the secret: its unsealed second frame is refused, it is never admitted.
    out = socket.create_connection(("127.0.0.1", p.port))
    olink = Link(out, "agent")
    olink.send(Hello("job1", "evil", "1", 8, "127.0.0.1", 1, new_nonce()))
    olink.recv(5)
    olink.send(Beat())  # unsealed (no key)
    refused = _events(p, AgentRefused)
    assert "not sealed" in refused[0].reason
    assert [h.name for h in p.live_hosts()] == []
    # Another job's agent is told so and refused.
    other = socket.create_connection(("127.0.0.1", p.port))
    ol = Link(other, "agent")
    ol.send(Hello("job2", "stray", "1", 1, "127.0.0.1", 1, new_nonce()))
    fence, _ = ol.recv(5)
    assert isinstance(fence, Fence) and "job1" in fence.reason
    for s in (sock, out, other):
        s.close()


def test_an_agent_refuses_an_impostor_coordinator(pool: tuple[HostPool, str]) -> None:
    p, _ = pool
    agent = Agent(AgentConfig(coordinator=f"127.0.0.1:{p.port}", slots=1, secret=new_token(), name="hx",
                              connect_timeout_s=5.0, rejoin=False, fork_server=False))
    sock = socket.create_connection(("127.0.0.1", p.port))
    with pytest.raises(AgentError, match="could not prove"):
        agent._serve(sock)
    sock.close()
    assert not agent.children, "an impostor never gets a process started"


def _welcome(listener: socket.socket, token: str) -> tuple[socket.socket, Link, Hello]:
    """Accept an agent on `listener` as its coordinator would: its hello, then a welcome (beats every 0.05 s, a
    0.3 s lease) under the session key."""
    listener.settimeout(10)
    conn, _ = listener.accept()
    link = Link(conn, "coordinator")
    hello, _ = link.recv(5)
    assert isinstance(hello, Hello)
    nonce = new_nonce()
    link.key = session_key(token, hello.nonce, nonce)
    link.send(Welcome(0.05, 0.3), {"cn": nonce})
    return conn, link, hello


def _start_sleeper(conn: socket.socket, link: Link) -> int:
    """Order the agent to start a process that sleeps; its pid once the agent says it started."""
    link.send(Spawn("w0", "worker", 0, ["-c", "import time; time.sleep(60)"], {}))
    conn.settimeout(5)
    got: list[object] = []
    while not any(isinstance(m, Started) for m in got):
        data = conn.recv(65536)
        assert data, "the agent hung up instead of starting the process"
        got += [m for m, _ in link.feed(data)]
    return next(m.pid for m in got if isinstance(m, Started))


def test_an_agent_fences_itself_when_its_lease_runs_out_and_comes_back_as_new(tmp_path: Path) -> None:
    token = new_token()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    port = listener.getsockname()[1]
    agent, thread = _agent(port, token, slots=1)
    incarnations = []
    for _ in range(2):
        conn, link, hello = _welcome(listener, token)
        incarnations.append(hello.incarnation)
        if len(incarnations) == 1:
            pid = _start_sleeper(conn, link)
            # Silence from here on: the lease (0.3 s) runs out; the agent kills w0 and reconnects as new.
        else:
            listener.close()  # no third connection: after this fence the agent gives up
            link.send(Fence("the test is over"))
        keep = conn
    thread.join(timeout=15)
    assert incarnations[0] != incarnations[1]
    assert agent.fenced == 2 and not agent.children
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # fenced: killed and reaped
    keep.close()


def test_on_one_machine_the_coordinator_sees_an_exit_on_its_own_pidfd_before_the_agent_reports_it(
        tmp_path: Path) -> None:
    """The local pool (runtime.launcher) starts processes through its agent like any host, but hands the
    coordinator each process's pidfd: the exit is known the moment the kernel reports it, the slot is free at once,
    and the agent's report that follows changes nothing."""
    import select
    import signal

    from runtime.launcher import LaunchConfig, LocalProcess, start_local_pool

    script = tmp_path / "idle.py"
    script.write_text("import time\ntime.sleep(60)\n")
    cfg = LaunchConfig(script=str(script), nproc=1, standby=0, quiet=True)
    token = new_token()
    p = start_local_pool(cfg, 1, token, None)
    try:
        w = p.spawn("w0", "worker")
        assert isinstance(w, LocalProcess) and w.pid > 0
        fd = w.exit_fd()
        assert fd is not None
        os.kill(w.pid, signal.SIGKILL)  # from outside, as an OOM kill would
        assert select.select([fd], [], [], 10)[0] == [fd]
        assert w.poll() == -signal.SIGKILL, "the exit is read from the process itself, not from the agent's report"
        assert not p.hosts[0].procs, "its slot is free for a replacement at once"
        s = p.spawn("s0", "standby")
        s.kill()  # killed directly, reaped whichever thread gets there first
        assert s.wait(10) == -signal.SIGKILL
        deadline = time.monotonic() + 10
        while p.agent.children["s0"].pidfd is not None and time.monotonic() < deadline:
            time.sleep(0.01)  # polling for the agent thread's own reaping
        assert w.poll() == -signal.SIGKILL and s.poll() == -signal.SIGKILL and w.exit_cause() is None
    finally:
        p.close()
    for h in (w, s):
        h.close()
        with pytest.raises(ProcessLookupError):
            os.kill(h.pid, 0)  # reaped: not even a zombie is left


def _raw_host(p: HostPool, token: str, name: str, slots: int, role: str = "any", address: str = "127.0.0.1",
              incarnation: str = "1") -> socket.socket:
    """A host admitted by hand-made frames (nothing is started on it): its role or name is what the test is about."""
    sock = socket.create_connection(("127.0.0.1", p.port))
    link = Link(sock, "agent")
    nonce = new_nonce()
    link.send(Hello("job1", name, incarnation, slots, address, 1, nonce, role=role))
    welcome, raw = link.recv(5)
    assert isinstance(welcome, Welcome) and welcome.job_id == "job1"
    link.key = session_key(token, nonce, raw["cn"])
    assert link.check_last()
    link.send(Beat())
    return sock


def test_hosts_take_only_what_their_role_allows(pool: tuple[HostPool, str]) -> None:
    """`trainmover agent --role`: a worker host never gets a standby, a standby host never a worker; free slots
    count only what may run standbys; a role outside the three is a protocol error."""
    p, token = pool
    socks = [_raw_host(p, token, "wk", 2, "worker"), _raw_host(p, token, "sb", 1, "standby")]
    p.wait_for_hosts(2, 5)
    try:
        with p._cond:
            assert p._place("worker")[0].name == "wk" and p._place("standby")[0].name == "sb"
        assert p.free_slots() == 1
        socks.append(_raw_host(p, token, "any", 1, "any"))
        p.wait_for_hosts(3, 5)
        assert p.free_slots() == 2
        with p._cond:
            (wk,) = [h for h in p.hosts if h.name == "wk"]
            wk.procs = {i: p._new_handle(f"w{i}", "worker", wk, i) for i in (0, 1)}  # full: workers go to "any" next
            assert p._place("worker")[0].name == "any"
            (sb,) = [h for h in p.hosts if h.name == "sb"]
            sb.procs = {0: p._new_handle("s0", "standby", sb, 0)}
            assert p._place("standby")[0].name == "any"
            (an,) = [h for h in p.hosts if h.name == "any"]
            an.procs = {0: p._new_handle("s1", "standby", an, 0)}
            with pytest.raises(NoSlot, match="may run a standby"):
                p._place("standby")
            for h in p.hosts:
                h.procs = {}
    finally:
        for s in socks:
            s.close()
    # A second agent on the workers' machine (same address) is the last choice for a standby.
    socks = [_raw_host(p, token, "wk2", 1, "worker", address="10.9.0.1"),
             _raw_host(p, token, "twin", 1, address="10.9.0.1"), _raw_host(p, token, "far", 1, address="10.9.0.2")]
    p.wait_for_hosts(3, 5)  # the three above are gone (their links closed)
    try:
        with p._cond:
            (wk2,) = [h for h in p.hosts if h.name == "wk2" and h.lost is None]
            wk2.procs = {0: p._new_handle("w2", "worker", wk2, 0)}
            assert p._place("standby")[0].name == "far"
            (far,) = [h for h in p.hosts if h.name == "far"]
            far.procs = {0: p._new_handle("s2", "standby", far, 0)}
            assert p._place("standby")[0].name == "twin"
            for h in p.hosts:
                h.procs = {}
    finally:
        for s in socks:
            s.close()
    with pytest.raises(ProtocolError, match="role must be"):
        decode({"v": VERSION, "t": "hello", "job_id": "", "host": "h", "incarnation": "1", "slots": 1,
                "address": "a", "pid": 1, "nonce": "n", "role": "boss"})


def test_an_agent_serves_the_first_job_it_joined_and_refuses_the_next(pool: tuple[HostPool, str]) -> None:
    """An agent started without --job-id is admitted to job0 (a coordinator that then dies); when another job's
    coordinator later listens at the same address with the same secret, the agent asks for job0 only: it is
    refused, counts toward nothing, and stops with a message naming both jobs."""
    p2, token = pool  # job1, started second; first a coordinator of job0 on a port the agent will come back to
    first = socket.create_server(("127.0.0.1", 0))
    port = first.getsockname()[1]
    errors: list[BaseException] = []

    def run() -> None:
        try:
            Agent(AgentConfig(coordinator=f"127.0.0.1:{port}", slots=1, secret=token, name="stale",
                              connect_timeout_s=20.0, fork_server=False)).run()
        except AgentError as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    conn, _ = first.accept()
    first.close()
    link = Link(conn, "coordinator")
    hello, _ = link.recv(5)
    assert isinstance(hello, Hello) and hello.job_id == ""
    nonce = new_nonce()
    link.key = session_key(token, hello.nonce, nonce)
    link.send(Welcome(0.05, 5.0, "job0"), {"cn": nonce})
    assert isinstance(link.recv(5)[0], Beat)
    conn.close()  # job0's coordinator dies; the agent comes back as a new incarnation, asking for job0
    relay = socket.create_server(("127.0.0.1", port))  # job1's coordinator, at the same address
    try:
        back, _ = relay.accept()
        relayed = Link(back, "coordinator")
        again, _ = relayed.recv(5)
        assert isinstance(again, Hello) and again.job_id == "job0"
        to_p2 = socket.create_connection(("127.0.0.1", p2.port))
        l2 = Link(to_p2, "agent")
        l2.send(again)
        fence, _ = l2.recv(5)
        assert isinstance(fence, Fence) and "runs job job1, not job0" in fence.reason
        relayed.send(fence)
        to_p2.close()
        back.close()
    finally:
        relay.close()
    thread.join(timeout=15)
    assert not thread.is_alive() and errors and "job1, not job0" in str(errors[0])
    assert p2.live_hosts() == [] and _events(p2, AgentRefused)[0].reason.startswith("it asked for job job0")


def test_two_machines_with_one_hostname_are_told_apart_by_address(pool: tuple[HostPool, str]) -> None:
    """Cloned images and network namespaces share a hostname: the second is named with its address in every event;
    the same machine coming back as a new incarnation (same address) keeps its name."""
    p, token = pool
    socks = [_raw_host(p, token, "vm", 1, address="10.0.0.1"), _raw_host(p, token, "vm", 1, address="10.0.0.2"),
             _raw_host(p, token, "vm", 1, address="10.0.0.1", incarnation="2")]
    try:
        p.wait_for_hosts(3, 5)
        assert [h.name for h in p.hosts] == ["vm", "vm@10.0.0.2", "vm"]
        assert len({h.key for h in p.hosts}) == 3
    finally:
        for s in socks:
            s.close()


def test_an_agent_whose_coordinator_vanished_stops_its_processes_and_powers_the_host_off(tmp_path: Path) -> None:
    """The dead-man's switch (`--orphan-timeout`): a coordinator starts a process on the host, then vanishes with its
    port (an orchestrator that died). The agent fences, keeps trying to reach a coordinator, and once none has been
    reachable for the timeout it kills what it started and runs the orphan command (here: one that leaves a mark,
    in place of `systemctl poweroff`); it exits with its own status, on which the host's unit does not restart."""
    token = new_token()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    port = listener.getsockname()[1]
    mark = tmp_path / "powered-off"
    command = f"{sys.executable} -c \"open('{mark}', 'w').write('off')\""
    agent = Agent(AgentConfig(coordinator=f"127.0.0.1:{port}", slots=1, secret=token, name="hx", fork_server=False,
                              connect_timeout_s=0.2, orphan_timeout_s=1.5, orphan_command=command))
    status: list[int] = []
    thread = threading.Thread(target=lambda: status.append(agent.run()), daemon=True)
    thread.start()
    conn, link, _ = _welcome(listener, token)
    pid = _start_sleeper(conn, link)
    t0 = time.monotonic()
    conn.close()
    listener.close()  # the coordinator is gone, its port with it
    thread.join(timeout=20)
    assert not thread.is_alive()
    assert time.monotonic() - t0 >= 1.0, "not before the timeout"
    assert mark.read_text() == "off"
    assert status == [ORPHANED_EXIT]
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # killed and reaped before the host went off


def test_an_orphan_timeout_without_a_command_is_refused() -> None:
    with pytest.raises(AgentError, match="--orphan-command is empty"):
        Agent(AgentConfig(coordinator="127.0.0.1:1", secret=new_token(), orphan_timeout_s=60, orphan_command=" ",
                          fork_server=False))
