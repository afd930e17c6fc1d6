"""`resilient_training` on Prefect's real engine (the test harness): a failing script still releases everything."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUGGY = ROOT / "tests" / "runtime" / "scripts" / "tiny_job.py"

pytestmark = [pytest.mark.usefixtures("prefect_harness"), pytest.mark.slow]


def _logs(state: object) -> str:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    run_id = state.state_details.flow_run_id  # type: ignore[attr-defined]
    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))
    return "\n".join(log.message for log in logs)


def test_a_script_bug_fails_the_flow_with_its_message_and_every_instance_is_released() -> None:
    from flows.models import StandbyLimits, TrainingRun
    from flows.training import resilient_training

    run = TrainingRun(
        job_id="flow-bug", workers=2, script=str(BUGGY), script_args=("--steps", "50", "--raise-at", "5"),
        standby=StandbyLimits(min_warm=1, max_warm=1, max_stopped=0),
    )
    state = resilient_training(run=run, max_wall_s=120.0, return_state=True)
    assert state.is_failed()
    with pytest.raises(RuntimeError, match="a bug in the training script at step 5"):
        state.result()
    # Run logs reach the API in batches: poll (bounded) for the release line.
    deadline = time.monotonic() + 30.0
    while "released 3 instance(s) of job flow-bug" not in (text := _logs(state)):
        assert time.monotonic() < deadline, text
        time.sleep(0.5)


def test_a_missing_script_is_refused_before_anything_launches() -> None:
    from flows.models import TrainingRun
    from flows.training import resilient_training

    state = resilient_training(run=TrainingRun(job_id="flow-missing", script="no/such/train.py"), return_state=True)
    with pytest.raises(ValueError, match="does not exist"):
        state.result()
    assert "instance(s)" not in _logs(state)
