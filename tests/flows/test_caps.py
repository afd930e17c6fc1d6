"""A run's caps (`TrainingRun.max_instances`, `.max_spend_usd`): every launch and wake-up is checked before the
provider is called; one that would pass a cap is refused with one message, announced as
`trainmover.job.cap_reached`, nothing is launched for it, and the run goes on with what it holds. Caps below what
the run's own minimums need are refused at submit (tests/flows/test_models.py).

The supervisor runs on the local provider with a fake clock (hours pass without sleeping) and no job: its
failures arrive as the coordinator's event records, as in tests/flows/test_host_slots.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cloud.local import LocalProvider
from flows.actions import SPEND_LOOKAHEAD_H, Caps, Held, cap_refusal
from flows.models import StandbyLimits, TrainingRun
from flows.supervisor import CapReached, Happening, Supervisor
from runtime.wire.event_records import MemberFailed

HOUR_S = 3600.0
CAP_EVENT = "trainmover.job.cap_reached"


class FakeClock:
    """Monotonic seconds that move only when a test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance_h(self, hours: float) -> None:
        self.now += hours * HOUR_S


def failed(rank: int, at: float = 0.0) -> MemberFailed:
    """The coordinator's record of rank `rank`'s process dying (its instance is gone: the supervisor replaces it)."""
    return MemberFailed(generation=0, rank=rank, proc=f"w{rank}", pid=100 + rank, cause="exit -9", step=5,
                        failure_at=at, declared_at=at, detect_s=0.1)


def running(cloud: LocalProvider, job_id: str) -> dict[str, str]:
    """The job's instances that still exist: id -> state."""
    return {i.instance_id: i.state for i in cloud.describe(job_id=job_id) if i.state != "terminated"}


@contextlib.contextmanager
def supervising(run: TrainingRun, tmp_path: Path) -> Iterator[tuple[Supervisor, LocalProvider, FakeClock]]:
    """A supervisor of `run` on the local provider (8 slots per host), its policy asked every hour of a fake clock;
    released at the end: (supervisor, provider, clock)."""
    clock = FakeClock()
    cloud = LocalProvider(slots=8)
    sup = Supervisor(run, cloud, tmp_path, clock=clock, policy_every_s=HOUR_S)
    try:
        yield sup, cloud, clock
    finally:
        sup.release()


def caps_of(happenings: list[Happening]) -> list[Happening]:
    return [h for h in happenings if h.event == CAP_EVENT]


# -- the rule, as a pure function --------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("caps", "held", "instances", "usd_per_h", "expected"),
    [
        pytest.param(Caps(), Held(9, 90.0, 1e6), 5, 50.0, None, id="no-caps-nothing-refused"),
        pytest.param(Caps(max_instances=4), Held(3, 30.0), 1, 10.0, None, id="up-to-the-instance-cap"),
        pytest.param(Caps(max_instances=4), Held(3, 30.0), 2, 20.0, ("max_instances", 4, 5), id="past-it"),
        pytest.param(Caps(max_instances=3), Held(4, 30.0), 0, 9.5, None, id="a-wake-up-adds-no-instance"),
        pytest.param(Caps(max_spend_usd=100.0), Held(3, 30.0, 60.0), 1, 10.0, None, id="spend-within"),
        pytest.param(Caps(max_spend_usd=100.0), Held(3, 30.0, 70.0), 1, 10.0, ("max_spend_usd", 100.0, 110.0),
                     id="spent-plus-an-hour-of-the-fleet-passes-it"),
        pytest.param(Caps(max_instances=9, max_spend_usd=100.0), Held(3, 30.0, 90.0), 0, 9.5,
                     ("max_spend_usd", 100.0, 129.5), id="a-wake-up-bills-its-difference"),
    ],
)
def test_a_launch_is_refused_exactly_when_it_would_pass_a_cap(
    caps: Caps, held: Held, instances: int, usd_per_h: float, expected: tuple[str, float, float] | None
) -> None:
    refusal = cap_refusal(caps, held, instances=instances, usd_per_h=usd_per_h, what="launching x",
                          also="lower y")
    if expected is None:
        assert refusal is None
        return
    assert refusal is not None
    assert refusal.cap == expected[0]
    assert (refusal.limit, refusal.would_reach) == pytest.approx(expected[1:])
    assert refusal.message.startswith(f"{expected[0]}=") and "launching x" in refusal.message
    assert refusal.message.endswith(f"raise run.{expected[0]}, or lower y")
    assert SPEND_LOOKAHEAD_H == 1.0  # the figures above assume one hour of look-ahead


# -- in the supervisor ------------------------------------------------------------------------------------------

def test_the_spend_cap_refuses_the_replacement_that_would_cross_it_and_the_run_goes_on(tmp_path: Path) -> None:
    """2 workers and a warm standby at 10 USD/h each, 100 USD at most: the first replacement (spent 60 + an hour of
    30 = 90) is ordered; the second (spent 90 + 30 = 120) is refused, announced once, and nothing is launched."""
    run = TrainingRun(job_id="cap-spend", workers=2, node_price_usd_per_h=10.0, max_spend_usd=100.0,
                      standby=StandbyLimits(min_warm=1, max_warm=1, max_stopped=0))
    with supervising(run, tmp_path) as (sup, cloud, clock):
        sup.provision()
        assert len(running(cloud, run.job_id)) == 3
        clock.advance_h(2.0)
        assert sup.spent_usd() == pytest.approx(60.0)  # what runs now, metered since the launch
        first = sup._on_event(failed(1))
        assert "trainmover.standby.ordered" in [h.event for h in first] and not caps_of(first)
        assert len(running(cloud, run.job_id)) == 3 and sup.spent_usd() == pytest.approx(60.0)
        clock.advance_h(1.0)
        before = running(cloud, run.job_id)
        second = sup._on_event(failed(0))
        (capped,) = caps_of(second)
        assert capped.payload["cap"] == "max_spend_usd" and capped.payload["limit"] == 100.0
        assert capped.payload["would_reach"] == pytest.approx(120.0)
        assert capped.message.startswith("max_spend_usd=100.00 refuses ordering 1 replacement standby instance(s): "
                                         "the run would reach 120.00 USD (90.00 spent so far"), capped.message
        assert "trainmover.standby.ordered" not in [h.event for h in second]
        # Nothing launched for it; the lost worker's instance went, the standby's took its rank; the job keeps two.
        after = running(cloud, run.job_id)
        assert set(after) < set(before) and len(after) == 2 and set(sup.workers.values()) == set(after)
        assert sup.warm_target == 0 and sup.warm == []  # the coordinator no longer waits for a standby
        # Terminated instances stop billing; what they cost stays spent.
        clock.advance_h(0.5)
        assert sup.spent_usd() == pytest.approx(90.0 + 0.5 * 20.0)


def test_the_instance_cap_refuses_the_policys_prewarm_whole_and_the_policy_sees_what_is_held(tmp_path: Path) -> None:
    """A job worth 100,000 nodes makes the policy pre-warm its 2 allowed standbys; with 3 instances at most the
    launch of 2 is refused: no instance, no raised target, and the policy's fleet state says 0 warm."""
    run = TrainingRun(job_id="cap-prewarm", workers=2, job_nodes=100_000, hazard_multiplier=100.0, max_instances=3,
                      standby=StandbyLimits(min_warm=0, max_warm=2, max_stopped=0))
    with supervising(run, tmp_path) as (sup, cloud, clock):
        sup.provision()
        decided = sup._decide(clock())
        (capped,) = caps_of(decided)
        assert capped.payload["cap"] == "max_instances" and capped.payload["would_reach"] == 4
        assert capped.message.startswith("max_instances=3 refuses pre-warming 2 standby instance(s) for "), capped
        assert "raise run.max_instances, or lower run.standby's limits" in capped.message
        assert "trainmover.standby.prewarmed" not in [h.event for h in decided]
        assert len(running(cloud, run.job_id)) == 2 and sup.warm == [] and sup.warm_target == 0
        assert sup.fleet.warm == 0
        clock.advance_h(1.0)
        assert caps_of(sup._decide(clock())) == [] and sup.refusals == 2  # asked again: a log line, no event


def test_the_spend_cap_refuses_waking_a_parked_standby_and_it_stays_parked(tmp_path: Path) -> None:
    """2 workers at 10 USD/h and a parked standby (its disk: the stopped tier's price), 50 USD at most. After 1.5 h
    (30.75 spent) rank 1's instance dies; waking the parked one would reach 30.75 + an hour of 20 USD/h: refused."""
    run = TrainingRun(job_id="cap-wake", workers=2, node_price_usd_per_h=10.0, max_spend_usd=50.0,
                      standby=StandbyLimits(min_warm=0, max_warm=1, max_stopped=1))
    stopped_usd_per_h = run.tier_prices()["stopped"]
    with supervising(run, tmp_path) as (sup, cloud, clock):
        sup.provision()
        (parked,) = [i.instance_id for i in sup._launch("standby", 1, kind="stopped")]  # as Supervisor._apply parks
        cloud.stop([parked])
        sup.parked = [parked]
        clock.advance_h(1.5)
        spent = 1.5 * (20.0 + stopped_usd_per_h)
        assert sup.spent_usd() == pytest.approx(spent)
        happened = sup._on_event(failed(1))
        (capped,) = caps_of(happened)
        assert capped.payload["cap"] == "max_spend_usd"
        assert capped.payload["would_reach"] == pytest.approx(spent + 20.0, abs=0.01)
        assert f"refuses waking parked standby {parked} for rank 1" in capped.message
        assert "trainmover.standby.woken" not in [h.event for h in happened]
        assert running(cloud, run.job_id)[parked] == "stopped" and sup.parked == [parked]
        assert 1 not in sup.workers or sup.workers[1] != parked


def test_workers_a_cap_refuses_fail_the_provisioning_before_anything_is_launched(tmp_path: Path) -> None:
    """On instances the worker hosts are counted at provisioning (the hosts' slots): a cap that passed submit's
    lower bound can still refuse them. The same state here, made by skipping submit's check (`model_copy`)."""
    run = TrainingRun(job_id="cap-workers", workers=4, standby=StandbyLimits(min_warm=0)).model_copy(
        update={"max_instances": 3})
    with supervising(run, tmp_path) as (sup, cloud, _):
        with pytest.raises(CapReached, match=r"^max_instances=3 refuses launching 4 worker instance\(s\) for 4 "
                                             r"rank\(s\).*raise run.max_instances, or lower run.workers$") as info:
            sup.provision()
        assert info.value.happening.event == CAP_EVENT and info.value.refusal.would_reach == 4
        assert cloud.describe(job_id=run.job_id) == []


def test_a_standby_a_cap_refuses_at_provisioning_is_not_fatal(tmp_path: Path) -> None:
    run = TrainingRun(job_id="cap-standby", workers=2, standby=StandbyLimits(min_warm=1)).model_copy(
        update={"max_instances": 2})
    with supervising(run, tmp_path) as (sup, cloud, _):
        happened = sup.provision()
        assert [h.event for h in happened] == [CAP_EVENT, "trainmover.fleet.provisioned"]
        assert len(running(cloud, run.job_id)) == 2 and sup.warm == [] and sup.warm_target == 0


@pytest.mark.usefixtures("prefect_harness")
def test_the_flow_announces_workers_a_cap_refuses_and_fails_before_launching_them() -> None:
    """4 ranks on local hosts of one slot each take 4 worker instances; 2 passed submit (a host could have held every
    rank), the flow's provisioning refuses them: the run fails with the message, the event is on the server, and
    no fleet was provisioned."""
    from prefect.client.orchestration import get_client
    from prefect.events.filters import EventFilter, EventNameFilter, EventRelatedFilter

    from flows.training import resilient_training
    from tests.flows.prefect_server import poll

    run = TrainingRun(job_id="cap-flow", workers=4, hosts="processes", max_instances=2,
                      standby=StandbyLimits(min_warm=0, max_warm=1, max_stopped=0))
    state = resilient_training(run=run, return_state=True)
    with pytest.raises(CapReached, match=r"^max_instances=2 refuses launching 4 worker instance\(s\) for 4 rank"):
        state.result()
    related = f"prefect.flow-run.{state.state_details.flow_run_id}"

    def events() -> list[Any] | None:
        with get_client(sync_client=True) as client:
            found = client.read_events(filter=EventFilter(
                event=EventNameFilter(prefix=["trainmover."]), related=EventRelatedFilter(id=[related])), limit=20)
        names = [e.event for e in found.events]
        return found.events if CAP_EVENT in names and "trainmover.job.failed" in names else None

    seen = poll("the run's cap_reached and job.failed events", events, 30.0)
    (capped,) = [e for e in seen if e.event == CAP_EVENT]
    assert (capped.payload["cap"], capped.payload["limit"], capped.payload["would_reach"]) == ("max_instances", 2, 4)
    assert "trainmover.fleet.provisioned" not in [e.event for e in seen]
