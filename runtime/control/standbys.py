"""The standby pool: warm processes waiting to take a lost rank.

`StandbyPool` starts standbys (named s0, s1, ...), keeps the unpromoted ones at the standby target (warming up
included) at a bounded rate, releases the surplus when the target drops, stops the job when standbys keep dying
before they are warm, and says which warm ones may be promoted. The process table it works on is the
coordinator's (runtime.control.coordinator); starting a process goes through the coordinator, which watches its exit.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

from runtime.control.health import JobFailed, Member
from runtime.wire.event_records import Coverage, StandbyReleased, StandbySpawned
from runtime.wire.events import EventLog

log = logging.getLogger("trainmover.coordinator")

SPAWN_WINDOW_S = 10.0
SPAWN_MIN_PER_WINDOW = 20
SPAWN_PER_STANDBY = 10
"""Standbys started in any 10 s: at most max(20, 10 x the largest standby target). Churn beyond it is deferred,
not dropped; a script whose standbys cannot start at all is stopped by the in-a-row rule instead."""


class StandbyPool:
    """Spawning, top-up, surplus release and promotion bookkeeping of the standbys."""

    def __init__(
        self,
        procs: dict[str, Member],
        spawn: Callable[[str, str], None],
        events: EventLog,
        target: int,
        max_failures_in_row: int,
        clock: Callable[[], float],
        looks_alive: Callable[[Member, float], bool],
        free_slots: Callable[[], int | None],
        next_name: Callable[[], int] | None = None,
    ) -> None:
        self.procs = procs
        self._spawn = spawn
        self.events = events
        self.target = target
        """Unpromoted standbys to keep: the job's `--standby` until an orchestrator sets another."""
        self.max_target = target
        self.max_failures_in_row = max_failures_in_row
        self.failures_in_row = 0
        """Standbys that died before they were warm since the last one that became warm."""
        self.clock = clock
        self.looks_alive = looks_alive
        self.free_slots = free_slots
        """A pool across hosts (runtime.control.hosts) says how many slots are free; None: the pool has no limit."""
        self.next_index = 0
        self._next_name = next_name
        """Hands out standby numbers (a counter in the job's store, so that a coordinator that takes over never
        reuses a name); None: counted here."""
        self.spawned = 0
        self._spawn_times: deque[float] = deque()
        self._covered: bool | None = None

    # -- who is there ---------------------------------------------------------------------------------
    def unpromoted(self) -> list[str]:
        """Live standbys that hold no rank, warm or still warming up."""
        return [n for n, m in self.procs.items() if m.handle.role == "standby" and not m.dead
                and m.assigned_gen is None]

    def ready(self) -> list[str]:
        """Warm standbys that look alive, in the order they were started: the ones to promote."""
        now = self.clock()
        return [n for n in self.unpromoted() if self.procs[n].ready and self.looks_alive(self.procs[n], now)]

    # -- starting and stopping ------------------------------------------------------------------------
    def spawn_one(self) -> str | None:
        """Start a standby; None when no host has a free slot (a pool across hosts), tried again later."""
        if (free := self.free_slots()) is not None and free < 1:
            return None
        if self._next_name is not None:
            self.next_index = self._next_name()
        name = f"s{self.next_index}"
        self.next_index += 1
        self.spawned += 1
        self._spawn(name, "standby")
        return name

    def cover(self, lost: int) -> None:
        """Start standbys for `lost` workers beyond those already warming up (no standby was ready for them)."""
        for _ in range(lost - len(self.unpromoted())):
            if (proc := self.spawn_one()) is not None:
                self.events.emit(StandbySpawned(proc=proc, reason="cover a lost worker"))

    def top_up(self, reason: str) -> None:
        """Start standbys until the unpromoted ones (warming up included) reach the target, at a bounded rate:
        what the rate defers, a later tick starts (the coordinator tops up every tick)."""
        now = self.clock()
        while self._spawn_times and now - self._spawn_times[0] > SPAWN_WINDOW_S:
            self._spawn_times.popleft()
        allowed = max(SPAWN_MIN_PER_WINDOW, SPAWN_PER_STANDBY * self.max_target) - len(self._spawn_times)
        for _ in range(min(allowed, self.target - len(self.unpromoted()))):
            proc = self.spawn_one()
            if proc is None:
                return  # no free slot; the next tick tries again (a new host may join)
            self._spawn_times.append(now)
            self.events.emit(StandbySpawned(proc=proc, reason=reason))

    def release_surplus(self, reason: str, keep_at_least: int = 0) -> None:
        """Stop unpromoted standbys beyond the target, never one that a pending death is waiting for
        (`keep_at_least`: the deaths waiting for a standby)."""
        spare = self.unpromoted()
        surplus = len(spare) - max(self.target, keep_at_least)
        # Those still warming up go first (newest first: latest started, then latest spawned); the warm ones are what
        # covers the next failure.
        order = {name: i for i, name in enumerate(spare)}
        newest_first = sorted(spare, key=lambda n: (self.procs[n].ready, -self.procs[n].started_at, -order[n]))
        for name in newest_first[:max(0, surplus)]:
            m = self.procs[name]
            m.dead = True  # released, not lost: nothing replaces it
            m.handle.kill()
            m.exit_code = m.handle.wait(5.0)
            self.events.emit(StandbyReleased(proc=name, pid=m.handle.pid, was_ready=m.ready, reason=reason))
            log.info("released standby %s (pid %d): %s", name, m.handle.pid, reason)

    def set_target(self, target: int, pending_deaths: int) -> int:
        """Apply a new standby target (start or release standbys); returns the old one."""
        old, self.target = self.target, target
        self.max_target = max(self.max_target, target)
        if target > old:
            self.top_up(f"standby target raised to {target}")
        elif target < old:
            self.release_surplus(f"standby target lowered to {target}", pending_deaths)
        return old

    def watch_coverage(self) -> None:
        """Say when the job turns uncovered (no warm standby to take a lost rank) and covered again: a `coverage`
        event at each change (and the first time), a warning when it turns uncovered."""
        warm = len(self.ready())
        covered = warm > 0
        if covered == self._covered:
            return
        self._covered = covered
        warming = len(self.unpromoted()) - warm
        self.events.emit(Coverage(covered=covered, warm=warm, warming=warming, target=self.target))
        if not covered:
            log.warning("the job runs uncovered: no warm standby is ready (%d warming up, target %d); a lost worker "
                        "waits for one, up to the standby wait", warming, self.target)

    # -- bookkeeping -----------------------------------------------------------------------------------
    def became_warm(self, name: str) -> None:
        self.failures_in_row = 0

    def lost(self, name: str, cause: str, was_ready: bool) -> None:
        """An unpromoted standby died: count it if it never got warm, and stop the job after too many in a row."""
        if was_ready:
            return
        self.failures_in_row += 1
        if self.failures_in_row >= self.max_failures_in_row:
            raise JobFailed(
                f"{self.failures_in_row} standbys in a row died before they were warm (the last, {name}, {cause}); "
                "the job was stopped instead of starting more. Check that the script runs on its own and that the "
                "machine has memory for one more process.")

    def promote(self, names: list[str], gen: int) -> None:
        """These standbys take ranks in generation `gen`: they are no longer spare."""
        for name in names:
            self.procs[name].assigned_gen = gen
