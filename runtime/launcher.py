"""`trainmover run`: start the coordinator, N workers and K warm standbys on this machine, and supervise them.

In the spirit of torchrun, but nothing healthy is ever restarted: a lost worker's logical rank goes to a
standby, and the survivors carry on in-process. The coordinator runs in this launcher process, never in a
training process, so losing any worker never loses it.

On one machine the processes are started by one agent (runtime.host.agent) that runs in this process, over the same
authenticated link, placement and fencing as `trainmover coordinator --agents N` across hosts: the single-machine
path is the multi-host path with one host.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import socket
import tempfile
import threading
import time

import torch.distributed as dist

from runtime.config import ConfigError, LaunchConfig, ProcessConfig
from runtime.control.coordinator import Coordinator, CoordinatorSettings, JobResult, configure_logging
from runtime.control.hosts import Host, HostPool, HostTiming, RemoteProcess
from runtime.control.ranklogs import RankLogs
from runtime.host.agent import Agent, AgentConfig, Child
from runtime.wire.auth import ENV_SECRET
from runtime.wire.events import EventLog
from runtime.wire.netaddr import interface_of
from runtime.wire.tunnel import StoreGate, TunnelError, is_loopback

log = logging.getLogger("trainmover.launcher")


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
    process's children, exactly as before; the zygote (runtime.host.zygote) belongs to the agent.
    """

    settle_s = 0.0  # one host: nothing to wait for before replacing its lost processes

    def __init__(self, listen: socket.socket, token: str, cfg: LaunchConfig, argv: list[str], env: dict[str, str],
                 zygote_env: dict[str, str]) -> None:
        super().__init__(listen, token, cfg.job_id, argv, env, LOCAL_TIMING,
                         RankLogs(cfg.rank_logs) if cfg.rank_logs else None)
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
            from runtime.training.tls_transport import TlsSetupError, make_job_certificate

            scratch = tempfile.TemporaryDirectory(prefix="trainmover-tls-")  # mode 700: this user's only
            try:
                cert, key = make_job_certificate(scratch.name)
            except TlsSetupError as exc:
                scratch.cleanup()
                raise ConfigError(str(exc)) from None
            tls = (cert, key, cfg.tls_ca or cert)
    server, gate = open_store(cfg.host, cfg.port, token)
    public_port = gate.port if gate is not None else server.port
    events = EventLog(cfg.events_path)
    try:
        pool = (start_host_pool if cfg.agents else start_local_pool)(cfg, public_port, token, tls)
    except ConfigError:
        events.close()
        if gate is not None:
            gate.close()
        raise
    settings = CoordinatorSettings(
        job_id=cfg.job_id, job_token=token, nproc=cfg.nproc, standby=cfg.standby,
        hang_timeout_s=cfg.hang_timeout_s, standby_wait_s=cfg.standby_wait_s, replenish=cfg.replenish,
        faults=cfg.faults, start_when_standbys_ready=cfg.wait_for_standbys, chaos=cfg.chaos,
        public_port=public_port,
    )
    main_thread = threading.current_thread() is threading.main_thread()  # signal handlers live there only
    previous = signal.getsignal(signal.SIGTERM)
    if main_thread:
        signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        coordinator = Coordinator(settings, server, pool, events)
        if gate is not None:  # refused connections counted and reported with the refused records
            gate.on_refused = coordinator.records.sealer.refuse
        result = coordinator.run()
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
        pool.close()
        if gate is not None:
            gate.close()
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
    pool = HostPool(listener, token, cfg.job_id, [cfg.script, *cfg.args], env, cfg.host_timing(),
                    RankLogs(cfg.rank_logs) if cfg.rank_logs else None)
    log.info("waiting for %d agents on %s:%d", cfg.agents, cfg.host, pool.port)
    port = pool.port  # named in the error below, after the listener is closed
    try:
        pool.wait_for_hosts(cfg.agents, cfg.agents_wait_s)
    except TimeoutError as exc:
        pool.close(2)
        raise ConfigError(f"{exc}: start `trainmover agent --coordinator {cfg.host}:{port} --slots G` on each "
                          "host, with the job's secret in --secret-file or $TRAINMOVER_JOB_SECRET") from None
    slots = sum(h.slots for h in pool.live_hosts() if h.role != "standby")
    if slots < cfg.nproc:
        pool.close(2)
        raise ConfigError(f"the {cfg.agents} hosts have {slots} slots that may run workers (agents not started "
                          f"with --role standby), fewer than the {cfg.nproc} workers")
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


def open_store(host: str, port: int, token: str) -> tuple[dist.TCPStore, StoreGate | None]:
    """The job's store and, when `host` is not a loopback address, the gate in front of it.

    On loopback the store listens on `host:port` itself. Elsewhere it listens on 127.0.0.1 only (an ephemeral
    port) and `host:port` is its gate (runtime.wire.tunnel): mutual TLS keyed by the job's secret, so nobody
    without the secret reads or writes a key.
    """
    if is_loopback(host):
        return listen_store(host, port), None
    listener = bind(host, port, "--port")
    server = listen_store("127.0.0.1", 0)
    try:
        return server, StoreGate(listener, server.port, token)
    except TunnelError as exc:
        listener.close()
        raise ConfigError(str(exc)) from None


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
