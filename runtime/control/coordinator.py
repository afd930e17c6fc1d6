"""The coordinator: the authority on membership, running off the training processes.

It hosts the job's store, watches every process (exit status and heartbeat), fences a hung one, declares
members dead, promotes warm standbys into their logical ranks by publishing a new generation, orders
replacement standbys, and turns the members' reports into `recovered` events. Processes come from a
`ProcessPool` (local subprocesses here; cloud instances behind the same small interface later).

An orchestrator steers a running job through control keys in the store (`runtime.wire.control`): a standby target
(more or fewer warm standbys) and planned moves (a rank's process leaves on purpose and a standby takes the
rank, exactly as after a failure). They are read in the health tick, so steering costs no thread; a value the
coordinator cannot apply is answered with a `control_rejected` event, never with a crash.

Split by concern: this module is the loop and the orchestration of recoveries; runtime.control.health reads
heartbeats and judges hangs; runtime.control.standbys keeps the standby pool; runtime.control.recoveries follows a
recovery from its deaths to its `recovered` event; runtime.control.decisions holds the pure rules (move refusals, a
recovery's figures); runtime.wire.protocol defines every record read or written here. Time comes from the clocks
given to `Coordinator` (`clock`, monotonic; `wall`, for timestamps; `sleep`), so tests run the whole loop in-process
on a fake clock.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import selectors
import signal
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch.distributed as dist

from runtime.config import KNOBS, ShrinkMode
from runtime.control.chaos import Candidate, ChaosMonkey, parse_chaos
from runtime.control.decisions import MoveContext, move_refusal
from runtime.control.elastic import PlannedChange, change_figures, cover_plan, resize_plan
from runtime.control.health import HealthWatch, JobFailed, Member, ProcessHandle, Warm, describe_exit, exit_cause
from runtime.control.hosts import NoSlot
from runtime.control.lease import Deposed, Lease
from runtime.control.recoveries import Death, Recoveries
from runtime.control.standbys import StandbyPool
from runtime.faults import parse_plan
from runtime.wire import store as keys
from runtime.wire.auth import Sealer
from runtime.wire.control import ControlValueError, MoveRequest, parse_move, parse_resize, parse_standby_target
from runtime.wire.event_records import (
    BackupWritten,
    ChaosInjected,
    ChaosUnresolved,
    ControlRejected,
    CoordinatorTookOver,
    Event,
    GenerationStarted,
    Grew,
    JobFinished,
    JobStarted,
    MemberFailed,
    MoveAccepted,
    Moved,
    RestoringFromBackup,
    Shrunk,
    StandbyLost,
    StandbyTargetChanged,
    StandbyWarm,
    UntrustedValue,
    WidthTargetChanged,
)
from runtime.wire.event_records import (
    JobFailed as JobFailedEvent,
)
from runtime.wire.events import EventLog
from runtime.wire.protocol import (
    Assignment,
    BackupRecord,
    ChaosDone,
    ControlCommand,
    CoordinatorLease,
    CurrentGeneration,
    FailureReport,
    FaultFired,
    FinalDigest,
    Finished,
    Generation,
    HoldsState,
    HotClaim,
    HotHeld,
    JobConfig,
    JobOver,
    Joined,
    MoveResult,
    Progress,
    RecoveryOpened,
    RecoveryReport,
    StandbyReady,
    StateHomes,
    StopOrder,
)

__all__ = ["Coordinator", "CoordinatorSettings", "JobFailed", "JobResult", "Member", "ProcessHandle", "ProcessPool",
           "SimplePool", "configure_logging", "describe_exit"]

log = logging.getLogger("trainmover.coordinator")

LOOP_S = 0.005
HEALTH_EVERY_S = 0.2
WARM_READ_S = 0.02
"""While a loss waits to be covered, the warming standbys' warm-up records are read at most this often."""


class ProcessPool(Protocol):
    """Where processes come from, and everything the coordinator asks of it: `runtime.control.hosts.HostPool` across
    hosts (and `runtime.launcher.LocalHostPool`, its one-machine form); `SimplePool` gives the answers of a pool with no
    hosts behind it (tests' simulated pools)."""

    @property
    def settle_s(self) -> float:
        """After a declared death, how long to wait for more before publishing the new generation: across hosts,
        losses seen together move together (0: replace at once)."""

    def spawn(self, name: str, role: str) -> ProcessHandle:
        """Start process `name` in `role` ("worker" or "standby"); NoSlot when there is no room for it."""
        ...

    def wake_fd(self) -> int | None:
        """A descriptor that turns readable when a process exited or a host was lost (None: the processes' own exit
        descriptors say so); `drain_wake` empties it."""
        ...

    def drain_wake(self) -> None: ...

    def helpers(self) -> dict[str, int]:
        """Helper processes (a zygote) by name, with their pids, for the job_started event."""
        ...

    def describe(self) -> dict[str, Any]:
        """Extra fields of the job_started event (`JobStarted`'s agent_port and hosts)."""
        ...

    def take_events(self) -> list[Event]:
        """Events the pool saw since the last call (hosts joined or lost, placements), for the event log."""
        ...

    def take_notices(self) -> list[tuple[str, str, str]]:
        """(host, incarnation, kind) of each notice a host's cloud sent since the last call."""
        ...

    def procs_on(self, host_name: str, incarnation: str) -> list[str]:
        """The live processes placed on that incarnation of a host."""
        ...

    def host_of(self, name: str) -> str | None:
        """The host (name and incarnation) process `name` runs on; None for a pool with no hosts."""
        ...

    def free_slots(self) -> int | None:
        """How many more standbys fit (None: no limit)."""
        ...

    def suspect(self, name: str) -> bool:
        """Whether process `name` may be lost with its host (its hang is then left to the host's timeout)."""
        ...

    def beat_seen(self, name: str) -> float | None:
        """When (the coordinator's monotonic clock) process `name` last beat as its host's agent saw it, apart from
        the job's store; None when the pool has no such report."""
        ...

    def announce(self, gen: int, members: list[str]) -> None:
        """A new generation was published with these members."""
        ...

    def attached(self) -> set[str]:
        """The hosts (name and incarnation) whose agents are attached now; empty for a pool with no hosts."""
        ...

    def take_adopted(self) -> Sequence[ProcessHandle]:
        """Processes the pool's agents re-attached with since the last call (a coordinator that took the job over
        adopts them instead of starting them)."""
        ...


class SimplePool:
    """The answers of a pool with no hosts behind it: processes signal their exits themselves, nothing to describe,
    no events or notices, no slot limit, nobody suspect. A pool of simulated processes subclasses it and adds
    `spawn`."""

    settle_s: float = 0.0

    def wake_fd(self) -> int | None:
        return None

    def drain_wake(self) -> None:
        pass

    def helpers(self) -> dict[str, int]:
        return {}

    def describe(self) -> dict[str, Any]:
        return {}

    def take_events(self) -> list[Event]:
        return []

    def take_notices(self) -> list[tuple[str, str, str]]:
        return []

    def procs_on(self, host_name: str, incarnation: str) -> list[str]:
        return []

    def host_of(self, name: str) -> str | None:
        return None

    def free_slots(self) -> int | None:
        return None

    def suspect(self, name: str) -> bool:
        return False

    def beat_seen(self, name: str) -> float | None:
        return None

    def announce(self, gen: int, members: list[str]) -> None:
        pass

    def attached(self) -> set[str]:
        return set()

    def take_adopted(self) -> Sequence[ProcessHandle]:
        return []


@dataclass(frozen=True, slots=True)
class CoordinatorSettings:
    """Detection and replacement knobs (the launcher fills them from its command line); the shared knobs' defaults
    and meanings are runtime.config.KNOBS's."""

    job_id: str
    job_token: str
    nproc: int
    standby: int
    hang_timeout_s: float = KNOBS.hang_timeout_s
    startup_timeout_s: float = KNOBS.startup_timeout_s
    """Longest a process may take from start to its first heartbeat."""
    standby_wait_s: float = KNOBS.standby_wait_s
    replenish: bool = KNOBS.replenish
    exit_grace_s: float = 60.0
    """After training completes, how long processes may take to exit before they are killed."""
    faults: str = ""
    start_when_standbys_ready: bool = KNOBS.wait_for_standbys
    chaos: str = ""
    """Random faults the coordinator injects itself (runtime.control.chaos), for soak tests and benchmarks."""
    max_standby_failures: int = 5
    """Standbys that die in a row before they are warm, after which the job stops instead of spawning more."""
    public_port: int = 0
    """The store's port as clients see it (its gate's, runtime.wire.tunnel, across hosts); 0: the store's own."""
    shrink: ShrinkMode = KNOBS.shrink
    """With no standby ready within the standby wait: continue with fewer members (a data-parallel job), or stop."""


@dataclass(frozen=True, slots=True)
class JobResult:
    """How a job ended."""

    exit_code: int
    message: str
    events: list[Event]
    digests: dict[str, str]


class Coordinator:
    """Runs one job to its end; `run()` returns how it ended (or drive it: `start()`, then `step()` until it
    returns a result, then `finish(result)`)."""

    def __init__(
        self,
        settings: CoordinatorSettings,
        store: dist.TCPStore,
        pool: ProcessPool,
        events: EventLog,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        lease: Lease | None = None,
    ) -> None:
        self.s = settings
        self.lease = lease
        """This coordinator's hold on the job when its store lives apart (runtime.control.lease): renewed every health
        tick, and every generation is claimed through it; None: the store lives and dies with this process."""
        self.deposed = False
        """Another coordinator took the job over: this one leaves the processes and the store alone."""
        self.on_progress: Callable[[int], None] | None = None
        """Told, at each health tick, the step the members' heartbeats published (the job's metrics)."""
        self.store = store
        self.pool = pool
        self.events = events
        self.clock = clock
        """Monotonic time: every timeout and rate."""
        self.wall = wall
        """Wall-clock time: the moments in events and recovery figures (comparable with the members')."""
        self.sleep = sleep
        # The refusal hook holds the event log only: a bound method would make a cycle that keeps the store (and
        # its listening socket) alive after the job, until the garbage collector runs.
        self.records = keys.Records(store, Sealer(settings.job_token, "coordinator", _refusal_reporter(events)))
        """The store through the job's seal: every record read is verified, every record written is sealed."""
        self.procs: dict[str, Member] = {}
        self.gen = Generation(0, tuple(f"w{i}" for i in range(settings.nproc)))
        self.health = HealthWatch(self.records, settings.hang_timeout_s, settings.startup_timeout_s, wall,
                                  pool.suspect, pool.beat_seen)
        # Through a weak reference, for the same reason: the standby pool must not keep the coordinator alive.
        me = weakref.proxy(self)
        self.standbys = StandbyPool(self.procs, lambda name, role: me._spawn(name, role), events, settings.standby,
                                    settings.max_standby_failures, clock, self.health.looks_alive,
                                    pool.free_slots, lambda: store.add(keys.k_standby_names(), 1) - 1)
        self.pending_deaths: dict[int, Death] = {}
        self.waiting_since: float | None = None
        self._warm_read_at = -math.inf
        """When `_replace` last read the warming standbys' records (not only at the health tick)."""
        self._state_homes: StateHomes | None = None
        """`StateHomes` once read (None: none yet; a data-parallel job has none: every rank holds every state)."""
        self.recoveries = Recoveries(self.records, events)
        self.failed_seen_at: float | None = None
        self.completing_since: float | None = None
        self.stop_sent = False
        self.fault_count = len(parse_plan(settings.faults))
        self._control_seq: dict[str, int] = {}
        self._control_last: dict[str, ControlCommand] = {}
        """The newest sequence number applied per control key: an older or equal one is a replay."""
        self._last_move_seq = 0
        self._host_notices: dict[tuple[str, str], str] = {}
        """(host, incarnation) -> the notice kind its agent sent, until its ranks moved (`_move_noticed_hosts`)."""
        self.started = False
        self._selector = selectors.DefaultSelector()
        self._exit_fds: dict[str, int] = {}
        self._fault_records: dict[int, FaultFired] = {}
        self.holders: set[str] = set(self.gen.members)
        """Live members known to hold the complete training state (every worker of generation 0)."""
        chaos = parse_chaos(settings.chaos)
        self.chaos = ChaosMonkey(chaos) if chaos is not None else None
        self._chaos_hit: dict[str, float] = {}
        """Processes the chaos monkey signalled, and when: their true moment of failure."""
        self._chaos_over = False
        self.width_target = settings.nproc
        """Members the job should run with: its logical width, until a resize request sets fewer."""
        self._resize_cause = "a standby is ready"
        self._change: PlannedChange | None = None
        self._deferred_move: MoveRequest | None = None
        """A move accepted before the first step was committed: it waits for one, then is judged again."""
        """A planned generation (a grow, a requested shrink) not every member has switched to yet."""
        self._last_backup: BackupRecord | None = None
        self._restore_announced = -1
        self._health_due = True
        self._next_health = 0.0
        self._t0 = 0.0
        self._adopt_until: float | None = None
        """While a coordinator that took over waits for the current members to be re-attached: until when."""
        self._took_over: CoordinatorTookOver | None = None
        self._adopted_exited: list[ProcessHandle] = []
        """Processes an agent re-attached with as exited (while no coordinator ran), declared dead once adopted."""
        self._wake_fd = pool.wake_fd()
        """A pool across hosts (runtime.control.hosts) wakes the loop through this when a process exits or a host is
        lost."""
        if self._wake_fd is not None:
            self._selector.register(self._wake_fd, selectors.EVENT_READ, None)

    @property
    def standby_target(self) -> int:
        """Unpromoted standbys to keep: `settings.standby` until an orchestrator sets another."""
        return self.standbys.target

    # -- lifecycle -----------------------------------------------------------------------------------
    def run(self) -> JobResult:
        """Start the job and run it to its end."""
        return self.run_loop(start=True)

    def run_loop(self, start: bool = False) -> JobResult:
        """Run the loop to the job's end (after `start()`, or after `take_over()`)."""
        try:
            if start:
                self.start()
            while (result := self.step()) is None:
                pass
        except Deposed as exc:
            self.deposed = True
            log.error("%s", exc)
            result = JobResult(5, str(exc), [], {})
        except JobFailed as exc:
            result = JobResult(1, str(exc), [], {})
        except KeyboardInterrupt:
            result = JobResult(130, "interrupted; every process was stopped", [], {})
        return self.finish(result)

    def start(self) -> None:
        """Publish the job's config, start the workers and the standbys (and generation 0, unless it waits for
        the standbys to be warm)."""
        self._t0 = self.wall()
        self.records.put(keys.k_job_config(), JobConfig(self.s.nproc, self.s.job_id))
        self.events.emit(JobStarted(job_id=self.s.job_id, nproc=self.s.nproc, standby=self.s.standby,
                                    port=self.s.public_port or self.store.port, helpers=self.pool.helpers(),
                                    **self.pool.describe()))
        self._pool_events()
        for name in self.gen.members:
            self._spawn(name, "worker")
        for _ in range(self.s.standby):
            self.standbys.spawn_one()
        self.started = not self.s.start_when_standbys_ready
        if self.started:
            self._publish(self.gen)
            self._emit_generation(self.gen)

    def take_over(self, previous: CoordinatorLease, stale_s: float, adopt_s: float) -> None:
        """Instead of `start()`: take over the job another coordinator ran (its lease went stale and this one holds
        the next epoch). What it knew is rebuilt from the job's store (the configuration, the current generation,
        which members hold the state, the recovery in flight, the orchestrator's last commands) and from the
        processes the agents re-attach with (`ProcessPool.take_adopted`); a member that no agent reports within
        `adopt_s` is declared dead then, like any lost member. Raises JobFailed for a store of another job."""
        self._t0 = self.wall()
        config = self.records.get_record(keys.k_job_config(), JobConfig)
        if config is None or config.job_id != self.s.job_id or config.nproc != self.s.nproc:
            found = f"job {config.job_id} of {config.nproc} workers" if config else "no job"
            raise JobFailed(f"the store holds {found}, not job {self.s.job_id} of {self.s.nproc} workers: take over "
                            "with the --job-id and --nproc the job was started with")
        current = self.records.get_record(keys.k_current_gen(), CurrentGeneration)
        if current is not None:
            gen = self.records.get_record(keys.k_gen(current.gen), Generation)
            if gen is None:
                raise JobFailed(f"generation {current.gen}'s record is missing or unsealed in the store; the job "
                                "cannot be taken over")
            planned = self.records.get_record(keys.k_gen(gen.gen + 1), Generation)
            if planned is not None and planned.planned:
                # The previous coordinator published a planned generation: its members switch to it on their own.
                self._change = PlannedChange(
                    gen, planned, "grow" if planned.world_size > gen.world_size else "shrink",
                    "resumed by the coordinator that took over",
                    left_out=[(r, p) for r, p in enumerate(gen.members) if p not in planned.members],
                    added=[p for p in planned.members if p not in gen.members])
                gen = planned
            self.gen, self.started = gen, True
        else:
            self.started = False  # the first coordinator was still waiting for its standbys
        self.holders = self._holders_from_records()
        for key in (keys.k_control_standby_target(), keys.k_control_move(), keys.k_control_resize()):
            command = self.records.get_record(key, ControlCommand)
            if command is not None:  # applied by the previous coordinator (one given while none ran is lost)
                self._control_last[key], self._control_seq[key] = command, command.seq
                if key == keys.k_control_standby_target() and command.request.strip().isdigit():
                    self.standbys.target = int(command.request)
        result = self.records.get_record(keys.k_control_move_result(), MoveResult)
        self._last_move_seq = result.seq if result is not None else 0
        resize = self._control_last.get(keys.k_control_resize())
        answer = self.records.get_record(keys.k_control_resize_result(), MoveResult)
        if resize is not None and answer is not None and answer.seq == resize.seq and answer.accepted:
            with contextlib.suppress(ControlValueError):
                request = parse_resize(resize.request)
                self.width_target, self._resize_cause = request.width, f"resize to {request.width}: {request.reason}"
        opened = self.records.get_record(keys.k_recovery(self.gen.gen), RecoveryOpened) if self.started else None
        reports = [self.records.get_record(keys.k_report(self.gen.gen, r), RecoveryReport)
                   for r in range(self.gen.world_size)] if opened is not None else []
        if opened is not None and not all(r is not None and r.final for r in reports):  # else reported already
            deaths = [Death(*d) for d in opened.deaths]
            self.recoveries.open(self.gen, deaths, opened.declared_at)
        self._adopt_until = self.clock() + adopt_s
        self._took_over = CoordinatorTookOver(epoch=previous.epoch + 1, previous=previous.holder,
                                              generation=self.gen.gen, stale_s=stale_s, time=self.wall())
        log.warning("took the job over from coordinator %s (epoch %d) at generation %d; waiting up to %.1f s for "
                    "the agents to re-attach with its members", previous.holder, previous.epoch, self.gen.gen,
                    adopt_s)
        self._pool_events()

    def _holders_from_records(self) -> set[str]:
        """Members that hold the complete training state, from the generations' records: every worker of
        generation 0, less each rank given away, plus each rank whose new process said it holds the state."""
        holders = set(self.gen.members) if self.gen.gen == 0 else set()
        for g in range(self.gen.gen + 1) if self.started else ():
            record = self.gen if g == self.gen.gen else self.records.get_record(keys.k_gen(g), Generation)
            if record is None:
                continue
            if g == 0:
                holders = set(record.members)
            for _, old, _ in record.replaced:
                holders.discard(old)
            for rank, proc in enumerate(record.members):
                if proc not in holders and self.records.get_record(keys.k_holds(g, rank), HoldsState) is not None:
                    holders.add(proc)
        return holders & set(self.gen.members)

    def _adopt(self, now: float) -> bool:
        """Take in the processes the agents re-attached with; True while the current members are still awaited."""
        # Hosts attached before the processes are taken: a host and the processes it re-attached with arrive
        # together, so every process of a host in this set is in this batch (or an earlier one).
        attached = self.pool.attached()
        exited = self._adopted_exited
        for handle in self.pool.take_adopted():
            if handle.name in self.procs:
                handle.kill()  # declared lost already (it came back too late): it must not write into the job
                continue
            member = handle.name in self.gen.members
            m = Member(handle, now, hb_changed_at=now, hb_changed_wall=self.wall())
            m.hello_ok = self.health.hello_ok(handle.name, m)
            m.released = self._change is not None and handle.name in {p for _, p in self._change.left_out}
            if handle.role == "standby":
                m.ready = self.records.get_record(keys.k_ready(handle.name), StandbyReady) is not None
                m.assigned_gen = self.gen.gen if member else None
            self.procs[handle.name] = m
            if self._adopt_until is None:  # after the takeover's event: its host re-attached later than the members'
                log.info("adopted %s %s, whose host re-attached after the takeover", handle.role, handle.name)
            if handle.poll() is not None:  # it exited: its agent says how and when
                m.hello_ok = True
                if member:
                    exited.append(handle)  # while no coordinator ran, or before the last one declared it
                else:
                    m.dead, m.exit_code = True, handle.poll()  # gone already: nothing of the job depends on it
        if self._adopt_until is None:
            self._declare_adopted_exits()
            return False
        missing = [p for p in self.gen.members if p not in self.procs]
        # A member is awaited until the adoption wait ends, or until the host it was placed on re-attached without it.
        if [p for p in missing if self.records.get(keys.k_placed(p)) not in attached] and now < self._adopt_until:
            return True
        took = self._took_over
        assert took is not None
        self._adopt_until = self._took_over = None
        self.events.emit(replace(took, adopted=sorted(self.procs), missing=missing,
                                 adopt_s=round(self.wall() - took.time, 4), time=self.wall()))
        self.pool.announce(self.gen.gen, list(self.gen.members))  # placement and rank logs learn the members
        if not self.started:  # generation 0 was never published: a missing worker holds nothing yet, start it anew
            for handle in self._adopted_exited:
                self.procs.pop(handle.name, None)
            missing += [h.name for h in self._adopted_exited]
            self._adopted_exited = []
            for name in missing:
                log.warning("worker %s of the generation not yet started is gone; starting it again", name)
                self._spawn(name, "worker")
            return False
        self._declare_adopted_exits()
        for name in missing:
            self.procs[name] = Member(_Gone(name), now, hello_ok=True)  # it joined: it was a member
            self._declare_dead(name, "not reported by any agent when this coordinator took the job over", -9)
        return False

    def _declare_adopted_exits(self) -> None:
        """Processes handed over as exited while no coordinator ran: each dies now, at the moment its agent saw."""
        exited, self._adopted_exited = self._adopted_exited, []
        for handle in exited:
            code = handle.poll()
            assert code is not None
            self._declare_dead(handle.name, exit_cause(handle, code), code, getattr(handle, "exited_at", None))

    def step(self) -> JobResult | None:
        """One turn of the loop: wait for an exit or the next health tick, then act; the job's end when it came.
        Raises JobFailed when the job cannot go on."""
        if self._adopt(self.clock()):  # a coordinator that took over, still waiting for the members
            if self.lease is not None and self.clock() >= self._next_health:
                self._next_health = self.clock() + HEALTH_EVERY_S
                self.lease.renew()
            self._wait_for_exit(LOOP_S * 4)
            self._pool_events()
            return None
        # Block until a child exits or the next health check is due: the coordinator shares the machine with the
        # workers (here, two cores), so it must not spin.
        busy = bool(self.pending_deaths) or not self.started or self.completing_since is not None
        now = self.clock()
        idle = bool(self._exit_fds) or self._wake_fd is not None  # something wakes the loop when a process exits
        exited = self._wait_for_exit(max(0.0, self._next_health - now) if idle and not busy else LOOP_S)
        now = self.clock()
        self._pool_events()
        self._poll_exits()
        due = now >= self._next_health
        if due:
            self._next_health = now + HEALTH_EVERY_S
            if self.lease is not None:
                self.lease.renew()
            if self.completing_since is None:
                self._poll_health(now)
                self._poll_control()
                self._tick_chaos(now)
            if self.on_progress is not None and (progress := self.records.get_record(keys.k_progress(), Progress)):
                self.on_progress(progress.step)
        if due or busy or exited:
            self._health_due = due
            return self._progress(now)
        return None

    def finish(self, result: JobResult) -> JobResult:
        """End the job: events, every process stopped, the store told it is over. A deposed coordinator ends only
        itself: the job and its processes are its successor's."""
        if self.deposed:
            self._selector.close()
            return JobResult(result.exit_code, result.message, list(self.events.events), {})
        self.records.put(keys.k_over(), JobOver(result.exit_code))
        self.recoveries.flush(self.gen.gen, final=True)
        self._check_backups()
        for name, at in self._chaos_hit.items():
            if not self.procs[name].dead:  # a hang injected too close to the end to be detected before it
                self.events.emit(ChaosUnresolved(proc=name, pid=self.procs[name].handle.pid, time=at,
                                                 reason="the job ended before the fault was detected"))
        digests = self._digests()
        refused = dict(self.records.sealer.refused)
        if result.exit_code == 0:
            self.events.emit(JobFinished(wall_s=self.wall() - self._t0, generation=self.gen.gen,
                                         digests=digests, step=self._last_step(),
                                         final_digest=digests.get(self.gen.members[0]), refused_values=refused))
        else:
            self.events.emit(JobFailedEvent(wall_s=self.wall() - self._t0, reason=result.message,
                                       exit_code=result.exit_code, refused_values=refused))
        self._shutdown(result.message)
        return JobResult(result.exit_code, result.message, list(self.events.events), digests)

    def _shutdown(self, reason: str) -> None:
        self._send_stop(reason)
        deadline = self.clock() + 10.0
        members = set(self.gen.members)
        for name, m in self.procs.items():
            if name not in members:
                m.handle.kill()  # an unpromoted standby holds nothing worth an orderly exit
        for m in self.procs.values():
            if m.handle.poll() is None:
                m.handle.wait(max(0.0, deadline - self.clock()))
            if m.handle.poll() is None:
                m.handle.kill()
                m.handle.wait(5.0)
        self._selector.close()
        for m in self.procs.values():
            m.handle.close()

    def _send_stop(self, reason: str) -> None:
        """Tell every process to leave; unpromoted standbys block on their assignment key, so release it too."""
        if self.stop_sent:
            return
        self.stop_sent = True
        self.records.put(keys.k_stop(), StopOrder(reason))
        for name, m in self.procs.items():
            if m.handle.role == "standby" and m.assigned_gen is None:
                self.records.put(keys.k_assign(name), Assignment(-1))

    # -- processes -----------------------------------------------------------------------------------
    def _spawn(self, name: str, role: str) -> None:
        try:
            handle = self.pool.spawn(name, role)
        except NoSlot as exc:
            raise JobFailed(f"cannot place {role} {name}: {exc}; start more agents or fewer workers") from None
        now = self.clock()
        self.procs[name] = Member(handle, now, hb_changed_at=now, hb_changed_wall=self.wall())
        if (host := self.pool.host_of(name)) is not None:
            self.records.put(keys.k_placed(name), host)
        fd = handle.exit_fd()
        if fd is not None:
            self._selector.register(fd, selectors.EVENT_READ, name)
            self._exit_fds[name] = fd

    def _wait_for_exit(self, timeout_s: float) -> bool:
        """Sleep until a child process exits (its pidfd turns readable) or the timeout passes."""
        if not self._exit_fds and self._wake_fd is None:
            self.sleep(timeout_s)
            return False
        ready = self._selector.select(timeout_s)
        seen = self.wall()
        for key, _ in ready:
            if key.data is None:
                self.pool.drain_wake()
                continue
            self._selector.unregister(key.fileobj)
            self._exit_fds.pop(key.data, None)
            self.procs[key.data].exit_seen_at = seen
        return bool(ready)

    def _members(self) -> dict[str, int]:
        return {proc: rank for rank, proc in enumerate(self.gen.members)}

    def _poll_exits(self) -> None:
        for name, m in list(self.procs.items()):  # declaring a death may spawn a replacement into the table
            if m.dead:
                continue
            code = m.handle.poll()
            if code is not None:
                if m.exit_seen_at is None:
                    m.exit_seen_at = getattr(m.handle, "exited_at", None)
                self._declare_dead(name, exit_cause(m.handle, code), code)

    def _pool_events(self) -> None:
        """Hosts that joined or were lost, as the pool across hosts saw them; notices their agents sent."""
        for event in self.pool.take_events():
            self.events.emit(replace(event, time=time.time()))  # stamped when logged, as every other event
        for host, incarnation, kind in self.pool.take_notices():
            self._host_notices.setdefault((host, incarnation), kind)

    def _move_noticed_hosts(self) -> None:
        """Move the ranks of hosts whose cloud announced they will go (spot interruption, eviction, maintenance) to
        standbys, as a planned move: once training runs, no recovery is under way and enough standbys are ready;
        until then the notice waits. A standby on such a host is retired now (a fresh one warms elsewhere)."""
        if not self._host_notices or not self.started or self.completing_since is not None:
            return
        for (host, incarnation), kind in list(self._host_notices.items()):
            procs = set(self.pool.procs_on(host, incarnation))
            if not procs:
                del self._host_notices[(host, incarnation)]  # lost already, or nothing of the job runs there
                continue
            ranks = [rank for rank, proc in enumerate(self.gen.members) if proc in procs]
            standbys = sorted(p for p in procs if p not in self.gen.members and not self.procs[p].dead)
            if len(ranks) == self.gen.world_size:
                self._reject("host_notice", f"{kind} on host {host}, which holds every rank: nowhere to move them",
                             host=host)
                del self._host_notices[(host, incarnation)]
                continue
            ready = [p for p in self.standbys.ready() if p not in procs]
            if ranks and (self.pending_deaths or self.recoveries or self._change is not None
                          or len(ready) < len(ranks) or not self._committed()):
                continue  # asked again on the next turn; the cloud's deadline is what bounds the wait
            del self._host_notices[(host, incarnation)]
            for proc in standbys:
                self._fence(proc, f"host_notice:{kind}")
            if ranks:
                moving = [self.gen.members[r] for r in ranks]
                self.events.emit(MoveAccepted(seq=None, ranks=ranks, procs=moving, reason=kind, host=host))
                log.warning("host %s: %s: moving rank(s) %s (%s) to standbys", host, kind, ranks, ", ".join(moving))
                self._move(ranks, kind, ready)

    def _declare_dead(self, name: str, cause: str, code: int | None, failure_at: float | None = None) -> None:
        m = self.procs[name]
        m.dead = True
        m.exit_code = code
        rank = self._members().get(name)
        if self.completing_since is None and self.started and rank is not None and self._all_done():
            # Every member finished the last step and this one left before the loop noticed: not a failure.
            self.completing_since = self.clock()
            self.pending_deaths.clear()
        if self.completing_since is not None:
            return  # training is over; exits now are the script's own business, judged at the end
        self.health.check_fatal(name)
        joined = m.hello_ok or self.health.hello_ok(name, m)
        if code is not None and code >= 0 and not joined and name not in self._chaos_hit:
            raise JobFailed(
                f"{m.handle.role} {name} (pid {m.handle.pid}) {cause} before joining the job. Every process runs "
                "the script, and the script must call runtime.init() (or build a Trainer) and Trainer.fit(); run "
                "it with plain `python` to see its own error. The job was stopped.")
        now_wall = self.wall()
        fault = self._fault_for(name)
        # The failure's moment: when the chaos monkey or an injected fault struck, else the last heartbeat of a
        # hung process, else the exit seen on its pidfd; the moment it was noticed only when nothing else is known.
        failure = (self._chaos_hit.get(name) or (fault.time if fault else None) or failure_at
                   or m.exit_seen_at or now_wall)
        if rank is None and m.released:
            c = self._change
            if code != 0 and c is not None and name in c.old.members and self.started:
                # Left out by a planned shrink, but lost before the members switched: their step waits on it.
                log.warning("%s (left out by a resize) %s before the members switched; rebuilding", name, cause)
                new = self.gen.change(f"{name} (left out by a resize) {cause} before the members switched")
                self._publish(new)
                self._emit_generation(new)
            return  # otherwise it left after the switch, as it was told
        if rank is None:
            if code == 0:
                return  # a standby that joined and then left on its own (the job is ending): nothing lost
            self.events.emit(StandbyLost(proc=name, pid=m.handle.pid, cause=cause, was_ready=m.ready,
                                         failure_at=failure, declared_at=now_wall, detect_s=now_wall - failure))
            log.warning("standby %s (pid %d) %s", name, m.handle.pid, cause)
            self.standbys.lost(name, cause, m.ready)
            self._free_hot_slot(name)
            if self.s.replenish:
                self.standbys.top_up("replace a lost standby")
            return
        self.holders.discard(name)
        death = Death(rank, name, m.handle.pid, cause, failure, now_wall)
        self.pending_deaths[rank] = death
        if self.waiting_since is None:
            self.waiting_since = self.clock()
        step = fault.step if fault else None
        self.events.emit(MemberFailed(generation=self.gen.gen, rank=rank, proc=name, pid=m.handle.pid,
                                      cause=cause, step=step, failure_at=failure, declared_at=now_wall,
                                      detect_s=now_wall - failure))
        where = f" at step {step}" if step is not None else ""
        log.warning("worker %s (rank %d, pid %d) %s%s", name, rank, m.handle.pid, cause, where)
        self._update_holders()  # a promoted standby may have finished its handoff since the last tick
        if self.started and not (self.holders & set(self.gen.members)) and not self._restoring_from_backup():
            lost = ", ".join(f"rank {d.rank} ({d.proc}, {d.cause})" for d in self.pending_deaths.values())
            raise JobFailed(
                f"every copy of the training state was lost: {lost}; no surviving process holds it, so no standby "
                "can be given it, and no backup was written (--backup-dir). The job was stopped; restart it from "
                "its last backup, if one exists elsewhere (trainmover run --resume-from DIR).")

    def _restoring_from_backup(self) -> bool:
        """Every copy of the state is lost: whether the next generation can start from a backup (rank 0 wrote
        one, `--backup-dir`) instead of the job stopping. Said once per lost generation."""
        backup = self._check_backups()
        if backup is None:
            return False
        if self._restore_announced != self.gen.gen:
            self._restore_announced = self.gen.gen
            committed = self._last_step()
            log.warning("every copy of the training state was lost: the next generation starts from the backup of "
                        "step %d (%s); steps %d-%d are trained again", backup.step, backup.path, backup.step + 1,
                        max(committed, backup.step))
            self.events.emit(RestoringFromBackup(generation=self.gen.gen, backup_step=backup.step, path=backup.path,
                                                 committed_step=committed,
                                                 steps_redone=max(0, committed - backup.step)))
        return True

    def _check_backups(self) -> BackupRecord | None:
        """The newest backup rank 0 reported (a `backup_written` event for each new one)."""
        backup = self.records.get_record(keys.k_backup(), BackupRecord)
        if backup is not None and backup != self._last_backup:
            self._last_backup = backup
            self.events.emit(BackupWritten(step=backup.step, path=backup.path, bytes=backup.bytes,
                                           stage_s=backup.stage_s, write_s=backup.write_s))
        return backup

    def _fault_for(self, name: str) -> FaultFired | None:
        for i in range(self.fault_count):
            if i not in self._fault_records and (
                record := self.records.get_record(keys.k_fault(i), FaultFired)
            ) is not None:
                self._fault_records[i] = record
        matches = [r for r in self._fault_records.values() if r.proc == name and r.action != "corrupt"]
        return matches[-1] if matches else None

    # -- health (runtime.control.health) ---------------------------------------------------------------------
    def _poll_health(self, now: float) -> None:
        verdicts = self.health.poll(self.procs, now)
        for fencing in verdicts.fence:
            if not self.procs[fencing.proc].dead:  # fencing one may have ended another (a standby not needed)
                self._fence(fencing.proc, fencing.cause, fencing.failure_at)
        self._became_warm(verdicts.warm)

    def _became_warm(self, warms: list[Warm]) -> None:
        for warm in warms:
            m = self.procs[warm.proc]
            self.standbys.became_warm(warm.proc)
            self.events.emit(StandbyWarm(proc=warm.proc, pid=m.handle.pid, warmup_s=warm.warmup_s,
                                         ready_after_s=warm.ready_after_s))

    def _fence(self, name: str, cause: str, failure_at: float | None = None) -> None:
        """Make sure a process declared dead cannot come back and write into the job (kill, then reap)."""
        m = self.procs[name]
        m.handle.kill()
        m.handle.wait(5.0)
        self._declare_dead(name, cause, m.handle.poll(), failure_at)

    # -- control (runtime.wire.control) --------------------------------------------------------------------
    def _poll_control(self) -> None:
        """Apply what an orchestrator wrote since the last tick; each value is acted on once."""
        for key in (keys.k_control_standby_target(), keys.k_control_move(), keys.k_control_resize()):
            command = self.records.get_record(key, ControlCommand)
            if command is None or command == self._control_last.get(key):
                continue  # nothing, refused (and counted once), or what the last tick saw
            self._control_last[key] = command
            last = self._control_seq.get(key, 0)
            if command.seq <= last:
                if command.seq < last:
                    self.records.sealer.refuse(key, f"stale (seq {command.seq}, the last applied is {last})")
                continue
            self._control_seq[key] = command.seq
            if key == keys.k_control_standby_target():
                self._apply_standby_target(command.request)
            elif key == keys.k_control_move():
                self._apply_move(command.request)
            else:
                self._apply_resize(command.request)

    def _reject(self, control: str, reason: str, *, value: str | None = None, seq: int | None = None,
                ranks: list[int] | None = None, host: str | None = None) -> None:
        log.warning("ignored a %s request: %s", control, reason)
        self.events.emit(ControlRejected(control=control, reason=reason, value=value, seq=seq, ranks=ranks,
                                         host=host))

    def _apply_standby_target(self, raw: str) -> None:
        try:
            target = parse_standby_target(raw)
        except ControlValueError as exc:
            self._reject("standby_target", str(exc), value=str(raw)[:40])
            return
        old = self.standbys.target
        if target == old:
            return
        self.events.emit(StandbyTargetChanged(old=old, new=target))
        log.info("standby target changed from %d to %d", old, target)
        self.standbys.set_target(target, len(self.pending_deaths))

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
        if not self._committed():
            # Before the first commit a data-parallel job is not told apart from a sharded one: the move waits for
            # it (a health tick or a few), then is judged again (`_deferred_moves`).
            self._deferred_move = request
            return
        self._accept_move(request)

    def _deferred_moves(self) -> None:
        request, self._deferred_move = self._deferred_move, None
        if request is None:
            return
        if not self._committed():
            self._deferred_move = request
            return
        refusal = self._move_refusal(request, again=True)
        if refusal is not None:
            self._reject("move", refusal, seq=request.seq, ranks=list(request.ranks))
            self._answer_move(request.seq, refusal)
            return
        self._accept_move(request)

    def _accept_move(self, request: MoveRequest) -> None:
        procs = [self.gen.members[r] for r in request.ranks]
        self.events.emit(MoveAccepted(seq=request.seq, ranks=list(request.ranks), procs=procs,
                                      reason=request.reason))
        self._answer_move(request.seq, None)
        log.warning("moving rank(s) %s (%s) to standbys: %s", list(request.ranks), ", ".join(procs), request.reason)
        self._move(list(request.ranks), request.reason, self.standbys.ready())

    def _move(self, ranks: list[int], reason: str, ready: list[str]) -> None:
        """Give `ranks` to ready standbys. A data-parallel job does it in a planned generation: the members switch at
        a step boundary, the standbys receive the state from the members that stay, the leaving processes exit once
        the others switched, and nothing is replayed. A sharded job's leaving rank may hold the only copy of a shard
        outside its buddy: it leaves by the failure path (fenced, `planned_move:<reason>`), which rebuilds it. Called
        once a step was committed (a sharded job is told apart by then)."""
        if not self._data_parallel():
            for r in ranks:
                self._fence(self.gen.members[r], f"planned_move:{reason}")
            return
        old = self.gen
        assignment = dict(zip(sorted(ranks), ready, strict=False))
        new = old.change(f"move: {reason}", assign=assignment, planned=True)
        for r in ranks:
            self.procs[old.members[r]].released = True
        self.standbys.promote(list(assignment.values()), new.gen)
        self._publish(new, assign=list(assignment.values()))
        self._change = PlannedChange(old, new, "move", reason, left_out=[(r, old.members[r]) for r in sorted(ranks)],
                                     added=list(assignment.values()))
        self._emit_generation(new)
        if self.s.replenish:
            self.standbys.top_up("replace a promoted standby")

    def _apply_resize(self, raw: str) -> None:
        try:
            request = parse_resize(raw)
        except ControlValueError as exc:
            self._reject("resize", str(exc), seq=exc.seq)
            self._answer(keys.k_control_resize_result(), exc.seq, str(exc))
            return
        logical = self.gen.logical_width
        refusal = None
        if self.s.shrink == "off":
            refusal = "the job was started with --shrink off: it runs at its full width only"
        elif (unit := self._shrink_unit()) == 0:
            refusal = ("this sharded job runs at its full width only: it has one replica group, or keeps buddy "
                       "copies (a sharded job resizes by whole replica groups of HSDP or DP x TP)")
        elif request.width % unit:
            refusal = (f"a sharded job resizes by whole replica groups of {unit} ranks: ask for a multiple of "
                       f"{unit}")
        elif not request.width <= logical:
            refusal = f"width {request.width} is more than the job's {logical} logical ranks (--nproc)"
        if refusal is not None:
            self._reject("resize", refusal, seq=request.seq, value=str(request.width))
            self._answer(keys.k_control_resize_result(), request.seq, refusal)
            return
        old, self.width_target = self.width_target, request.width
        self._resize_cause = f"resize to {request.width}: {request.reason}"
        self.events.emit(WidthTargetChanged(old=old, new=request.width, reason=request.reason, seq=request.seq))
        log.warning("width target changed from %d to %d members: %s", old, request.width, request.reason)
        self._answer(keys.k_control_resize_result(), request.seq, None)

    def _move_refusal(self, request: MoveRequest, again: bool = False) -> str | None:
        """Why `request` cannot happen now (`again`: a deferred request judged again, its seq handled already)."""
        last = request.seq - 1 if again else self._last_move_seq
        return move_refusal(request, MoveContext(
            last_seq=last, started=self.started, finished=self.started and self._all_done(),
            world=self.gen.world_size,
            recovering=bool(self.pending_deaths or self.recoveries or self._change is not None),
            ready=len(self.standbys.ready())))

    def _answer_move(self, seq: int | None, refusal: str | None) -> None:
        self._answer(keys.k_control_move_result(), seq, refusal)

    def _answer(self, key: str, seq: int | None, refusal: str | None) -> None:
        if seq is not None:
            self.records.put(key, MoveResult(seq, refusal is None, refusal or ""))

    # -- membership ----------------------------------------------------------------------------------
    def _progress(self, now: float) -> JobResult | None:
        if not self.started:
            if self.s.replenish:  # a standby lost while no slot was free (its host was lost): one has come back since
                self.standbys.top_up("replace a lost standby")
            if len(self.standbys.ready()) >= self.standbys.target:
                self.started = True
                self._publish(self.gen)
                self._emit_generation(self.gen)
            elif now - min(m.started_at for m in self.procs.values()) > self.s.startup_timeout_s:
                raise JobFailed(f"the standbys were not warm within {self.s.startup_timeout_s:.0f} s; "
                                "check that the script runs, or start without waiting for standbys")
            return None
        if self.completing_since is not None:
            return self._progress_completion(now)
        if self._change is not None:
            self._track_change()
        if self._all_done():
            self.completing_since = now
            self.pending_deaths.clear()
            return None
        self._update_holders()
        self._handle_failed_reports(now)
        self._move_noticed_hosts()
        if self.s.replenish:
            self.standbys.top_up("keep the standby target")
        if self.pending_deaths:
            self._replace(now)
        elif self._health_due:
            self._deferred_moves()
            self._resize()
        if self._health_due:
            # Reports are read on health ticks only: a recovery of N ranks costs 2N store round trips per read,
            # which the busy loop (every 5 ms while a death is pending) must not pay.
            self.recoveries.flush(self.gen.gen)
            self.standbys.watch_coverage()
            self._check_backups()
        return None

    def _update_holders(self) -> None:
        """A promoted standby holds the state once its handoff completed (it says so in the store)."""
        for rank, proc in enumerate(self.gen.members):
            if proc not in self.holders and not self.procs[proc].dead and self.records.get_record(
                keys.k_holds(self.gen.gen, rank), HoldsState
            ) is not None:
                self.holders.add(proc)

    def _finished(self, rank: int) -> bool:
        return self.records.get_record(keys.k_done(self.gen.gen, rank), Finished) is not None

    def _all_done(self) -> bool:
        """Whether every member finished the last step: one round trip while any is missing (the usual answer)."""
        return self.store.check([keys.k_done(self.gen.gen, r) for r in range(self.gen.world_size)]) and all(
            self._finished(r) for r in range(self.gen.world_size))

    # -- chaos (runtime.control.chaos) -----------------------------------------------------------------------
    def _tick_chaos(self, now: float) -> None:
        if self.chaos is None or not self.started or self._chaos_over:
            return
        if self.chaos.next_at is None:
            self.chaos.start(now)
        if not self.chaos.due(now):
            return
        if any(self._finished(r) for r in range(self.gen.world_size)):
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
                if not m.ready and self.standbys.failures_in_row + warming_hit >= self.s.max_standby_failures - 2:
                    continue  # chaos must not trip the stop meant for a script whose standbys cannot start
                candidates.append(Candidate(name, "standby", "standby_warm" if m.ready else "standby_warming",
                                            False))
        for shot in self.chaos.strike(now, candidates):
            m = self.procs[shot.proc]
            at = self.wall()
            self._chaos_hit[shot.proc] = at
            remote = getattr(m.handle, "send_signal", None)
            if remote is not None:
                remote(shot.signal)
            else:
                os.kill(m.handle.pid, signal.SIGKILL if shot.signal == "kill" else signal.SIGSTOP)
            state = next(c.state for c in candidates if c.proc == shot.proc)
            self.events.emit(ChaosInjected(proc=shot.proc, pid=m.handle.pid, signal=shot.signal,
                                           role="worker" if shot.proc in members else "standby", state=state,
                                           time=at, rank=members.get(shot.proc), generation=self.gen.gen,
                                           n=self.chaos.injected))
            log.warning("chaos: %s %s (pid %d, %s)", shot.signal, shot.proc, m.handle.pid, state)
        if self.chaos.exhausted:
            self._chaos_over = True
            self.records.put(keys.k_chaos_done(), ChaosDone(self.chaos.injected))

    # -- completion and recovery -----------------------------------------------------------------------
    def _progress_completion(self, now: float) -> JobResult | None:
        members = [self.procs[p] for p in self.gen.members]
        if not self.stop_sent and all(
            self.procs[p].dead or self.records.get_record(keys.k_digest(p), FinalDigest) is not None
            for p in self.gen.members
        ):
            self._send_stop("training completed")
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
        # While a planned generation is pending the members still train in the old one, and report there.
        gens = [self.gen] if self._change is None else [self._change.old, self.gen]
        by_gen = {g.gen: [r for p in g.members
                          if (r := self.records.get_record(keys.k_failed(g.gen, p), FailureReport)) is not None]
                  for g in gens if keys.read_counter(self.store, keys.k_failed_count(g.gen)) > 0}
        reports = [r for rs in by_gen.values() for r in rs]
        if not reports:
            self.failed_seen_at = None
            return
        for r in reports:
            if r.kind == "state_lost":
                raise JobFailed(f"{r.message or 'the training state was lost'}; the job was stopped")
        for r in by_gen.get(self.gen.gen, []):
            untrusted = r.untrusted_rank
            if (untrusted is not None and 0 <= untrusted < self.gen.world_size
                    and not self.procs[self.gen.members[untrusted]].dead):
                self._fence(self.gen.members[untrusted], "failed to prove it belongs to the job during a handoff")
        if self.pending_deaths:
            return
        if self.failed_seen_at is None:
            self.failed_seen_at = now
        elif now - self.failed_seen_at > self.s.hang_timeout_s:
            self.failed_seen_at = None
            message = reports[0].message
            new = self.gen.change(f"collective error without a lost member: {message}")
            log.warning("collective error without a lost member (%s); rebuilding the groups", message)
            self.recoveries.carry_over(new)
            self._publish(new)
            self._emit_generation(new)

    def _replace(self, now: float) -> None:
        if now - self._warm_read_at >= WARM_READ_S:  # bounded: a long wait for standbys reads them at this pace
            self._warm_read_at = now
            self._became_warm(self.health.warm_now(self.procs, now))
        ready = self.standbys.ready()
        deaths = sorted(self.pending_deaths.values(), key=lambda d: d.rank)
        settle_s = self.pool.settle_s
        if settle_s > 0 and self.wall() - max(d.declared_at for d in deaths) < settle_s:
            return  # across hosts, hosts failing together (a rack, a switch) are seen within ms: one generation
        lost = [d.rank for d in deaths]
        world = self.gen.world_size
        unit = self._shrink_unit()
        # The lowest lost ranks get standbys (a rank given to one keeps its number); as many as the width target
        # needs: all of them at full width. A sharded job keeps or leaves out whole replica groups.
        want, _ = cover_plan(lost, world, self.width_target, unit=unit or 1)
        shrinking = False
        if len(ready) < len(want):
            if self.s.replenish:
                self.standbys.cover(len(want))
            assert self.waiting_since is not None
            if now - self.waiting_since <= self.s.standby_wait_s:
                return
            if not self._can_shrink(lost):
                self._no_standby(deaths)
            shrinking = True
        covered_ranks, dropped = cover_plan(lost, world, self.width_target, len(ready) if shrinking else None,
                                            unit=unit or 1)
        covered = [d for d in deaths if d.rank in covered_ranks]
        released = [r for r in dropped if r not in lost]
        assignment = self._assign(covered, ready)
        reason = "; ".join(f"{d.proc} {d.cause}" for d in deaths)
        if dropped:
            self._resize_cause = "a standby is ready"  # what grows the job back, unless a resize asks otherwise
            why = (f"no standby ready within {self.s.standby_wait_s:.0f} s" if shrinking
                   else f"the width target is {self.width_target}")
            reason += f"; {len(dropped)} rank(s) left out ({why}): {world - len(dropped)} of " \
                      f"{self.gen.logical_width} members"
            if released:
                reason += f"; {', '.join(self.gen.members[r] for r in released)} released with its replica group"
        for r in released:  # alive, the rest of a replica group left out: it exits, as a resize's would
            self.procs[self.gen.members[r]].released = True
        width_before = world
        left_out = [self.gen.members[r] for r in dropped]
        new = self.gen.change(reason, assign=assignment, drop=dropped, released=released)
        declared_at = self.wall()
        self.records.put(keys.k_recovery(new.gen), RecoveryOpened(
            tuple((d.rank, d.proc, d.pid, d.cause, d.failure_at, d.declared_at) for d in deaths), declared_at))
        self.standbys.promote(list(assignment.values()), new.gen)
        self._publish(new, assign=list(assignment.values()))
        self.recoveries.open(new, deaths, declared_at, left_out=left_out, width_before=width_before,
                             mode=self.s.shrink)
        self._emit_generation(new)
        self.pending_deaths.clear()
        self.waiting_since = None
        if self.s.replenish:
            self.standbys.top_up("replace a promoted standby")

    def _no_standby(self, deaths: list[Death]) -> None:
        lost = ", ".join(f"rank {d.rank} ({d.proc}, {d.cause})" for d in deaths)
        hint = ("Start more standbys (--standby K) or allow a longer wait (--standby-wait SECONDS).")
        if self.pool.free_slots() is not None:
            hint = ("No standby host is left: start `trainmover agent` on another host (it joins as a standby "
                    "host), or keep more standby slots (--standby K), or allow a longer --standby-wait.")
        if self.s.shrink == "off" and self.gen.world_size > len(deaths) and not self._sharded():
            hint += " Or let the job continue with fewer members (--shrink accumulate)."
        raise JobFailed(
            f"lost {lost} and no standby became ready within {self.s.standby_wait_s:.0f} s; the job was "
            f"stopped. {hint}"
        )

    # -- elastic width (runtime.control.elastic) -------------------------------------------------------------
    def _homes_record(self) -> StateHomes | None:
        """A sharded job's `StateHomes` (its rank 0 publishes it before the first step), once read."""
        if self._state_homes is None:
            self._state_homes = self.records.get_record(keys.k_state_homes(), StateHomes)
        return self._state_homes

    def _sharded(self) -> bool:
        return self._homes_record() is not None

    def _shrink_unit(self) -> int:
        """The ranks a job shrinks and grows by: 1 (a data-parallel job), a replica group (a sharded job with
        groups to spare, `StateHomes.replica_size`), or 0 (a sharded job that runs at its full width only)."""
        homes = self._homes_record()
        return 1 if homes is None else homes.replica_size

    def _committed(self) -> bool:
        """Whether a step was committed (the members' heartbeats publish it): by then a sharded job's rank 0 has
        published its `StateHomes`, so a job without them is data-parallel."""
        progress = self.records.get_record(keys.k_progress(), Progress)
        return progress is not None and progress.step >= 1

    def _data_parallel(self) -> bool:
        return self._committed() and not self._sharded()

    def _can_shrink(self, lost: list[int]) -> bool:
        """Whether the job can go on without the ranks no standby takes: a group of its shrink unit untouched by
        the loss is left, to hold every state class."""
        unit = self._shrink_unit()
        return (self.s.shrink != "off" and unit > 0
                and len({r // unit for r in lost}) < self.gen.world_size // unit)

    def _resize(self) -> None:
        """With nothing lost pending: move the job towards its width target (a planned generation), growing back
        onto ready standbys after a shrink, or leaving out the highest ranks when a resize asked for fewer."""
        if (not self.started or self.completing_since is not None or self._change is not None or self.recoveries
                or self.s.shrink == "off" or self.gen.world_size == self.width_target):
            return
        unit = self._shrink_unit() if self._committed() else 0
        if unit == 0:
            return  # a sharded job at full width only (its resize was refused); or no step committed yet: next tick
        old = self.gen
        drop, add = resize_plan(old.world_size, self.width_target, self.standbys.ready(), unit)
        if not drop and not add:
            if self.s.replenish:
                self.standbys.cover(self.width_target - old.world_size)  # new instances, to grow onto
            return
        cause = self._resize_cause
        if drop:
            left_out = [(r, old.members[r]) for r in drop]
            for _, proc in left_out:
                self.procs[proc].released = True
            new = old.change(f"shrink: {cause}", drop=drop, planned=True)
            self._publish(new)
            self._change = PlannedChange(old, new, "shrink", cause, left_out=left_out)
        else:
            new = old.change(f"grow: {', '.join(add)} joined ({cause})", add=add, planned=True)
            self.standbys.promote(add, new.gen)
            self._publish(new, assign=add)
            self._change = PlannedChange(old, new, "grow", cause, added=add)
            if self.s.replenish:
                self.standbys.top_up("replace a promoted standby")
        log.warning("%s from %d to %d members at the next step boundary: %s", self._change.kind, old.world_size,
                    new.world_size, cause)
        self._emit_generation(new)

    def _track_change(self) -> None:
        """A planned generation: current once every member joined it; its `grew`/`shrunk` event once each member
        committed its first step in it. If the old generation's members all finished first (the job's last step
        came before the switch point), the job ends in the old generation."""
        c = self._change
        assert c is not None
        old, new = c.old, c.new
        if self.store.check([keys.k_done(old.gen, r) for r in range(old.world_size)]):
            log.info("the job finished before switching to generation %d", new.gen)
            self._change = None
            self.gen = old
            self.pool.announce(old.gen, list(old.members))
            return
        if not c.current:
            if not all(self.records.get_record(keys.k_joined(new.gen, r), Joined) is not None
                       for r in range(new.world_size)):
                return
            self.records.put(keys.k_current_gen(), CurrentGeneration(new.gen))
            c.current = True
        reports = [self.records.get_record(keys.k_report(new.gen, r), RecoveryReport) for r in range(new.world_size)]
        if any(r is None for r in reports):
            return
        f = change_figures([r for r in reports if r is not None])
        self._change = None
        if c.kind == "move":
            self.events.emit(Moved(generation=new.gen, ranks=[{"rank": r, "old": p, "new": new.members[r]}
                                                              for r, p in c.left_out], reason=c.cause,
                                   stall_s=f.stall_s, handoff_bytes=f.handoff_bytes, group_s=f.group_s,
                                   handoff_s=f.handoff_s, first_step_s=f.first_step_s,
                                   steady_step_s=f.steady_step_s))
            log.warning("moved rank(s) %s at a step boundary: the members stalled %.3f s",
                        [r for r, _ in c.left_out], f.stall_s)
            return
        if c.kind == "grow":
            self.events.emit(Grew(generation=new.gen, width_from=old.world_size, width_to=new.world_size,
                                  logical_width=new.logical_width, procs=c.added, cause=c.cause, stall_s=f.stall_s,
                                  handoff_bytes=f.handoff_bytes, first_step_s=f.first_step_s,
                                  steady_step_s=f.steady_step_s, group_s=f.group_s, handoff_s=f.handoff_s))
        else:
            self.events.emit(Shrunk(generation=new.gen, width_from=old.world_size, width_to=new.world_size,
                                    logical_width=new.logical_width,
                                    ranks=[{"rank": r, "proc": p} for r, p in c.left_out], cause=c.cause,
                                    planned=True, mode=self.s.shrink, lost_s=f.stall_s, first_step_s=f.first_step_s,
                                    steady_step_s=f.steady_step_s))
        log.warning("%s to %d of %d members: the members stalled %.3f s", "grew" if c.kind == "grow" else "shrank",
                    new.world_size, new.logical_width, f.stall_s)

    def _assign(self, deaths: list[Death], ready: list[str]) -> dict[int, str]:
        """A ready standby for each lost rank: for a sharded job, one on a host where no surviving copy of that
        rank's state lives (`StateHomes`), where there is one, so that a host lost later cannot take both homes of
        a shard; otherwise in the order the standbys became ready."""
        record = self._homes_record()
        world = len(self.gen.members)
        every: list[list[int]] = []
        if record is not None and len(record.homes) == world:
            every = record.homes
        elif record is not None and record.replica_size:  # fewer (or more) replica groups than at the start
            unit = record.replica_size
            every = [[r % unit + k * unit for k in range(world // unit) if k != r // unit] for r in range(world)]
        lost = {d.rank for d in deaths}
        free = self._most_current_first(ready)
        out: dict[int, str] = {}
        for d in deaths:
            homes = every[d.rank] if every else []
            avoid = {self.pool.host_of(self.gen.members[r]) for r in homes if r not in lost} - {None}
            pick = next((p for p in free if self.pool.host_of(p) not in avoid), free[0])
            free.remove(pick)
            out[d.rank] = pick
        return out

    def _most_current_first(self, ready: list[str]) -> list[str]:
        """Hot standbys (runtime.training.hot) by the newest step they hold, then the others in their order: the
        most current one's takeover moves the least."""
        hot = self._hot_claimants()
        step = {p: r.step for p in ready
                if p in hot and (r := self.records.get_record(keys.k_hot_held(p), HotHeld)) is not None}
        return sorted(ready, key=lambda p: -step.get(p, -1))

    def _hot_claimants(self) -> set[str]:
        """The standbys holding a hot slot. Standbys claim slots from 0 up, so the first slot never written ends the
        look: a job without hot standbys costs one store round trip."""
        out: set[str] = set()
        slot = 0
        while True:
            raw, claim = self.records.get_slot(keys.k_hot_slot(slot), HotClaim)
            if raw is None:
                return out
            if claim is not None:
                out.add(claim.proc)
            slot += 1

    def _free_hot_slot(self, name: str) -> None:
        """A standby died: the hot slot it held (if any) is free for another."""
        slot = self.records.get_int(keys.k_hot_of(name))
        if slot < 0:
            return
        key = keys.k_hot_slot(slot)
        raw, claim = self.records.get_slot(key, HotClaim)
        if raw and claim is not None and claim.proc == name:
            self.records.store.compare_set(key, raw.decode(), "")
            log.info("hot slot %d of %s freed", slot, name)

    def _publish(self, gen: Generation, assign: list[str] | None = None) -> None:
        if self.lease is None:
            self.records.put(keys.k_gen(gen.gen), gen)
        else:  # two coordinators never publish one generation: the store's compare_set decides
            self.lease.renew()
            self.lease.claim(keys.k_gen(gen.gen), gen.to_json())
        for proc in assign or []:
            self.records.put(keys.k_assign(proc), Assignment(gen.gen))
        if not gen.planned:  # a planned generation becomes current once every member switched (`_track_change`)
            self.records.put(keys.k_current_gen(), CurrentGeneration(gen.gen))
            self._change = None  # a failure's generation supersedes a planned one not switched to
        self.gen = gen
        self.pool.announce(gen.gen, list(gen.members))

    def _emit_generation(self, gen: Generation) -> None:
        self.events.emit(GenerationStarted(
            generation=gen.gen, reason=gen.reason, world_size=gen.world_size,
            members=[{"rank": r, "proc": p, "pid": self.procs[p].handle.pid if p in self.procs else None}
                     for r, p in enumerate(gen.members)],
            replaced=[{"rank": r, "old": a, "new": b} for r, a, b in gen.replaced],
        ))

    def _last_step(self) -> int:
        """The step the job ended on: what the final generation's members committed last (each says so when it
        finishes), else the progress the heartbeats published (a beat behind); -1 when neither is known."""
        done = [self.records.get_record(keys.k_done(self.gen.gen, r), Finished) for r in range(len(self.gen.members))]
        steps = [d.step for d in done if d is not None]
        if steps:
            return max(steps)
        progress = self.records.get_record(keys.k_progress(), Progress)
        return progress.step if progress is not None else -1

    def _digests(self) -> dict[str, str]:
        out = {}
        for p in self.gen.members:
            if (digest := self.records.get_record(keys.k_digest(p), FinalDigest)) is not None:
                out[p] = digest.digest
        return out


class _Gone:
    """A member of the generation a coordinator took over that no agent reported: dead, with nothing to signal."""

    role = "worker"
    pid = -1

    def __init__(self, name: str) -> None:
        self.name = name

    def poll(self) -> int | None:
        return -9

    def kill(self) -> None:
        pass

    def wait(self, timeout_s: float) -> int | None:
        return -9

    def exit_fd(self) -> int | None:
        return None

    def close(self) -> None:
        pass


def _refusal_reporter(events: EventLog) -> Callable[[str, str, str], None]:
    def refused(kind: str, key: str, why: str) -> None:
        """A value the job's seal refused (someone without the secret wrote it, or replayed an old one)."""
        events.emit(UntrustedValue(key=key, key_kind=kind, reason=why))

    return refused


def configure_logging(quiet: bool = False) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[trainmover] %(message)s"))
    for name in ("trainmover.coordinator", "trainmover.launcher", "trainmover.auth"):
        lg = logging.getLogger(name)
        lg.handlers[:] = [handler]
        lg.setLevel(logging.ERROR if quiet else logging.INFO)
        lg.propagate = False
