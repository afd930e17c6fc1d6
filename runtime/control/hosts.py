"""The coordinator's side of the agents: hosts, their slots, their processes, and whole-host failures.

`HostPool` is the coordinator's `ProcessPool` across machines: it never starts a process itself; it places
each worker and standby in a slot of a host whose agent joined (`runtime.host.agent`), orders the agent to start
it, and hands the coordinator a `RemoteProcess` that behaves like a local child (poll, kill, wait). One thread
serves every agent link (accept, handshake, frames, beats, timeouts) and wakes the coordinator's loop through
a pipe when a process exits or a host is lost.

A host is **lost** when its agent's link closes (the agent died: the kernel closes its socket, so this is seen
at once) or when nothing arrives from it for `host_timeout_s` (a partition, a frozen machine). Every process of
a lost host exits at that moment as far as the coordinator is concerned, so all its ranks go to standbys in
one generation. The agent fences itself on its side after `lease_s` < `host_timeout_s` of silence, so by the
time its ranks are given away its processes are dead; a host that comes back is a new incarnation, never
readmitted in its old role.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from runtime.config import KNOBS
from runtime.control.ranklogs import RankLogs
from runtime.wire.event_records import AgentRefused, Event, HostJoined, HostLost, HostNoticed, Placed
from runtime.wire.protocol import (
    Beat,
    Exited,
    Fence,
    GenerationNotice,
    Hello,
    HostNotice,
    Link,
    Message,
    Output,
    ProcBeats,
    ProtocolError,
    Signal,
    Spawn,
    Started,
    Stop,
    Welcome,
    new_nonce,
    session_key,
)

log = logging.getLogger("trainmover.coordinator")

SPAWN_ANSWER_S = 10.0
HANDSHAKE_S = 5.0


class NoSlot(RuntimeError):
    """No host has a free slot for one more process."""


@dataclass(frozen=True, slots=True)
class HostTiming:
    """The agent links' timing (defaults: runtime.config.KNOBS's agent_heartbeat_s, agent_lease_s, host_timeout_s and
    host_settle_s). The host timeout is longer than the lease plus a beat: a lost host's processes are fenced by
    then."""

    heartbeat_s: float = KNOBS.agent_heartbeat_s
    lease_s: float = KNOBS.agent_lease_s
    host_timeout_s: float = KNOBS.host_timeout_s
    settle_s: float = KNOBS.host_settle_s

    def validate(self) -> None:
        if not 0 <= self.settle_s < self.host_timeout_s:
            raise ValueError(f"--host-settle ({self.settle_s} s) must be at least 0 and shorter than the host timeout "
                             f"({self.host_timeout_s} s)")
        if self.heartbeat_s <= 0:
            raise ValueError(f"the agents' heartbeat must be positive, got {self.heartbeat_s}")
        if self.lease_s < 2 * self.heartbeat_s:
            raise ValueError(f"the agents' lease ({self.lease_s} s) must span two heartbeats ({self.heartbeat_s} s)")
        if self.host_timeout_s < self.lease_s + self.heartbeat_s:
            raise ValueError(f"--host-timeout ({self.host_timeout_s} s) must exceed the agents' lease plus a heartbeat "
                             f"({self.lease_s + self.heartbeat_s} s): a host's processes must be fenced before "
                             "its ranks are given away")


@dataclass
class Host:
    name: str
    incarnation: str
    slots: int
    address: str
    pid: int
    link: Link
    joined_wall: float
    last_seen: float
    last_seen_wall: float
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    procs: dict[int, RemoteProcess] = field(default_factory=dict)
    """slot -> the process the coordinator placed there (alive or not yet reported gone)."""
    lost: str | None = None
    role: str = "any"
    """What the host may run (`trainmover agent --role`): "worker", "standby" or "any"."""
    ran: set[str] = field(default_factory=set)
    """Every process ever placed on this incarnation (its output may arrive after its exit)."""

    @property
    def key(self) -> str:
        return f"{self.name}#{self.incarnation}"


class RemoteProcess:
    """A training process on an agent's host, as the coordinator sees it."""

    def __init__(self, pool: HostPool, name: str, role: str, host: Host, slot: int) -> None:
        self.pool = pool
        self.name = name
        self.role = role
        self.host = host
        self.slot = slot
        self.pid = -1
        self.code: int | None = None
        self.cause: str | None = None
        self.exited_at: float | None = None
        self.start_error = ""
        self.started = threading.Event()

    def poll(self) -> int | None:
        return self.code

    def exit_cause(self) -> str | None:
        return self.cause

    def kill(self) -> None:
        self.send_signal("kill")

    def send_signal(self, sig: str) -> None:
        if self.code is None:
            self.pool.order(self.host, Signal(self.name, "kill" if sig == "kill" else "stop"))

    def wait(self, timeout_s: float) -> int | None:
        return self.pool.wait_exit(self, timeout_s)

    def exit_fd(self) -> int | None:
        return None

    def close(self) -> None:
        pass


class HostPool:
    """Places processes on the agents' hosts; see the module's docstring."""

    @property
    def settle_s(self) -> float:
        """After a process is lost, how long the coordinator waits for more losses before replacing
        (`HostTiming.settle_s`, `--host-settle`)."""
        return self.timing.settle_s

    def __init__(self, listen: socket.socket, token: str, job_id: str, argv: list[str],
                 env: dict[str, str], timing: HostTiming, rank_logs: RankLogs | None = None, *,
                 store: str = "", epoch: int = 0, adopting: bool = False) -> None:
        self.store = store
        """The job's store as processes reach it, when it lives apart from the coordinator (`Welcome.store`)."""
        self.epoch = epoch
        """This coordinator's lease epoch (runtime.control.lease), told to every agent."""
        self.adopting = adopting
        """This coordinator took the job over: agents that re-attach with processes hand them to it."""
        self._adopted: list[RemoteProcess] = []
        self._beat_at: dict[str, float] = {}
        """When (monotonic) each process last beat, as its agent saw it (`ProcBeats`)."""
        self.rank_logs = rank_logs
        """Where the processes' output goes (`--rank-logs`); None: the agents' own output, as they started them."""
        self.listener = listen
        self.token = token
        self.job_id = job_id
        self.argv = argv
        self.env = env
        """Launch variables of every process, without the secret and without the per-process ones."""
        self.timing = timing
        self.hosts: list[Host] = []
        self._by_sock: dict[socket.socket, Host | _Pending] = {}
        self._cond = threading.Condition()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._events: list[Event] = []
        self.notices: list[tuple[str, str, str]] = []
        self._doomed: set[tuple[str, str]] = set()  # hosts whose cloud announced they will go: nothing new there
        """(host, incarnation, kind) of each notice an agent sent; the coordinator takes them (`take_notices`)."""
        self._members: set[str] = set()
        self._halt = False
        self._closing = False
        self._sel = selectors.DefaultSelector()
        self._sel.register(listen, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._serve, name="trainmover-agents", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self.listener.getsockname()[1])

    # -- the coordinator's side ----------------------------------------------------------------------
    def wake_fd(self) -> int:
        """Readable when a process exited or a host was lost; `drain_wake` empties it."""
        return self._wake_r

    def drain_wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_r, 4096):
                pass

    def helpers(self) -> dict[str, int]:
        """Helper processes of the pool, by name: none here (the agents own theirs)."""
        return {}

    def take_events(self) -> list[Event]:
        with self._cond:
            out, self._events = self._events, []
        return out

    def attached(self) -> set[str]:
        """The hosts (`Host.key`) whose agents are attached now."""
        with self._cond:
            return {h.key for h in self.hosts if h.lost is None}

    def take_adopted(self) -> list[RemoteProcess]:
        """Processes that agents re-attached with since the last call (see `adopting`)."""
        with self._cond:
            out, self._adopted = self._adopted, []
        return out

    def take_notices(self) -> list[tuple[str, str, str]]:
        with self._cond:
            taken, self.notices = self.notices, []
            return taken

    def procs_on(self, host_name: str, incarnation: str) -> list[str]:
        """The processes the coordinator placed on that incarnation of the host and that have not exited."""
        with self._cond:
            return sorted(p.name for h in self.hosts if h.name == host_name and h.incarnation == incarnation
                          and h.lost is None for p in h.procs.values() if p.code is None)

    def host_of(self, name: str) -> str | None:
        """The host (`name/incarnation`) process `name` was placed on, while it has not exited."""
        with self._cond:
            for h in self.hosts:
                for p in h.procs.values():
                    if p.name == name and p.code is None:
                        return h.key
        return None

    def live_hosts(self) -> list[Host]:
        with self._cond:
            return [h for h in self.hosts if h.lost is None]

    def wait_for_hosts(self, count: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while len([h for h in self.hosts if h.lost is None]) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    have = len([h for h in self.hosts if h.lost is None])
                    raise TimeoutError(f"{have} of {count} agents joined within {timeout_s:.0f} s")
                self._cond.wait(left)

    def beat_seen(self, name: str) -> float | None:
        """When (time.monotonic) process `name` last beat as its agent saw it, apart from the store; None: never.
        Without the pool's lock: one read of a dict the link thread only ever sets values in (atomic in CPython),
        asked for every process at every health tick, which must not queue behind the link thread."""
        return self._beat_at.get(name)

    def free_slots(self) -> int:
        """Free slots on the hosts that may run a standby (role "any" or "standby")."""
        with self._cond:
            return sum(h.slots - len(h.procs) for h in self.hosts if h.lost is None and h.role != "worker")

    def spawn(self, name: str, role: str) -> RemoteProcess:
        with self._cond:
            host, slot = self._place(role)
            handle = self._new_handle(name, role, host, slot)
            host.procs[slot] = handle
            host.ran.add(name)
        env = {**self.env, "TM_PROC": name, "TM_ROLE": role}
        self.order(host, Spawn(name, role, slot, list(self.argv), env, output=self.rank_logs is not None))
        handle.started.wait(SPAWN_ANSWER_S)
        with self._cond:
            if handle.pid < 0 and handle.code is None:
                why = handle.start_error or f"its agent did not answer within {SPAWN_ANSWER_S:.0f} s"
                self._exit(handle, 127, f"could not start on host {host.key}: {why}", time.time())
            self._events.append(Placed(proc=name, role=role, host=host.name, incarnation=host.incarnation,
                                       slot=slot, pid=handle.pid))
        return handle

    def _new_handle(self, name: str, role: str, host: Host, slot: int) -> RemoteProcess:
        return RemoteProcess(self, name, role, host, slot)

    def mark_exited(self, handle: RemoteProcess, code: int) -> None:
        """An exit seen on this machine before its agent reported it (a local pool watches its children's pidfds
        itself); the agent's report that follows is then ignored."""
        with self._cond:
            if handle.code is None:
                self._exit(handle, code, None, time.time())

    def _place(self, role: str) -> tuple[Host, int]:
        """Workers fill hosts in the order they joined; a standby goes to a host that holds no member (a
        standby host) first, and of those first to one on another machine (address) than every member, else to
        any free slot. A host takes only what its agent's role allows (a "standby"
        host never a worker, a "worker" host never a standby). A host whose cloud announced it will go gets
        nothing new."""
        live = [h for h in self.hosts if h.lost is None and (h.name, h.incarnation) not in self._doomed
                and h.role in ("any", role)]

        def free(h: Host) -> list[int]:
            return [s for s in range(h.slots) if s not in h.procs]

        def holds_member(h: Host) -> bool:
            return any(p.role == "worker" or p.name in self._members for p in h.procs.values())

        # Two agents with one address are one machine: a standby beside a member there dies with it.
        member_machines = {h.address for h in self.hosts if h.lost is None and holds_member(h)}
        order = live if role == "worker" else sorted(live, key=lambda h: (holds_member(h),
                                                                           h.address in member_machines))
        for h in order:
            slots = free(h)
            if slots:
                return h, slots[0]
        raise NoSlot(f"no free slot on the {len(live)} hosts of the job that may run a {role}")

    def wait_exit(self, handle: RemoteProcess, timeout_s: float) -> int | None:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while handle.code is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            return handle.code

    def suspect(self, name: str) -> bool:
        """Whether the host of process `name` has been silent for two beats (it may be lost: let the host
        timeout decide, so that all its ranks move in one generation)."""
        with self._cond:
            for h in self.hosts:
                for p in h.procs.values():
                    if p.name == name:
                        return h.lost is None and time.monotonic() - h.last_seen > 2 * self.timing.heartbeat_s
        return False

    def announce(self, gen: int, members: list[str]) -> None:
        """Tell every live agent the new generation."""
        with self._cond:
            self._members = set(members)
            hosts = [h for h in self.hosts if h.lost is None]
        if self.rank_logs is not None:
            self.rank_logs.generation(gen, members)
        for h in hosts:
            self.order(h, GenerationNotice(gen, []))

    def order(self, host: Host, msg: Message) -> None:
        if host.lost is not None:
            return
        try:
            with host.send_lock:
                host.link.send(msg)
        except OSError as exc:
            with self._cond:
                self._lose(host, f"its link failed ({exc.strerror or exc})", time.time())

    def close(self, exit_code: int = 0, stop_agents: bool = True) -> None:
        """The job is over: every agent is told to stop, and the link thread ends. A second call does nothing.
        `stop_agents=False` (a coordinator deposed by another): the links are only closed, and the agents, whose
        processes go on training, re-attach to the coordinator that holds the job now."""
        if self._halt:
            return
        self._closing = True  # agents leaving now are not lost hosts
        for h in self.live_hosts() if stop_agents else ():
            self.order(h, Stop(exit_code))
        self._halt = True
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=5.0)
        for sock in list(self._by_sock):
            with contextlib.suppress(OSError):
                sock.close()
        with contextlib.suppress(OSError):
            self.listener.close()
        self._sel.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        if self.rank_logs is not None:
            self.rank_logs.close()

    def describe(self) -> dict[str, Any]:
        """For the job_started event: where agents connect, and the hosts that joined."""
        return {"agent_port": self.port, "hosts": [
            {"host": h.name, "incarnation": h.incarnation, "slots": h.slots, "address": h.address}
            for h in self.live_hosts()]}

    # -- the link thread -----------------------------------------------------------------------------
    def _serve(self) -> None:
        check_due = beat_due = time.monotonic()
        while not self._halt:
            for key, _ in self._sel.select(max(0.0, min(check_due, beat_due) - time.monotonic())):
                if key.data is None:
                    self._accept()
                elif (got := self._read(key.fileobj)) is not None:  # type: ignore[arg-type]
                    peer, messages = got
                    with self._cond:
                        peer.last_seen, peer.last_seen_wall = time.monotonic(), time.time()
                        for msg, _ in messages:
                            self._on_message(peer, msg)
            now = time.monotonic()
            if now >= check_due:  # silences are judged twice per beat; beats go out once per beat
                check_due = now + self.timing.heartbeat_s / 2
                self._tick(now, beat=now >= beat_due)
                if now >= beat_due:
                    beat_due = now + self.timing.heartbeat_s

    def _accept(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            sock, _ = self.listener.accept()
            sock.settimeout(2.0)
            self._by_sock[sock] = _Pending(Link(sock, "coordinator"), time.monotonic())
            self._sel.register(sock, selectors.EVENT_READ, True)

    def _drop(self, sock: socket.socket) -> None:
        self._by_sock.pop(sock, None)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(sock)
        with contextlib.suppress(OSError):
            sock.close()

    def _read(self, sock: socket.socket) -> tuple[Host, list[tuple[Message, dict[str, Any]]]] | None:
        """What a host's link brought, verified, for the caller to act on; None when there is nothing to act on
        (a handshake frame, a closed or refused link: handled here)."""
        peer = self._by_sock.get(sock)
        if peer is None:
            return None
        try:
            data = sock.recv(65536)
        except ConnectionResetError:  # the agent died with our frames unread: its kernel answers with a reset
            data, err = b"", "its agent's link closed"
        except (OSError, TimeoutError) as exc:
            data, err = b"", str(exc)
        else:
            err = "its agent's link closed"
        if not data:
            self._drop(sock)
            if isinstance(peer, Host):
                with self._cond:
                    self._lose(peer, err, time.time())
            return None
        try:
            if isinstance(peer, _Pending):  # one frame at a time: the key changes after the first
                peer.link.push(data)
                while isinstance(self._by_sock.get(sock), _Pending) and (got := peer.link.next_message()) is not None:
                    self._handshake(sock, peer, got[0])
                if isinstance(self._by_sock.get(sock), Host):
                    self._read_buffered(sock)
                return None
            messages = peer.link.feed(data)
        except ProtocolError as exc:
            self._drop(sock)
            log.warning("refused an agent link from %s: %s", _peer_name(sock), exc)
            with self._cond:
                self._events.append(AgentRefused(peer=_peer_name(sock), reason=str(exc)))
                if isinstance(peer, Host):
                    self._lose(peer, f"it sent a bad frame ({exc})", time.time())
            return None
        return peer, messages

    def _read_buffered(self, sock: socket.socket) -> None:
        """Frames that came with the agent's proof, now that it is a host."""
        host = self._by_sock[sock]
        assert isinstance(host, Host)
        with self._cond:
            for msg, _ in host.link.feed(b""):
                self._on_message(host, msg)

    def _handshake(self, sock: socket.socket, pending: _Pending, msg: Message) -> None:
        """One frame of a link not yet admitted: the hello, then the agent's first sealed frame (its proof)."""
        link = pending.link
        if pending.hello is None:
            if not isinstance(msg, Hello):
                self._refuse(sock, f"expected hello, got {type(msg).__name__}")
                return
            if msg.job_id and msg.job_id != self.job_id:
                link.send(Fence(f"this coordinator runs job {self.job_id}, not {msg.job_id}"))
                self._refuse(sock, f"it asked for job {msg.job_id}")
                return
            if msg.slots < 1 or msg.slots > 4096:
                self._refuse(sock, f"slots {msg.slots}")
                return
            pending.hello = msg
            nonce = new_nonce()
            link.key = session_key(self.token, msg.nonce, nonce)
            link.send(Welcome(self.timing.heartbeat_s, self.timing.lease_s, self.job_id, self.store, self.epoch),
                      {"cn": nonce})
            return
        if link.sealed_in == 0:  # an unsealed second frame: the agent does not hold the secret
            self._refuse(sock, "its frames are not sealed with the job's secret")
            return
        hello = pending.hello
        now = time.monotonic()
        host = Host(hello.host, hello.incarnation, hello.slots, hello.address, hello.pid, link, time.time(),
                    now, time.time(), role=hello.role)
        with self._cond:
            if any(h.name == host.name and h.address != host.address for h in self.hosts):
                # Two machines with one hostname (cloned images, network namespaces): told apart by address in
                # every event. The same machine coming back (same address) keeps its name.
                host.name = f"{host.name}@{host.address}"
            if any(h.key == host.key for h in self.hosts):
                self._refuse(sock, f"host {host.key} joined already")
                return
            if hello.children:
                if not self.adopting:
                    link.send(Fence("this coordinator did not take a job over: it adopts no running process"))
                    self._refuse(sock, f"it re-attached with {len(hello.children)} process(es) to a coordinator "
                                       "that did not take the job over")
                    return
                try:
                    children = [_child(c, host.slots) for c in hello.children]
                except ValueError as exc:
                    self._refuse(sock, f"it re-attached with a malformed process ({exc})")
                    return
                for name, role, slot, pid, exit_code, exited_at in children:
                    handle = self._new_handle(name, role, host, slot)
                    handle.pid = pid
                    handle.started.set()
                    if exit_code is None:
                        host.procs[slot] = handle
                    else:  # it exited while no coordinator ran: handed over with how and when
                        handle.code, handle.exited_at = exit_code, exited_at
                    host.ran.add(name)
                    self._adopted.append(handle)
            self.hosts.append(host)
            self._by_sock[sock] = host
            self._events.append(HostJoined(host=host.name, incarnation=host.incarnation, slots=host.slots,
                                           address=host.address))
            self._cond.notify_all()
        log.info("host %s joined with %d slots at %s", host.key, host.slots, host.address)

    def _refuse(self, sock: socket.socket, why: str) -> None:
        log.warning("refused an agent from %s: %s", _peer_name(sock), why)
        with self._cond:
            self._events.append(AgentRefused(peer=_peer_name(sock), reason=why))
        self._drop(sock)

    def _on_message(self, host: Host, msg: Message) -> None:
        """With the lock held."""
        if isinstance(msg, Beat):
            return
        if isinstance(msg, Started):
            handle = self._handle(host, msg.proc)
            if handle is not None:
                handle.pid = msg.pid
                handle.start_error = msg.error
                handle.started.set()
            return
        if isinstance(msg, Exited):
            handle = self._handle(host, msg.proc)
            if handle is not None and handle.code is None:
                self._exit(handle, msg.code, None, msg.at)
            return
        if isinstance(msg, ProcBeats):
            now = time.monotonic()
            for proc, age in msg.ages.items():
                if proc in host.ran and 0 <= age < 3600:
                    self._beat_at[proc] = max(self._beat_at.get(proc, 0.0), now - age)
            return
        if isinstance(msg, Output):
            if self.rank_logs is not None and msg.proc in host.ran:  # its own processes only
                self.rank_logs.write(msg.proc, host.name, msg.text)
            return
        if isinstance(msg, HostNotice):
            procs = sorted(p.name for p in host.procs.values() if p.code is None)
            self._events.append(HostNoticed(host=host.name, incarnation=host.incarnation, notice=msg.kind,
                                            deadline_at=msg.deadline_at, detail=msg.detail[:200], procs=procs))
            self.notices.append((host.name, host.incarnation, msg.kind))
            self._doomed.add((host.name, host.incarnation))
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"x")
            return
        log.warning("host %s: unexpected %s from an agent", host.key, type(msg).__name__)

    def _handle(self, host: Host, proc: str) -> RemoteProcess | None:
        return next((p for p in host.procs.values() if p.name == proc), None)

    def _exit(self, handle: RemoteProcess, code: int, cause: str | None, at: float) -> None:
        """With the lock held."""
        handle.code, handle.cause, handle.exited_at = code, cause, at
        handle.host.procs.pop(handle.slot, None)
        handle.started.set()
        self._cond.notify_all()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def _tick(self, now: float, beat: bool = True) -> None:
        for sock, peer in list(self._by_sock.items()):
            if isinstance(peer, _Pending) and now - peer.since > HANDSHAKE_S:
                self._refuse(sock, f"no handshake within {HANDSHAKE_S:.0f} s")
        with self._cond:
            hosts = [h for h in self.hosts if h.lost is None]
            for h in hosts:
                silent = now - h.last_seen
                if silent > self.timing.host_timeout_s:
                    self._lose(h, f"no heartbeat for {silent:.1f} s", h.last_seen_wall)
        for h in hosts if beat else ():
            if h.lost is None:
                self.order(h, Beat())

    def _lose(self, host: Host, why: str, failure_at: float) -> None:
        """With the lock held: the host is out of the job for good; its processes count as exited."""
        if host.lost is not None:
            return
        host.lost = why
        if self._closing:
            return
        log.warning("host %s lost: %s", host.key, why)
        procs = list(host.procs.values())
        self._events.append(HostLost(host=host.name, incarnation=host.incarnation, cause=why,
                                     procs=[p.name for p in procs], failure_at=failure_at))
        with contextlib.suppress(OSError):
            host.link.sock.setblocking(False)
            host.link.sock.send(host.link.encode(Fence(f"host lost: {why}")))
        for p in procs:
            self._exit(p, -9, f"host {host.name} lost ({why})", failure_at)
        # The link thread sees the shut-down socket as closed and drops it (from any thread, this is safe).
        with contextlib.suppress(OSError):
            host.link.sock.shutdown(socket.SHUT_RDWR)
        self._cond.notify_all()


@dataclass
class _Pending:
    link: Link
    since: float
    hello: Hello | None = None


def _child(text: str, slots: int) -> tuple[str, str, int, int, int | None, float | None]:
    """One "NAME ROLE SLOT PID [CODE AT]" of a re-attaching agent's `Hello.children`, checked: (name, role, slot,
    pid, exit code, exit time), the last two None for a process that runs."""
    parts = text.split()
    if (len(parts) not in (4, 6) or parts[0][:1] not in ("w", "s") or not parts[0][1:].isdigit()
            or parts[1] not in ("worker", "standby") or not parts[2].isdigit() or not parts[3].isdigit()):
        raise ValueError(f"{text[:60]!r} is not NAME ROLE SLOT PID [CODE AT]")
    slot, pid = int(parts[2]), int(parts[3])
    if slot >= slots or pid < 1:
        raise ValueError(f"{text[:60]!r}: slot or pid out of range")
    if len(parts) == 4:
        return parts[0], parts[1], slot, pid, None, None
    try:
        return parts[0], parts[1], slot, pid, int(parts[4]), float(parts[5])
    except ValueError:
        raise ValueError(f"{text[:60]!r}: exit code or time is not a number") from None


def _peer_name(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "?"
