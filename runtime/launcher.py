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
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from runtime.config import ConfigError, LaunchConfig, ProcessConfig, metrics_address
from runtime.control.coordinator import Coordinator, CoordinatorSettings, JobFailed, JobResult, configure_logging
from runtime.control.hosts import Host, HostPool, HostTiming, RemoteProcess
from runtime.control.lease import Lease, LeaseError
from runtime.control.ranklogs import RankLogs
from runtime.host.agent import Agent, AgentConfig, Child
from runtime.wire.auth import ENV_SECRET, Sealer
from runtime.wire.events import EventLog
from runtime.wire.netaddr import interface_of
from runtime.wire.tunnel import StoreDoor, StoreGate, TunnelError, is_loopback

if TYPE_CHECKING:
    from runtime.control.metrics import JobMetrics

log = logging.getLogger("trainmover.launcher")


LOCAL_TIMING = HostTiming(heartbeat_s=0.5, lease_s=30.0, host_timeout_s=60.0, settle_s=0.0)
"""The one local agent shares this process: it cannot be cut off, so its lease and timeout only catch a stall; and
one host has no other host to wait for before its lost processes are replaced."""
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

    def close(self, exit_code: int = 0, stop_agents: bool = True) -> None:
        super().close(exit_code, stop_agents)  # the agent stops, and kills whatever of the job is left
        self._agent_thread.join(timeout=15.0)
        self.agent.close()


def _absolute(path: str | None) -> str:
    """A path the processes read whatever their working directory (empty: not given; a URL as it is)."""
    if not path or "://" in path:
        return path or ""
    return str(Path(path).absolute())


def _process_env(cfg: LaunchConfig, store_port: int, tls: tuple[str, str, str] | None,
                 store_host: str | None = None) -> dict[str, str]:
    """The launch variables every process of the job gets from its agent (the per-process ones and the secret
    are the agent's to add)."""
    pc = ProcessConfig(
        store_host=store_host or cfg.host, store_port=store_port, job_id=cfg.job_id, job_token="", proc="",
        role="worker",
        backend=cfg.backend, num_threads=cfg.threads(), faults=cfg.faults, heartbeat_s=cfg.heartbeat_s,
        recovery_timeout_s=cfg.recovery_timeout_s, chunk_bytes=cfg.chunk_bytes,
        handoff_transport=cfg.handoff_transport, handoff_overlap=cfg.handoff_overlap,
        hot_standbys=cfg.hot_standbys,
        tls_cert=tls[0] if tls else "", tls_key=tls[1] if tls else "",
        tls_ca=tls[2] if tls else "",
        backup_dir=_absolute(cfg.backup_dir), backup_every=cfg.backup_every, backup_keep=cfg.backup_keep,
        resume_from=_absolute(cfg.resume_from), shrink=cfg.shrink,
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
    door: StoreDoor | None = None
    lease: Lease | None = None
    if cfg.store:  # the store lives apart (`trainmover store`): the job can outlive this coordinator
        server, door = connect_store(cfg.store, token)
        gate = None
        public_port = int(cfg.store.rpartition(":")[2])
    else:
        server, gate = open_store(cfg.host, cfg.port, token)
        public_port = gate.port if gate is not None else server.port
    events = EventLog(cfg.events_path)
    metrics: JobMetrics | None = None
    try:
        metrics = _serve_metrics(cfg)
        if metrics is not None:
            events.listeners.append(metrics.observe)
        if cfg.store:
            pool, lease = start_pool_on_store(cfg, server, token, tls)
        else:
            pool = (start_host_pool if cfg.agents else start_local_pool)(cfg, public_port, token, tls)
    except ConfigError:
        events.close()
        if metrics is not None:
            metrics.close()
        for closing in (gate, door):
            if closing is not None:
                closing.close()
        raise
    settings = CoordinatorSettings(
        job_id=cfg.job_id, job_token=token, nproc=cfg.nproc, standby=cfg.standby,
        hang_timeout_s=cfg.hang_timeout_s, standby_wait_s=cfg.standby_wait_s, replenish=cfg.replenish,
        faults=cfg.faults, start_when_standbys_ready=cfg.wait_for_standbys, chaos=cfg.chaos,
        public_port=public_port, shrink=cfg.shrink,
    )
    main_thread = threading.current_thread() is threading.main_thread()  # signal handlers live there only
    previous = signal.getsignal(signal.SIGTERM)
    if main_thread:
        signal.signal(signal.SIGTERM, _raise_interrupt)
    coordinator: Coordinator | None = None
    try:
        coordinator = Coordinator(settings, server, pool, events, lease=lease)
        if metrics is not None:
            coordinator.on_progress = metrics.committed
        if gate is not None:  # refused connections counted and reported with the refused records
            gate.on_refused = coordinator.records.sealer.refuse
        if lease is not None and lease.previous is not None:
            try:
                coordinator.take_over(lease.previous, lease.stale_for, _adopt_s(cfg))
            except JobFailed as exc:
                raise ConfigError(str(exc)) from None
            result = coordinator.run_loop()
        else:
            result = coordinator.run()
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
        pool.close(stop_agents=coordinator is None or not coordinator.deposed)
        for closing in (gate, door):
            if closing is not None:
                closing.close()
        events.close()
        if metrics is not None:
            metrics.close()
        if scratch is not None:
            scratch.cleanup()
    if result.exit_code == 0:
        log.info("%s", result.message)
    else:
        log.error("%s", result.message)
    return result


def _serve_metrics(cfg: LaunchConfig) -> JobMetrics | None:
    """The job's Prometheus endpoint (`--metrics HOST:PORT`), listening; None without the flag."""
    if cfg.metrics is None:
        return None
    from runtime.control.metrics import JobMetrics, MetricsUnavailable

    host, port = metrics_address(cfg.metrics)
    try:
        metrics = JobMetrics(cfg.job_id)
        bound = metrics.serve(host, port)
    except MetricsUnavailable as exc:
        raise ConfigError(str(exc)) from None
    except OSError as exc:
        raise ConfigError(f"--metrics {cfg.metrics}: cannot listen there ({exc.strerror or exc}): pick a free port "
                          "of an address of this machine") from None
    log.info("job %s: Prometheus metrics at http://%s:%d/metrics", cfg.job_id, host, bound)
    return metrics


def start_host_pool(cfg: LaunchConfig, store_port: int, token: str, tls: tuple[str, str, str] | None) -> HostPool:
    """The coordinator's side of the agents: listen on the agent port, wait for `cfg.agents` hosts."""
    listener = bind(cfg.host, cfg.agent_port, "--agent-port")
    env = _process_env(cfg, store_port, tls)
    pool = HostPool(listener, token, cfg.job_id, [cfg.script, *cfg.args], env, cfg.host_timing(),
                    RankLogs(cfg.rank_logs) if cfg.rank_logs else None)
    _wait_for_agents(cfg, pool)
    return pool


def _wait_for_agents(cfg: LaunchConfig, pool: HostPool) -> None:
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


def _adopt_s(cfg: LaunchConfig) -> float:
    """How long a coordinator that took over waits for the agents to re-attach with the members: an agent notices
    its coordinator gone at its lease (or at once, when the coordinator's process died and its link closed), reads
    the store's lease twice half a beat apart, then polls it for the new epoch; a host timeout and a margin of 3
    beats cover that."""
    return cfg.host_timeout_s + 3 * cfg.agent_heartbeat_s


def connect_store(address: str, token: str, wait_s: float = 30.0) -> tuple[dist.TCPStore, StoreDoor | None]:
    """A client of the job's store that `trainmover store` serves at HOST:PORT (through a door when it is not on
    loopback); ConfigError when nothing answers there within `wait_s` or it refuses the secret."""
    import datetime

    from runtime.wire.control import JobNotFound, wait_for_listener

    host, _, port_text = address.rpartition(":")
    host, port = host.strip("[]"), int(port_text)
    door = None if is_loopback(host) else StoreDoor(host, port, token)
    try:
        wait_for_listener(host, port, time.monotonic() + wait_s, door)
    except JobNotFound as exc:
        if door is not None:
            door.close()
        raise ConfigError(f"{exc} (the store of a coordinator started with --store is `trainmover store --host "
                          f"{host} --port {port}`, started first)") from None
    at = ("127.0.0.1", door.port) if door is not None else (host, port)
    store = dist.TCPStore(at[0], at[1], None, False, timeout=datetime.timedelta(seconds=30), use_libuv=True)
    return store, door


def start_pool_on_store(cfg: LaunchConfig, store: dist.TCPStore, token: str,
                        tls: tuple[str, str, str] | None) -> tuple[HostPool, Lease]:
    """The agents' side of a coordinator whose store lives apart: the job's lease first (created for a new job,
    taken over with --takeover), then the pool, which tells each agent where the store is and the lease's epoch."""
    listener = bind(cfg.host, cfg.agent_port, "--agent-port")
    agents_at = f"[{cfg.host}]:{listener.getsockname()[1]}" if ":" in cfg.host else \
        f"{cfg.host}:{listener.getsockname()[1]}"
    lease = Lease(store, Sealer(token, "coordinator"), agents_at, clock=time.monotonic, sleep=time.sleep,
                  wall=time.time)
    timing = cfg.host_timing()
    try:
        if cfg.takeover:
            _check_job(cfg, store, token)
            log.info("waiting for the job's coordinator to be gone (its lease unrenewed for %.1f s)", timing.lease_s)
            lease.take_over(timing.lease_s, cfg.agents_wait_s)
        else:
            lease.create()
    except LeaseError as exc:
        listener.close()
        raise ConfigError(str(exc)) from None
    store_host, _, store_port = cfg.store.rpartition(":")
    env = _process_env(cfg, int(store_port), tls, store_host.strip("[]"))
    pool = HostPool(listener, token, cfg.job_id, [cfg.script, *cfg.args], env, timing,
                    RankLogs(cfg.rank_logs) if cfg.rank_logs else None, store=cfg.store, epoch=lease.epoch,
                    adopting=cfg.takeover)
    if not cfg.takeover:
        _wait_for_agents(cfg, pool)
    return pool, lease


def _check_job(cfg: LaunchConfig, store: dist.TCPStore, token: str) -> None:
    """Before taking a job over: the store holds this job (id and world size), and it has not ended; ConfigError
    saying what differs (the lease is left alone)."""
    from runtime.wire import store as keys
    from runtime.wire.protocol import JobConfig, JobOver

    records = keys.Records(store, Sealer(token, "coordinator"))
    config = records.get_record(keys.k_job_config(), JobConfig)
    if config is None or config.job_id != cfg.job_id or config.nproc != cfg.nproc:
        found = f"job {config.job_id} of {config.nproc} workers" if config else "no job started with this secret"
        raise LeaseError(f"the store at {cfg.store} holds {found}, not job {cfg.job_id} of {cfg.nproc} workers: take "
                         "it over with the --job-id and --nproc it was started with")
    over = records.get_record(keys.k_over(), JobOver)
    if over is not None:
        raise LeaseError(f"job {cfg.job_id} on {cfg.store} has ended (exit status {over.exit_code}): there is "
                         "nothing to take over")


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


STORE_AFTER_OVER_S = 30.0
"""How long `trainmover store` serves after the job ended: its coordinator still reads digests and stops the
processes through it."""


def serve_store(host: str, port: int, token: str, idle_exit_s: float = 600.0, poll_s: float = 0.5,
                stop: threading.Event | None = None) -> int:
    """`trainmover store`: the job's store (and its gate off loopback) in a process of its own, which outlives any
    coordinator: a coordinator started with `--store HOST:PORT` uses it, and a later one takes the job over from
    it (runtime.control.lease). Serves until `STORE_AFTER_OVER_S` after the job ended, or until no coordinator has
    renewed a lease there for `idle_exit_s`, or until `stop` is set (SIGTERM, SIGINT)."""
    from runtime.wire import store as keys
    from runtime.wire.protocol import JobOver

    server, gate = open_store(host, port, token)
    sealer = Sealer(token, "store")
    records = keys.Records(server, sealer)
    if gate is not None:
        gate.on_refused = sealer.refuse
    stop = stop or threading.Event()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, lambda *_: stop.set())
    print(f"[trainmover] the job's store listens on {host}:{gate.port if gate else server.port}", file=sys.stderr,
          flush=True)
    last_lease, moved_at, over_at = b"", time.monotonic(), None
    try:
        while not stop.wait(poll_s):
            now = time.monotonic()
            lease = server.get(keys.k_lease()) if server.check([keys.k_lease()]) else b""
            if lease != last_lease:
                last_lease, moved_at = lease, now
            if over_at is None and records.get_record(keys.k_over(), JobOver) is not None:
                over_at = now
            if over_at is not None and now - over_at > STORE_AFTER_OVER_S:
                break
            if now - moved_at > idle_exit_s:
                print(f"[trainmover] no coordinator renewed a lease here for {idle_exit_s:.0f} s; the store exits",
                      file=sys.stderr, flush=True)
                return 3
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if gate is not None:
            gate.close()
        if sealer.total_refused():
            print(f"[trainmover] the store refused: {dict(sealer.refused)}", file=sys.stderr, flush=True)
    return 0


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
