"""Scenarios for `cloud.capacity`: the order in which a standby that cannot wake (or a launch the cloud cannot
place) falls back, against the local provider with a capacity map of which type/zone/market has room."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest

from cloud.base import CapacityError, Instance, InvalidRequestError, LaunchRequest, QuotaError
from cloud.capacity import Candidate, Fallbacks, launch_with_fallback, plan_fallback, wake_or_replace
from cloud.local import LocalProvider

JOB = "job-capacity"
P5 = "p5.48xlarge"
P5E = "p5e.48xlarge"


class TightCloud(LocalProvider):
    """A local cloud with no room for the (type, zone, market) launches in `full`, nor to wake parked standbys
    while `wake_full` holds; it records every launch and start it is asked for."""

    def __init__(self, full: Sequence[tuple[str, str | None, str]] = (), *, wake_full: bool = True) -> None:
        super().__init__(slots=8)
        self.full = set(full)
        self.wake_full = wake_full
        self.calls: list[tuple[str, str, str | None, str]] = []

    def launch(self, request: LaunchRequest) -> list[Instance]:
        self.calls.append(("launch", request.instance_type, request.zone, request.market))
        if (request.instance_type, request.zone, request.market) in self.full:
            raise CapacityError("no capacity", provider=self.name, code="InsufficientInstanceCapacity")
        return self.place(request)

    def place(self, request: LaunchRequest) -> list[Instance]:
        """Launch regardless of `full`; this machine has one zone, so the zone asked for is only reported back."""
        launched = super().launch(dataclasses.replace(request, zone=None))
        return [dataclasses.replace(i, zone=request.zone) for i in launched]

    def start(self, instance_ids: Sequence[str]) -> list[Instance]:
        self.calls.append(("start", *instance_ids, None, ""))
        if self.wake_full:
            raise CapacityError("no capacity", provider=self.name, code="InsufficientInstanceCapacity")
        return super().start(instance_ids)


def parked_standby(cloud: TightCloud, request: LaunchRequest) -> str:
    [standby] = cloud.place(request)  # launched while there was room
    cloud.stop([standby.instance_id])
    cloud.calls.clear()
    return standby.instance_id


def test_the_plan_is_wake_other_zones_other_types_then_on_demand() -> None:
    request = LaunchRequest(JOB, "standby", P5, zone="us-east-1a", market="spot")
    fallbacks = Fallbacks(zones=("us-east-1a", "us-east-1b"), instance_types=(P5, P5E))

    plan = plan_fallback(request, fallbacks, waking=True)

    assert plan == (
        Candidate("wake", P5, "us-east-1a", "spot"),
        Candidate("zone", P5, "us-east-1b", "spot"),  # the request's own zone and type are not tried twice
        Candidate("type", P5E, "us-east-1a", "spot"),
        Candidate("on-demand", P5, "us-east-1a", "on-demand"),
    )


def test_an_on_demand_launch_is_not_retried_as_the_same_on_demand_launch() -> None:
    request = LaunchRequest(JOB, "standby", P5, zone="us-east-1a")

    plan = plan_fallback(request, Fallbacks(), waking=False)

    assert plan == (Candidate("request", P5, "us-east-1a", "on-demand"),)


def test_a_standby_that_wakes_is_all_that_happens() -> None:
    cloud = TightCloud(wake_full=False)
    request = LaunchRequest(JOB, "standby", P5)
    standby = parked_standby(cloud, request)

    outcome = wake_or_replace(cloud, standby, request, Fallbacks(instance_types=(P5E,)))

    assert outcome.step == "wake" and [i.instance_id for i in outcome.instances] == [standby]
    assert cloud.calls == [("start", standby, None, "")]
    assert outcome.released == ()


def test_no_capacity_to_wake_moves_to_another_zone_and_releases_the_parked_standby() -> None:
    cloud = TightCloud()
    request = LaunchRequest(JOB, "standby", P5, zone="us-east-1a")
    standby = parked_standby(cloud, request)

    outcome = wake_or_replace(cloud, standby, request, Fallbacks(zones=("us-east-1b",)))

    assert outcome.step == "zone"
    [replacement] = outcome.instances
    assert replacement.zone == "us-east-1b" and replacement.instance_type == P5
    assert [(a.candidate.step, a.ok, a.error_code) for a in outcome.attempts] == [
        ("wake", False, "InsufficientInstanceCapacity"),
        ("zone", True, None),
    ]
    assert outcome.released == (standby,)
    assert [i.state for i in cloud.describe([standby])] in ([], ["terminated"])


def test_every_zone_full_moves_to_another_type_of_the_same_accelerator() -> None:
    cloud = TightCloud(full=[(P5, "us-east-1b", "on-demand")])
    request = LaunchRequest(JOB, "standby", P5, zone="us-east-1a")
    standby = parked_standby(cloud, request)

    outcome = wake_or_replace(cloud, standby, request, Fallbacks(zones=("us-east-1b",), instance_types=(P5E,)))

    assert outcome.step == "type" and outcome.instances[0].instance_type == P5E
    assert cloud.calls[:3] == [
        ("start", standby, None, ""),
        ("launch", P5, "us-east-1b", "on-demand"),
        ("launch", P5E, "us-east-1a", "on-demand"),
    ]


def test_spot_without_capacity_anywhere_ends_on_demand() -> None:
    cloud = TightCloud(full=[(P5, "us-east-1a", "spot"), (P5, "us-east-1b", "spot"), (P5E, "us-east-1a", "spot")])
    request = LaunchRequest(JOB, "standby", P5, zone="us-east-1a", market="spot")

    outcome = launch_with_fallback(cloud, request, Fallbacks(zones=("us-east-1b",), instance_types=(P5E,)))

    assert outcome.step == "on-demand"
    assert outcome.instances[0].market == "on-demand" and outcome.instances[0].instance_type == P5
    assert [a.candidate.step for a in outcome.attempts] == ["request", "zone", "type", "on-demand"]
    assert "request p5.48xlarge@us-east-1a spot: InsufficientInstanceCapacity" in outcome.summary()


def test_no_capacity_anywhere_is_an_outcome_listing_every_attempt_and_keeps_the_standby() -> None:
    cloud = TightCloud(full=[(P5, "us-east-1a", "on-demand")])
    request = LaunchRequest(JOB, "standby", P5, zone="us-east-1a")
    standby = parked_standby(cloud, request)

    outcome = wake_or_replace(cloud, standby, request)

    assert not outcome.succeeded and outcome.step is None and outcome.released == ()
    assert [a.candidate.step for a in outcome.attempts] == ["wake", "on-demand"]
    assert cloud.describe([standby])[0].parked


def test_an_error_other_than_capacity_is_raised_not_fallen_through() -> None:
    cloud = TightCloud()
    request = LaunchRequest(JOB, "standby", P5)
    standby = parked_standby(cloud, request)
    cloud.fail_next("launch", QuotaError("vCPU quota", code="VcpuLimitExceeded"))

    with pytest.raises(QuotaError):
        wake_or_replace(cloud, standby, request, Fallbacks(instance_types=(P5E,)))

    assert cloud.describe([standby])[0].parked


def test_a_standby_is_replaced_by_one_instance_and_fallbacks_are_validated() -> None:
    cloud = TightCloud()
    with pytest.raises(InvalidRequestError, match="count must be 1"):
        wake_or_replace(cloud, "i-1", LaunchRequest(JOB, "standby", P5, count=2))
    with pytest.raises(InvalidRequestError, match="zones"):
        Fallbacks(zones="us-east-1b")  # type: ignore[arg-type]


class ReservedCloud(TightCloud):
    """A TightCloud that records each launch's capacity reservation and places it without one (this machine has
    none)."""

    def __init__(self, full: Sequence[tuple[str, str | None, str]] = ()) -> None:
        super().__init__(full)
        self.reservations: list[tuple[str | None, bool]] = []

    def launch(self, request: LaunchRequest) -> list[Instance]:
        self.reservations.append((request.capacity_reservation, request.capacity_block))
        return super().launch(dataclasses.replace(request, capacity_reservation=None, capacity_block=False))


def test_a_full_capacity_block_falls_back_outside_it() -> None:
    """The block (one type in one zone) is full: the fallbacks launch outside it, never into it with another type."""
    cloud = ReservedCloud(full=[(P5, "us-east-1a", "on-demand")])
    request = LaunchRequest(JOB, "worker", P5, zone="us-east-1a", capacity_reservation="cr-0123456789abcdef0",
                            capacity_block=True)
    outcome = launch_with_fallback(cloud, request, Fallbacks(instance_types=(P5E,)))
    assert outcome.step == "type" and [i.instance_type for i in outcome.instances] == [P5E]
    assert cloud.reservations == [("cr-0123456789abcdef0", True), (None, False)]
