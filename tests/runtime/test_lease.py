"""The coordinator's lease (runtime.control.lease) and a coordinator taking a job over, in-process on a fake clock.

The lease's races are decided by the store's compare_set: these tests run them against torch's own stores, one
contender after another, and then run two coordinators on one store: the first one stops renewing (it died), the
second takes the job over with the processes the first one started, and the first finds itself deposed.
"""

from __future__ import annotations

import datetime
import socket

import pytest
import torch.distributed as dist

from runtime.control.coordinator import Coordinator, CoordinatorSettings
from runtime.control.health import ProcessHandle
from runtime.control.lease import Deposed, Lease, LeaseError
from runtime.wire import store as keys
from runtime.wire.auth import Sealer
from runtime.wire.event_records import CoordinatorTookOver, GenerationStarted, JobFinished, MemberFailed, Recovered
from runtime.wire.events import EventLog
from runtime.wire.protocol import CoordinatorLease, StopOrder
from runtime.wire.store import read_lease
from tests.runtime.test_coordinator_fake_clock import TOKEN, FakeClock, Script, SimPool

pytestmark = pytest.mark.timeout(30)


def _free_port() -> int:
    """A port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _lease(store: dist.Store, clock: FakeClock, agents: str = "10.0.0.1:7000", token: str = TOKEN) -> Lease:
    return Lease(store, Sealer(token, "coordinator"), agents, clock=clock.monotonic, sleep=clock.sleep,
                 wall=clock.wall)


def test_a_new_job_creates_epoch_1_and_a_second_creator_is_refused() -> None:
    store, clock = dist.HashStore(), FakeClock()
    first = _lease(store, clock)
    first.create()
    assert first.epoch == 1
    with pytest.raises(LeaseError, match="--takeover"):
        _lease(store, clock).create()
    first.renew()
    _, record = read_lease(store, Sealer(TOKEN, "x")) or (b"", None)
    assert record is not None and record.count == 1 and record.agents == "10.0.0.1:7000"


def test_takeover_waits_while_the_holder_renews_and_gives_up_after_its_timeout() -> None:
    store, clock = dist.HashStore(), FakeClock()
    holder = _lease(store, clock)
    holder.create()

    class Renewing(FakeClock):
        """The contender's clock; the holder renews at every one of its sleeps (it is alive)."""

        def sleep(self, seconds: float) -> None:
            clock.sleep(seconds)
            holder.renew()

    contender = Lease(store, Sealer(TOKEN, "coordinator"), "10.0.0.2:7000", clock=clock.monotonic,
                      sleep=Renewing().sleep, wall=clock.wall)
    with pytest.raises(LeaseError, match="kept renewing"):
        contender.take_over(stale_s=2.0, timeout_s=10.0)
    assert clock.monotonic() >= 10.0
    holder.renew()  # never deposed


def test_a_stale_lease_goes_to_one_contender_and_its_holder_is_deposed() -> None:
    store, clock = dist.HashStore(), FakeClock()
    holder = _lease(store, clock)
    holder.create()
    clock.sleep(0.5)
    second = _lease(store, clock, "10.0.0.2:7000")
    taken = second.take_over(stale_s=2.0, timeout_s=30.0)
    assert taken.epoch == 1 and second.epoch == 2
    assert 2.0 <= clock.monotonic() <= 2.0 + 0.1, "taken as soon as the lease was stale for 2 s (by its own time)"
    assert second.stale_for >= 2.0
    # A third contender that read the same stale bytes loses the swap and finds a live holder.
    third = _lease(store, clock, "10.0.0.3:7000")
    with pytest.raises(LeaseError, match="kept renewing"):
        third.take_over(stale_s=2.0, timeout_s=1.0)
    with pytest.raises(Deposed, match="epoch 2"):
        holder.renew()
    second.claim(keys.k_gen(1), {"gen": 1})
    with pytest.raises(Deposed, match="published"):
        holder.claim(keys.k_gen(1), {"gen": 1, "members": ["other"]})  # one generation 1, whoever holds the lease
    holder.claim(keys.k_gen(1), {"gen": 1})  # the very same record again (seals are deterministic): no conflict


def test_no_job_to_take_over_and_a_forged_lease_are_refused_with_what_to_do() -> None:
    store, clock = dist.HashStore(), FakeClock()
    with pytest.raises(LeaseError, match="without --takeover"):
        _lease(store, clock).take_over(stale_s=2.0, timeout_s=5.0)
    forged = _lease(store, clock, token="0" * 64)  # another secret: its record is not the job's
    forged.create()
    with pytest.raises(LeaseError, match="no job to take over"):
        _lease(store, clock).take_over(stale_s=2.0, timeout_s=5.0)


class AdoptingPool(SimPool):
    """The second coordinator's pool: the first one's processes, handed over as its agents would re-attach."""

    def __init__(self, first: SimPool, records: keys.Records) -> None:
        super().__init__(first.clock, records, first.scripts)
        self.waiting = [p for p in first.procs.values() if p.poll() is None]
        self.procs = dict(first.procs)

    def take_adopted(self) -> list[ProcessHandle]:
        out, self.waiting = self.waiting, []
        return list(out)


class TwoCoordinators:
    """A job whose first coordinator runs for a while and stops (SIGKILL: no renewal, no clean-up), then a second
    one that takes it over, on one fake clock and one real store."""

    def __init__(self, scripts: Script | None = None, **settings: object) -> None:
        self.clock = FakeClock()
        self.store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=5),
                                   wait_for_workers=False)
        self.member = keys.Records(self.store, Sealer(TOKEN, "member"))
        self.settings = CoordinatorSettings(job_id="j", job_token=TOKEN, nproc=2, standby=1, **settings)  # type: ignore[arg-type]
        self.first_pool = SimPool(self.clock, self.member, self._scripts)
        self.first_lease = _lease(self.store, self.clock)
        self.first_lease.create()
        self.first = self._coordinator(self.first_pool, self.first_lease)
        self.second: Coordinator | None = None
        self.exits: dict[str, float] = {}

    def _scripts(self, name: str, role: str) -> Script:
        if role == "standby":
            return Script(ready_at=0.5, finish_at=20.0)
        return Script(finish_at=20.0, exit_at=self.exits.get(name))

    def _coordinator(self, pool: SimPool, lease: Lease) -> Coordinator:
        return Coordinator(self.settings, self.store, pool, EventLog(None), clock=self.clock.monotonic,
                           wall=self.clock.wall, sleep=self.clock.sleep, lease=lease)

    def run_first(self, until: float) -> None:
        self.first.start()
        while self.clock.monotonic() < until:
            assert self.first.step() is None

    def take_over(self) -> Coordinator:
        lease = _lease(self.store, self.clock, "10.0.0.2:7000")
        previous = lease.take_over(stale_s=2.0, timeout_s=30.0)
        self.second = self._coordinator(AdoptingPool(self.first_pool, self.member), lease)
        self.second.take_over(previous, lease.stale_for, adopt_s=4.5)
        return self.second

    def finish(self) -> Coordinator:
        assert self.second is not None
        result = self.second.run_loop()
        assert result.exit_code == 0, result.message
        return self.second


def test_a_coordinator_that_takes_over_in_steady_training_adopts_everyone_and_the_old_one_is_deposed() -> None:
    job = TwoCoordinators()
    job.run_first(until=3.0)
    assert job.first.started and job.first.gen.gen == 0
    second = job.take_over()
    assert second.gen.gen == 0 and second.holders == {"w0", "w1"}
    done = job.finish()
    took = done.events.of_type(CoordinatorTookOver)
    assert len(took) == 1 and took[0].epoch == 2 and took[0].missing == [] and took[0].adopted == ["s0", "w0", "w1"]
    assert not done.events.of_type(MemberFailed) and done.events.of_type(JobFinished)[0].generation == 0
    # The first one wakes up (it was frozen, not dead): its next tick finds the lease gone and it leaves the job be.
    job.clock.sleep(0.3)
    result = job.first.run_loop()
    assert result.exit_code == 5 and "lost the job's lease" in result.message and job.first.deposed
    stop = keys.Records(job.store, Sealer(TOKEN, "x")).get_record(keys.k_stop(), StopOrder)
    assert stop is not None and stop.reason == "training completed", "the deposed one wrote no stop of its own"


def test_a_member_that_died_while_no_coordinator_ran_is_replaced_by_the_one_that_takes_over() -> None:
    job = TwoCoordinators()
    job.exits["w1"] = 4.0  # after the first coordinator's last tick (3.0), before the second takes over
    job.run_first(until=3.0)
    second = job.take_over()
    assert "w1" not in second.procs
    done = job.finish()
    took = done.events.of_type(CoordinatorTookOver)[0]
    assert took.missing == ["w1"] and took.adopt_s >= 4.5 - 0.01, "awaited for the whole adoption wait"
    failed = done.events.of_type(MemberFailed)
    assert [(f.proc, f.rank) for f in failed] == [("w1", 1)]
    gens = done.events.of_type(GenerationStarted)
    assert [g.generation for g in gens] == [1] and gens[0].replaced == [{"rank": 1, "old": "w1", "new": "s0"}]
    assert done.events.of_type(JobFinished)[0].generation == 1
    names = keys.read_counter(job.store, keys.k_standby_names())
    assert names >= 2, "the second coordinator named its new standby after the first one's (s1, never s0 again)"
    assert "s1" in done.procs


def test_a_recovery_in_flight_is_reported_by_the_coordinator_that_takes_over() -> None:
    job = TwoCoordinators()
    job.exits["w1"] = 2.0
    job.run_first(until=2.3)  # w1 declared dead and generation 1 published: the replay has not been reported
    assert job.first.gen.gen == 1 and job.first.recoveries
    second = job.take_over()
    assert second.gen.gen == 1 and second.recoveries, "the open recovery was read back from the store"
    assert second.holders == {"w0"}, "s0 holds rank 1 only once its handoff says so"
    lease = CoordinatorLease.from_json(Sealer(TOKEN, "x").open(keys.k_lease(), job.store.get(keys.k_lease())))
    assert lease.epoch == 2
    done = job.finish()
    assert not done.events.of_type(MemberFailed), "the death was the first coordinator's to declare, once"
    assert done.events.of_type(JobFinished)[0].generation == 1
    assert not done.events.of_type(Recovered) or done.events.of_type(Recovered)[0].generation == 1


def test_a_takeover_of_another_job_or_of_an_ended_one_is_refused_before_the_lease_is_touched() -> None:
    from runtime.config import LaunchConfig
    from runtime.launcher import _check_job
    from runtime.wire.protocol import JobConfig, JobOver

    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=5), wait_for_workers=False)
    records = keys.Records(store, Sealer(TOKEN, "coordinator"))
    clock = FakeClock()
    _lease(store, clock).create()
    before = store.get(keys.k_lease())
    cfg = LaunchConfig(script="train.py", agents=2, nproc=2, job_id="j", store=f"127.0.0.1:{store.port}",
                       takeover=True)
    with pytest.raises(LeaseError, match="no job started with this secret"):
        _check_job(cfg, store, TOKEN)
    records.put(keys.k_job_config(), JobConfig(4, "other"))
    with pytest.raises(LeaseError, match="holds job other of 4 workers, not job j of 2 workers: take it over with"):
        _check_job(cfg, store, TOKEN)
    records.put(keys.k_job_config(), JobConfig(2, "j"))
    _check_job(cfg, store, TOKEN)
    records.put(keys.k_over(), JobOver(0))
    with pytest.raises(LeaseError, match="has ended"):
        _check_job(cfg, store, TOKEN)
    assert store.get(keys.k_lease()) == before


def test_the_store_process_exits_when_no_coordinator_renews_a_lease_and_when_told_to() -> None:
    import signal
    import threading

    from runtime.launcher import serve_store

    before = signal.getsignal(signal.SIGTERM)
    assert serve_store("127.0.0.1", _free_port(), TOKEN, idle_exit_s=0.3, poll_s=0.02) == 3
    assert signal.getsignal(signal.SIGTERM) is before, "the store's handler outlived it"
    stop = threading.Event()
    result: list[int] = []
    port = _free_port()
    server = threading.Thread(target=lambda: result.append(serve_store("127.0.0.1", port, TOKEN, poll_s=0.02,
                                                                       stop=stop)))
    server.start()
    client = keys.connect("127.0.0.1", port, timeout_s=10.0)
    lease = _lease(client, FakeClock())
    lease.create()  # a coordinator's lease: the store serves on
    stop.set()
    server.join(timeout=10)
    assert result == [0]


def test_a_takeover_before_training_started_starts_a_lost_worker_anew_and_then_the_job() -> None:
    job = TwoCoordinators(start_when_standbys_ready=True)
    job.exits["w1"] = 0.4  # before generation 0 (the standby is warm at 0.5): it held nothing
    job.run_first(until=0.3)
    assert not job.first.started
    del job.exits["w1"]  # the w1 started again runs well
    second = job.take_over()
    assert not second.started
    done = job.finish()
    assert not done.events.of_type(MemberFailed), "no member was lost: training had not started"
    gens = done.events.of_type(GenerationStarted)
    assert [g.generation for g in gens] == [0] and [m["proc"] for m in gens[0].members] == ["w0", "w1"]
    assert job.first_pool.procs["w1"] is not done.procs["w1"].handle, "w1 was started again"
    assert done.events.of_type(JobFinished)[0].generation == 0
