"""Health and detection: the coordinator's process table, heartbeats, hangs and how a process ended.

`HealthWatch` reads what the processes say about themselves (hello, heartbeat, warm-up, fatal error: the
records of runtime.wire.protocol) and turns it into verdicts: who is hung or never started (to be fenced), which
standby became warm. It kills nothing and publishes nothing; the coordinator (runtime.control.coordinator) acts on its
verdicts. Time comes from the clocks it is given, so tests drive it with a fake one.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from runtime.wire import store as keys
from runtime.wire.protocol import FatalError, Heartbeat, ProcessHello, StandbyReady


class JobFailed(Exception):
    """The job cannot go on; the message says why and what to do."""


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


@dataclass
class Member:
    """One process of the job (worker or standby) and what the coordinator knows of its health."""

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
    released: bool = False
    """A member a planned shrink left out: it leaves on its own once the others switched, and nothing replaces it."""
    store_read_at: float = float("-inf")
    """When its heartbeat was last read from the store (`HealthWatch.poll` reads it less often while its agent sees
    it beat)."""
    store_changed_at: float = 0.0
    """When its heartbeat in the store last went up (or it started)."""


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def exit_cause(handle: ProcessHandle, code: int) -> str:
    """Why a process ended: what its pool knows (a lost host), else its exit status in words."""
    return getattr(handle, "exit_cause", lambda: None)() or describe_exit(code)


@dataclass(frozen=True, slots=True)
class Fencing:
    """A process to fence (kill, reap, declare dead) and why."""

    proc: str
    cause: str
    failure_at: float | None = None
    """When it failed, where known (the last heartbeat of a hung process)."""


@dataclass(frozen=True, slots=True)
class Warm:
    """A standby that finished its warm-up."""

    proc: str
    warmup_s: float
    ready_after_s: float


@dataclass
class Verdicts:
    fence: list[Fencing] = field(default_factory=list)
    warm: list[Warm] = field(default_factory=list)


STORE_EVERY_S = 1.0
"""How often the store's heartbeat of a process is read while its agent reports it beating (`HealthWatch.poll`);
every health tick otherwise."""


@dataclass(eq=False)
class HealthWatch:
    """Heartbeat and hang detection over the process table, one health tick at a time."""

    records: keys.Records
    hang_timeout_s: float
    startup_timeout_s: float
    wall: Callable[[], float]
    suspect: Callable[[str], bool] = lambda _: False
    """Whether a process's whole host went silent: the host timeout then takes all its ranks at once."""
    beat_seen: Callable[[str], float | None] = lambda _: None
    """When a process last beat as its agent saw it (the pool's `beat_seen`), apart from the store: a beat that is
    missing from the store (deleted or overwritten there by someone else) is not a hang while its agent sees it."""

    def poll(self, procs: dict[str, Member], now: float) -> Verdicts:
        """Judge every live process by its latest beat: as its agent saw it (sealed on the agent's link, apart from
        the store) or as its heartbeat in the store says (one round trip for those that beat before). While its
        agent saw it beat within half the hang timeout, the store's heartbeat is read only every `STORE_EVERY_S`
        (at 4,096 hosts, reading and verifying every heartbeat every tick was a third of the coordinator's CPU at
        rest); a hung process stops beating to both, so its store heartbeat is read every tick again well before
        its hang timeout."""
        out = Verdicts()
        agent_saw: dict[str, float] = {}
        for n, m in procs.items():
            if not m.dead and m.hello_ok and m.hb_value >= 0 and now - m.store_read_at < STORE_EVERY_S:
                seen = self.beat_seen(n)
                if seen is not None and now - seen <= self.hang_timeout_s / 2:
                    agent_saw[n] = seen
        beating = [n for n, m in procs.items() if not m.dead and m.hello_ok and m.hb_value >= 0 and n not in agent_saw]
        beats = self.records.get_present_records([keys.k_heartbeat(n) for n in beating], Heartbeat)
        for name, m in procs.items():
            if m.dead:
                continue
            if name in agent_saw:
                if agent_saw[name] > m.hb_changed_at:
                    m.hb_changed_at, m.hb_changed_wall = agent_saw[name], self.wall() - (now - agent_saw[name])
                self._check_warm(name, m, now, out)
                continue
            if not m.hello_ok:
                m.hello_ok = self.hello_ok(name, m)
            key = keys.k_heartbeat(name)
            beat = (beats[key] if key in beats else self.records.get_record(key, Heartbeat)) if m.hello_ok else None
            value = beat.count if beat is not None else -1  # -1 until the first beat
            read_before, m.store_read_at = m.store_read_at, now if m.hello_ok else m.store_read_at
            if value > m.hb_value:  # a replayed older beat is no sign of life
                # After a gap in the reads (its agent reported it meanwhile) the new value was written at some moment
                # of the gap, not now: a hung process's last beat would otherwise look a second younger than it is.
                at = max(m.hb_changed_at, read_before) if m.hb_value >= 0 and now - read_before >= STORE_EVERY_S / 2 \
                    else now
                if at > m.hb_changed_at:
                    m.hb_changed_at, m.hb_changed_wall = at, self.wall() - (now - at)
                m.hb_value, m.store_changed_at = value, now
            elif m.hb_value >= 0 and now - m.store_changed_at > self.hang_timeout_s and (
                    (seen := self.beat_seen(name)) is not None and now - seen <= self.hang_timeout_s):
                # Its agent saw it beat: the store's heartbeat is what went missing. Counted, never a kill.
                self.records.sealer.refuse(key, "silent in the store while its agent sees it beat")
                if seen > m.hb_changed_at:
                    m.hb_changed_at, m.hb_changed_wall = seen, self.wall() - (now - seen)
            elif m.hb_value < 0 and now - m.started_at > self.startup_timeout_s:
                out.fence.append(Fencing(name, f"did not start within {self.startup_timeout_s:.0f} s"))
                continue
            elif m.hb_value >= 0 and now - m.hb_changed_at > self.hang_timeout_s and not self.suspect(name):
                out.fence.append(Fencing(name, f"hung (no heartbeat for {now - m.hb_changed_at:.1f} s)",
                                         m.hb_changed_wall))
                continue
            self._check_warm(name, m, now, out)
        return out

    def warm_now(self, procs: dict[str, Member], now: float) -> list[Warm]:
        """Standbys whose warm-up record arrived since the last tick: read when a loss is being covered, so that a
        standby warm (or hot) for less than a tick is not passed over for an older one."""
        out = Verdicts()
        for name, m in procs.items():
            if not m.dead and m.handle.role == "standby" and m.assigned_gen is None and not m.ready:
                if not m.hello_ok:  # it said hello since the last tick: warm and hot since, too, perhaps
                    m.hello_ok = self.hello_ok(name, m)
                self._check_warm(name, m, now, out)
        return out.warm

    def _check_warm(self, name: str, m: Member, now: float, out: Verdicts) -> None:
        if m.handle.role == "standby" and not m.ready and m.hello_ok and (
            warm := self.records.get_record(keys.k_ready(name), StandbyReady)
        ) is not None:
            m.ready = True
            out.warm.append(Warm(name, warm.warmup_s, now - m.started_at))

    def looks_alive(self, m: Member, now: float) -> bool:
        """A warm standby whose heartbeat has been silent for half the hang timeout is not promoted (it may be
        hung; promoting it would cost the new generation a hang detection)."""
        return m.hello_ok and now - m.hb_changed_at < self.hang_timeout_s / 2

    def hello_ok(self, name: str, m: Member) -> bool:
        """Whether the process said hello, sealed with the job's secret, from the pid the pool started.

        A hello that fails is ignored (counted by the seal): an outsider who writes one first cannot get a
        process fenced, and the real process's own hello overwrites it."""
        hello = self.records.get_record(keys.k_hello(name), ProcessHello)
        if hello is None:
            return False
        if hello.pid != m.handle.pid:
            self.records.sealer.refuse(keys.k_hello(name), f"it names pid {hello.pid!r}, not {m.handle.pid}")
            return False
        return True

    def check_fatal(self, name: str) -> None:
        """Stop the job if the process's script raised: a standby would fail the same way."""
        fatal = self.records.get_record(keys.k_fatal(name), FatalError)
        if fatal is not None:
            last = fatal.message.strip().splitlines()[-1] if fatal.message.strip() else "?"
            raise JobFailed(
                f"the training script failed in {name}: {last}\n"
                "This is an error in the script itself, so a standby would fail the same way; the job was "
                "stopped. Full traceback above."
            )
