"""How a run that does not finish says so: its ending told from the exception, the partial cost report, the holdings
record, and the crash hook run on a real flow run against the session's Prefect server."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prefect.exceptions import TerminationSignal
from prefect.states import Cancelling, Crashed, Running

from flows.endings import Ending, ending_of, record_what_was_left
from flows.holdings import HOLDINGS_FILE, Holdings, find_holdings, workdir_prefix, write_holdings
from flows.models import TrainingRun
from flows.supervisor import RunReport
from flows.training import cost_markdown, resilient_training
from tests.flows.prefect_server import poll


@pytest.mark.parametrize(
    ("exc", "state", "kind", "reason"),
    [
        (TimeoutError("job x ran past max_wall_s=60 s"), None, "failed", "TimeoutError: job x ran past max_wall_s"),
        (TerminationSignal(signal.SIGTERM), Cancelling(message="cancelled from the UI"), "cancelled",
         "cancelled from the UI"),
        (TerminationSignal(signal.SIGTERM), Running(), "crashed", "received SIGTERM (not a cancellation)"),
        (TerminationSignal(signal.SIGTERM), None, "crashed", "received SIGTERM"),
        (KeyboardInterrupt(), None, "crashed", "KeyboardInterrupt"),
    ],
)
def test_an_ending_is_told_from_the_exception_and_the_server_state(
    exc: BaseException, state: Any, kind: str, reason: str
) -> None:
    ending = ending_of(exc, state)
    assert ending.kind == kind and reason in ending.reason
    assert ending.event == f"trainmover.job.{kind}"


def _report(steps: int) -> RunReport:
    return RunReport(
        job_id="rr", exit_code=-15, message="", wall_s=12.0, steps=steps, interruptions=[],
        standby_hours={"warm": 0.5, "stopped": 0.0}, standby_cost_usd=27.5, downtime_s=0.0, downtime_cost_usd=0.0,
        ettr=1.0, restart_downtime_s=0.0, restart_cost_usd=0.0, restart_ettr=1.0, final_digest=None,
    )


def test_the_cost_report_of_a_run_stopped_midway_says_so_and_why() -> None:
    run = TrainingRun(job_id="rr")
    partial = cost_markdown(_report(37), run, ending=Ending("cancelled", "cancelled from the UI"))
    assert "**The run was cancelled** after 37 committed step(s): cancelled from the UI" in partial
    assert "cover what ran until then" in partial and "| standby cost | 27.50 USD | 0 |" in partial
    assert "**The run" not in cost_markdown(_report(37), run)


def _holdings(job_id: str, owner: str, workdir: Path, pid: int | None = None) -> Holdings:
    return Holdings(job_id=job_id, owner=owner, host="h", workdir=str(workdir), launcher_pid=pid, port=29500,
                    instances=("local-1", "local-2"))


def test_holdings_are_found_only_for_their_job_and_owner(tmp_path: Path) -> None:
    for job, owner in (("a", "run-1"), ("a-b", "run-1"), ("a", "run-2")):
        d = tmp_path / f"{workdir_prefix(job)}x{owner}"
        d.mkdir()
        write_holdings(d / HOLDINGS_FILE, _holdings(job, owner, d, pid=42))
    (tmp_path / f"{workdir_prefix('a')}broken").mkdir()
    (tmp_path / f"{workdir_prefix('a')}broken" / HOLDINGS_FILE).write_text("{not json")
    (found,) = find_holdings("a", "run-1", tmp_path)
    assert found == _holdings("a", "run-1", tmp_path / f"{workdir_prefix('a')}xrun-1", pid=42)
    assert Holdings.from_json(found.to_json()) == found


# -- the crash hook on a real flow run -------------------------------------------------------------------


@pytest.fixture
def stand_in_launcher() -> Iterator[subprocess.Popen[bytes]]:
    """A live process standing for a job's launcher that a killed flow run left behind."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=10)


@pytest.mark.usefixtures("prefect_harness")
def test_the_crash_hook_names_what_a_killed_flow_run_left_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stand_in_launcher: subprocess.Popen[bytes]
) -> None:
    """The hook is called directly, as Prefect's worker calls it after a flow-run process was SIGKILLed (its
    `finally` never ran): no in-process test can kill the flow run's own process."""
    from prefect import get_client
    from prefect.events.filters import EventFilter, EventNameFilter, EventRelatedFilter

    job = "hook-left"
    with get_client(sync_client=True) as client:
        created = client.create_flow_run(
            resilient_training, parameters={"run": TrainingRun(job_id=job).model_dump(mode="json")}
        )
        flow_run = client.read_flow_run(created.id)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the supervisor's work directories go
    workdir = tmp_path / f"{workdir_prefix(job)}k1ll"
    workdir.mkdir()
    left = Holdings(job_id=job, owner=str(flow_run.id), host=socket.gethostname(), workdir=str(workdir),
                    launcher_pid=stand_in_launcher.pid, port=29511, instances=("local-7", "local-8"))
    write_holdings(workdir / HOLDINGS_FILE, left)

    why = "Flow run infrastructure exited with non-zero status code -9."
    record_what_was_left(resilient_training, flow_run, Crashed(message=why))

    def orphaned() -> Any:
        with get_client(sync_client=True) as client:
            events = client.read_events(
                filter=EventFilter(
                    event=EventNameFilter(name=["trainmover.job.orphaned"]),
                    related=EventRelatedFilter(id=[f"prefect.flow-run.{flow_run.id}"]),
                ),
                limit=5,
            ).events
        return events[0] if events else None

    event = poll("the trainmover.job.orphaned event", orphaned, 30.0)
    assert event.resource["trainmover.job"] == job
    assert event.payload["launcher_pid"] == stand_in_launcher.pid and event.payload["launcher_alive"] is True
    assert event.payload["instances"] == ["local-7", "local-8"] and event.payload["port"] == 29511
    assert event.payload["state"] == "Crashed" and why in event.payload["why"]
