"""`resilient_training` on Prefect's real engine (the session's server): a failing script still releases everything; a
run that fails midway still reports what ran; a second run of a running job is refused and touches nothing."""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cloud.base import Notice
from cloud.local import LocalProvider
from flows.holdings import find_holdings
from tests.flows.prefect_server import poll

ROOT = Path(__file__).resolve().parents[2]
TINY_JOB = ROOT / "tests" / "runtime" / "scripts" / "tiny_job.py"

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
        job_id="flow-bug", workers=2, script=str(TINY_JOB), script_args=("--steps", "50", "--raise-at", "5"),
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


def test_a_run_that_is_not_a_drill_is_billed_on_the_wall_clock_whatever_its_time_scale() -> None:
    """The drill's deployment sets time_scale 3600; a run there with the drill off must not bill each wall second of
    its standbys as an hour."""
    from flows.models import StandbyLimits, TrainingRun
    from flows.training import resilient_training

    run = TrainingRun(
        job_id="flow-wall-clock", workers=1, script=str(TINY_JOB), script_args=("--steps", "40", "--step-ms", "20"),
        standby=StandbyLimits(min_warm=1, max_warm=1, max_stopped=0),
    )
    state = resilient_training(run=run, drill=False, time_scale=3600.0, policy_every_s=0.5, max_wall_s=120.0,
                               return_state=True)
    assert state.is_completed(), state
    summary = state.result()
    # One warm standby for under 120 wall seconds: under 0.034 h (on the drill's clock: over a hundred hours).
    assert 0 < summary["standby_hours"]["warm"] < 120 / 3600, summary["standby_hours"]
    assert summary["standby_cost_usd"] < 120 / 3600 * run.tier_prices()["warm"] and summary["ettr"] <= 1.0, summary
    report = str(_artifacts(state)["flow-wall-clock-cost-report"].data)
    assert "Scaled clock" not in report and "(scaled clock)" not in report, report
    poll("the run's note that it runs on the wall clock",
         lambda: True if "is the drill's clock; this run is not a drill" in _logs(state) else None, 30.0)


# -- one owner per job; a run that fails midway --------------------------------------------------------------


class BreakableCloud(LocalProvider):
    """The local cloud, shared by both runs (each run would otherwise get a fresh one), whose notice API can be
    broken on demand: an unexpected error in the middle of supervision."""

    def __init__(self) -> None:
        super().__init__(slots=16)
        self.broken = threading.Event()

    def poll_notices(self, timeout_s: float = 0.0) -> list[Notice]:
        if self.broken.is_set():
            raise RuntimeError("the provider's notice API answered garbage")
        return super().poll_notices(timeout_s)

    def live(self, job_id: str) -> dict[str, str]:
        return {i.instance_id: i.state for i in self.describe(job_id=job_id) if i.state != "terminated"}


@dataclass(frozen=True)
class TwoRuns:
    first: Any  # the owner's final state
    second: Any  # the intruder's final state
    fleet: dict[str, str]  # the owner's instances before the second run
    after_refusal: dict[str, str]  # ... and right after it was refused
    cloud: BreakableCloud


OWNED = "flow-owner"


def _training(job_id: str) -> bool:
    """Whether a job of this host has formed its group (its events file, in the run's work directory, says so)."""
    from flows.holdings import workdir_prefix

    found = Path(tempfile.gettempdir()).glob(f"{workdir_prefix(job_id)}*/events.jsonl")
    return any(b'"generation"' in p.read_bytes() for p in found)


@pytest.fixture(scope="module")
def two_runs_of_one_job(prefect_harness: None) -> Iterator[TwoRuns]:
    """The first run of job `flow-owner` provisions and starts; a second run of the same job is tried meanwhile;
    then the cloud's API breaks under the first, which fails midway."""
    import flows.training
    from flows.models import StandbyLimits, TrainingRun
    from flows.training import resilient_training

    cloud = BreakableCloud()
    run = TrainingRun(
        job_id=OWNED, workers=1, script=str(TINY_JOB), script_args=("--steps", "100000", "--step-ms", "20"),
        standby=StandbyLimits(min_warm=0, max_warm=0, max_stopped=0),
    )
    first: dict[str, Any] = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(flows.training, "make_provider", lambda _run, _credentials=None: cloud)
        owner = threading.Thread(
            target=lambda: first.update(state=resilient_training(run=run, max_wall_s=120.0, return_state=True)),
            name="owner-run",
            daemon=True,
        )
        owner.start()
        try:
            fleet = poll("the first run's fleet", lambda: cloud.live(OWNED) or None, 60.0)
            second = resilient_training(run=run, max_wall_s=120.0, return_state=True)
            after_refusal = cloud.live(OWNED)
            poll("the first run's job to train", lambda: _training(OWNED) or None, 60.0)
        finally:
            cloud.broken.set()
            owner.join(timeout=90.0)
        assert not owner.is_alive(), "the first run did not end within 90 s of its cloud breaking"
    yield TwoRuns(first["state"], second, fleet, after_refusal, cloud)


def _artifacts(state: Any) -> dict[str, Any]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    of_run = FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
    with get_client(sync_client=True) as client:
        # Keyed artifacts only: Prefect also records a failed run's result (its exception) as an artifact without a key.
        return {a.key: a for a in client.read_artifacts(flow_run_filter=of_run) if a.key}


def test_a_second_run_of_a_running_job_is_refused_and_the_first_fleet_is_untouched(
    two_runs_of_one_job: TwoRuns,
) -> None:
    from flows.ownership import JobAlreadyRunning

    runs = two_runs_of_one_job
    assert runs.second.is_failed()
    with pytest.raises(JobAlreadyRunning, match=f"job '{OWNED}' is already running under another flow run") as info:
        runs.second.result()
    assert str(runs.first.state_details.flow_run_id) in str(info.value)  # it names the owner
    # The same worker, still up.
    assert len(runs.fleet) == 1 and set(runs.after_refusal) == set(runs.fleet)
    assert set(runs.after_refusal.values()) <= {"pending", "running"}, runs.after_refusal
    assert _artifacts(runs.second) == {}  # not even a progress bar: it refused before anything
    assert "instance(s)" not in _logs(runs.second)


def test_a_run_that_fails_midway_still_reports_what_ran_and_emits_job_failed(two_runs_of_one_job: TwoRuns) -> None:
    from prefect.client.orchestration import get_client
    from prefect.events.filters import EventFilter, EventNameFilter, EventRelatedFilter

    runs = two_runs_of_one_job
    assert runs.first.is_failed()
    with pytest.raises(RuntimeError, match="notice API answered garbage"):
        runs.first.result()
    assert runs.cloud.live(OWNED) == {}  # released, as always
    assert find_holdings(OWNED, str(runs.first.state_details.flow_run_id)) == []  # nothing left for a crash hook

    artifacts = _artifacts(runs.first)
    report = str(artifacts[f"{OWNED}-cost-report"].data)
    assert "**The run failed** after" in report and "notice API answered garbage" in report, report
    assert f"{OWNED}-interruptions" in artifacts

    related = f"prefect.flow-run.{runs.first.state_details.flow_run_id}"

    def failed_event() -> Any:
        with get_client(sync_client=True) as client:
            mine = client.read_events(
                filter=EventFilter(
                    event=EventNameFilter(name=["trainmover.job.failed"]), related=EventRelatedFilter(id=[related])
                ),
                limit=5,
            ).events
        return mine[0] if mine else None

    event = poll("the first run's trainmover.job.failed event", failed_event, 30.0)
    assert "notice API answered garbage" in event.payload["reason"] and event.resource["trainmover.job"] == OWNED
