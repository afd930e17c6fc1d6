"""`trainmover agent`: one per host. It starts the processes the coordinator assigns to this host's slots.

Started by whatever starts a command on every host (cloud-init, a Kubernetes pod, Slurm `srun`, SkyPilot's
`run:`) with the coordinator's agent address, the host's slot count and the job's secret (from a file or the
`TRAINMOVER_JOB_SECRET` variable, never the command line: that shows in `ps`). It:

- opens one authenticated link to the coordinator (`runtime.wire.protocol`) and refuses a coordinator that cannot
  prove the job's secret;
- starts each assigned worker or standby in its slot (its local rank, and on NCCL its own GPU), with the
  job's secret in its environment, and watches it with a pidfd: an exit is reported at once, with its status;
- heartbeats for the host; the coordinator's beats renew its lease. **Fencing**: when it has heard nothing from
  the coordinator for longer than the lease (a partition, a dead coordinator), it kills every process it
  started, then comes back as a new host (a new incarnation, which the coordinator treats as a fresh standby
  host at most, never as the old one) until `--connect-timeout` passes without a coordinator. The one exception:
  when the job's store lives apart (`trainmover store`) and the coordinator's lease there stands still, the
  coordinator is gone rather than cut off, so its processes train on and it re-attaches them to the coordinator
  that takes the job over (runtime.host.survival);
- is the parent its processes watch: each training process kills itself within one heartbeat when its agent
  dies (runtime.training.job), so an agent crash fences its processes and the coordinator sees a lost host. This is the
  documented choice over re-adopting orphans: a new agent could not prove that an orphan is what the old one
  started, and the host's ranks move to standbys in one generation either way.
"""

from __future__ import annotations

import codecs
import contextlib
import logging
import os
import select
import selectors
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from runtime.config import (
    ENV_BACKEND,
    ENV_BIND_HOST,
    ENV_JOB_TOKEN,
    ENV_STORE_HOST,
    ENV_STORE_PORT,
    FORK_SERVER,
    KNOBS,
    flag,
)
from runtime.host.survival import LeaseWatch, endpoint
from runtime.host.zygote import READY_WAIT_S, ZygoteClient, wait_exit
from runtime.wire.auth import ENV_SECRET
from runtime.wire.netaddr import interface_of
from runtime.wire.protocol import (
    NOTICE_KINDS,
    OUTPUT_CHUNK,
    Beat,
    Exited,
    Fence,
    GenerationNotice,
    Hello,
    HostNotice,
    Link,
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
from runtime.wire.tunnel import Doors, TunnelError

log = logging.getLogger("trainmover.agent")

ENV_AGENT_PID = "TM_AGENT_PID"
"""The agent's pid, in every process it starts: the process kills itself when that pid is gone."""
ENV_AGENT_BEATS = "TM_AGENT_BEATS"
"""The agent's beat socket (a Unix datagram socket in a directory only this user can enter): each process sends
"NAME COUNT" there at every heartbeat, so the agent sees it beat without the job's store."""
ENV_LOCAL_RANK = "LOCAL_RANK"
ALLOWED_ENV = ("OMP_NUM_THREADS", "PYTHONUNBUFFERED")
"""What a spawn order may set besides the runtime's own TM_* launch variables."""
HANDSHAKE_S = 10.0
RETRY_S = 0.2
JOIN_WAIT_S = 30.0
"""How long an agent waits for its zygote's imports before it joins the job (not at all for a stopped one): a host
whose zygote is still importing when it joins starts its first processes as new interpreters, which import beside the
zygote; on a loaded host that made a woken standby host's standby warm in 19.5 s instead of a fork's fraction of one."""
EXITS_KEPT_S = 30.0
"""How long a process's exit is kept for a coordinator that takes over (longer than any takeover takes)."""
HELD_OUTPUT = 1 << 20
"""Most output (characters) held for the next coordinator while none holds the job."""


ORPHAN_COMMAND = "systemctl poweroff"
ORPHANED_EXIT = 5
"""The agent's exit status after its dead-man's switch fired (the bootstrap's unit does not restart on it)."""


class AgentError(RuntimeError):
    """A setting the user got wrong, or a coordinator that could not be joined; the message says what to do."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentConfig:
    """Everything `trainmover agent` takes; its command line is made of these fields (runtime.cli)."""

    coordinator: str = field(metadata=flag("--coordinator", "the coordinator's agent port", metavar="HOST:PORT"))
    slots: int = field(default=1, metadata=flag(
        "--slots", "processes this host runs (one per GPU; default %(default)s)"))
    secret: str = field(repr=False)
    name: str = field(default_factory=socket.gethostname, metadata=flag(
        "--name", "this host's name in the job's events (default: the hostname)"))
    address: str | None = field(default=None, metadata=flag(
        "--address", "address this host's processes listen on (default: the one facing the coordinator)"))
    """Where this host's processes listen for their peers; default: this end of the link to the coordinator."""
    job_id: str = field(default="", metadata=flag("--job-id", "join only this job (default: the first job this "
                                                              "agent is admitted to, and only that one from then on)"))
    role: Literal["any", "worker", "standby"] = field(default="any", metadata=flag(
        "--role", "what this host runs: workers only, standbys only, or either (default %(default)s)"))
    connect_timeout_s: float = field(default=KNOBS.agent_connect_timeout_s, metadata=flag(
        "--connect-timeout", "how long to keep trying to reach the coordinator (default %(default)s s)", metavar="S"))
    rejoin: bool = field(default=True, metadata=flag(
        "--rejoin", "after being fenced, come back as a new host (a standby host) instead of exiting"))
    fork_server: bool = field(default=KNOBS.fork_server, metadata={"flag": FORK_SERVER})
    orphan_timeout_s: float = field(default=0.0, metadata=flag(
        "--orphan-timeout", "a dead-man's switch: when no coordinator of its job has been reachable for this long, "
        "stop every process and run --orphan-command (a cloud host powers itself off, and stops billing, when its "
        "orchestrator died); 0: never (default %(default)s)", metavar="S"))
    orphan_command: str = field(default=ORPHAN_COMMAND, metadata=flag(
        "--orphan-command", "what an orphaned host runs (default: %(default)r; on AWS the launch makes a shutdown "
        "terminate the instance)", metavar="CMD"))
    notices: NoticeWatch | None = None
    """This host's cloud notices (spot interruption, eviction, maintenance), forwarded to the coordinator, which
    moves the host's ranks to standbys before the cloud acts."""

    def endpoint(self) -> tuple[str, int]:
        try:
            return endpoint(self.coordinator)
        except ValueError:
            raise AgentError(f"--coordinator must be HOST:PORT (the agent port), got {self.coordinator!r}") from None


@dataclass
class _Stream:
    """The read end of a process's stdout and stderr, forwarded to the coordinator (`Spawn.output`)."""

    proc: str
    fd: int
    decoder: codecs.IncrementalDecoder


class Child:
    """A process this agent started: a subprocess, or one the zygote forked and this process adopted."""

    def __init__(self, proc: str, slot: int, pid: int, popen: subprocess.Popen[bytes] | None = None,
                 role: str = "worker") -> None:
        self.proc = proc
        self.role = role
        self.slot = slot
        self.pid = pid
        self.popen = popen
        self.code: int | None = None
        self.exited_at: float | None = None
        """When (wall clock) this agent saw it exit."""
        self.pidfd: int | None = None
        self._reaping = threading.Lock()
        """On one machine the launcher's coordinator polls the agent's children too (runtime.launcher)."""
        with contextlib.suppress(OSError, AttributeError):
            self.pidfd = os.pidfd_open(pid)

    def poll(self) -> int | None:
        """The exit code, or None while it runs (or while another thread is reaping it)."""
        if self.popen is not None:
            code = self.popen.poll()  # Popen guards its own reaping
        else:
            if self.code is None and self._reaping.acquire(blocking=False):
                try:
                    self._reap_once()
                finally:
                    self._reaping.release()
            code = self.code
        if code is not None and self.exited_at is None:
            self.exited_at = time.time()  # reaped here first: a watcher that saw the exit earlier set it already
        return code

    def _reap_once(self) -> None:
        if self.code is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: gone, how is unknown
                self.code = -int(signal.SIGKILL)
            else:
                if pid == self.pid:
                    self.code = os.waitstatus_to_exitcode(status)

    def signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def wait(self, timeout_s: float) -> int | None:
        return wait_exit(self.poll, self.pidfd, timeout_s)


Outcome = Literal["stop", "fenced", "lease", "closed"]


class NoticeSource(Protocol):
    """This host's notice endpoint (cloud.aws.notices.ImdsNoticeSource, cloud.azure.notices.ScheduledEventsSource):
    each notice once, with `kind`, `deadline_at` (epoch seconds or None) and `detail`."""

    def poll(self) -> list[Any]: ...


class NoticeWatch:
    """Polls a `NoticeSource` every `every_s` on a thread of its own (a metadata call may take a second; the agent's
    loop must not wait for it) and wakes the agent's loop through a pipe; `take()` returns what came since."""

    def __init__(self, source: NoticeSource, every_s: float = 1.0) -> None:
        self.source = source
        self.every_s = every_s
        self.read_fd, self._write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        self._lock = threading.Lock()
        self._pending: list[HostNotice] = []
        self._stop = threading.Event()
        self._failures = 0
        self._thread = threading.Thread(target=self._run, name="notice-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                found = self.source.poll()
            except Exception as exc:  # the metadata service is down or slow: say so now and then, keep watching
                self._failures += 1
                if self._failures in (1, 10) or self._failures % 600 == 0:
                    log.warning("agent: cannot read this host's notices (%d time(s)): %s", self._failures, exc)
                continue
            notices = [HostNotice(str(n.kind), float(n.deadline_at or 0.0), str(n.detail or "")[:200])
                       for n in found if str(n.kind) in NOTICE_KINDS]
            if notices:
                with self._lock:
                    self._pending += notices
                with contextlib.suppress(OSError):
                    os.write(self._write_fd, b"n")

    def take(self) -> list[HostNotice]:
        with contextlib.suppress(OSError):
            while os.read(self.read_fd, 512):
                pass
        with self._lock:
            taken, self._pending = self._pending, []
        return taken

    def requeue(self, notices: list[HostNotice]) -> None:
        """Notices a lost link could not carry: sent on the next one."""
        with self._lock:
            self._pending = notices + self._pending

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.every_s + 5.0)
        for fd in (self.read_fd, self._write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


class Agent:
    """One host's agent; `run()` returns its exit status."""

    def __init__(self, cfg: AgentConfig, zygote_env: dict[str, str] | None = None) -> None:
        if cfg.slots < 1:
            raise AgentError(f"--slots must be 1 or more (the host's GPUs, or processes on CPU), got {cfg.slots}")
        if not cfg.orphan_timeout_s >= 0:
            raise AgentError(f"--orphan-timeout must be 0 (off) or a number of seconds, got {cfg.orphan_timeout_s}")
        if cfg.orphan_timeout_s and not shlex.split(cfg.orphan_command):
            raise AgentError("--orphan-command is empty: give the command that powers this host off")
        cfg.endpoint()
        self.cfg = cfg
        self.children: dict[str, Child] = {}
        self.incarnation = uuid.uuid4().hex[:8]
        self.job_id = cfg.job_id
        """The one job this agent serves: --job-id, else the first job it is admitted to (a coordinator of another
        job, started later at the same address with the same secret, refuses it)."""
        self.exit_code = 0
        self._contact = time.monotonic()
        """When (monotonic) this agent last had a live link to a coordinator (its start, before the first)."""
        self.fenced = 0
        """Times this agent fenced itself or was fenced."""
        self._beat_dir = tempfile.mkdtemp(prefix="trainmover-beats-")  # mode 700: this user's processes only
        self.beat_path = os.path.join(self._beat_dir, "beats.sock")
        self._beat_sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._beat_sock.bind(self.beat_path)
        self._beat_sock.setblocking(False)
        self._beats: dict[str, tuple[int, float]] = {}
        """Each process's last beat count and when (monotonic) it last went up."""
        self._streams: dict[int, _Stream] = {}
        """Read ends of the processes' output this agent forwards, by descriptor."""
        self.doors = Doors(cfg.secret)
        self.watch: LeaseWatch | None = None
        """The coordinator's lease in the job's store, when the store lives apart (runtime.host.survival): what lets
        this agent keep its processes through the coordinator's loss."""
        self.epoch = 0
        """The lease epoch of the coordinator this agent serves."""
        self._beat_s = KNOBS.agent_heartbeat_s
        """The link's heartbeat, as the coordinator's welcome set it."""
        self._address = ""
        """The agent address of the coordinator that took the job over, once this agent re-attached to one (empty:
        --coordinator's)."""
        self._held: list[Output] = []
        """Output the processes wrote while no coordinator was there, sent to the next one."""
        """This host's doors to the job's store (runtime.wire.tunnel): its processes reach a store that is not on
        loopback through one, never directly."""
        self.zygote: ZygoteClient | None = None
        if cfg.fork_server:
            env = zygote_env if zygote_env is not None else dict(os.environ)
            self.zygote = ZygoteClient({k: v for k, v in env.items() if k not in (ENV_SECRET, ENV_JOB_TOKEN)})

    def helpers(self) -> dict[str, int]:
        """Processes of this host that serve the job without training in it (the zygote), by name."""
        pid = self.zygote.pid if self.zygote is not None else None
        return {"zygote": pid} if pid is not None else {}

    def close(self) -> None:
        """Stop the helpers; the training processes are gone by the time `run()` returns."""
        if self.cfg.notices is not None:
            self.cfg.notices.close()
        if self.zygote is not None:
            self.zygote.close()
            self.zygote = None
        self.doors.close()
        self._beat_sock.close()
        shutil.rmtree(self._beat_dir, ignore_errors=True)

    # -- the outer loop: connect, serve, fence, come back as new -------------------------------------
    def run(self) -> int:
        if self.cfg.notices is not None:
            self.cfg.notices.start()
        if self.zygote is not None and not self.zygote.wait_ready(JOIN_WAIT_S):
            log.warning("agent %s: its fork server is not ready after %.0f s (or stopped): processes start as new "
                        "interpreters until it is", self.cfg.name, JOIN_WAIT_S)
        sock = self._connect()
        reattach = False
        while True:
            if sock is None:
                if self.cfg.orphan_timeout_s:
                    return self._orphaned()
                log.error("agent %s: no coordinator at %s within %.0f s; exiting", self.cfg.name, self.cfg.coordinator,
                          self.cfg.connect_timeout_s)
                return 4
            try:
                self._contact = time.monotonic()
                outcome = self._serve(sock, reattach)
            except (ProtocolError, OSError) as exc:
                log.error("agent %s: the link to the coordinator failed: %s", self.cfg.name, exc)
                outcome = "closed"
            except AgentError as exc:
                if not reattach:
                    raise
                log.error("agent %s: %s", self.cfg.name, exc)  # a coordinator that would not adopt its processes
                outcome = "fenced"
            finally:
                self._contact = time.monotonic()  # the link was alive until now
                with contextlib.suppress(OSError):
                    sock.close()
            reattach = False
            if outcome in ("lease", "closed") and self.watch is not None and self._to_report():
                sock = self._survive()
                if sock is not None:
                    reattach = True
                    continue  # re-attach to the coordinator that took the job over: the processes train on
            self._kill_all()
            if outcome == "stop":
                if self.cfg.orphan_timeout_s:
                    # The job is over and this host serves no other: its orchestrator releases it, or, if that
                    # died too, the dead-man's switch does once the timeout passes.
                    log.warning("agent %s: the job is over; powering this host off in %.0f s unless it is released "
                                "first", self.cfg.name, self.cfg.orphan_timeout_s)
                    threading.Event().wait(max(0.0, self._contact + self.cfg.orphan_timeout_s - time.monotonic()))
                    return self._orphaned()
                return self.exit_code
            self.fenced += 1
            if not self.cfg.rejoin:
                return 3
            self.incarnation = uuid.uuid4().hex[:8]
            log.warning("agent %s: fenced (%s); every process it started is gone; coming back as incarnation %s",
                        self.cfg.name, outcome, self.incarnation)
            sock = self._connect()

    def _orphaned(self) -> int:
        """The dead-man's switch: no coordinator for `--orphan-timeout`. Nothing of the job runs here any more (its
        processes are killed) and the host is powered off, so that a host whose orchestrator died stops billing."""
        self._kill_all()
        silent = time.monotonic() - self._contact
        command = shlex.split(self.cfg.orphan_command)
        log.error("agent %s: no coordinator of its job reachable for %.0f s (--orphan-timeout %.0f s): every process "
                  "stopped; running %r", self.cfg.name, silent, self.cfg.orphan_timeout_s, self.cfg.orphan_command)
        try:
            done = subprocess.run(command, timeout=60, check=False, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.error("agent %s: the orphan command failed (%s): power the host off by hand", self.cfg.name, exc)
            return ORPHANED_EXIT
        if done.returncode != 0:
            log.error("agent %s: the orphan command exited %d: power the host off by hand", self.cfg.name,
                      done.returncode)
        return ORPHANED_EXIT

    def _live(self) -> list[Child]:
        return [c for c in self.children.values() if c.poll() is None]

    def _exited_lately(self) -> list[tuple[Child, int]]:
        """Processes that exited within the last `EXITS_KEPT_S`, oldest first, with their exit codes: a coordinator
        that takes over may never have heard of them (the one that did died with the news)."""
        since = time.time() - EXITS_KEPT_S
        found = [(c, code) for c in self.children.values()
                 if (code := c.poll()) is not None and (c.exited_at or 0.0) >= since]
        return sorted(found, key=lambda e: e[0].exited_at or 0.0)[-64:]

    def _to_report(self) -> bool:
        """Whether a coordinator that takes over needs this host: it runs processes, or some exited lately."""
        return bool(self._live() or self._exited_lately())

    # -- a coordinator lost: gone, or cut off from (runtime.host.survival) ----------------------------------
    def _survive(self) -> socket.socket | None:
        """The link to the coordinator went silent or closed. A link to the coordinator that took the job over
        (its processes kept training meanwhile), or None: fence (this host is cut off, or nobody took over)."""
        assert self.watch is not None
        # The coordinator gives this host's ranks away at its host timeout, a beat or two after this agent's lease ran
        # out: each look is bounded by half a beat, and a store that does not answer the first fences at once.
        look = self._beat_s / 2
        first = self.watch.read(look)
        second = None
        if first is not None:
            self._tend(look)  # the coordinator renews every 0.2 s: a live one moves the count within this
            second = self.watch.read(look)
        if first is None or second is None:
            log.error("agent %s: the coordinator is silent and the job's store does not answer: fencing this host",
                      self.cfg.name)
            return None
        if second.epoch == self.epoch and second.raw != first.raw:
            log.error("agent %s: the coordinator still renews its lease: this host is cut off from it; fencing",
                      self.cfg.name)
            return None
        log.warning("agent %s: the coordinator (epoch %d) is gone; %d process(es) train on while a coordinator takes "
                    "the job over (up to %.0f s)", self.cfg.name, self.epoch, len(self._live()),
                    self.cfg.connect_timeout_s)
        deadline = time.monotonic() + self.cfg.connect_timeout_s
        seen = second
        while time.monotonic() < deadline:
            if seen.epoch > self.epoch:
                sock = self._dial(seen.agents)
                if sock is not None:
                    self._address = seen.agents  # where this agent comes back after a fence, too
                    log.warning("agent %s: re-attaching to coordinator %s (epoch %d) at %s", self.cfg.name,
                                seen.holder, seen.epoch, seen.agents)
                    return sock
            self._tend(RETRY_S)
            now = self.watch.read(look)
            if now is None:
                log.error("agent %s: the job's store stopped answering while no coordinator held the job; fencing",
                          self.cfg.name)
                return None
            if now.epoch == self.epoch and now.raw != seen.raw:
                log.error("agent %s: the coordinator this host lost renews its lease again; fencing this host (it gave "
                          "this host's ranks away, or will)", self.cfg.name)
                return None
            seen = now
        log.error("agent %s: no coordinator took the job over within %.0f s; fencing this host", self.cfg.name,
                  self.cfg.connect_timeout_s)
        return None

    def _dial(self, address: str) -> socket.socket | None:
        try:
            return socket.create_connection(endpoint(address), timeout=2.0)
        except (OSError, ValueError):
            return None

    def _tend(self, timeout_s: float) -> None:
        """With no coordinator: reap the processes that exit, keep their beats and hold their output, for up to
        `timeout_s`."""
        sel = selectors.DefaultSelector()
        try:
            sel.register(self._beat_sock, selectors.EVENT_READ, self._beat_sock)
            for child in self._live():
                if child.pidfd is not None:
                    sel.register(child.pidfd, selectors.EVENT_READ, child)
            for stream in self._streams.values():
                sel.register(stream.fd, selectors.EVENT_READ, stream)
            deadline = time.monotonic() + timeout_s
            while (left := deadline - time.monotonic()) > 0:
                for key, _ in sel.select(left):
                    if key.data is self._beat_sock:
                        self._take_beats()
                    elif isinstance(key.data, _Stream):
                        self._pump(key.data, None, sel)
                    else:
                        child = key.data
                        sel.unregister(child.pidfd)
                        os.close(child.pidfd)
                        child.pidfd = None
                        child.exited_at = time.time()
                        code = child.wait(5.0)
                        self._beats.pop(child.proc, None)
                        log.warning("agent %s: %s (pid %d) exited (%s) while no coordinator held the job",
                                    self.cfg.name, child.proc, child.pid, code)
        finally:
            sel.close()

    def _connect(self) -> socket.socket | None:
        host, port = endpoint(self._address) if self._address else self.cfg.endpoint()
        deadline = time.monotonic() + self.cfg.connect_timeout_s
        if self.cfg.orphan_timeout_s:  # keep trying until the dead-man's switch, however long that is
            deadline = max(deadline, self._contact + self.cfg.orphan_timeout_s)
        while True:
            try:
                return socket.create_connection((host, port), timeout=min(2.0, self.cfg.connect_timeout_s))
            except OSError:
                if time.monotonic() > deadline:
                    return None
                time.sleep(RETRY_S)  # a retry pace, not a synchronisation: the coordinator may not be up yet

    # -- one link ------------------------------------------------------------------------------------
    def _serve(self, sock: socket.socket, reattach: bool = False) -> Outcome:
        link = Link(sock, "agent")
        nonce = new_nonce()
        address = self.cfg.address or sock.getsockname()[0]
        children = []
        if reattach:  # what runs here, and what exited lately (the coordinator that saw it may have died with it)
            children = [f"{c.proc} {c.role} {c.slot} {c.pid}" for c in self._live()]
            children += [f"{c.proc} {c.role} {c.slot} {c.pid} {code} {c.exited_at or time.time():.6f}"
                         for c, code in self._exited_lately()]
        link.send(Hello(job_id=self.job_id, host=self.cfg.name, incarnation=self.incarnation,
                        slots=self.cfg.slots, address=address, pid=os.getpid(), nonce=nonce, role=self.cfg.role,
                        children=children))
        welcome, raw = link.recv(HANDSHAKE_S)
        if isinstance(welcome, Fence):
            raise AgentError(f"the coordinator refused this host: {welcome.reason}")
        if not isinstance(welcome, Welcome) or not isinstance(raw.get("cn"), str):
            raise ProtocolError(f"expected welcome, got {type(welcome).__name__}")
        link.key = session_key(self.cfg.secret, nonce, raw["cn"])
        if not link.check_last():
            raise AgentError("the coordinator could not prove the job's secret: check that this agent and the "
                             "coordinator read the same secret (a different job, or an impostor, is listening there)")
        if self.job_id and welcome.job_id and welcome.job_id != self.job_id:
            raise AgentError(f"the coordinator at {self.cfg.coordinator} runs job {welcome.job_id}, and this agent "
                             f"serves job {self.job_id} only: start a new agent for the new job")
        if not self.job_id and welcome.job_id:
            self.job_id = welcome.job_id  # sealed: the coordinator's proof covers it
        if reattach and welcome.epoch <= self.epoch:
            raise AgentError(f"the coordinator at {sock.getpeername()[0]} holds epoch {welcome.epoch}, not a newer "
                             f"one than {self.epoch}: it did not take the job over")
        self.epoch = welcome.epoch
        self._beat_s = welcome.heartbeat_s
        if welcome.store and self.watch is None:
            try:
                self.watch = LeaseWatch(welcome.store, self.cfg.secret, self.doors)
            except ValueError as exc:
                raise ProtocolError(str(exc)) from None
            self.watch.warm()
        link.send(Beat())  # sealed: this host's proof of the secret
        log.info("agent %s (incarnation %s): joined job %s at %s with %d slots, address %s, role %s",
                 self.cfg.name, self.incarnation, self.job_id or "?", self.cfg.coordinator, self.cfg.slots, address,
                 self.cfg.role)
        sock.settimeout(5.0)  # sends only; reads happen when the selector says so
        heard = time.monotonic()
        beat_due = heard + welcome.heartbeat_s
        sel = selectors.DefaultSelector()
        sel.register(sock, selectors.EVENT_READ, None)
        sel.register(self._beat_sock, selectors.EVENT_READ, self._beat_sock)
        for child in self._live():  # processes kept through a coordinator's loss
            if child.pidfd is not None:
                sel.register(child.pidfd, selectors.EVENT_READ, child)
        for stream in self._streams.values():
            sel.register(stream.fd, selectors.EVENT_READ, stream)
        held, self._held = self._held, []
        for out in held:
            link.send(out)
        watch = self.cfg.notices
        if watch is not None:
            sel.register(watch.read_fd, selectors.EVENT_READ, watch)
            self._forward(watch, link)  # what came while this host had no link
        try:
            for msg, _ in link.feed(b""):  # orders that arrived with the welcome
                outcome = self._handle(msg, link, sel, address)
                if outcome is not None:
                    return outcome
            while True:
                now = time.monotonic()
                for key, _ in sel.select(max(0.0, min(beat_due, heard + welcome.lease_s) - now)):
                    if isinstance(key.data, NoticeWatch):
                        self._forward(key.data, link)
                    elif isinstance(key.data, _Stream):
                        self._pump(key.data, link, sel)
                    elif key.data is self._beat_sock:
                        self._take_beats()
                    elif key.data is None:
                        data = sock.recv(65536)
                        if not data:
                            return "closed"
                        heard = time.monotonic()
                        for msg, _ in link.feed(data):
                            outcome = self._handle(msg, link, sel, address)
                            if outcome is not None:
                                return outcome
                    else:
                        self._reap(key.data, link, sel)
                # Judged on what arrived, read or not: while this loop was busy (a fork server slow to answer on a
                # loaded machine), the coordinator's beats waited in the socket, and they count (read next turn).
                silent = time.monotonic() - heard
                if silent > welcome.lease_s and not select.select([sock], [], [], 0)[0]:
                    log.error("agent %s: nothing from the coordinator for %.1f s (lease %.1f s): fencing this host",
                              self.cfg.name, silent, welcome.lease_s)
                    return "lease"
                if time.monotonic() >= beat_due:
                    self._send_beats(link)
                    beat_due = time.monotonic() + welcome.heartbeat_s
        finally:
            sel.close()

    def _send_beats(self, link: Link) -> None:
        """This host's beat: the ages of its processes' latest beats, or a bare beat when it runs none (one frame
        either way: every frame is a sign of life to the coordinator)."""
        if self._beats:
            at = time.monotonic()
            link.send(ProcBeats({p: round(at - t, 4) for p, (_, t) in self._beats.items()}))
        else:
            link.send(Beat())

    def _keepalive(self, link: Link) -> Callable[[], None]:
        """For a wait inside the loop (the fork server's answer): beat as the loop would, so that neither this host
        nor its processes look silent to the coordinator meanwhile."""
        due = time.monotonic() + self._beat_s

        def beat() -> None:
            nonlocal due
            if time.monotonic() >= due:
                self._take_beats()
                self._send_beats(link)
                due = time.monotonic() + self._beat_s

        return beat

    def _take_beats(self) -> None:
        """Read the beats the processes sent since the last look ("NAME COUNT"; a count that did not go up, or a
        name this agent did not start or has reaped, is ignored)."""
        for _ in range(1024):
            try:
                data = self._beat_sock.recv(256)
            except (BlockingIOError, InterruptedError):
                return
            name, _, count = data.decode(errors="replace").partition(" ")
            child = self.children.get(name)
            if child is None or child.code is not None or not count.isdigit():
                continue
            last = self._beats.get(name)
            if last is None or int(count) > last[0]:
                self._beats[name] = (int(count), time.monotonic())

    def _pump(self, stream: _Stream, link: Link | None, sel: selectors.BaseSelector) -> None:
        """Forward what a process wrote since the last read (None: no coordinator now, so hold it, up to
        `HELD_OUTPUT` bytes); at its end, stop watching its stream."""
        try:
            data = os.read(stream.fd, OUTPUT_CHUNK)
        except BlockingIOError:
            return
        text = stream.decoder.decode(data, final=not data)
        if text and link is not None:
            link.send(Output(stream.proc, text))
        elif text and sum(len(o.text) for o in self._held) < HELD_OUTPUT:
            self._held.append(Output(stream.proc, text))
        if not data:
            sel.unregister(stream.fd)
            os.close(stream.fd)
            del self._streams[stream.fd]

    def _forward(self, watch: NoticeWatch, link: Link) -> None:
        notices = watch.take()
        for i, notice in enumerate(notices):
            try:
                link.send(notice)
            except OSError:
                watch.requeue(notices[i:])
                raise
            log.warning("agent %s: this host's cloud announced %s (%s); told the coordinator", self.cfg.name,
                        notice.kind, notice.detail or "no detail")

    def _handle(self, msg: object, link: Link, sel: selectors.BaseSelector, address: str) -> Outcome | None:
        if isinstance(msg, Spawn):
            link.send(self._spawn(msg, address, sel, self._keepalive(link)))
        elif isinstance(msg, Signal):
            child = self.children.get(msg.proc)
            if child is not None:
                child.signal(signal.SIGKILL if msg.signal == "kill" else signal.SIGSTOP)
        elif isinstance(msg, Fence):
            log.error("agent %s: the coordinator fenced this host: %s", self.cfg.name, msg.reason)
            return "fenced"
        elif isinstance(msg, Stop):
            self.exit_code = 0
            return "stop"
        elif isinstance(msg, (Beat, GenerationNotice)):
            pass
        else:
            raise ProtocolError(f"unexpected {type(msg).__name__} from the coordinator")
        return None

    def _spawn(self, order: Spawn, address: str, sel: selectors.BaseSelector,
               keepalive: Callable[[], None] | None = None) -> Started:
        if not 0 <= order.slot < self.cfg.slots:
            return Started(order.proc, -1, f"slot {order.slot} does not exist (this host has {self.cfg.slots})")
        if order.proc in self.children and self.children[order.proc].poll() is None:
            return Started(order.proc, -1, f"{order.proc} is running already")
        busy = [c.proc for c in self.children.values() if c.slot == order.slot and c.poll() is None]
        if busy:
            return Started(order.proc, -1, f"slot {order.slot} is held by {busy[0]}")
        unknown = [k for k in order.env if not (k.startswith("TM_") or k in ALLOWED_ENV)]
        if unknown or ENV_JOB_TOKEN in order.env:
            return Started(order.proc, -1, f"refused environment variables {sorted(unknown) or [ENV_JOB_TOKEN]}")
        env = {k: v for k, v in os.environ.items() if k != ENV_SECRET}
        env.update(order.env)
        env.update({ENV_JOB_TOKEN: self.cfg.secret, ENV_AGENT_PID: str(os.getpid()), ENV_LOCAL_RANK: str(order.slot),
                    ENV_BIND_HOST: address, ENV_AGENT_BEATS: self.beat_path})
        if ENV_STORE_HOST in env and ENV_STORE_PORT in env:
            try:
                host, port = self.doors.local(env[ENV_STORE_HOST], int(env[ENV_STORE_PORT]))
            except (TunnelError, ValueError) as exc:
                return Started(order.proc, -1, f"no way to the job's store: {exc}")
            env.update({ENV_STORE_HOST: host, ENV_STORE_PORT: str(port)})
        iface = interface_of(address)
        if iface is not None:
            env.setdefault("GLOO_SOCKET_IFNAME", iface)
            env.setdefault("NCCL_SOCKET_IFNAME", iface)
        nccl = order.env.get(ENV_BACKEND) == "nccl"
        if nccl:
            env["CUDA_VISIBLE_DEVICES"] = str(order.slot)
            if self.zygote is not None:  # an NCCL job never forks from it (on by default): free what it holds
                self.zygote.close()
                self.zygote = None
        pid = None
        out_r, out_w = os.pipe() if order.output else (None, None)
        try:
            if self.zygote is not None and not nccl and self.zygote.wait_ready(READY_WAIT_S, keepalive):
                pid = self.zygote.spawn(env, list(order.argv), out_w, keepalive)
            if pid is not None:
                child = Child(order.proc, order.slot, pid, role=order.role)
                how = "forked"
            else:
                try:
                    popen = subprocess.Popen([sys.executable, *order.argv], env=env, start_new_session=True,
                                             stdout=out_w, stderr=out_w)
                except OSError as exc:
                    if out_r is not None:
                        os.close(out_r)
                    return Started(order.proc, -1, f"cannot start {order.argv[:1]}: {exc}")
                child, how = Child(order.proc, order.slot, popen.pid, popen, order.role), "started"
        finally:
            if out_w is not None:
                os.close(out_w)  # the process holds its own copy: its exit is the stream's end
        if out_r is not None:
            os.set_blocking(out_r, False)
            stream = _Stream(order.proc, out_r, codecs.getincrementaldecoder("utf-8")(errors="replace"))
            self._streams[out_r] = stream
            sel.register(out_r, selectors.EVENT_READ, stream)
        self.children[order.proc] = child
        if child.pidfd is not None:
            sel.register(child.pidfd, selectors.EVENT_READ, child)
        log.info("agent %s: %s %s %s in slot %d (pid %d)", self.cfg.name, how, order.role, order.proc, order.slot,
                 child.pid)
        return Started(order.proc, child.pid)

    def _reap(self, child: Child, link: Link, sel: selectors.BaseSelector) -> None:
        at = child.exited_at = time.time()
        assert child.pidfd is not None
        sel.unregister(child.pidfd)
        os.close(child.pidfd)
        child.pidfd = None
        code = child.wait(5.0)
        self._beats.pop(child.proc, None)
        link.send(Exited(child.proc, child.pid, -int(signal.SIGKILL) if code is None else code, at))

    def _kill_all(self) -> None:
        """Fence: every process this agent started is dead when this returns."""
        for stream in self._streams.values():
            os.close(stream.fd)
        self._streams.clear()
        self._held.clear()
        for child in self.children.values():
            child.signal(signal.SIGKILL)
        for child in self.children.values():
            child.wait(5.0)
            if child.pidfd is not None:
                os.close(child.pidfd)
                child.pidfd = None
        self.children.clear()
        self._beats.clear()


def configure_agent_logging(quiet: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[trainmover] %(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(logging.ERROR if quiet else logging.INFO)
    log.propagate = False
