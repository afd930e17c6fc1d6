"""The coordinator: the authority on membership, running off the training processes.

It hosts the job's store, watches every process (exit status and heartbeat), fences a hung one, declares
members dead, promotes warm standbys into their logical ranks by publishing a new generation, orders
replacement standbys, and turns the members' reports into `recovered` events. Processes come from a
`ProcessPool` (local subprocesses here; cloud instances behind the same small interface later).

An orchestrator steers a running job through control keys in the store (`runtime.control`): a standby target
(more or fewer warm standbys) and planned moves (a rank's process leaves on purpose and a standby takes the
rank, exactly as after a failure). They are read in the health tick, so steering costs no thread; a value the
coordinator cannot apply is answered with a `control_rejected` event, never with a crash.
"""

from __future__ import annotations

import logging
import os
import selectors
import signal
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch.distributed as dist

from runtime import store as keys
from runtime.auth import Sealer
from runtime.chaos import Candidate, ChaosMonkey, parse_chaos
from runtime.control import ControlValueError, MoveRequest, parse_move, parse_standby_target
from runtime.decisions import MoveContext, move_refusal, recovery_metrics
from runtime.events import EventLog
from runtime.faults import parse_plan
from runtime.hosts import NoSlot
from runtime.membership import Generation

log = logging.getLogger("trainmover.coordinator")

LOOP_S = 0.005
HEALTH_EVERY_S = 0.2
HOST_SETTLE_S = 0.05
"""Across hosts, how long after the last declared death the coordinator waits for more before it publishes the
new generation: losses seen together move together."""
SPAWN_WINDOW_S = 10.0
SPAWN_MIN_PER_WINDOW = 20
SPAWN_PER_STANDBY = 10
"""Standbys started in any 10 s: at most max(20, 10 x the largest standby target). Churn beyond it is deferred,
not dropped; a script whose standbys cannot start at all is stopped by the in-a-row rule instead."""


class ProcessHandle(Protocol):
    """One training process as the coordinator sees it."""

    name: str
    role: str
    pid: int

    def poll(self) -> int | None: ...

    def kill(self) -> None: ...

    def wait(self, timeout_s: float) -> int | None: ...

    def exit_fd(self) -> int | None:
        """A file descriptor that turns readable when the process exits (a pidfd), or None to be polled."""
        ...

    def close(self) -> None:
        """Release what watching the process held (its pidfd); the process is gone or killed by now."""
        ...


class ProcessPool(Protocol):
    def spawn(self, name: str, role: str) -> ProcessHandle: ...


@dataclass(frozen=True, slots=True)
class CoordinatorSettings:
    """Detection and replacement knobs (the launcher fills them from its command line)."""

    job_id: str
    job_token: str
    nproc: int
    standby: int
    hang_timeout_s: float = 2.0
    """A process whose heartbeat is silent this long is declared hung, fenced (SIGKILL) and replaced."""
    startup_timeout_s: float = 180.0
    """Longest a process may take from start to its first heartbeat."""
    standby_wait_s: float = 30.0
    """With no standby ready, how long to wait for one (a replacement warming up) before stopping the job."""
    replenish: bool = True
    """Start a new standby whenever one is promoted or lost, keeping the pool at the standby target."""
    exit_grace_s: float = 60.0
    """After training completes, how long processes may take to exit before they are killed."""
    faults: str = ""
    start_when_standbys_ready: bool = False
    """Hold the workers at generation 0 until every standby is warm, so that the first failure is covered."""
    chaos: str = ""
    """Random faults the coordinator injects itself (runtime.chaos), for soak tests and benchmarks."""
    max_standby_failures: int = 5
    """Standbys that die in a row before they are warm, after which the job stops instead of spawning more."""


@dataclass
class Member:
    handle: ProcessHandle
    started_at: float
    hello_ok: bool = False
    ready: bool = False
    hb_value: int = -1
    hb_changed_at: float = 0.0
    hb_changed_wall: float = 0.0
    dead: bool = False
    exit_code: int | None = None
    assigned_gen: int | None = None
    exit_seen_at: float | None = None
    """Wall-clock moment its pidfd turned readable: when the process exited, to the loop's latency."""


@dataclass
class Death:
    rank: int
    proc: str
    pid: int
    cause: str
    failure_at: float
    declared_at: float


@dataclass
class PendingRecovery:
    gen: Generation
    deaths: list[Death]
    declared_at: float
    reports: dict[int, dict[str, Any]] = field(default_factory=dict)
    attempts: list[dict[str, Any]] = field(default_factory=list)
    """Earlier generations of this recovery that failed before its replayed step committed, and why."""

    def replayed(self) -> bool:
        return any("replay_done_at" in r for r in self.reports.values())


@dataclass(frozen=True, slots=True)
class JobResult:
    """How a job ended."""

    exit_code: int
    message: str
    events: list[dict[str, Any]]
    digests: dict[str, str]


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


class JobFailed(Exception):
    pass


class Coordinator:
    """Runs one job to its end; `run()` returns how it ended."""

    def __init__(
        self, settings: CoordinatorSettings, store: dist.TCPStore, pool: ProcessPool, events: EventLog
    ) -> None:
        self.s = settings
        self.store = store
        self.pool = pool
        self.events = events
        # The refusal hook holds the event log only: a bound method would make a cycle that keeps the store (and
        # its listening socket) alive after the job, until the garbage collector runs.
        self.records = keys.Records(store, Sealer(settings.job_token, "coordinator", _refusal_reporter(events)))
        """The store through the job's seal: every record read is verified, every record written is sealed."""
        self.procs: dict[str, Member] = {}
        self.gen = Generation(0, tuple(f"w{i}" for i in range(settings.nproc)))
        self.pending_deaths: dict[int, Death] = {}
        self.waiting_since: float | None = None
        self.recoveries: list[PendingRecovery] = []
        self.failed_seen_at: float | None = None
        self.completing_since: float | None = None
        self.stop_sent = False
        self.next_standby = 0
        self.spawned_standbys = 0
        self._spawn_times: deque[float] = deque()
        self.fault_count = len(parse_plan(settings.faults))
        self.standby_target = settings.standby
        """Unpromoted standbys to keep: `settings.standby` until an orchestrator sets another."""
        self._max_standby_target = settings.standby
        self._control_seq: dict[str, int] = {}
        self._control_last: dict[str, Any] = {}
        """The newest sequence number applied per control key: an older or equal one is a replay."""
        self._last_move_seq = 0
        self.started = False
        self._selector = selectors.DefaultSelector()
        self._exit_fds: dict[str, int] = {}
        self._fault_records: dict[int, dict[str, Any]] = {}
        self.holders: set[str] = set(self.gen.members)
        """Live members known to hold the complete training state (every worker of generation 0)."""
        self.standby_failures_in_row = 0
        chaos = parse_chaos(settings.chaos)
        self.chaos = ChaosMonkey(chaos) if chaos is not None else None
        self._chaos_hit: dict[str, float] = {}
        """Processes the chaos monkey signalled, and when: their true moment of failure."""
        self._chaos_over = False
        self._health_due = True
        self._wake_fd: int | None = getattr(pool, "wake_fd", lambda: None)()
        """A pool across hosts (runtime.hosts) wakes the loop through this when a process exits or a host is lost."""
        if self._wake_fd is not None:
            self._selector.register(self._wake_fd, selectors.EVENT_READ, None)

    # -- lifecycle -----------------------------------------------------------------------------------
    def run(self) -> JobResult:
        t0 = time.time()
        self.records.put(keys.k_job_config(), {"nproc": self.s.nproc, "job_id": self.s.job_id})
        helpers: dict[str, int] = getattr(self.pool, "helpers", dict)()
        self.events.emit("job_started", job_id=self.s.job_id, nproc=self.s.nproc, standby=self.s.standby,
                         port=self.store.port, helpers=helpers, **getattr(self.pool, "describe", dict)())
        self._pool_events()
        next_health = 0.0
        try:
            for name in self.gen.members:
                self._spawn(name, "worker")
            for _ in range(self.s.standby):
                self._spawn_standby()
            self.started = not self.s.start_when_standbys_ready
            if self.started:
                self._publish(self.gen)
                self._emit_generation(self.gen)
            while True:
                # Block until a child exits or the next health check is due: the coordinator shares the
                # machine with the workers (here, two cores), so it must not spin.
                busy = bool(self.pending_deaths) or not self.started or self.completing_since is not None
                now = time.monotonic()
                exited = self._wait_for_exit(LOOP_S if busy or not self._exit_fds else max(0.0, next_health - now))
                now = time.monotonic()
                self._pool_events()
                self._poll_exits()
                due = now >= next_health
                if due:
                    next_health = now + HEALTH_EVERY_S
                    if self.completing_since is None:
                        self._poll_health(now)
                        self._poll_control()
                        self._tick_chaos(now)
                if due or busy or exited:
                    self._health_due = due
                    result = self._progress(now)
                    if result is not None:
                        return self._finish(result, t0)
        except JobFailed as exc:
            return self._finish(JobResult(1, str(exc), [], {}), t0)
        except KeyboardInterrupt:
            return self._finish(JobResult(130, "interrupted; every process was stopped", [], {}), t0)

    def _finish(self, result: JobResult, t0: float) -> JobResult:
        self.records.put(keys.k_over(), {"exit_code": result.exit_code})
        self._flush_recoveries(final=True)
        for name, at in self._chaos_hit.items():
            if not self.procs[name].dead:  # a hang injected too close to the end to be detected before it
                self.events.emit("chaos_unresolved", proc=name, pid=self.procs[name].handle.pid, time=at,
                                 reason="the job ended before the fault was detected")
        digests = self._digests()
        refused = dict(self.records.sealer.refused)
        if result.exit_code == 0:
            self.events.emit("job_finished", wall_s=time.time() - t0, generation=self.gen.gen, digests=digests,
                             step=self.records.get_int(keys.k_progress(), -1),
                             final_digest=digests.get(self.gen.members[0]), refused_values=refused)
        else:
            self.events.emit("job_failed", wall_s=time.time() - t0, reason=result.message, exit_code=result.exit_code,
                             refused_values=refused)
        self._shutdown()
        return JobResult(result.exit_code, result.message, list(self.events.events), digests)

    def _shutdown(self) -> None:
        self._send_stop()
        deadline = time.monotonic() + 10.0
        members = set(self.gen.members)
        for name, m in self.procs.items():
            if name not in members:
                m.handle.kill()  # an unpromoted standby holds nothing worth an orderly exit
        for m in self.procs.values():
            if m.handle.poll() is None:
                m.handle.wait(max(0.0, deadline - time.monotonic()))
            if m.handle.poll() is None:
                m.handle.kill()
                m.handle.wait(5.0)
        self._selector.close()
        for m in self.procs.values():
            m.handle.close()

    def _send_stop(self) -> None:
        """Tell every process to leave; unpromoted standbys block on their assignment key, so release it too."""
        if self.stop_sent:
            return
        self.stop_sent = True
        self.records.put(keys.k_stop(), True)
        for name, m in self.procs.items():
            if m.handle.role == "standby" and m.assigned_gen is None:
                self.records.put(keys.k_assign(name), -1)

    # -- processes -----------------------------------------------------------------------------------
    def _spawn(self, name: str, role: str) -> None:
        try:
            handle = self.pool.spawn(name, role)
        except NoSlot as exc:
            raise JobFailed(f"cannot place {role} {name}: {exc}; start more agents or fewer workers") from None
        now = time.monotonic()
        self.procs[name] = Member(handle, now, hb_changed_at=now, hb_changed_wall=time.time())
        fd = handle.exit_fd()
        if fd is not None:
            self._selector.register(fd, selectors.EVENT_READ, name)
            self._exit_fds[name] = fd

    def _wait_for_exit(self, timeout_s: float) -> bool:
        """Sleep until a child process exits (its pidfd turns readable) or the timeout passes."""
        if not self._exit_fds and self._wake_fd is None:
            time.sleep(timeout_s)
            return False
        ready = self._selector.select(timeout_s)
        seen = time.time()
        for key, _ in ready:
            if key.data is None:
                self.pool.drain_wake()  # type: ignore[attr-defined]
                continue
            self._selector.unregister(key.fileobj)
            self._exit_fds.pop(key.data, None)
            self.procs[key.data].exit_seen_at = seen
        return bool(ready)

    def _spawn_standby(self) -> str | None:
        """Start a standby; None when no host has a free slot (a pool across hosts), tried again later."""
        free = getattr(self.pool, "free_slots", None)
        if free is not None and free() < 1:
            return None
        name = f"s{self.next_standby}"
        self.next_standby += 1
        self.spawned_standbys += 1
        self._spawn(name, "standby")
        return name

    def _members(self) -> dict[str, int]:
        return {proc: rank for rank, proc in enumerate(self.gen.members)}

    def _poll_exits(self) -> None:
        for name, m in list(self.procs.items()):  # declaring a death may spawn a replacement into the table
            if m.dead:
                continue
            code = m.handle.poll()
            if code is not None:
                cause = getattr(m.handle, "exit_cause", lambda: None)() or describe_exit(code)
                if m.exit_seen_at is None:
                    m.exit_seen_at = getattr(m.handle, "exited_at", None)
                self._declare_dead(name, cause, code)

    def _pool_events(self) -> None:
        """Hosts that joined or were lost, as the pool across hosts saw them."""
        for kind, fields in getattr(self.pool, "take_events", list)():
            self.events.emit(kind, **fields)

    def _declare_dead(self, name: str, cause: str, code: int | None, failure_at: float | None = None) -> None:
        m = self.procs[name]
        m.dead = True
        m.exit_code = code
        rank = self._members().get(name)
        if self.completing_since is None and self.started and rank is not None and self._all_done():
            # Every member finished the last step and this one left before the loop noticed: not a failure.
            self.completing_since = time.monotonic()
            self.pending_deaths.clear()
        if self.completing_since is not None:
            return  # training is over; exits now are the script's own business, judged at the end
        self._check_fatal(name)
        joined = m.hello_ok or self._hello_ok(name, m)
        if code is not None and code >= 0 and not joined and name not in self._chaos_hit:
            raise JobFailed(
                f"{m.handle.role} {name} (pid {m.handle.pid}) {cause} before joining the job. Every process runs "
                "the script, and the script must call runtime.init() (or build a Trainer) and Trainer.fit(); run "
                "it with plain `python` to see its own error. The job was stopped.")
        now_wall = time.time()
        fault = self._fault_for(name)
        # The failure's moment: when the chaos monkey or an injected fault struck, else the last heartbeat of a
        # hung process, else the exit seen on its pidfd; the moment it was noticed only when nothing else is known.
        failure = (self._chaos_hit.get(name) or (fault["time"] if fault else None) or failure_at
                   or m.exit_seen_at or now_wall)
        if rank is None:
            if code == 0:
                return  # a standby that joined and then left on its own (the job is ending): nothing lost
            self.events.emit("standby_lost", proc=name, pid=m.handle.pid, cause=cause, was_ready=m.ready,
                             failure_at=failure, declared_at=now_wall, detect_s=now_wall - failure)
            log.warning("standby %s (pid %d) %s", name, m.handle.pid, cause)
            if not m.ready:
                self.standby_failures_in_row += 1
                if self.standby_failures_in_row >= self.s.max_standby_failures:
                    raise JobFailed(
                        f"{self.standby_failures_in_row} standbys in a row died before they were warm (the last, "
                        f"{name}, {cause}); the job was stopped instead of starting more. Check that the script "
                        "runs on its own and that the machine has memory for one more process.")
            if self.s.replenish:
                self._top_up("replace a lost standby")
            return
        self.holders.discard(name)
        death = Death(rank, name, m.handle.pid, cause, failure, now_wall)
        self.pending_deaths[rank] = death
        if self.waiting_since is None:
            self.waiting_since = time.monotonic()
        step = fault.get("step") if fault else None
        self.events.emit("member_failed", generation=self.gen.gen, rank=rank, proc=name, pid=m.handle.pid,
                         cause=cause, step=step, failure_at=failure, declared_at=now_wall,
                         detect_s=now_wall - failure)
        where = f" at step {step}" if step is not None else ""
        log.warning("worker %s (rank %d, pid %d) %s%s", name, rank, m.handle.pid, cause, where)
        self._update_holders()  # a promoted standby may have finished its handoff since the last tick
        if self.started and not (self.holders & set(self.gen.members)):
            lost = ", ".join(f"rank {d.rank} ({d.proc}, {d.cause})" for d in self.pending_deaths.values())
            raise JobFailed(
                f"every copy of the training state was lost: {lost}; no surviving process holds it, so no standby "
                "can be given it. The job was stopped; restart it from its last backup checkpoint.")

    def _fault_for(self, name: str) -> dict[str, Any] | None:
        for i in range(self.fault_count):
            if i not in self._fault_records and (record := self.records.get(keys.k_fault(i))) is not None:
                self._fault_records[i] = record
        matches = [r for r in self._fault_records.values()
                   if isinstance(r, dict) and r.get("proc") == name and r.get("action") != "corrupt"]
        return matches[-1] if matches else None

    def _poll_health(self, now: float) -> None:
        # Processes that beat before have a heartbeat key: all of them are read in one round trip.
        beating = [n for n, m in self.procs.items() if not m.dead and m.hello_ok and m.hb_value >= 0]
        beats = self.records.get_present([keys.k_heartbeat(n) for n in beating])
        for name, m in list(self.procs.items()):
            if m.dead:
                continue
            if not m.hello_ok:
                m.hello_ok = self._hello_ok(name, m)
            key = keys.k_heartbeat(name)
            beat = (beats[key] if key in beats else self.records.get(key)) if m.hello_ok else None
            value = beat if isinstance(beat, int) and not isinstance(beat, bool) else -1  # -1 until the first beat
            if value > m.hb_value:  # a replayed older beat is no sign of life
                m.hb_value, m.hb_changed_at, m.hb_changed_wall = value, now, time.time()
            elif m.hb_value < 0 and now - m.started_at > self.s.startup_timeout_s:
                self._fence(name, f"did not start within {self.s.startup_timeout_s:.0f} s")
            elif m.hb_value >= 0 and now - m.hb_changed_at > self.s.hang_timeout_s and not self._suspect(name):
                self._fence(name, f"hung (no heartbeat for {now - m.hb_changed_at:.1f} s)", m.hb_changed_wall)
            if (
                m.handle.role == "standby" and not m.ready and not m.dead and m.hello_ok
                and isinstance(warm := self.records.get(keys.k_ready(name)), dict)
            ):
                m.ready = True
                self.standby_failures_in_row = 0
                self.events.emit("standby_ready", proc=name, pid=m.handle.pid, warmup_s=warm.get("warmup_s"),
                                 ready_after_s=now - m.started_at)

    def _suspect(self, name: str) -> bool:
        """Whether the process's whole host went silent: the host timeout then takes all its ranks at once."""
        suspect = getattr(self.pool, "suspect", None)
        return bool(suspect(name)) if suspect is not None else False

    def _hello_ok(self, name: str, m: Member) -> bool:
        """Whether the process said hello, sealed with the job's secret, from the pid the pool started.

        A hello that fails is ignored (counted by the seal): an outsider who writes one first cannot get a
        process fenced, and the real process's own hello overwrites it."""
        hello = self.records.get(keys.k_hello(name))
        if not isinstance(hello, dict):
            return False
        if hello.get("pid") != m.handle.pid:
            self.records.sealer.refuse(keys.k_hello(name), f"it names pid {hello.get('pid')!r}, not {m.handle.pid}")
            return False
        return True

    def _check_fatal(self, name: str) -> None:
        fatal = self.records.get(keys.k_fatal(name))
        if isinstance(fatal, dict) and isinstance(fatal.get("message"), str):
            last = fatal["message"].strip().splitlines()[-1] if fatal["message"].strip() else "?"
            raise JobFailed(
                f"the training script failed in {name}: {last}\n"
                "This is an error in the script itself, so a standby would fail the same way; the job was "
                "stopped. Full traceback above."
            )

    def _fence(self, name: str, cause: str, failure_at: float | None = None) -> None:
        """Make sure a process declared dead cannot come back and write into the job (kill, then reap)."""
        m = self.procs[name]
        m.handle.kill()
        m.handle.wait(5.0)
        self._declare_dead(name, cause, m.handle.poll(), failure_at)

    # -- the standby pool ----------------------------------------------------------------------------
    def _unpromoted_standbys(self) -> list[str]:
        """Live standbys that hold no rank, warm or still warming up."""
        return [n for n, m in self.procs.items() if m.handle.role == "standby" and not m.dead
                and m.assigned_gen is None]

    def _ready_standbys(self) -> list[str]:
        """Warm standbys that look alive: one whose heartbeat has been silent for half the hang timeout is not
        promoted (it may be hung; promoting it would cost the new generation a hang detection)."""
        now = time.monotonic()
        return [n for n in self._unpromoted_standbys() if self.procs[n].ready and self.procs[n].hello_ok
                and now - self.procs[n].hb_changed_at < self.s.hang_timeout_s / 2]

    def _top_up(self, reason: str) -> None:
        """Start standbys until the unpromoted ones (warming up included) reach the target, at a bounded rate:
        what the rate defers, the next tick starts (`_progress` tops up every tick)."""
        now = time.monotonic()
        while self._spawn_times and now - self._spawn_times[0] > SPAWN_WINDOW_S:
            self._spawn_times.popleft()
        allowed = max(SPAWN_MIN_PER_WINDOW, SPAWN_PER_STANDBY * self._max_standby_target) - len(self._spawn_times)
        for _ in range(min(allowed, self.standby_target - len(self._unpromoted_standbys()))):
            proc = self._spawn_standby()
            if proc is None:
                return  # no free slot; the next tick tries again (a new host may join)
            self._spawn_times.append(now)
            self.events.emit("standby_spawned", proc=proc, reason=reason)

    def _release_surplus(self, reason: str) -> None:
        """Stop unpromoted standbys beyond the target, never one that a pending death is waiting for."""
        spare = self._unpromoted_standbys()
        surplus = len(spare) - max(self.standby_target, len(self.pending_deaths))
        # Those still warming up go first (newest first): the warm ones are what covers the next failure.
        for name in sorted(spare, key=lambda n: (self.procs[n].ready, -self.procs[n].started_at))[:max(0, surplus)]:
            m = self.procs[name]
            m.dead = True  # released, not lost: nothing replaces it
            m.handle.kill()
            m.exit_code = m.handle.wait(5.0)
            self.events.emit("standby_released", proc=name, pid=m.handle.pid, was_ready=m.ready, reason=reason)
            log.info("released standby %s (pid %d): %s", name, m.handle.pid, reason)

    # -- control (runtime.control) --------------------------------------------------------------------
    def _poll_control(self) -> None:
        """Apply what an orchestrator wrote since the last tick; each value is acted on once."""
        for key in (keys.k_control_standby_target(), keys.k_control_move()):
            signed = self.records.get(key)
            if signed is None or signed == self._control_last.get(key):
                continue  # nothing, refused (and counted once), or what the last tick saw
            self._control_last[key] = signed
            seq = signed.get("seq") if isinstance(signed, dict) else None
            if not isinstance(seq, int) or isinstance(seq, bool) or "request" not in signed:
                self.records.sealer.refuse(key, "a sealed control value without seq and request")
                continue
            last = self._control_seq.get(key, 0)
            if seq <= last:
                if seq < last:
                    self.records.sealer.refuse(key, f"stale (seq {seq}, the last applied is {last})")
                continue
            self._control_seq[key] = seq
            if key == keys.k_control_standby_target():
                self._apply_standby_target(signed["request"])
            else:
                self._apply_move(signed["request"])

    def _reject(self, control: str, reason: str, **fields: Any) -> None:
        log.warning("ignored a %s request: %s", control, reason)
        self.events.emit("control_rejected", control=control, reason=reason, **fields)

    def _apply_standby_target(self, raw: str) -> None:
        try:
            target = parse_standby_target(raw)
        except ControlValueError as exc:
            self._reject("standby_target", str(exc), value=str(raw)[:40])
            return
        old, self.standby_target = self.standby_target, target
        self._max_standby_target = max(self._max_standby_target, target)
        if target == old:
            return
        self.events.emit("standby_target_changed", old=old, new=target)
        log.info("standby target changed from %d to %d", old, target)
        if target > old:
            self._top_up(f"standby target raised to {target}")
        else:
            self._release_surplus(f"standby target lowered to {target}")

    def _apply_move(self, raw: str) -> None:
        try:
            request = parse_move(raw)
        except ControlValueError as exc:
            self._reject("move", str(exc), seq=exc.seq)
            self._answer_move(exc.seq, str(exc))
            return
        refusal = self._move_refusal(request)
        if request.seq > self._last_move_seq:
            self._last_move_seq = request.seq
        if refusal is not None:
            self._reject("move", refusal, seq=request.seq, ranks=list(request.ranks))
            self._answer_move(request.seq, refusal)
            return
        procs = [self.gen.members[r] for r in request.ranks]
        self.events.emit("move_accepted", seq=request.seq, ranks=list(request.ranks), procs=procs,
                         reason=request.reason)
        self._answer_move(request.seq, None)
        log.warning("moving rank(s) %s (%s) to standbys: %s", list(request.ranks), ", ".join(procs), request.reason)
        # Leaving on purpose takes the failure path: after a SIGKILL the survivors' recovery is the one that is
        # tested bit for bit, and a hand-over at a step boundary would save only the replay of one step.
        for proc in procs:
            self._fence(proc, f"planned_move:{request.reason}")

    def _move_refusal(self, request: MoveRequest) -> str | None:
        return move_refusal(request, MoveContext(
            last_seq=self._last_move_seq, started=self.started, finished=self.started and self._all_done(),
            world=self.gen.world_size, recovering=bool(self.pending_deaths or self.recoveries),
            ready=len(self._ready_standbys())))

    def _answer_move(self, seq: int | None, refusal: str | None) -> None:
        if seq is not None:
            self.records.put(keys.k_control_move_result(),
                             {"seq": seq, "accepted": refusal is None, "reason": refusal or ""})

    # -- membership ----------------------------------------------------------------------------------
    def _progress(self, now: float) -> JobResult | None:
        if not self.started:
            if len(self._ready_standbys()) >= self.standby_target:
                self.started = True
                self._publish(self.gen)
                self._emit_generation(self.gen)
            elif now - min(m.started_at for m in self.procs.values()) > self.s.startup_timeout_s:
                raise JobFailed(f"the standbys were not warm within {self.s.startup_timeout_s:.0f} s; "
                                "check that the script runs, or start without waiting for standbys")
            return None
        if self.completing_since is not None:
            return self._progress_completion(now)
        if self._all_done():
            self.completing_since = now
            self.pending_deaths.clear()
            return None
        self._update_holders()
        self._handle_failed_reports(now)
        if self.s.replenish:
            self._top_up("keep the standby target")
        if self.pending_deaths:
            self._replace(now)
        if self._health_due:
            # Reports are read on health ticks only: a recovery of N ranks costs 2N store round trips per read,
            # which the busy loop (every 5 ms while a death is pending) must not pay.
            self._flush_recoveries()
        return None

    def _update_holders(self) -> None:
        """A promoted standby holds the state once its handoff completed (it says so in the store)."""
        for rank, proc in enumerate(self.gen.members):
            if proc not in self.holders and not self.procs[proc].dead and self.records.has(
                keys.k_holds(self.gen.gen, rank)
            ):
                self.holders.add(proc)

    # -- chaos (runtime.chaos) -----------------------------------------------------------------------
    def _tick_chaos(self, now: float) -> None:
        if self.chaos is None or not self.started or self._chaos_over:
            return
        if self.chaos.next_at is None:
            self.chaos.start(now)
        if not self.chaos.due(now):
            return
        if any(self.records.has(keys.k_done(self.gen.gen, r)) for r in range(self.gen.world_size)):
            self._chaos_over = True  # training is finishing: a fault now would test the script's exit, not us
            return
        self._update_holders()
        members = self._members()
        # Standbys hit while warming whose loss is not declared yet count towards the in-a-row stop too.
        warming_hit = sum(1 for n in self._chaos_hit if not self.procs[n].dead and not self.procs[n].ready
                          and n not in members)
        candidates = []
        for name, m in self.procs.items():
            if m.dead or name in self._chaos_hit or m.hb_value < 0 or m.handle.poll() is not None:
                continue  # only processes that joined (a hang before the first heartbeat waits out the startup)
            if name in members:
                holds = name in self.holders
                candidates.append(Candidate(name, "worker", "training" if holds else "receiving", holds))
            elif m.handle.role == "standby" and m.assigned_gen is None:
                if not m.ready and self.standby_failures_in_row + warming_hit >= self.s.max_standby_failures - 2:
                    continue  # chaos must not trip the stop meant for a script whose standbys cannot start
                candidates.append(Candidate(name, "standby", "standby_warm" if m.ready else "standby_warming",
                                            False))
        for shot in self.chaos.strike(now, candidates):
            m = self.procs[shot.proc]
            at = time.time()
            self._chaos_hit[shot.proc] = at
            remote = getattr(m.handle, "send_signal", None)
            if remote is not None:
                remote(shot.signal)
            else:
                os.kill(m.handle.pid, signal.SIGKILL if shot.signal == "kill" else signal.SIGSTOP)
            state = next(c.state for c in candidates if c.proc == shot.proc)
            self.events.emit("chaos_injected", proc=shot.proc, pid=m.handle.pid, signal=shot.signal,
                             role="worker" if shot.proc in members else "standby", state=state, time=at,
                             rank=members.get(shot.proc), generation=self.gen.gen, n=self.chaos.injected)
            log.warning("chaos: %s %s (pid %d, %s)", shot.signal, shot.proc, m.handle.pid, state)
        if self.chaos.exhausted:
            self._chaos_over = True
            self.records.put(keys.k_chaos_done(), self.chaos.injected)

    def _all_done(self) -> bool:
        return self.records.has_all([keys.k_done(self.gen.gen, r) for r in range(self.gen.world_size)])

    def _progress_completion(self, now: float) -> JobResult | None:
        members = [self.procs[p] for p in self.gen.members]
        if not self.stop_sent and all(self.records.has(keys.k_digest(p)) or self.procs[p].dead
                                      for p in self.gen.members):
            self._send_stop()
        if all(m.dead or m.handle.poll() is not None for m in members):
            codes = {p: self.procs[p].handle.poll() for p in self.gen.members}
            bad = {p: c for p, c in codes.items() if c}
            if bad:
                return JobResult(1, "training completed but the script then failed in "
                                 + ", ".join(f"{p} ({describe_exit(c or 0)})" for p, c in bad.items()), [], {})
            return JobResult(0, f"training completed in generation {self.gen.gen}", [], {})
        if now - self.completing_since > self.s.exit_grace_s:  # type: ignore[operator]
            return JobResult(1, f"training completed but workers did not exit within {self.s.exit_grace_s:.0f} s",
                             [], {})
        return None

    def _handle_failed_reports(self, now: float) -> None:
        """A member saw a collective fail. Usually a death explains it; if none does, rebuild anyway."""
        if keys.read_counter(self.store, keys.k_failed_count(self.gen.gen)) == 0:
            self.failed_seen_at = None
            return
        reports = [r for p in self.gen.members
                   if isinstance(r := self.records.get(keys.k_failed(self.gen.gen, p)), dict)]
        if not reports:
            self.failed_seen_at = None
            return
        for r in reports:
            if r.get("kind") == "state_lost":
                raise JobFailed(f"{r.get('message', 'the training state was lost')}; the job was stopped")
        for r in reports:
            untrusted = r.get("untrusted_rank")
            if (isinstance(untrusted, int) and 0 <= untrusted < self.gen.world_size
                    and not self.procs[self.gen.members[untrusted]].dead):
                self._fence(self.gen.members[untrusted], "failed to prove it belongs to the job during a handoff")
        if self.pending_deaths:
            return
        if self.failed_seen_at is None:
            self.failed_seen_at = now
        elif now - self.failed_seen_at > self.s.hang_timeout_s:
            self.failed_seen_at = None
            message = reports[0].get("message", "")
            new = Generation(self.gen.gen + 1, self.gen.members, f"collective error without a lost member: {message}")
            log.warning("collective error without a lost member (%s); rebuilding the groups", message)
            for rec in self._unfinished_recoveries(new):
                rec.gen, rec.reports = new, {}
                self.recoveries.append(rec)
            self._publish(new)
            self._emit_generation(new)

    def _replace(self, now: float) -> None:
        ready = self._ready_standbys()
        deaths = sorted(self.pending_deaths.values(), key=lambda d: d.rank)
        if self._wake_fd is not None and time.time() - max(d.declared_at for d in deaths) < HOST_SETTLE_S:
            return  # across hosts, hosts failing together (a rack, a switch) are seen within ms: one generation
        if len(ready) < len(deaths):
            if self.s.replenish:
                for _ in range(len(deaths) - len(self._unpromoted_standbys())):
                    if (proc := self._spawn_standby()) is not None:
                        self.events.emit("standby_spawned", proc=proc, reason="cover a lost worker")
            assert self.waiting_since is not None
            if now - self.waiting_since > self.s.standby_wait_s:
                lost = ", ".join(f"rank {d.rank} ({d.proc}, {d.cause})" for d in deaths)
                hint = ("Start more standbys (--standby K) or allow a longer wait (--standby-wait SECONDS).")
                if getattr(self.pool, "free_slots", None) is not None:
                    hint = ("No standby host is left: start `trainmover agent` on another host (it joins as a standby "
                            "host), or keep more standby slots (--standby K), or allow a longer --standby-wait.")
                raise JobFailed(
                    f"lost {lost} and no standby became ready within {self.s.standby_wait_s:.0f} s; the job was "
                    f"stopped. {hint}"
                )
            return
        assignment = {d.rank: ready[i] for i, d in enumerate(deaths)}
        reason = "; ".join(f"{d.proc} {d.cause}" for d in deaths)
        new = self.gen.replace(assignment, reason)
        declared_at = time.time()
        for proc in assignment.values():
            self.procs[proc].assigned_gen = new.gen
        self._publish(new, assign=list(assignment.values()))
        # A recovery whose generation is superseded before its replayed step committed goes on in this one: its
        # failure, its deaths and its failed generations are this recovery's, and its time runs from there.
        earlier = self._unfinished_recoveries(new)
        merged = [d for r in earlier for d in r.deaths] + deaths
        rec = PendingRecovery(new, merged, declared_at, attempts=[a for r in earlier for a in r.attempts])
        self.recoveries.append(rec)
        self._emit_generation(new)
        self.pending_deaths.clear()
        self.waiting_since = None
        if self.s.replenish:
            self._top_up("replace a promoted standby")

    def _unfinished_recoveries(self, new: Generation) -> list[PendingRecovery]:
        """Take out the pending recoveries that `new` supersedes before their replay committed; each records
        its generation as a failed attempt."""
        self._read_reports()
        out = [r for r in self.recoveries if r.gen.gen < new.gen and not r.replayed()]
        for r in out:
            self.recoveries.remove(r)
            r.attempts.append({"generation": r.gen.gen, "failed": new.reason})
        return out

    def _publish(self, gen: Generation, assign: list[str] | None = None) -> None:
        self.records.put(keys.k_gen(gen.gen), gen.to_json())
        for proc in assign or []:
            self.records.put(keys.k_assign(proc), gen.gen)
        self.records.put(keys.k_current_gen(), gen.gen)
        self.gen = gen
        announce = getattr(self.pool, "announce", None)
        if announce is not None:
            announce(gen.gen, list(gen.members))

    def _emit_generation(self, gen: Generation) -> None:
        self.events.emit(
            "generation", generation=gen.gen, reason=gen.reason, world_size=gen.world_size,
            members=[{"rank": r, "proc": p, "pid": self.procs[p].handle.pid if p in self.procs else None}
                     for r, p in enumerate(gen.members)],
            replaced=[{"rank": r, "old": a, "new": b} for r, a, b in gen.replaced],
        )

    # -- reports -------------------------------------------------------------------------------------
    def _read_reports(self) -> None:
        """Read the members' recovery reports: a first one when the replayed step committed, the final one after
        the steps that follow it."""
        for rec in self.recoveries:
            g = rec.gen.gen
            for r in range(rec.gen.world_size):
                if not rec.reports.get(r, {}).get("final") and isinstance(
                    report := self.records.get(keys.k_report(g, r)), dict
                ):
                    rec.reports[r] = report

    def _flush_recoveries(self, final: bool = False) -> None:
        self._read_reports()
        for rec in list(self.recoveries):
            g = rec.gen.gen
            complete = len(rec.reports) == rec.gen.world_size and all(r.get("final") for r in rec.reports.values())
            superseded = self.gen.gen > g
            if complete or final or (superseded and rec.reports):
                self.recoveries.remove(rec)
                if rec.reports:
                    self._emit_recovered(rec)

    def _emit_recovered(self, rec: PendingRecovery) -> None:
        m = recovery_metrics([(d.failure_at, d.declared_at) for d in rec.deaths], list(rec.reports.values()))
        self.events.emit(
            "recovered", generation=rec.gen.gen, step=m["step"],
            ranks=[{"rank": d.rank, "old": d.proc, "new": rec.gen.members[d.rank]} for d in rec.deaths],
            causes=[d.cause for d in rec.deaths], recovery_s=m["recovery_s"],
            handoff_bytes=m["handoff_bytes"], sources=m["sources"],
            **{k: m[k] for k in ("detect_s", "reconfigure_s", "handoff_s", "replay_s", "warmup_penalty_s")},
            reconfigure_split=m["reconfigure_split"], tier="warm", generations=len(rec.attempts) + 1,
            failed_attempts=rec.attempts, refetched_chunks=m["refetched_chunks"],
        )
        for d in rec.deaths:
            new = rec.gen.members[d.rank]
            log.warning("worker %s (pid %d) died at step %d (%s); standby %s took rank %d in %.2f s "
                        "(detect %.3f, reconfigure %.3f, handoff %.3f, replay %.3f)", d.proc, d.pid, m["step"],
                        d.cause, new, d.rank, m["recovery_s"], m["detect_s"], m["reconfigure_s"], m["handoff_s"],
                        m["replay_s"])

    def _digests(self) -> dict[str, str]:
        out = {}
        for p in self.gen.members:
            if isinstance(digest := self.records.get(keys.k_digest(p)), str):
                out[p] = digest
        return out


def _refusal_reporter(events: EventLog) -> Callable[[str, str, str], None]:
    def refused(kind: str, key: str, why: str) -> None:
        """A value the job's seal refused (someone without the secret wrote it, or replayed an old one)."""
        events.emit("untrusted_value", key=key, key_kind=kind, reason=why)

    return refused


def configure_logging(quiet: bool = False) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[trainmover] %(message)s"))
    for name in ("trainmover.coordinator", "trainmover.launcher", "trainmover.auth"):
        lg = logging.getLogger(name)
        lg.handlers[:] = [handler]
        lg.setLevel(logging.ERROR if quiet else logging.INFO)
        lg.propagate = False
