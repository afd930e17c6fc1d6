"""One owner per job, against the session's real Prefect server: a live owner keeps its job; an owner that is over
(its process was SIGKILLed: the worker marked it Crashed) is relieved of it by the next run of the job."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, timedelta
from uuid import UUID

import pytest
from prefect import flow, get_client
from prefect.states import Crashed, Running

from flows import jobrecord
from flows.jobrecord import JobRecord
from flows.ownership import OWNER_LEASE_S, JobAlreadyRunning, _ensure_limit, _take, owning

pytestmark = pytest.mark.usefixtures("prefect_harness")


@flow(name="ownership-probe")
def _probe() -> None:
    """Only a flow for the flow runs below to belong to."""


def _flow_run(state: str, job_id: str = "owner") -> UUID:
    """A flow run of `job_id`, named and parametrised as the training flow's are."""
    with get_client(sync_client=True) as client:
        flow_id = client.create_flow_from_name(_probe.name)
        fr = client.create_flow_run(_probe, name=f"{job_id}-{uuid.uuid4().hex[:6]}",
                                    parameters={"run": {"job_id": job_id}})
        assert fr.flow_id == flow_id
        client.set_flow_run_state(fr.id, Running(), force=True)
        if state == "crashed":
            client.set_flow_run_state(fr.id, Crashed(message="the flow-run process was SIGKILLed"), force=True)
        return fr.id


def _held_by(job_id: str, owner: UUID) -> UUID:
    """`owner` takes the job's slot and records it, as a run does once its job started; then it stops renewing."""
    _ensure_limit(job_id)
    lease = _take(job_id, owner)
    jobrecord.publish(JobRecord(job_id=job_id, flow_run_id=str(owner), host="elsewhere", workdir="/nonexistent",
                                launcher_pid=1, store_host="127.0.0.1", store_port=1, secret_file="/nonexistent",
                                events="/nonexistent", provider="local", owner_lease=str(lease)))
    return lease


@pytest.fixture
def job(request: pytest.FixtureRequest) -> Iterator[str]:
    """A job id of the test's own; its record is forgotten afterwards."""
    job_id = f"owned-{request.node.name.removeprefix('test_')[:20].replace('_', '-')}"
    yield job_id
    jobrecord.forget(job_id)


def _name(flow_run_id: UUID) -> str:
    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id).name


def test_a_live_owner_keeps_its_job_and_the_refusal_names_it_and_how_to_stop_it(job: str) -> None:
    owner = _flow_run("running", job)
    _held_by(job, owner)
    with pytest.raises(JobAlreadyRunning, match="is already running under another flow run") as info, \
            owning(job, _flow_run("running", job)):
        pass
    assert f"flow run {_name(owner)!r} (id {owner}, Running)" in str(info.value)
    assert f"`prefect flow-run cancel {owner}`" in str(info.value)


def test_an_owner_that_crashed_is_relieved_and_the_job_then_has_one_owner_again(job: str) -> None:
    _held_by(job, _flow_run("crashed"))
    with owning(job, _flow_run("running")) as lease:
        assert isinstance(lease, UUID)
        # Taken over: a third run is refused while this one holds it.
        with pytest.raises(JobAlreadyRunning), owning(job, _flow_run("running")):
            pass
    with owning(job, _flow_run("running")):  # given back at the end of the block
        pass


def test_without_a_recorded_lease_a_crashed_owner_holds_the_job_until_its_lease_lapses_which_the_refusal_says(
    job: str,
) -> None:
    dead = _flow_run("crashed", job)
    _ensure_limit(job)
    _take(job, dead)  # killed before its job started: no record names the lease
    _flow_run("crashed", f"{job}-b")  # a later dead run of another job, whose name starts like this one's
    with pytest.raises(JobAlreadyRunning) as info, owning(job, _flow_run("running", job)):
        pass
    with get_client(sync_client=True) as client:
        ended = client.read_flow_run(dead).state.timestamp  # type: ignore[union-attr]
    lapse = (ended + timedelta(seconds=OWNER_LEASE_S)).astimezone(UTC)
    message = str(info.value)
    assert f"is still held by flow run {_name(dead)!r} (id {dead}, Crashed)" in message, message
    assert f"lapses by itself by {lapse:%H:%M:%S} UTC at the latest" in message, message
    assert "cancel" not in message  # nothing to cancel: the hint is when to run again
