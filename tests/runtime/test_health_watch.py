"""`HealthWatch.poll` on a fake clock, over a real in-process store: which heartbeats it reads from the store and
when, while a process's agent reports it beating, once the agent stops, and when only the store falls silent."""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch.distributed as dist

from runtime.control.health import STORE_EVERY_S, Fencing, HealthWatch, Member
from runtime.wire import store as keys
from runtime.wire.auth import Sealer
from runtime.wire.protocol import Heartbeat, ProcessHello
from tests.runtime.test_coordinator_logic import StubProcess

TOKEN = "e" * 64
HANG_S = 2.0
TICK_S = 0.2


class CountingRecords(keys.Records):
    """The job's records, counting the heartbeat reads (`get_present_records` and `get_record` of heartbeats)."""

    def __init__(self, store: Any, sealer: Sealer) -> None:
        super().__init__(store, sealer)
        self.heartbeat_reads = 0

    def get_present_records(self, names: list[str], kind: Any) -> Any:  # type: ignore[override]
        self.heartbeat_reads += sum(1 for n in names if n.endswith("/heartbeat"))
        return super().get_present_records(names, kind)

    def get_record(self, key: str, kind: Any) -> Any:  # type: ignore[override]
        self.heartbeat_reads += key.endswith("/heartbeat")
        return super().get_record(key, kind)


class Worker(StubProcess):
    name, role, pid = "w0", "worker", 4242

    def poll(self) -> int | None:
        return None


class World:
    """One process `w0`, its heartbeat in the store, and what its agent saw of it, on a fake clock."""

    def __init__(self) -> None:
        self.store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=5))
        self.coordinator = CountingRecords(self.store, Sealer(TOKEN, "coordinator"))
        self.member = keys.Records(self.store, Sealer(TOKEN, "member"))
        self.now = 100.0
        self.agent_saw: float | None = None
        proc = Worker()
        self.member.put(keys.k_hello("w0"), ProcessHello(4242, "worker"))
        self.procs = {"w0": Member(proc, self.now, hb_changed_at=self.now, hb_changed_wall=self.now)}
        self.count = 0
        self.watch = HealthWatch(self.coordinator, HANG_S, 60.0, wall=lambda: self.now,
                                 beat_seen=lambda name: self.agent_saw)

    def beat(self, store: bool = True, agent: bool = True) -> None:
        self.count += 1
        if store:
            self.member.put(keys.k_heartbeat("w0"), Heartbeat(self.count))
        if agent:
            self.agent_saw = self.now

    def run(self, seconds: float, store: bool = True, agent: bool = True) -> list[str]:
        """Beat every 0.25 s and poll every tick for `seconds`; the fences."""
        fenced: list[str] = []
        end = self.now + seconds
        while self.now < end - 1e-9:
            self.now += TICK_S / 2
            self.beat(store, agent)
            self.now += TICK_S / 2
            fenced += [f.proc for f in self.watch.poll(self.procs, self.now).fence]
        return fenced


@pytest.fixture
def world() -> Any:
    w = World()
    yield w
    del w.store


def test_while_its_agent_sees_it_beat_the_store_heartbeat_is_read_once_a_second(world: World) -> None:
    assert world.run(1.0) == []
    before = world.coordinator.heartbeat_reads
    assert world.run(10.0) == []
    reads = world.coordinator.heartbeat_reads - before
    assert reads <= 10.0 / STORE_EVERY_S + 1, f"{reads} store reads in 10 s (50 ticks)"
    assert world.procs["w0"].hb_value > 0


def test_a_hang_seen_by_both_is_fenced_within_the_hang_timeout_and_a_tick(world: World) -> None:
    world.run(3.0)
    hung_at = world.now
    fenced: list[Fencing] = []
    while not fenced:
        world.now += TICK_S
        fenced = world.watch.poll(world.procs, world.now).fence
        assert world.now - hung_at <= HANG_S + 2 * TICK_S, "not fenced in time"
    assert [f.proc for f in fenced] == ["w0"] and world.now - hung_at > HANG_S - TICK_S
    assert fenced[0].failure_at is not None and abs(fenced[0].failure_at - (hung_at - TICK_S / 2)) < 1e-6, \
        "it failed at its last beat"


def test_a_store_heartbeat_gone_silent_while_its_agent_sees_it_is_counted_never_fenced(world: World) -> None:
    world.run(1.0)
    assert world.run(3 * HANG_S, store=False) == [], "its agent sees it beat"
    assert world.coordinator.sealer.refused["proc/w#/heartbeat"] > 0, "the store's silence is counted"


def test_with_no_agent_reports_every_tick_reads_the_store(world: World) -> None:
    world.run(1.0, agent=False)
    before = world.coordinator.heartbeat_reads
    assert world.run(2.0, agent=False) == []
    assert world.coordinator.heartbeat_reads - before == 10
