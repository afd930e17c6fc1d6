"""`trainmover run`: start the coordinator, N workers and K warm standbys on this machine, and supervise them.

In the spirit of torchrun, but nothing healthy is ever restarted: a lost worker's logical rank goes to a
standby, and the survivors carry on in-process. The coordinator runs in this launcher process, never in a
training process, so losing any worker never loses it.

On one machine the processes are started by one agent (runtime.agent) that runs in this process, over the same
authenticated link, placement and fencing as `trainmover coordinator --agents N` across hosts: the single-machine
path is the multi-host path with one host.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import select
import signal
import socket
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch.distributed as dist

from runtime.agent import Agent, AgentConfig, Child
from runtime.auth import ENV_SECRET, check_secret, new_token, read_secret_file, write_secret_file
from runtime.chaos import parse_chaos
from runtime.config import ProcessConfig
from runtime.coordinator import Coordinator, CoordinatorSettings, JobResult, configure_logging
from runtime.events import EventLog
from runtime.faults import parse_plan
from runtime.hosts import Host, HostPool, HostTiming, RemoteProcess
from runtime.netaddr import interface_of

log = logging.getLogger("trainmover.launcher")


class ConfigError(ValueError):
    """A launch setting a user got wrong; the message says what to change."""


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    """Everything `trainmover run` takes."""

    script: str
    """The training script (run with this Python interpreter)."""
    args: tuple[str, ...] = ()
    """Arguments passed to the script."""
    nproc: int = 2
    """Number of workers: logical data-parallel ranks 0..nproc-1."""
    standby: int = 1
    """Number of warm standby processes kept ready."""
    backend: Literal["gloo", "nccl"] = "gloo"
    """gloo (CPU) or nccl (one GPU per process: workers and standbys alike)."""
    events_path: str | None = None
    """Write membership and recovery events here as JSON lines."""
    hang_timeout_s: float = 2.0
    """Heartbeat silence after which a process is declared hung and fenced."""
    heartbeat_s: float = 0.25
    """Heartbeat interval of every process."""
    standby_wait_s: float = 30.0
    """With no standby ready, how long to wait for one before stopping the job."""
    replenish: bool = True
    """Start a replacement standby whenever one is promoted or lost."""
    num_threads: int | None = None
    """torch threads per process (equal everywhere, for bit-exact replays); default: cores / nproc."""
    faults: str = ""
    """Fault-injection plan (runtime.faults) for demos and tests."""
    chaos: str = ""
    """Random faults the coordinator injects (runtime.chaos), e.g. "seed=1,every_s=1.5,max=100,signals=kill|stop"."""
    host: str = "127.0.0.1"
    """Address the coordinator's store listens on (that address only), and where Gloo listens too."""
    secret: str | None = field(default=None, repr=False)
    """The job's secret, which signs every control record and proves membership. Default: the
    `TRAINMOVER_JOB_SECRET` environment variable, else the contents of `secret_file`, else a fresh one."""
    secret_file: str | None = None
    """A file holding the job's secret (mode 600); created with a fresh secret if it does not exist, so that an
    orchestrator started later can read it."""
    port: int = 0
    """Port of the coordinator's store, where an orchestrator connects to steer the job (`runtime.control`);
    0 picks a free one (the `job_started` event names it)."""
    recovery_timeout_s: float = 120.0
    """Longest a member waits for a new generation or for its peers to join one."""
    chunk_bytes: int = 64 << 20
    """Largest message of a state handoff."""
    job_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    """Name of the job, in events and proofs."""
    quiet: bool = False
    """Log only errors."""
    wait_for_standbys: bool = False
    """Start training only once every standby is warm (the first failure is then always covered)."""
    handoff_transport: Literal["gloo", "tls"] = "gloo"
    """How the state travels to a new member: over the generation's Gloo/NCCL group (fast, not encrypted), or
    "tls": mutual-TLS connections (Python's ssl), for standbys across a trust boundary."""
    tls_cert: str | None = None
    """With tls: the job's certificate (PEM) every member presents; default: a fresh self-signed one per job."""
    tls_key: str | None = None
    """Its private key (PEM, mode 600)."""
    tls_ca: str | None = None
    """What a peer's certificate must chain to; default: the job's certificate."""
    agents: int = 0
    """0: every process runs on this machine. N > 0: the coordinator alone; it waits for N agents
    (`trainmover agent`, one per host) and places every process in their slots, never starting one itself."""
    agent_port: int = 0
    """Where the agents connect (with --agents); 0 picks a free one (the `job_started` event names it)."""
    host_timeout_s: float = 3.0
    """With --agents: a host whose agent is silent this long is lost, with every process on it."""
    agent_heartbeat_s: float = 0.5
    """With --agents: beats each way on every agent link; an agent's lease is host_timeout - 2 beats."""
    agents_wait_s: float = 120.0
    """With --agents: how long to wait for the agents to join before giving up."""
    fork_server: bool = True
    """Fork standbys from a zygote that imported torch once (runtime.zygote): a replacement standby starts in
    milliseconds instead of seconds. Gloo only; without it (or when the zygote fails) processes start as usual."""

    def validate(self) -> None:
        if self.nproc < 1:
            raise ConfigError(f"--nproc must be at least 1, got {self.nproc}")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", self.job_id):
            raise ConfigError(f"--job-id must be 1-64 letters, digits, '.', '_' or '-', got {self.job_id!r}")
        if self.standby < 0:
            raise ConfigError(f"--standby must be 0 or more, got {self.standby}")
        if self.backend not in ("gloo", "nccl"):
            raise ConfigError(f"--backend must be gloo or nccl, got {self.backend!r}")
        if self.agents < 0:
            raise ConfigError(f"--agents must be 0 (this machine) or the number of hosts, got {self.agents}")
        if self.agents == 0 and not Path(self.script).is_file():
            raise ConfigError(f"training script {self.script!r} does not exist")
        if self.agents and self.handoff_transport == "tls" and self.tls_cert is None:
            raise ConfigError("--handoff-transport tls across hosts needs --tls-cert and --tls-key files at the same "
                              "path on every host (a per-job certificate made here would not be on the hosts)")
        if self.agents:
            try:
                self.host_timing().validate()
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        if not 0 <= self.agent_port <= 65535:
            raise ConfigError(f"--agent-port must be a TCP port (0 picks a free one), got {self.agent_port}")
        if self.hang_timeout_s <= self.heartbeat_s * 2:
            raise ConfigError(
                f"--hang-timeout ({self.hang_timeout_s} s) must exceed two heartbeats ({2 * self.heartbeat_s} s), "
                "or healthy workers would be declared hung"
            )
        try:
            socket.getaddrinfo(self.host, None, type=socket.SOCK_STREAM)
        except OSError:
            raise ConfigError(f"--host {self.host!r} is not an address of this machine") from None
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be a TCP port (0 picks a free one), got {self.port}")
        if self.standby_wait_s < 0:
            raise ConfigError(f"--standby-wait must be 0 or more seconds, got {self.standby_wait_s}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(f"--threads must be 1 or more torch threads per process, got {self.num_threads}; "
                              "leave it out for cores / nproc")
        if self.handoff_transport not in ("gloo", "tls"):
            raise ConfigError(f"--handoff-transport must be gloo or tls, got {self.handoff_transport!r}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("--tls-cert and --tls-key go together (or leave both out for a per-job certificate)")
        for flag, path in (("--tls-cert", self.tls_cert), ("--tls-key", self.tls_key), ("--tls-ca", self.tls_ca)):
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"{flag} {path!r} is not a file")
        if self.handoff_transport == "gloo" and (self.tls_cert or self.tls_ca):
            raise ConfigError("--tls-cert/--tls-ca apply to --handoff-transport tls only")
        try:
            plan = parse_plan(self.faults)
            parse_chaos(self.chaos)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if not self.agents and any(f.action == "host" for f in plan):
            raise ConfigError("the fault action host kills a whole host (its agent and every process on it): it needs "
                              "hosts of their own (--agents with `trainmover agent`); on one machine use kill")
        if self.backend == "nccl":
            import torch

            needed = self.nproc + self.standby
            have = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if have < needed:
                raise ConfigError(
                    f"--backend nccl gives each process its own GPU: {needed} processes need {needed} GPUs, "
                    f"this machine has {have}. Use --backend gloo, or fewer workers/standbys."
                )

    def job_secret(self) -> str:
        """The secret from the config, the environment or the secret file (created if absent); never logged."""
        try:
            if self.secret is not None:
                return check_secret(self.secret, "the launch config")
            if os.environ.get(ENV_SECRET):
                return check_secret(os.environ[ENV_SECRET], ENV_SECRET)
            if self.secret_file is not None:
                if Path(self.secret_file).exists():
                    return read_secret_file(self.secret_file)
                secret = new_token()
                write_secret_file(self.secret_file, secret)
                return secret
        except (ValueError, OSError) as exc:
            raise ConfigError(str(exc)) from None
        return new_token()

    def host_timing(self) -> HostTiming:
        beat = self.agent_heartbeat_s
        return HostTiming(heartbeat_s=beat, lease_s=self.host_timeout_s - 2 * beat, host_timeout_s=self.host_timeout_s)

    def threads(self) -> int:
        return self.num_threads or max(1, (os.cpu_count() or 1) // self.nproc)


LOCAL_TIMING = HostTiming(heartbeat_s=0.5, lease_s=30.0, host_timeout_s=60.0)
"""The one local agent shares this process: it cannot be cut off, so its lease and timeout only catch a stall."""
LOCAL_GLOO_SLOTS = 1024
"""On CPU one machine runs as many processes as the job asks for; on NCCL, one per GPU."""


class LocalProcess(RemoteProcess):
    """A process of the local agent, as the coordinator sees it: placed and started through the agent like any
    other, but watched through its own pidfd, so that an exit reaches the coordinator's loop the moment the kernel
    reports it (no hop through the agent's thread, its link and the link thread), and killed directly."""

    pool: LocalHostPool

    def __init__(self, pool: LocalHostPool, name: str, role: str, host: Host, slot: int) -> None:
        super().__init__(pool, name, role, host, slot)
        self._pidfd: int | None = None

    def _child(self) -> Child | None:
        child = self.pool.agent.children.get(self.name)
        return child if child is not None and child.pid == self.pid else None

    def poll(self) -> int | None:
        if self.code is None and (child := self._child()) is not None:
            code = child.poll()
            if code is None and self._pidfd is not None and select.select([self._pidfd], [], [], 0)[0]:
                code = child.wait(1.0)  # it is dead, and the agent's thread is reaping it this instant
            if code is not None:
                self.pool.mark_exited(self, code)
        return self.code

    def kill(self) -> None:
        child = self._child()
        if child is None:
            super().kill()
        elif self.code is None:
            child.signal(signal.SIGKILL)

    def wait(self, timeout_s: float) -> int | None:
        fd = self.exit_fd()
        if fd is None:
            return super().wait(timeout_s)
        deadline = time.monotonic() + timeout_s
        while self.poll() is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            select.select([fd], [], [], min(left, 0.05))  # readable at once when it exited: the bound is a guard
        return self.code

    def exit_fd(self) -> int | None:
        if self._pidfd is None and self.pid > 0 and self.code is None:
            with contextlib.suppress(OSError):  # reaped already: the agent's report says how it ended
                self._pidfd = os.pidfd_open(self.pid)
        return self._pidfd

    def close(self) -> None:
        if self._pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(self._pidfd)
            self._pidfd = None


class LocalHostPool(HostPool):
    """One machine: the pool across hosts with a single agent, run by this process in a thread.

    The single-machine job takes the multi-host path (placement, the agent link, the agent's pidfd watch and its
    fencing), so the demo and every single-machine test exercise it. Processes started by the agent are this
    process's children, exactly as before; the zygote (runtime.zygote) belongs to the agent.
    """

    settle_s = 0.0  # one host: nothing to wait for before replacing its lost processes

    def __init__(self, listen: socket.socket, token: str, cfg: LaunchConfig, argv: list[str], env: dict[str, str],
                 zygote_env: dict[str, str]) -> None:
        super().__init__(listen, token, cfg.job_id, argv, env, LOCAL_TIMING)
        slots = LOCAL_GLOO_SLOTS
        if cfg.backend == "nccl":
            import torch

            slots = torch.cuda.device_count()
        host = cfg.host if cfg.host not in ("0.0.0.0", "::") else "127.0.0.1"
        self.agent = Agent(AgentConfig(
            coordinator=f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}", slots=slots,
            secret=token, name=socket.gethostname(), address=cfg.host, job_id=cfg.job_id, connect_timeout_s=10.0,
            rejoin=False, fork_server=cfg.fork_server and cfg.backend == "gloo"), zygote_env)
        self._agent_thread = threading.Thread(target=self.agent.run, name="trainmover-local-agent", daemon=True)
        self._agent_thread.start()

    def _new_handle(self, name: str, role: str, host: Host, slot: int) -> RemoteProcess:
        return LocalProcess(self, name, role, host, slot)

    def helpers(self) -> dict[str, int]:
        return self.agent.helpers()

    def close(self, exit_code: int = 0) -> None:
        super().close(exit_code)  # the agent stops, and kills whatever of the job is left
        self._agent_thread.join(timeout=15.0)
        self.agent.close()


def _process_env(cfg: LaunchConfig, store_port: int, tls: tuple[str, str, str] | None) -> dict[str, str]:
    """The launch variables every process of the job gets from its agent (the per-process ones and the secret
    are the agent's to add)."""
    pc = ProcessConfig(
        store_host=cfg.host, store_port=store_port, job_id=cfg.job_id, job_token="", proc="", role="worker",
        backend=cfg.backend, num_threads=cfg.threads(), faults=cfg.faults, heartbeat_s=cfg.heartbeat_s,
        recovery_timeout_s=cfg.recovery_timeout_s, chunk_bytes=cfg.chunk_bytes,
        handoff_transport=cfg.handoff_transport, tls_cert=tls[0] if tls else "", tls_key=tls[1] if tls else "",
        tls_ca=tls[2] if tls else "",
    )
    env = {k: v for k, v in pc.to_env().items() if k not in ("TM_JOB_TOKEN", "TM_PROC", "TM_ROLE", "TM_BIND_HOST")}
    env.update({"OMP_NUM_THREADS": str(cfg.threads()), "PYTHONUNBUFFERED": "1"})
    return env


def start_local_pool(cfg: LaunchConfig, store_port: int, token: str, tls: tuple[str, str, str] | None) -> HostPool:
    """The single-machine pool: one agent, in this process."""
    env = _process_env(cfg, store_port, tls)
    zygote_env = {k: v for k, v in os.environ.items() if k != ENV_SECRET}
    zygote_env.update({"OMP_NUM_THREADS": env["OMP_NUM_THREADS"], "PYTHONUNBUFFERED": "1"})
    iface = interface_of(cfg.host)
    if iface is not None:
        zygote_env.setdefault("GLOO_SOCKET_IFNAME", iface)
    pool = LocalHostPool(bind(cfg.host, 0, "--host"), token, cfg, [cfg.script, *cfg.args], env, zygote_env)
    try:
        pool.wait_for_hosts(1, 30.0)
    except TimeoutError:
        pool.close(2)
        raise ConfigError(f"the local agent could not join the coordinator on {cfg.host}; check that --host is an "
                          "address of this machine that it can connect to") from None
    return pool


def launch(cfg: LaunchConfig) -> JobResult:
    """Run one job to its end on this machine."""
    cfg.validate()
    configure_logging(cfg.quiet)
    token = cfg.job_secret()
    scratch: tempfile.TemporaryDirectory[str] | None = None
    tls: tuple[str, str, str] | None = None
    if cfg.handoff_transport == "tls":
        if cfg.tls_cert is not None and cfg.tls_key is not None:
            tls = (cfg.tls_cert, cfg.tls_key, cfg.tls_ca or cfg.tls_cert)
        else:
            from runtime.tls_transport import TlsSetupError, make_job_certificate

            scratch = tempfile.TemporaryDirectory(prefix="trainmover-tls-")  # mode 700: this user's only
            try:
                cert, key = make_job_certificate(scratch.name)
            except TlsSetupError as exc:
                scratch.cleanup()
                raise ConfigError(str(exc)) from None
            tls = (cert, key, cfg.tls_ca or cert)
    server = listen_store(cfg.host, cfg.port)
    events = EventLog(cfg.events_path)
    try:
        pool = (start_host_pool if cfg.agents else start_local_pool)(cfg, server.port, token, tls)
    except ConfigError:
        events.close()
        raise
    settings = CoordinatorSettings(
        job_id=cfg.job_id, job_token=token, nproc=cfg.nproc, standby=cfg.standby,
        hang_timeout_s=cfg.hang_timeout_s, standby_wait_s=cfg.standby_wait_s, replenish=cfg.replenish,
        faults=cfg.faults, start_when_standbys_ready=cfg.wait_for_standbys, chaos=cfg.chaos,
    )
    main_thread = threading.current_thread() is threading.main_thread()  # signal handlers live there only
    previous = signal.getsignal(signal.SIGTERM)
    if main_thread:
        signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        result = Coordinator(settings, server, pool, events).run()
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
        pool.close()
        events.close()
        if scratch is not None:
            scratch.cleanup()
    if result.exit_code == 0:
        log.info("%s", result.message)
    else:
        log.error("%s", result.message)
    return result


def start_host_pool(cfg: LaunchConfig, store_port: int, token: str, tls: tuple[str, str, str] | None) -> HostPool:
    """The coordinator's side of the agents: listen on the agent port, wait for `cfg.agents` hosts."""
    listener = bind(cfg.host, cfg.agent_port, "--agent-port")
    env = _process_env(cfg, store_port, tls)
    pool = HostPool(listener, token, cfg.job_id, [cfg.script, *cfg.args], env, cfg.host_timing())
    log.info("waiting for %d agents on %s:%d", cfg.agents, cfg.host, pool.port)
    port = pool.port  # named in the error below, after the listener is closed
    try:
        pool.wait_for_hosts(cfg.agents, cfg.agents_wait_s)
    except TimeoutError as exc:
        pool.close(2)
        raise ConfigError(f"{exc}: start `trainmover agent --coordinator {cfg.host}:{port} --slots G` on each "
                          "host, with the job's secret in --secret-file or $TRAINMOVER_JOB_SECRET") from None
    slots = sum(h.slots for h in pool.live_hosts())
    if slots < cfg.nproc:
        pool.close(2)
        raise ConfigError(f"the {cfg.agents} hosts have {slots} slots, fewer than the {cfg.nproc} workers")
    return pool


def bind(host: str, port: int, flag: str) -> socket.socket:
    """A listening socket on `host` only; a clear error when it cannot be had."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(512)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port} ({exc.strerror or exc}); pick another {flag}, or 0 for "
                          "a free one, and a --host that is an address of this machine") from None
    return sock


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def listen_store(host: str, port: int) -> dist.TCPStore:
    """The job's store, listening on `host` only.

    torch's TCPStore server listens on every interface whatever host it is given; bound by us and handed over
    as its listen socket, it listens where asked.
    """
    import datetime

    sock = bind(host, port, "--port")
    bound = sock.getsockname()[1]
    fd = sock.detach()  # the store owns the socket from here on
    try:
        return dist.TCPStore(host, bound, None, True, timeout=datetime.timedelta(seconds=10),
                             wait_for_workers=False, master_listen_fd=fd, use_libuv=True)
    except RuntimeError as exc:
        os.close(fd)
        raise ConfigError(f"cannot start the job's store on {host}:{bound} ({str(exc).splitlines()[0]})") from None
