"""Scenarios for `cloud.local.LocalProvider`: the cloud's state machine on this machine, with injected failures."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from cloud.base import (
    DESCRIBE,
    JOB_TAG,
    MUTATE,
    ROLE_TAG,
    CapacityError,
    CloudError,
    InvalidRequestError,
    JobNetwork,
    LaunchRequest,
    NotFoundError,
    RetryBudget,
    ThrottledError,
    UnsupportedError,
    with_retries,
)
from cloud.local import LOCAL_DEFAULT_PRICE_USD_PER_H, LOCAL_SPOT_FACTOR, LocalProvider

JOB = "job-local"


class FakeClock:
    """Epoch seconds that move only when a test says so."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def cloud(clock: FakeClock) -> Iterator[LocalProvider]:
    provider = LocalProvider(slots=3, clock=clock)
    try:
        yield provider
    finally:
        left = [i.instance_id for i in provider.describe()]
        if left:
            provider.terminate(left)


def assert_nothing_left(cloud: LocalProvider, job_id: str = JOB) -> None:
    cloud.release_job(job_id)
    assert cloud.describe(job_id=job_id) == []
    assert cloud.describe() == []


def workers(count: int = 1, **kw: object) -> LaunchRequest:
    return LaunchRequest(job_id=JOB, role="worker", instance_type="g5.xlarge", count=count, **kw)  # type: ignore[arg-type]


def test_a_standby_is_launched_parked_woken_and_terminated(cloud: LocalProvider) -> None:
    (standby,) = cloud.launch(LaunchRequest(job_id=JOB, role="standby", instance_type="g5.xlarge", tags={"t": "1"}))
    assert standby.instance_id == "local-000001"
    assert (standby.state, standby.health, standby.role, standby.provider) == ("running", "ok", "standby", "local")
    assert cloud.tags(standby.instance_id) == {"t": "1", JOB_TAG: JOB, ROLE_TAG: "standby"}

    (parked,) = cloud.stop([standby.instance_id])
    assert parked.parked and parked.health == "unknown"
    assert cloud.stop([standby.instance_id])[0].parked  # parking a parked instance is a no-op

    (woken,) = cloud.start([standby.instance_id])
    assert woken.running

    cloud.terminate([standby.instance_id])
    cloud.terminate([standby.instance_id])  # idempotent
    (gone,) = cloud.describe([standby.instance_id])  # still describable by id, as on EC2
    assert gone.state == "terminated"
    assert cloud.describe(job_id=JOB) == []
    assert_nothing_left(cloud)


def test_a_launch_is_pending_until_the_start_delay_has_passed(clock: FakeClock) -> None:
    cloud = LocalProvider(slots=2, start_delay_s=30.0, clock=clock)
    (inst,) = cloud.launch(workers())
    assert (inst.state, inst.health) == ("pending", "initializing")
    clock.advance(29.0)
    assert cloud.describe([inst.instance_id])[0].state == "pending"
    clock.advance(1.0)
    assert cloud.describe([inst.instance_id])[0].running
    # Woken instances go through pending again.
    cloud.stop([inst.instance_id])
    assert cloud.start([inst.instance_id])[0].state == "pending"
    seen = cloud.wait_for_state([inst.instance_id], ["running"], timeout_s=60.0, poll_s=10.0, sleep=clock.advance)
    assert seen[0].running
    assert_nothing_left(cloud)


def test_wait_for_state_times_out_naming_the_laggards(clock: FakeClock) -> None:
    cloud = LocalProvider(slots=2, start_delay_s=300.0, clock=clock)
    slow, fast = (i.instance_id for i in cloud.launch(workers(2)))
    cloud.stop([fast])
    cloud.start([fast])
    clock.advance(299.0)
    with pytest.raises(TimeoutError) as err:
        cloud.wait_for_state([slow, fast], ["running"], timeout_s=0.0, sleep=clock.advance)
    assert slow in str(err.value) and fast in str(err.value) and "pending" in str(err.value)
    assert_nothing_left(cloud)


def test_launch_beyond_the_free_slots_is_a_capacity_error_and_launches_nothing(cloud: LocalProvider) -> None:
    cloud.launch(workers(2))
    with pytest.raises(CapacityError, match="1 of 3 slots free") as err:
        cloud.launch(workers(2))
    assert err.value.code == "InsufficientInstanceCapacity" and not err.value.transient
    assert len(cloud.describe(job_id=JOB)) == 2
    assert_nothing_left(cloud)


def test_waking_a_standby_when_every_slot_is_taken_fails_until_one_is_released(cloud: LocalProvider) -> None:
    (standby,) = cloud.launch(LaunchRequest(job_id=JOB, role="standby", instance_type="g5.xlarge"))
    cloud.stop([standby.instance_id])  # a parked standby holds no slot...
    busy = cloud.launch(workers(3))  # ...so three workers fit

    with pytest.raises(CapacityError, match="0 of 3 slots free"):
        cloud.start([standby.instance_id])
    assert cloud.describe([standby.instance_id])[0].parked  # nothing changed

    cloud.terminate([busy[0].instance_id])
    assert cloud.start([standby.instance_id])[0].running
    assert_nothing_left(cloud)


def test_start_is_all_or_nothing(cloud: LocalProvider) -> None:
    ids = [i.instance_id for i in cloud.launch(workers(3))]
    cloud.stop(ids)
    cloud.launch(LaunchRequest(job_id=JOB, role="standby", instance_type="m5.large"))
    with pytest.raises(CapacityError):
        cloud.start(ids)
    assert all(i.parked for i in cloud.describe(ids))
    assert [i.state for i in cloud.start(ids[:2])] == ["running", "running"]
    assert_nothing_left(cloud)


def test_injected_throttling_is_retried_within_the_mutate_budget(cloud: LocalProvider) -> None:
    cloud.fail_next("launch", ThrottledError("RequestLimitExceeded", provider="local"), times=2)
    delays: list[float] = []
    launched = with_retries(lambda: cloud.launch(workers()), MUTATE, sleep=delays.append)
    assert len(launched) == 1 and launched[0].running
    assert len(delays) == 2 and all(0.0 <= d <= MUTATE.max_delay_s for d in delays)
    assert_nothing_left(cloud)


def test_throttling_that_outlasts_the_budget_raises_the_last_error_and_changes_nothing(cloud: LocalProvider) -> None:
    (inst,) = cloud.launch(workers())
    budget = RetryBudget("test", attempts=3, base_delay_s=0.01, max_delay_s=0.01, deadline_s=5.0)
    cloud.fail_next("stop", ThrottledError("slow down", provider="local"), times=5)
    delays: list[float] = []
    with pytest.raises(ThrottledError, match="slow down"):
        with_retries(lambda: cloud.stop([inst.instance_id]), budget, sleep=delays.append)
    assert len(delays) == budget.attempts - 1
    assert cloud.describe([inst.instance_id])[0].running
    # Two injected failures remain queued; then stop works again.
    for _ in range(2):
        with pytest.raises(ThrottledError):
            cloud.stop([inst.instance_id])
    assert cloud.stop([inst.instance_id])[0].parked
    assert_nothing_left(cloud)


def test_an_injected_capacity_error_is_not_retried(cloud: LocalProvider) -> None:
    (inst,) = cloud.launch(workers())
    cloud.stop([inst.instance_id])
    cloud.fail_next("start", CapacityError("InsufficientInstanceCapacity in local", provider="local"))
    delays: list[float] = []
    with pytest.raises(CapacityError):
        with_retries(lambda: cloud.start([inst.instance_id]), DESCRIBE, sleep=delays.append)
    assert delays == []
    assert cloud.start([inst.instance_id])[0].running
    assert_nothing_left(cloud)


def test_injected_terminate_failures_do_not_defeat_release_with_retries(cloud: LocalProvider) -> None:
    cloud.launch(workers(3))
    cloud.fail_next("terminate", ThrottledError("throttled", provider="local"))
    released = with_retries(lambda: cloud.release_job(JOB), MUTATE, sleep=lambda _: None)
    assert released == ["local-000001", "local-000002", "local-000003"]
    assert cloud.release_job(JOB) == []
    assert_nothing_left(cloud)


def test_a_spot_notice_arrives_with_its_lead_time_and_the_cloud_acts_at_the_deadline(
    cloud: LocalProvider, clock: FakeClock
) -> None:
    spot, other = cloud.launch(workers(2, market="spot"))
    assert spot.market == "spot"
    notice = cloud.inject_notice(spot.instance_id, "spot_interruption", detail="capacity reclaimed")
    maintenance = cloud.inject_notice(other.instance_id, "scheduled_maintenance", lead_s=900.0)

    polled = cloud.poll_notices()
    assert polled == [notice, maintenance]
    assert notice.lead_s == pytest.approx(120.0) and maintenance.lead_s == pytest.approx(900.0)
    assert (notice.source, notice.detail) == ("local", "capacity reclaimed")
    assert notice.event_id != maintenance.event_id
    assert cloud.poll_notices() == []  # delivered once

    clock.advance(119.0)
    assert cloud.describe([spot.instance_id])[0].running
    clock.advance(1.0)
    assert cloud.describe([spot.instance_id])[0].state == "terminated"
    clock.advance(1000.0)
    assert cloud.describe([other.instance_id])[0].running  # maintenance warns only
    assert_nothing_left(cloud)


def test_poll_notices_waits_at_most_its_timeout(cloud: LocalProvider) -> None:
    started = time.monotonic()
    assert cloud.poll_notices(timeout_s=0.2) == []
    assert 0.15 <= time.monotonic() - started < 5.0
    assert cloud.poll_notices(timeout_s=-1.0) == []


def test_poll_notices_returns_as_soon_as_another_thread_injects_one(cloud: LocalProvider) -> None:
    (inst,) = cloud.launch(workers())
    injector = threading.Thread(target=cloud.inject_notice, args=(inst.instance_id, "eviction", 30.0))
    started = time.monotonic()
    injector.start()
    try:
        polled = cloud.poll_notices(timeout_s=10.0)
    finally:
        injector.join(timeout=10.0)
    assert [n.kind for n in polled] == ["eviction"]
    assert time.monotonic() - started < 5.0
    assert_nothing_left(cloud)


def test_an_unhealthy_instance_recovers_after_stop_and_start(cloud: LocalProvider) -> None:
    (inst,) = cloud.launch(workers())
    assert cloud.mark_unhealthy(inst.instance_id).health == "impaired"
    assert cloud.describe([inst.instance_id])[0].health == "impaired"
    cloud.stop([inst.instance_id])
    with pytest.raises(InvalidRequestError, match="only a pending or running"):
        cloud.mark_unhealthy(inst.instance_id)
    assert cloud.start([inst.instance_id])[0].health == "ok"
    assert_nothing_left(cloud)


def test_release_job_leaves_nothing_of_the_job_and_spares_other_jobs(cloud: LocalProvider) -> None:
    mine = cloud.launch(workers(2))
    cloud.stop([mine[1].instance_id])  # parked instances are released too
    (theirs,) = cloud.launch(LaunchRequest(job_id="other", role="worker", instance_type="g5.xlarge"))
    assert sorted(cloud.release_job(JOB)) == sorted(i.instance_id for i in mine)
    assert cloud.describe(job_id=JOB) == []
    assert cloud.describe() == [cloud.describe([theirs.instance_id])[0]]
    assert_nothing_left(cloud, "other")


def test_concurrent_launches_never_exceed_the_slots() -> None:
    cloud = LocalProvider(slots=5)
    barrier = threading.Barrier(8, timeout=10.0)
    outcomes: list[str] = []
    lock = threading.Lock()

    def launch_one() -> None:
        barrier.wait()
        try:
            cloud.launch(workers())
            outcome = "launched"
        except CapacityError:
            outcome = "capacity"
        with lock:
            outcomes.append(outcome)

    threads = [threading.Thread(target=launch_one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10.0)
    assert sorted(outcomes) == ["capacity"] * 3 + ["launched"] * 5
    ids = [i.instance_id for i in cloud.describe(job_id=JOB)]
    assert len(set(ids)) == 5
    assert_nothing_left(cloud)


def test_prices_come_from_the_table_the_overrides_and_a_default(clock: FakeClock) -> None:
    cloud = LocalProvider(prices_usd_per_h={"g5.xlarge": 2.0, "g5.xlarge:spot": 0.5, "mine": 7.0}, clock=clock)
    assert cloud.hourly_price_usd("g5.xlarge") == 2.0
    assert cloud.hourly_price_usd("g5.xlarge", "spot") == 0.5
    assert cloud.hourly_price_usd("mine", "spot") == pytest.approx(7.0 * LOCAL_SPOT_FACTOR)
    assert cloud.hourly_price_usd("p4d.24xlarge") > 20.0
    assert cloud.hourly_price_usd("no-such-type") == LOCAL_DEFAULT_PRICE_USD_PER_H
    with pytest.raises(InvalidRequestError, match="market"):
        cloud.hourly_price_usd("g5.xlarge", "reserved")  # type: ignore[arg-type]


def test_capabilities_and_check_say_what_the_local_provider_can_do(cloud: LocalProvider) -> None:
    caps = cloud.capabilities()
    assert caps.spot and caps.can_park("spot") and caps.can_park("on-demand")
    assert not caps.placement_groups and not caps.capacity_reservations
    assert caps.spot_notice_s == 120.0 and "eviction" in caps.notice_kinds and len(caps.notice_kinds) == 5
    results = cloud.check()
    assert results and all(r.ok for r in results)
    assert any(r.name == "slots" and "3 of 3 free" in r.detail for r in results)


@pytest.mark.parametrize(
    ("request_kw", "error", "message"),
    [
        ({"placement_group": "pg-1"}, UnsupportedError, "placement groups"),
        ({"capacity_reservation": "cr-1"}, UnsupportedError, "capacity reservations"),
        ({"network": JobNetwork(29400, 29401)}, UnsupportedError, "security groups"),
        ({"zone": "us-east-1a"}, InvalidRequestError, "one zone"),
        ({"market": "reserved"}, InvalidRequestError, "market"),
        ({"instance_type": " "}, InvalidRequestError, "instance_type"),
        ({"role": "boss"}, InvalidRequestError, "role"),
    ],
)
def test_a_bad_launch_request_is_one_clear_error(
    cloud: LocalProvider, request_kw: dict[str, object], error: type[CloudError], message: str
) -> None:
    kw: dict[str, object] = {"job_id": JOB, "role": "worker", "instance_type": "g5.xlarge", **request_kw}
    with pytest.raises(error, match=message):
        cloud.launch(LaunchRequest(**kw))  # type: ignore[arg-type]
    assert cloud.describe() == []


def test_unknown_ids_and_terminated_instances_are_refused_clearly(cloud: LocalProvider) -> None:
    for call in (cloud.stop, cloud.start, cloud.terminate, cloud.describe):
        with pytest.raises(NotFoundError, match="local-999999"):
            call(["local-999999"])
    with pytest.raises(InvalidRequestError, match="sequence of ids"):
        cloud.stop("local-000001")
    (inst,) = cloud.launch(workers())
    cloud.terminate([inst.instance_id])
    with pytest.raises(InvalidRequestError, match=r"terminated instance.*launch a new one"):
        cloud.start([inst.instance_id])
    with pytest.raises(InvalidRequestError, match="terminated"):
        cloud.stop([inst.instance_id])
    with pytest.raises(InvalidRequestError, match="terminated"):
        cloud.inject_notice(inst.instance_id, "eviction")
    assert_nothing_left(cloud)


def test_bad_settings_and_injections_are_refused() -> None:
    with pytest.raises(InvalidRequestError, match="slots"):
        LocalProvider(slots=0)
    with pytest.raises(InvalidRequestError, match="start_delay_s"):
        LocalProvider(start_delay_s=-1.0)
    with pytest.raises(InvalidRequestError, match="price"):
        LocalProvider(prices_usd_per_h={"g5.xlarge": -1.0})
    with pytest.raises(InvalidRequestError, match="count"):
        workers(0)
    cloud = LocalProvider(slots=1)
    with pytest.raises(InvalidRequestError, match="operation"):
        cloud.fail_next("reboot", ThrottledError("x"))  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="times"):
        cloud.fail_next("launch", ThrottledError("x"), times=0)
    with pytest.raises(TypeError, match="CloudError"):
        cloud.fail_next("launch", RuntimeError("x"))  # type: ignore[arg-type]
    (inst,) = cloud.launch(workers())
    with pytest.raises(InvalidRequestError, match="notice kind"):
        cloud.inject_notice(inst.instance_id, "meteor")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="lead_s"):
        cloud.inject_notice(inst.instance_id, "eviction", lead_s=-5.0)
    assert cloud.slots == 1 and LocalProvider().slots >= 8
    assert_nothing_left(cloud)


def test_a_promoted_standby_is_retagged_worker(cloud: LocalProvider) -> None:
    (standby,) = cloud.launch(LaunchRequest(job_id=JOB, role="standby", instance_type="g5.xlarge", tags={"t": "1"}))

    promoted = cloud.set_role(standby.instance_id, "worker")

    assert promoted.role == "worker" and [i.role for i in cloud.describe(job_id=JOB)] == ["worker"]
    assert cloud.tags(standby.instance_id) == {"t": "1", JOB_TAG: JOB, ROLE_TAG: "worker"}
    with pytest.raises(InvalidRequestError, match="invalid role 'boss'"):
        cloud.set_role(standby.instance_id, "boss")  # type: ignore[arg-type]
    cloud.terminate([standby.instance_id])
    with pytest.raises(InvalidRequestError, match="cannot retag terminated"):
        cloud.set_role(standby.instance_id, "standby")
    assert_nothing_left(cloud)
