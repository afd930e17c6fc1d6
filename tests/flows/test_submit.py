"""Bad parameters of `resilient-training` are refused before anything is provisioned, on Prefect's real engine.

Two gates, as a user meets them: the API (and the UI form, which validates with the same schema) refuses what the
parameter schema can say (limits, choices, the faults plan's grammar) before a flow run exists; what needs code
(the faults plan's cross-checks, by the runtime's own parser; cross-field mistakes; a drill that would do nothing)
is refused as the run starts, with one message and no `provision` task.
"""

from __future__ import annotations

import time
from typing import Any
from uuid import UUID

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId, FlowRunFilter, FlowRunFilterId
from prefect.exceptions import ParameterTypeError, PrefectHTTPStatusError
from prefect.utilities.callables import parameter_schema

from flows.training import resilient_training

pytestmark = pytest.mark.usefixtures("prefect_harness")

GOOD_RUN: dict[str, Any] = {"job_id": "submit", "workers": 2, "standby": {"min_warm": 0, "max_warm": 1}}


@pytest.fixture(scope="module")
def deployment_id() -> UUID:
    """`resilient-training` registered with the schema `prefect deploy` stores and enforces (no worker needed)."""
    with get_client(sync_client=True) as client:
        flow_id = client.create_flow_from_name(resilient_training.name)
        return client.create_deployment(
            flow_id=flow_id,
            name="submit-checks",
            parameter_openapi_schema=parameter_schema(resilient_training).model_dump_for_openapi(),
            enforce_parameter_schema=True,
        )


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"max_wall_s": -5}, "max_wall_s"),
        ({"time_scale": 0}, "time_scale"),
        ({"policy_every_s": 0.01}, "policy_every_s"),
        ({"drill": "sometimes"}, "drill"),
        ({"run": {**GOOD_RUN, "workers": 0}}, "run.workers"),
        ({"run": {**GOOD_RUN, "faults": "explode:rank=1"}}, "run.faults"),  # the plan's grammar is in the schema
        ({"run": {**GOOD_RUN, "faults": "kill:rank=one"}}, "run.faults"),
    ],
)
def test_the_api_refuses_what_the_schema_can_say_before_a_flow_run_exists(
    deployment_id: UUID, params: dict[str, Any], field: str
) -> None:
    with get_client(sync_client=True) as client:
        with pytest.raises(PrefectHTTPStatusError) as info:
            client.create_flow_run_from_deployment(deployment_id, parameters={"run": GOOD_RUN, **params})
        assert info.value.response.status_code == 409
        assert f"Validation failed for field '{field}'" in info.value.response.text, info.value.response.text
        of_deployment = DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id]))
        assert client.read_flow_runs(deployment_filter=of_deployment) == []


def _task_names(flow_run_id: UUID, wanted: str, timeout_s: float = 20.0) -> set[str]:
    """The flow run's task run names once `wanted` is among them (task runs reach the API through events)."""
    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while True:
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
            names = {r.name.rsplit("-", 1)[0] for r in runs}
            if wanted in names:
                return names
            assert time.monotonic() < deadline, f"no {wanted!r} task run within {timeout_s:.0f} s: {names}"
            time.sleep(0.25)


@pytest.mark.parametrize(
    ("params", "needle"),
    [
        ({"run": {**GOOD_RUN, "faults": "explode:rank=1"}}, "run.faults: Value error, fault 'explode:rank=1'"),
        ({"run": {**GOOD_RUN, "standby": {"min_warm": 3, "max_warm": 1}}}, "min_warm=3 exceeds max_warm=1"),
        ({"max_wall_s": -5}, "max_wall_s: Input should be greater than 0"),
    ],
)
def test_the_engine_refuses_what_needs_code_as_the_run_starts(params: dict[str, Any], needle: str) -> None:
    state = resilient_training(**{"run": GOOD_RUN, **params}, return_state=True)
    assert state.is_failed()
    # Prefect's own words for a run whose body never ran: nothing was provisioned.
    assert state.message is not None and state.message.startswith("Validation of flow parameters failed")
    assert needle in state.message, state.message
    with pytest.raises(ParameterTypeError):
        state.result()


def test_a_drill_that_would_do_nothing_is_refused_before_provisioning_and_the_run_is_named_after_the_job() -> None:
    run = {**GOOD_RUN, "job_id": "drill-refused", "standby": {"min_warm": 1, "max_warm": 2}}
    state = resilient_training(run=run, drill=True, time_scale=3600.0, policy_every_s=0.5, return_state=True)
    assert state.is_failed()
    with pytest.raises(ValueError, match=r"drill refused: .* set run.standby.min_warm to 0"):
        state.result()
    flow_run_id = state.state_details.flow_run_id
    assert flow_run_id is not None
    assert "provision" not in _task_names(flow_run_id, wanted="check")
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(flow_run_id).name.startswith("drill-refused-")
