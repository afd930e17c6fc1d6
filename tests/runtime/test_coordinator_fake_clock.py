"""The coordinator's loop in-process, on a fake clock: simulated processes, a real store, no sleeps.

Each simulated process writes what a real one would (its hello, heartbeats every 0.25 s, a standby's warm-up
record, its last step and digest) as runtime.wire.protocol records into a real in-process store, at moments of a
fake clock; the coordinator runs with that clock (`clock`, `wall`, `sleep`), so hang timeouts, startup timeouts
and standby waits of seconds take milliseconds, and each moment a rule fires is checked to the loop's tick.
"""

from __future__ import annotations

import datetime
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest
import torch.distributed as dist

from runtime.control.coordinator import HEALTH_EVERY_S, LOOP_S, Coordinator, CoordinatorSettings, JobFailed, SimplePool
from runtime.wire import store as keys
from runtime.wire.auth import Sealer
from runtime.wire.event_records import (
    Coverage,
    Event,
    GenerationStarted,
    JobFinished,
    MemberFailed,
    Recovered,
    StandbyLost,
    StandbyReleased,
    StandbySpawned,
    StandbyTargetChanged,
    StandbyWarm,
    UntrustedValue,
)
from runtime.wire.event_records import JobFailed as JobFailedEvent
from runtime.wire.events import EventLog
from runtime.wire.protocol import (
    Assignment,
    ControlCommand,
    CurrentGeneration,
    FailureReport,
    FinalDigest,
    Finished,
    Generation,
    Heartbeat,
    HotClaim,
    HotHeld,
    ProcessHello,
    RecoveryReport,
    StandbyReady,
    StateHomes,
    StopOrder,
)
from tests.runtime.test_coordinator_logic import StubProcess

TOKEN = "f" * 64
BEAT_S = 0.25
TICK = HEALTH_EVERY_S + 2 * LOOP_S
"""How late after a deadline a rule may fire: the next health tick (and the loop turn that reaches it)."""
_pids = itertools.count(800_000)

E = TypeVar("E", bound=Event)


class FakeClock:
    """Monotonic time in whole nanoseconds (no drift from adding 5 ms steps as floats); `sleep` advances it."""

    def __init__(self) -> None:
        self.ns = 0

    def monotonic(self) -> float:
        return self.ns / 1e9

    def wall(self) -> float:
        return 1_700_000_000.0 + self.ns / 1e9

    def sleep(self, seconds: float) -> None:
        self.ns += max(1, round(seconds * 1e9))


@dataclass(frozen=True)
class Script:
    """What a simulated process does, at moments of the fake clock."""

    hello: bool = True
    """Says hello and beats (a process that never does is one whose script never called runtime.init())."""
    beat_until: float = math.inf
    """Stops beating then, without exiting: a hang."""
    ready_at: float | None = None
    """A standby finishes its warm-up then (None: never)."""
    exit_at: float | None = None
    exit_code: int = -9
    finish_at: float | None = None
    """A member writes its last step and digest then, and exits 0 a moment later."""


class SimProcess(StubProcess):
    def __init__(self, name: str, role: str, script: Script, clock: FakeClock, records: keys.Records) -> None:
        self.name, self.role, self.pid = name, role, next(_pids)
        self.script, self.clock, self.records = script, clock, records
        self.killed = False
        self.beats = 0
        self.next_beat = 0.0
        self.ready_sent = False
        self.finished_at: float | None = None
        if script.hello:
            records.put(keys.k_hello(name), ProcessHello(self.pid, role))

    def poll(self) -> int | None:
        """What the process did by now (the coordinator polls every loop turn: the simulation runs here)."""
        if self.killed:
            return -9
        now, s = self.clock.monotonic(), self.script
        if s.exit_at is not None and now >= s.exit_at:
            return s.exit_code
        if self.finished_at is not None and now >= self.finished_at + 0.1:
            return 0
        if s.hello and now < s.beat_until and now >= self.next_beat:
            self.records.put(keys.k_heartbeat(self.name), Heartbeat(self.beats))
            self.beats += 1
            self.next_beat = now + BEAT_S
        if s.ready_at is not None and not self.ready_sent and now >= s.ready_at:
            self.records.put(keys.k_ready(self.name), StandbyReady(0.1))
            self.ready_sent = True
        if s.finish_at is not None and self.finished_at is None and now >= s.finish_at:
            self._finish(now)
        return None

    def _finish(self, now: float) -> None:
        current = self.records.get_record(keys.k_current_gen(), CurrentGeneration)
        gen = self.records.get_record(keys.k_gen(current.gen), Generation) if current is not None else None
        rank = gen.rank_of(self.name) if gen is not None else None
        if gen is None or rank is None:
            return  # an unpromoted standby waits to be told to leave
        self.records.put(keys.k_done(gen.gen, rank), Finished(20))
        self.records.put(keys.k_digest(self.name), FinalDigest("d" * 32))
        self.finished_at = now


class SimPool(SimplePool):
    def __init__(self, clock: FakeClock, records: keys.Records, scripts: Callable[[str, str], Script]) -> None:
        self.clock, self.records, self.scripts = clock, records, scripts
        self.procs: dict[str, SimProcess] = {}

    def spawn(self, name: str, role: str) -> SimProcess:
        self.procs[name] = SimProcess(name, role, self.scripts(name, role), self.clock, self.records)
        return self.procs[name]


class Scene:
    """A coordinator, its simulated processes and an orchestrator, on one fake clock."""

    def __init__(self, scripts: Callable[[str, str], Script], pool: type[SimPool] | None = None,
                 **settings: Any) -> None:
        self.clock = FakeClock()
        self.store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=5),
                                   wait_for_workers=False)
        self.member = keys.Records(self.store, Sealer(TOKEN, "member"))
        self.orchestrator = keys.Records(self.store, Sealer(TOKEN, "control"))
        self.pool = (pool or SimPool)(self.clock, self.member, scripts)
        s = CoordinatorSettings(job_id="j", job_token=TOKEN, **{"nproc": 2, "standby": 1, **settings})
        self.c = Coordinator(s, self.store, self.pool, EventLog(None), clock=self.clock.monotonic,
                             wall=self.clock.wall, sleep=self.clock.sleep)

    @property
    def now(self) -> float:
        return self.clock.monotonic()

    def until(self, done: Callable[[], bool], limit_s: float) -> float:
        """Turn the loop until `done()`; the fake time it first held. Fails past `limit_s` of fake time."""
        end = self.now + limit_s
        while not done():
            assert self.now <= end, f"not done within {limit_s} s of fake time"
            assert self.c.step() is None
        return self.now

    def run_for(self, seconds: float) -> None:
        end = self.now + seconds
        self.until(lambda: self.now >= end, seconds + 1.0)

    def events(self, kind: type[E]) -> list[E]:
        return self.c.events.of_type(kind)


def _standby_warm_at(at: float, **worker: Any) -> Callable[[str, str], Script]:
    return lambda name, role: Script(ready_at=at) if role == "standby" else Script(**worker)


@pytest.mark.timeout(20)
def test_a_worker_whose_heartbeat_stops_is_declared_hung_after_the_hang_timeout_and_not_before() -> None:
    scene = Scene(lambda name, role: Script(beat_until=3.0) if name == "w1" else Script(ready_at=0.5),
                  hang_timeout_s=2.0)
    scene.c.start()
    scene.until(lambda: scene.now > 3.0 + TICK, 5.0)  # w1's last beat (before 3.0) has been seen
    w1 = scene.c.procs["w1"]
    last_seen = w1.hb_changed_at
    assert 2.5 < last_seen <= 3.0 + TICK and not w1.dead
    declared = scene.until(lambda: w1.dead, 5.0)
    assert 2.0 < declared - last_seen <= 2.0 + TICK, "hung exactly at the first health tick past the timeout"
    assert scene.pool.procs["w1"].killed, "fenced before it is replaced"
    (failed,) = scene.events(MemberFailed)
    assert failed.rank == 1 and failed.cause.startswith("hung (no heartbeat for 2.")
    assert failed.failure_at == pytest.approx(scene.clock.wall() - (declared - last_seen))
    # The warm standby takes the rank in the same turn, and a new standby replaces it in the pool.
    (gen1,) = [e for e in scene.events(GenerationStarted) if e.generation == 1]
    assert gen1.replaced == [{"rank": 1, "old": "w1", "new": "s0"}]
    assert scene.member.get_record(keys.k_gen(1), Generation) == Generation(1, ("w0", "s0"), gen1.reason,
                                                                             ((1, "w1", "s0"),))
    assert scene.member.get_record(keys.k_assign("s0"), Assignment) == Assignment(1)
    assert scene.member.get_record(keys.k_current_gen(), CurrentGeneration) == CurrentGeneration(1)
    spawned = scene.events(StandbySpawned)
    assert [(e.proc, e.reason) for e in spawned] == [("s1", "replace a promoted standby")]
    assert scene.c.standbys.unpromoted() == ["s1"]


@pytest.mark.timeout(20)
def test_a_hung_worker_replaced_by_a_standby_still_lets_the_job_complete() -> None:
    def script(name: str, role: str) -> Script:
        if name == "w1":
            return Script(beat_until=1.0)
        return Script(ready_at=0.5 if role == "standby" else None, finish_at=6.0)

    scene = Scene(script, hang_timeout_s=2.0)
    result = scene.c.run()
    assert result.exit_code == 0, result.message
    assert result.message == "training completed in generation 1"
    assert result.digests == {"w0": "d" * 32, "s0": "d" * 32}
    (finished,) = [e for e in result.events if isinstance(e, JobFinished)]
    assert finished.step == 20, "the step the members finished on, not the heartbeats' last (a beat behind)"
    assert 6.0 < scene.now < 8.0
    assert scene.member.get_record(keys.k_stop(), StopOrder) == StopOrder("training completed")
    assert scene.member.get_record(keys.k_assign("s1"), Assignment) == Assignment(-1), "the spare one is released"


@pytest.mark.timeout(20)
def test_a_standby_that_never_starts_is_fenced_at_the_startup_timeout_and_replaced() -> None:
    scene = Scene(lambda name, role: Script(hello=role == "worker"), startup_timeout_s=5.0)
    scene.c.start()
    fenced = scene.until(lambda: scene.c.procs["s0"].dead, 10.0)
    assert 5.0 < fenced <= 5.0 + TICK
    (lost,) = scene.events(StandbyLost)
    assert lost.proc == "s0" and lost.cause == "did not start within 5 s" and not lost.was_ready
    assert scene.pool.procs["s0"].killed
    assert [(e.proc, e.reason) for e in scene.events(StandbySpawned)] == [("s1", "replace a lost standby")]
    assert scene.c.standbys.failures_in_row == 1
    assert not scene.events(MemberFailed), "the workers beat: only the standby is lost"


class _SlottedPool(SimPool):
    """A SimPool with `free` slots for standbys, as hosts come and go."""

    free = 0

    def free_slots(self) -> int | None:
        return self.free


@pytest.mark.timeout(20)
def test_a_standby_lost_before_generation_0_with_no_slot_free_is_replaced_once_a_slot_comes_back() -> None:
    """Its host is lost (a false alarm on a loaded machine, here) while the job waits for its standbys: no slot is
    free then; the host comes back a moment later as a new incarnation, and the replacement goes there, so that
    generation 0 starts instead of the workers waiting for it until they give up."""
    scene = Scene(lambda name, role: Script(exit_at=1.0) if name == "s0" else
                  Script(ready_at=scene.now + 0.5) if role == "standby" else Script(), pool=_SlottedPool,
                  start_when_standbys_ready=True)
    pool = scene.pool
    assert isinstance(pool, _SlottedPool)
    pool.free = 1
    scene.c.start()
    pool.free = 0  # s0 took the last slot
    scene.until(lambda: bool(scene.events(StandbyLost)), 3.0)
    scene.run_for(1.0)
    assert [e.proc for e in scene.events(StandbySpawned)] == [], "no slot: nothing to spawn yet"
    pool.free = 1  # the host is back
    started = scene.until(lambda: bool(scene.events(GenerationStarted)), 3.0)
    assert [(e.proc, e.reason) for e in scene.events(StandbySpawned)] == [("s1", "replace a lost standby")]
    assert scene.events(GenerationStarted)[0].generation == 0 and started < 5.0


@pytest.mark.timeout(20)
def test_standbys_that_never_get_warm_stop_the_job_after_the_failures_in_a_row() -> None:
    scene = Scene(lambda name, role: Script(hello=role == "worker"), startup_timeout_s=5.0, max_standby_failures=3)
    result = scene.c.run()
    assert result.exit_code == 1
    assert result.message.startswith("3 standbys in a row died before they were warm (the last, s2, did not start")
    assert [e.proc for e in scene.events(StandbyLost)] == ["s0", "s1", "s2"]
    assert "s3" not in scene.pool.procs, "the third loss stops the job instead of starting a fourth"
    assert 15.0 < scene.now <= 15.0 + 3 * TICK, "each one given its full startup timeout"
    stop = scene.member.get_record(keys.k_stop(), StopOrder)
    assert stop is not None and stop.reason == result.message


@pytest.mark.timeout(20)
def test_a_warm_standby_resets_the_count_of_failures_in_a_row() -> None:
    scene = Scene(lambda name, role: Script(hello=role == "worker" or name == "s1", ready_at=1.0),
                  startup_timeout_s=5.0, max_standby_failures=2)
    scene.c.start()
    scene.until(lambda: scene.c.standbys.failures_in_row == 1, 10.0)  # s0 never started
    scene.until(lambda: bool(scene.events(StandbyWarm)), 5.0)  # s1 did
    assert scene.c.standbys.failures_in_row == 0


@pytest.mark.timeout(20)
def test_no_standby_left_stops_the_job_after_the_standby_wait_with_what_to_do() -> None:
    scene = Scene(lambda name, role: Script(exit_at=1.0) if name == "w1" else Script(), standby=0,
                  standby_wait_s=5.0, shrink="off")
    result = scene.c.run()
    assert result.exit_code == 1
    assert result.message.startswith(
        "lost rank 1 (w1, killed by SIGKILL) and no standby became ready within 5 s; the job was stopped.")
    assert "Start more standbys (--standby K)" in result.message
    # A standby was started to cover the loss; it never got warm, and the job waited exactly the standby wait.
    assert [(e.proc, e.reason) for e in scene.events(StandbySpawned)] == [("s0", "cover a lost worker")]
    (failed,) = scene.events(MemberFailed)
    assert failed.failure_at == pytest.approx(failed.declared_at)
    assert 6.0 < scene.now <= 6.0 + 2 * LOOP_S
    assert scene.member.get_record(keys.k_stop(), StopOrder) == StopOrder(result.message)
    assert scene.member.get_record(keys.k_assign("s0"), Assignment) == Assignment(-1)
    assert scene.pool.procs["s0"].killed
    (ended,) = scene.events(JobFailedEvent)
    assert ended.reason == result.message


@pytest.mark.timeout(20)
def test_a_lower_standby_target_releases_the_warming_ones_first_and_a_higher_one_tops_up() -> None:
    scene = Scene(lambda name, role: Script(ready_at=None if name == "s2" else 0.3), standby=3)
    scene.c.start()
    scene.until(lambda: len(scene.c.standbys.ready()) == 2, 2.0)
    scene.orchestrator.put(keys.k_control_standby_target(), ControlCommand(1, "1"))
    scene.until(lambda: scene.c.standby_target == 1, 1.0)
    assert [(e.old, e.new) for e in scene.events(StandbyTargetChanged)] == [(3, 1)]
    assert [(e.proc, e.was_ready) for e in scene.events(StandbyReleased)] == [("s2", False), ("s1", True)]
    assert scene.pool.procs["s2"].killed and scene.pool.procs["s1"].killed and not scene.pool.procs["s0"].killed
    assert scene.c.standbys.unpromoted() == ["s0"]
    scene.run_for(2.0)
    assert not scene.events(StandbySpawned), "released standbys are not replaced"
    scene.orchestrator.put(keys.k_control_standby_target(), ControlCommand(2, "2"))
    scene.until(lambda: scene.c.standby_target == 2, 1.0)
    assert [(e.proc, e.reason) for e in scene.events(StandbySpawned)] == [
        ("s3", "standby target raised to 2")]


@pytest.mark.timeout(20)
def test_a_malformed_record_from_a_member_is_refused_once_and_a_well_formed_one_is_obeyed() -> None:
    scene = Scene(_standby_warm_at(0.3), hang_timeout_s=2.0)
    scene.c.start()
    scene.run_for(0.5)
    key = keys.k_failed(0, "w0")
    newer = {"v": 9, "message": "from a newer trainmover", "time": 1.0, "step": 3}
    scene.store.set(key, scene.member.sealer.seal(key, newer))  # sealed by the job, but not a record it reads
    scene.store.add(keys.k_failed_count(0), 1)
    scene.run_for(3.0)  # longer than the hang timeout: a report it could read would have rebuilt the groups
    refused = [e for e in scene.events(UntrustedValue) if e.key_kind == "gen/#/failed/w#"]
    assert len(refused) == 1, "read every tick, refused (and reported) once"
    assert "not a FailureReport record" in refused[0].reason and "version 9" in refused[0].reason
    assert scene.c.records.sealer.refused["gen/#/failed/w#"] == 1
    assert [e.generation for e in scene.events(GenerationStarted)] == [0]
    scene.member.put(keys.k_failed(0, "w1"), FailureReport("peer lost", 1.0, 3))
    scene.until(lambda: scene.c.gen.gen == 1, 3.0)
    assert scene.c.gen.reason == "collective error without a lost member: peer lost"
    assert scene.c.gen.members == ("w0", "w1")


@pytest.mark.timeout(20)
def test_a_heartbeat_that_is_not_a_count_is_no_sign_of_life() -> None:
    scene = Scene(lambda name, role: Script(beat_until=0.5) if name == "w1" else Script(ready_at=0.3),
                  hang_timeout_s=2.0)
    scene.c.start()
    scene.run_for(0.6)
    key = keys.k_heartbeat("w1")
    for i in range(20):  # a process of another version beating with something else than a count
        scene.store.set(key, scene.member.sealer.seal(key, {"count": 100 + i}))
        scene.run_for(0.2)
    assert scene.c.procs["w1"].dead
    (failed,) = scene.events(MemberFailed)
    assert failed.proc == "w1" and failed.cause.startswith("hung")
    assert scene.c.records.sealer.refused["proc/w#/heartbeat"] >= 5, "each value refused and counted"


@pytest.mark.timeout(20)
def test_a_member_reporting_the_state_lost_stops_the_job_at_the_next_turn() -> None:
    scene = Scene(_standby_warm_at(0.3))
    scene.c.start()
    scene.run_for(0.5)
    scene.member.put(keys.k_failed(0, "w1"), FailureReport("no intact copy of the state", 1.0, 3, "state_lost"))
    scene.store.add(keys.k_failed_count(0), 1)
    with pytest.raises(JobFailed, match=r"^no intact copy of the state; the job was stopped$"):
        scene.run_for(HEALTH_EVERY_S + LOOP_S)


@pytest.mark.timeout(20)
def test_a_recovery_is_reported_once_every_member_sent_its_final_report() -> None:
    scene = Scene(lambda name, role: Script(beat_until=1.0) if name == "w1" else Script(ready_at=0.5),
                  hang_timeout_s=2.0)
    scene.c.start()
    scene.until(lambda: scene.c.gen.gen == 1, 5.0)
    (failed,) = scene.events(MemberFailed)
    t = scene.clock.wall()

    def report(rank: int, role: str, final: bool) -> RecoveryReport:
        return RecoveryReport(rank=rank, role=role, group_ready_at=t + 0.1, handoff_s=0.2, handoff_bytes=1000,
                              handoff_end_at=t + 0.3, replay_step=8, replay_done_at=t + 0.4, final=final,
                              post_steps_s=[0.1] if final else [])

    scene.member.put(keys.k_report(1, 0), report(0, "source", final=True))
    scene.member.put(keys.k_report(1, 1), report(1, "receiver", final=False))  # the replay committed
    scene.run_for(1.0)
    assert not scene.events(Recovered), "waits for every final report"
    assert scene.c.recoveries
    scene.member.put(keys.k_report(1, 1), report(1, "receiver", final=True))
    scene.until(lambda: bool(scene.events(Recovered)), 1.0)
    (recovered,) = scene.events(Recovered)
    assert recovered.generation == 1 and recovered.step == 8
    assert recovered.ranks == [{"rank": 1, "old": "w1", "new": "s0"}]
    assert recovered.recovery_s == pytest.approx(t + 0.4 - failed.failure_at)
    assert recovered.handoff_bytes == 1000 and recovered.sources == [0] and recovered.generations == 1
    assert not scene.c.recoveries


@pytest.mark.timeout(20)
def test_a_peer_named_untrusted_is_fenced_and_a_rank_outside_the_generation_is_ignored() -> None:
    scene = Scene(_standby_warm_at(0.3))
    scene.c.start()
    scene.run_for(0.5)
    scene.member.put(keys.k_failed(0, "w0"), FailureReport("bad proof", 1.0, 3, "comm", untrusted_rank=7))
    scene.store.add(keys.k_failed_count(0), 1)
    scene.run_for(0.5)
    assert not any(m.dead for m in scene.c.procs.values()), "rank 7 is no member: nobody is fenced"
    scene.member.put(keys.k_failed(0, "w0"), FailureReport("bad proof", 1.0, 3, "comm", untrusted_rank=1))
    scene.until(lambda: scene.c.procs["w1"].dead, 1.0)
    (failed,) = scene.events(MemberFailed)
    assert failed.cause == "failed to prove it belongs to the job during a handoff"
    assert scene.c.gen.members == ("w0", "s0"), "and its rank goes to the warm standby"


def test_the_job_says_when_it_runs_uncovered_and_when_it_is_covered_again() -> None:
    """s0 warm at 0.5 s covers the job; w1 hangs, s0 takes its rank, and the job runs uncovered until the
    replacement s1 is warm at 6 s: a `coverage` event at each change (and the first turn), none in between."""
    def script(name: str, role: str) -> Script:
        if name == "w1":
            return Script(beat_until=1.0)
        ready = {"s0": 0.5, "s1": 6.0}.get(name)
        return Script(ready_at=ready if role == "standby" else None, finish_at=9.0)

    scene = Scene(script, hang_timeout_s=2.0)
    result = scene.c.run()
    assert result.exit_code == 0, result.message
    turns = [(e.covered, e.warm, e.target) for e in result.events if isinstance(e, Coverage)]
    assert turns == [(False, 0, 1), (True, 1, 1), (False, 0, 1), (True, 1, 1)], turns
    (failed,) = [e for e in result.events if isinstance(e, MemberFailed)]
    uncovered = [e.time for e in result.events if isinstance(e, Coverage) and not e.covered]
    assert uncovered[1] >= failed.declared_at, "uncovered from the promotion on, not before"


@pytest.mark.timeout(20)
@pytest.mark.parametrize("homes", [True, False])
def test_a_lost_rank_gets_a_standby_away_from_the_hosts_that_hold_its_states_other_copies(homes: bool) -> None:
    """HSDP 2 x 2: rank 1's state also lives on rank 3 (host B). s0 is on host B, s1 on host C: rank 1 goes to s1,
    although s0 became ready first, so that losing host B later cannot take both copies of its shard. A job that
    said nothing of its states' homes (data parallelism: every rank holds them all) takes s0."""
    hosts = {"w0": "A", "w1": "A", "w2": "B", "w3": "B", "s0": "B", "s1": "C"}
    scene = Scene(lambda name, role: Script(exit_at=2.0) if name == "w1" else
                  Script(ready_at=0.3 if name == "s0" else 0.6) if role == "standby" else Script(),
                  nproc=4, standby=2)
    scene.pool.host_of = hosts.get  # type: ignore[method-assign]
    if homes:
        scene.member.put(keys.k_state_homes(), StateHomes([[2], [3], [0], [1]]))
    scene.c.start()
    scene.until(lambda: scene.c.gen.gen == 1, 5.0)
    assert scene.c.gen.members[1] == ("s1" if homes else "s0")


@pytest.mark.timeout(20)
def test_a_lost_rank_goes_to_the_hot_standby_that_holds_the_newest_step() -> None:
    """s0 became ready first but is warm; s1 mirrors the state (runtime.training.hot) and holds step 7: rank 1 goes
    to s1, whose takeover sends nothing."""
    scene = Scene(lambda name, role: Script(exit_at=2.0) if name == "w1" else
                  Script(ready_at=0.3 if name == "s0" else 0.6) if role == "standby" else Script(), standby=2)
    slot = keys.k_hot_slot(0)  # s1 holds the job's hot slot (runtime.training.hot), and step 7
    scene.store.compare_set(slot, "", scene.member.sealer.seal(slot, HotClaim("s1", "127.0.0.1", 40001).to_json()))
    scene.member.put(keys.k_hot_held("s1"), HotHeld(7))
    scene.c.start()
    scene.until(lambda: scene.c.gen.gen == 1, 5.0)
    assert scene.c.gen.members[1] == "s1"


@pytest.mark.timeout(20)
def test_a_standby_that_said_hello_and_became_hot_since_the_last_health_tick_still_takes_the_lost_rank() -> None:
    """s1 says hello, finishes its warm-up and holds the hot slot at step 7 just after a health tick; w1 dies before
    the next: the loss is covered by s1 (read when the loss is covered), not by the older, warm s0."""
    scene = Scene(lambda name, role: Script(hello=False) if name == "s1" else
                  Script(ready_at=0.1) if role == "standby" else Script(), standby=2, hang_timeout_s=4.0)
    scene.c.start()
    scene.until(lambda: scene.c.gen.gen == 0 and bool(scene.c.standbys.ready()), 2.0)  # s0 is warm
    tick = scene.c._next_health
    scene.until(lambda: scene.now > tick, 1.0)  # a health tick just ran: the next is HEALTH_EVERY_S away
    s1 = scene.pool.procs["s1"]
    scene.member.put(keys.k_hello("s1"), ProcessHello(s1.pid, "standby"))
    scene.member.put(keys.k_ready("s1"), StandbyReady(0.1))
    slot = keys.k_hot_slot(0)
    scene.store.compare_set(slot, "", scene.member.sealer.seal(slot, HotClaim("s1", "127.0.0.1", 40001).to_json()))
    scene.member.put(keys.k_hot_held("s1"), HotHeld(7))
    scene.pool.procs["w1"].killed = True
    scene.until(lambda: scene.c.gen.gen == 1, 1.0)
    assert scene.now < tick + HEALTH_EVERY_S, "covered before the next health tick"
    assert scene.c.gen.members[1] == "s1"


@pytest.mark.timeout(20)
def test_the_hot_slot_of_a_standby_that_dies_is_freed_for_another() -> None:
    scene = Scene(lambda name, role: Script(ready_at=0.3, exit_at=1.0) if name == "s0" else Script())
    slot = keys.k_hot_slot(0)
    claim = scene.member.sealer.seal(slot, HotClaim("s0", "127.0.0.1", 40000).to_json())
    scene.store.compare_set(slot, "", claim)
    scene.member.put(keys.k_hot_of("s0"), 0)
    scene.c.start()
    scene.until(lambda: bool(scene.events(StandbyLost)), 5.0)
    assert scene.store.get(slot) == b"", "free: the next standby's compare_set from empty claims it"
