"""The coordinator's decisions in-process: a real store, scripted fake processes, no training.

Each fake process exits (or not) as its script says; the coordinator must end every one of these jobs with one
clear message, never with a crash, a spin or an ever-growing process table.
"""

from __future__ import annotations

import datetime
import itertools
from collections.abc import Callable

import pytest
import torch.distributed as dist

from runtime.control.chaos import Candidate, ChaosMonkey, ChaosSpecError, parse_chaos
from runtime.control.coordinator import Coordinator, CoordinatorSettings, SimplePool
from runtime.wire import store as keys
from runtime.wire.auth import Sealer
from runtime.wire.event_records import (
    BackupWritten,
    Event,
    GenerationStarted,
    MemberFailed,
    RestoringFromBackup,
    StandbyLost,
)
from runtime.wire.events import EventLog, of_type
from runtime.wire.protocol import BackupRecord, Finished
from runtime.wire.store import Records

_pids = itertools.count(900_000)

TOKEN = "t" * 64


class StubProcess:
    """What the coordinator needs of a process, for one that exists only as `poll`'s answers: `kill` marks it
    killed (`poll` then says -9), `wait` polls once, and it has no exit fd to watch."""

    killed: bool

    def poll(self) -> int | None:
        raise NotImplementedError

    def kill(self) -> None:
        self.killed = True

    def wait(self, timeout_s: float) -> int | None:
        return self.poll()

    def exit_fd(self) -> int | None:
        return None

    def close(self) -> None:
        pass


class FakeProcess(StubProcess):
    """A process that exits with `code` once polled `after` times (never, for code None)."""

    def __init__(self, name: str, role: str, code: int | None, after: int = 0) -> None:
        self.name, self.role, self.pid = name, role, next(_pids)
        self.code, self.after, self.polls = code, after, 0
        self.killed = False

    def poll(self) -> int | None:
        if self.killed:
            return -9
        self.polls += 1
        return self.code if self.code is not None and self.polls > self.after else None


class FakePool(SimplePool):
    def __init__(self, behaviour: Callable[[str, str], tuple[int | None, int]]) -> None:
        self.behaviour = behaviour
        self.spawned: list[FakeProcess] = []

    def spawn(self, name: str, role: str) -> FakeProcess:
        code, after = self.behaviour(name, role)
        p = FakeProcess(name, role, code, after)
        self.spawned.append(p)
        return p


def run(pool: FakePool, done: bool = False, backup: BackupRecord | None = None,
        **settings: object) -> tuple[int, str, list[Event]]:
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=10),
                          wait_for_workers=False)
    if backup is not None:  # rank 0 reported a finished backup
        Records(store, Sealer(TOKEN, "w0")).put(keys.k_backup(), backup)
    if done:  # every worker already finished the last step of generation 0
        for rank in range(2):
            Records(store, Sealer(TOKEN)).put(keys.k_done(0, rank), Finished(20))
    s = CoordinatorSettings(job_id="j", job_token=TOKEN, **{"nproc": 2, "standby": 1, **settings})  # type: ignore[arg-type]
    result = Coordinator(s, store, pool, EventLog(None)).run()
    return result.exit_code, result.message, result.events


@pytest.mark.timeout(30)
def test_a_script_that_exits_before_joining_stops_the_job_instead_of_spawning_standbys() -> None:
    pool = FakePool(lambda name, role: (0, 0))  # exits 0 at once, never calls runtime.init()
    code, message, _ = run(pool)
    assert code == 1
    assert "exited with code 0 before joining the job" in message and "runtime.init()" in message
    assert len(pool.spawned) <= 3  # the two workers and the first standby: no storm


@pytest.mark.timeout(30)
def test_standbys_dying_before_they_are_warm_stop_the_job_after_five_in_a_row() -> None:
    pool = FakePool(lambda name, role: (None, 0) if role == "worker" else (-9, 0))
    code, message, events = run(pool)
    assert code == 1
    assert "5 standbys in a row died before they were warm" in message
    assert len(of_type(events, StandbyLost)) == 5
    assert sum(p.role == "standby" for p in pool.spawned) == 5  # each replaced once, the fifth not


@pytest.mark.timeout(30)
def test_losing_every_holder_of_the_state_stops_the_job_at_once() -> None:
    pool = FakePool(lambda name, role: (-9, 2) if role == "worker" else (None, 0))
    code, message, events = run(pool)
    assert code == 1
    assert "every copy of the training state was lost" in message
    assert not [e for e in of_type(events, GenerationStarted) if e.generation > 0]


@pytest.mark.timeout(30)
def test_losing_every_holder_with_a_backup_goes_on_to_a_generation_that_restores_it() -> None:
    """With no standby to form it the job still stops, but for that reason, and after saying what it would restore."""
    pool = FakePool(lambda name, role: (-9, 2) if role == "worker" else (None, 0))
    backup = BackupRecord(step=8, path="/b/step-000000008", bytes=100, stage_s=0.001, write_s=0.01)
    code, message, events = run(pool, backup=backup, standby=0, standby_wait_s=0.0)
    assert code == 1
    assert "every copy" not in message and "standby" in message
    (restore,) = of_type(events, RestoringFromBackup)
    assert restore.backup_step == 8 and restore.path == backup.path
    (written,) = of_type(events, BackupWritten)
    assert written.step == 8 and written.bytes == 100


@pytest.mark.timeout(30)
def test_workers_that_finished_and_left_before_the_loop_noticed_complete_the_job() -> None:
    pool = FakePool(lambda name, role: (0, 0) if role == "worker" else (None, 0))  # gone at the first look
    code, message, events = run(pool, done=True)
    assert code == 0, message
    assert not of_type(events, MemberFailed)


def test_chaos_specs_parse_and_bad_ones_say_what_is_expected() -> None:
    spec = parse_chaos("seed=3,every_s=0.5,max=7,signals=kill|stop,targets=worker,burst=2")
    assert spec is not None and spec.max_faults == 7 and spec.signals == ("kill", "stop") and spec.burst == 2
    assert parse_chaos("") is None
    for bad in ("seed", "every_s=0", "signals=term", "targets=coordinator", "burst=0", "speed=1", "max=x"):
        with pytest.raises(ChaosSpecError, match="chaos"):
            parse_chaos(bad)


def test_chaos_never_takes_the_last_holder_of_the_state_and_respects_burst_and_max() -> None:
    spec = parse_chaos("seed=1,every_s=1,max=50,signals=kill|stop,burst=3")
    assert spec is not None
    monkey = ChaosMonkey(spec)
    monkey.start(0.0)
    candidates = [Candidate("w0", "worker", "training", True), Candidate("w1", "worker", "training", True),
                  Candidate("w2", "worker", "receiving", False), Candidate("s0", "standby", "standby_warm", False)]
    hits: list[str] = []
    now = 0.0
    while not monkey.exhausted:
        now += 10.0
        assert monkey.due(now)
        shots = monkey.strike(now, candidates)
        assert 1 <= len(shots) <= 3
        assert sum(s.proc in ("w0", "w1") for s in shots) <= 1  # one holder always survives
        hits += [s.proc for s in shots]
    assert len(hits) == 50 and monkey.injected == 50 and not monkey.due(now + 100)
    assert {"w0", "w1", "w2", "s0"} <= set(hits)
    lone = [Candidate("w0", "worker", "training", True)]
    assert ChaosMonkey(spec).strike(0.0, lone) == []


def test_covered_chaos_hits_no_more_workers_than_warm_standbys_can_replace() -> None:
    spec = parse_chaos("seed=2,every_s=1,signals=kill,burst=3,covered=1")
    assert spec is not None and spec.covered
    monkey = ChaosMonkey(spec)
    workers = [Candidate(f"w{i}", "worker", "training", True) for i in range(4)]
    for warm in range(3):
        standbys = [Candidate(f"s{i}", "standby", "standby_warm", False) for i in range(warm)]
        for _ in range(200):
            shots = monkey.strike(0.0, workers + standbys)
            hit_workers = sum(s.proc.startswith("w") for s in shots)
            hit_warm = sum(s.proc.startswith("s") for s in shots)
            assert hit_workers <= warm - hit_warm
