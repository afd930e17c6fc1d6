"""A training process's link to its job: the store connection, the heartbeat, fatal-error reporting.

`init()` is the first call of a training script under `trainmover run`. It connects to the coordinator's
store, proves membership, starts the heartbeat the coordinator watches for hangs, and reports an uncaught
exception as a fatal error of the script (a bug that a standby would only repeat), not as a lost machine.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import faulthandler
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from types import TracebackType

import torch
import torch.distributed as dist

from runtime.config import LaunchError, ProcessConfig
from runtime.faults import FaultInjector
from runtime.wire import store as keys
from runtime.wire.auth import Sealer
from runtime.wire.protocol import FatalError, Generation, ProcessHello

COORDINATOR_LOST_S = 15.0


WATCH_WAIT_S = 3600.0
"""How long one wait of the generation watch lasts before it starts another (on a new connection)."""


class Heartbeat(threading.Thread):
    """Bumps this process's counter in the store every interval; watches the generation and stop flags.

    It has its own store connection: the main thread may be blocked in the store or a collective.
    A SIGSTOPped process stops beating, which is how the coordinator sees a hang.

    A new generation is seen at once, not up to a beat later: a second thread (`_watch`) waits in the store for
    the next generation's record (the store answers a wait when the key is written), and wakes the beat when that
    generation is current. A member whose collective is not broken by the loss (one waiting on a peer that left
    for the new generation) is drained that much sooner (docs/sharded.md).
    """

    def __init__(self, cfg: ProcessConfig, sealer: Sealer) -> None:
        super().__init__(name="trainmover-heartbeat", daemon=True)
        self.cfg = cfg
        self.sealer = sealer
        self.latest_gen = -1
        self.stopping = False
        self.committed_step = 0
        """The last step this process committed; the trainer sets it, the beat publishes it (progress)."""
        self._published_step = 0
        self.on_new_generation: list[Callable[[int, keys.Records], None]] = []
        """Called from this thread with the newest generation and this thread's own store connection."""
        self._halt = threading.Event()
        self._wake = threading.Event()
        self._watch_thread: threading.Thread | None = None
        self._watch_blocked = False
        """Whether the watch is blocked in its long store wait (where the process may exit under it); elsewhere it
        makes short store calls, and a process that exits during one of those aborts (torch's client)."""

    def run(self) -> None:
        client = keys.connect(self.cfg.store_host, self.cfg.store_port)
        self._watch_thread = threading.Thread(target=self._watch, name="trainmover-generation-watch", daemon=True)
        self._watch_thread.start()
        threading.Thread(target=self._beat_agent, name="trainmover-agent-beat", daemon=True).start()
        try:
            self._beat(keys.Records(client, self.sealer))
        finally:
            del client

    def _beat(self, records: keys.Records) -> None:
        last_ok = time.monotonic()
        beats = 0
        while not self._halt.is_set():
            try:
                records.put(keys.k_heartbeat(self.cfg.proc), beats)
                beats += 1
                latest = records.get_int(keys.k_current_gen())
                if latest > self.latest_gen:
                    self.latest_gen = latest
                    for callback in self.on_new_generation:
                        callback(latest, records)
                self.stopping = records.has(keys.k_stop())
                step = self.committed_step
                if step != self._published_step:
                    # Progress for orchestrators, off the training thread: one store write per beat at most.
                    records.put(keys.k_progress(), step)
                    self._published_step = step
                last_ok = time.monotonic()
            except Exception:
                if time.monotonic() - last_ok > COORDINATOR_LOST_S:
                    # The store is gone (and the coordinator with it, or no coordinator can reach the job): nobody can
                    # recover this job any more; do not linger as an orphan.
                    sys.stderr.write(f"[trainmover] {self.cfg.proc}: the job's store unreachable for "
                                     f"{COORDINATOR_LOST_S:.0f} s; exiting\n")
                    os._exit(3)
            self._wake.wait(self.cfg.heartbeat_s)
            self._wake.clear()

    def _beat_agent(self) -> None:
        """Beat to the host's agent (runtime.host.agent), which sees this process alive without the store; and fence
        this process when the agent is gone. A thread of its own, so that a slow store (flooded by an outsider, or
        far away) delays only the store's beat, never this one."""
        agent = _agent_pidfd()
        to_agent, agent_beats = _agent_beat_socket()
        beats = 0
        while not self._halt.is_set():
            if to_agent is not None:
                with contextlib.suppress(OSError):
                    to_agent.sendto(f"{self.cfg.proc} {beats}".encode(), agent_beats)
                beats += 1
            if agent is not None and select.select([agent], [], [], 0)[0]:
                # The host's agent is gone: nobody on this host can fence or report this process any more, so it
                # fences itself; the coordinator has lost the host and moves its ranks.
                sys.stderr.write(f"[trainmover] {self.cfg.proc}: the host's agent exited; this process stops\n")
                os.kill(os.getpid(), signal.SIGKILL)
            if to_agent is None and agent is None:
                return
            self._halt.wait(self.cfg.heartbeat_s)

    def _watch(self) -> None:
        """Wake the beat when generation `latest_gen + 1` becomes current. The coordinator writes the record, then
        the assignments, then the current generation: after the record appears this thread reads the current
        generation every `keys.POLL_S` for at most a beat. A record that never becomes current (forged: only the
        sealed current generation counts) leaves the beat's own pace in charge until the next generation.

        The thread is a daemon blocked in the store at exit, which ends the process cleanly (its client is never
        destroyed mid-call: the frame keeps it)."""
        client: dist.TCPStore | None = None
        seen = -1
        while not self._halt.is_set():
            nxt = max(self.latest_gen, seen) + 1
            try:
                if client is None:
                    client = keys.connect(self.cfg.store_host, self.cfg.store_port)
                self._watch_blocked = True
                client.wait([keys.k_gen(nxt)], datetime.timedelta(seconds=WATCH_WAIT_S))
                if self._halt.is_set():
                    # The process is leaving, perhaps finalizing already: a store call now could abort it (torch's
                    # client, from a daemon thread). Park here instead (still "blocked"); the process exits under it.
                    threading.Event().wait()
                self._watch_blocked = False
                records = keys.Records(client, self.sealer)
                record = records.get_record(keys.k_gen(nxt), Generation)
                if record is not None and record.planned:
                    # Members switch to it at a step boundary (Trainer._planned_switch), not at once: wait for the
                    # one after it (a failure's), while the beat sees this one become current.
                    seen = nxt
                    continue
                deadline = time.monotonic() + self.cfg.heartbeat_s
                while (current := records.get_int(keys.k_current_gen())) < nxt and time.monotonic() < deadline \
                        and not self._halt.is_set():
                    time.sleep(keys.POLL_S)
            except Exception:  # a timed-out wait leaves its answer on the connection; or the store is gone
                self._watch_blocked = False
                client = None
                self._halt.wait(self.cfg.heartbeat_s)
                continue
            if current >= nxt:
                seen = current
                self._wake.set()
                continue
            while self.latest_gen < nxt and not self._halt.wait(self.cfg.heartbeat_s):
                pass  # a record that is not current (forged): the beat's pace until generation nxt is

    def halt(self) -> None:
        self._halt.set()
        self._wake.set()

    def join_watch(self, timeout_s: float) -> None:
        """Wait (bounded) for the watch to end, unless it is blocked in its long wait (safe to exit under)."""
        if self._watch_thread is not None and not self._watch_blocked:
            self._watch_thread.join(timeout_s)


def _agent_beat_socket() -> tuple[socket.socket | None, str]:
    """A datagram socket to the agent's beat socket (TM_AGENT_BEATS), or None without an agent."""
    path = os.environ.get("TM_AGENT_BEATS", "")
    if not path:
        return None, ""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.setblocking(False)
    return sock, path


def _agent_pidfd() -> int | None:
    """A pidfd of the agent that started this process (multi-host), readable once the agent exits."""
    pid = os.environ.get("TM_AGENT_PID", "")
    if not pid.isdigit():
        return None
    try:
        return os.pidfd_open(int(pid))
    except ProcessLookupError:
        os.kill(os.getpid(), signal.SIGKILL)  # the agent died before this process got going
    except (OSError, AttributeError):
        return None
    return None


class Job:
    """This process's view of the job."""

    def __init__(self, cfg: ProcessConfig) -> None:
        self.cfg = cfg
        torch.set_num_threads(cfg.num_threads)
        self.store: dist.TCPStore = keys.connect(cfg.store_host, cfg.store_port)
        self.sealer = Sealer(cfg.job_token, cfg.proc)
        self.records = keys.Records(self.store, self.sealer)
        """The store through the job's seal: what this process writes is sealed, what it reads is verified."""
        self.faults = FaultInjector(cfg.faults, self.records, cfg.proc)
        self.records.put(keys.k_hello(cfg.proc), ProcessHello(pid=os.getpid(), role=cfg.role))
        self.heartbeat = Heartbeat(cfg, self.sealer)
        self.heartbeat.start()
        self._previous_hook = sys.excepthook
        sys.excepthook = self._report_fatal
        # Stop the heartbeat before the interpreter tears down: a store client destroyed mid-call from a
        # daemon thread aborts the process ("terminate called without an active exception").
        atexit.register(self.close)

    def close(self) -> None:
        self.heartbeat.halt()
        self.heartbeat.join(timeout=5.0)
        self.heartbeat.join_watch(timeout_s=1.0)

    @property
    def proc(self) -> str:
        return self.cfg.proc

    @property
    def is_standby(self) -> bool:
        return self.cfg.role == "standby"

    def num_workers(self) -> int:
        config = self.records.wait([keys.k_job_config()], self.cfg.recovery_timeout_s, what="the job's config")
        return int(config[keys.k_job_config()]["nproc"])

    def fatal(self, message: str) -> None:
        """Tell the coordinator the script itself failed, so it stops the job instead of swapping in a standby."""
        with contextlib.suppress(Exception):  # the coordinator may already be gone; nothing left to tell
            self.records.put(keys.k_fatal(self.proc), FatalError(message=message[-4000:]))

    def _report_fatal(
        self, kind: type[BaseException], value: BaseException, tb: TracebackType | None
    ) -> None:
        if not issubclass(kind, KeyboardInterrupt):
            self.fatal("".join(traceback.format_exception(kind, value, tb)))
        self._previous_hook(kind, value, tb)


_job: Job | None = None


def init() -> Job:
    """Join the job this process was launched into (idempotent)."""
    global _job
    if _job is None:
        try:
            cfg = ProcessConfig.from_env()
        except LaunchError as exc:
            sys.stderr.write(f"trainmover: {exc}\n")
            raise SystemExit(2) from None
        # `kill -USR1 <pid>` prints every thread's stack to the process's stderr (its agent's log, or its rank
        # log with --rank-logs): what a stuck member is waiting on, without stopping it.
        faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
        _job = Job(cfg)
    return _job
