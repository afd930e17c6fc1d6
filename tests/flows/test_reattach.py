"""A job outlives the flow run that started it: a new flow run of the job re-attaches from the job's record, and the
job ends bit for bit; the sweep stops and releases a job nobody supervises.

The supervisor that "dies" is dropped without its release (its launcher runs in a session of its own, as after a
flow-run process is killed); the re-attaching one is a new object with a new provider, as in a new process.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from cloud.local import LocalProvider
from flows import jobrecord
from flows.jobrecord import JobRecord
from flows.models import StandbyLimits, TrainingRun
from flows.supervisor import Happening, Supervisor
from tests.runtime.conftest import TINY_JOB, clean_digest

pytestmark = pytest.mark.slow
ARGS = ("--step-ms", "40")
STEPS = 200


def _run(job_id: str) -> TrainingRun:
    return TrainingRun(job_id=job_id, workers=2, steps=STEPS, script=str(TINY_JOB), script_args=ARGS,
                       standby=StandbyLimits(min_warm=1, max_warm=1, max_stopped=0),
                       faults="kill:rank=1,step=20;kill:rank=0,step=150")


def _until(sup: Supervisor, what: str, done: object, timeout_s: float = 120.0) -> list[Happening]:
    seen: list[Happening] = []
    deadline = time.monotonic() + timeout_s
    while not done():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"not {what} within {timeout_s:.0f} s: {[h.event for h in seen]}"
        seen += sup.tick()
        sup.committed_step()
        time.sleep(0.1)  # the flow's tick pace
    return seen


def _abandoned(job_id: str, tmp_path: Path) -> tuple[JobRecord, Supervisor]:
    """A job whose supervisor is gone after its first interruption: what a killed flow-run process leaves."""
    first = Supervisor(_run(job_id), LocalProvider(slots=8), tmp_path / "first", owner="flow-run-that-died")
    first.provision()
    first.start(TINY_JOB)
    _until(first, "the first interruption", lambda: first.interruptions)
    record = first.job_record()
    assert record is not None and record.launcher_alive()
    assert record.read_secret() not in str(record.to_value()), "the record names the secret's file, never the secret"
    assert first.job is not None and first.job.control is not None
    first.job.control.close()  # its connection dies with its process; nothing is released
    return record, first


@pytest.mark.usefixtures("prefect_harness")
def test_a_new_flow_run_of_the_job_reattaches_by_itself_and_forgets_the_record(tmp_path: Path) -> None:
    from flows.training import resilient_training

    record, _ = _abandoned("reattach-flow", tmp_path)
    jobrecord.publish(record)
    state = resilient_training(run=_run("reattach-flow"), max_wall_s=180.0, return_state=True)
    assert state.is_completed(), state
    summary = state.result()
    # The first interruption happened before the re-attach (read back from the events); the second after it,
    # supervised live by the new run.
    assert summary["exit_code"] == 0 and [i["rank"] for i in summary["interruptions"]] == [1, 0]
    assert summary["final_digest"] == clean_digest(2, STEPS, TINY_JOB, ARGS)
    assert jobrecord.read("reattach-flow") is None, "a released job leaves no record"
    assert not record.launcher_alive()


@pytest.mark.usefixtures("prefect_harness")
def test_the_sweep_stops_and_forgets_an_unsupervised_job_and_keeps_a_supervised_one(tmp_path: Path) -> None:
    from flows.sweep import sweep_unsupervised_jobs

    workdir = tmp_path / "trainmover-swept-job"
    workdir.mkdir()
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", str(workdir)],
                                start_new_session=True)
    try:
        base = dict(host=__import__("socket").gethostname(), store_host="127.0.0.1", store_port=1,
                    secret_file=str(workdir / "job.secret"), events=str(workdir / "events.jsonl"), provider="local")
        stale = JobRecord(job_id="swept-job", flow_run_id=None, workdir=str(workdir), launcher_pid=launcher.pid,
                          supervised_at=time.time() - 3600, **base)  # type: ignore[arg-type]
        fresh = JobRecord(job_id="kept-job", flow_run_id=None, workdir=str(tmp_path / "other"), launcher_pid=1,
                          supervised_at=time.time(), **base)  # type: ignore[arg-type]
        jobrecord.publish(stale)
        jobrecord.publish(fresh)
        out = sweep_unsupervised_jobs(ttl_s=600.0)
        assert [row["job"] for row in out["swept"]] == ["swept-job"]
        assert out["swept"][0]["launcher"] == "launcher stopped"
        assert launcher.wait(timeout=10) == -15
        assert jobrecord.read("swept-job") is None and jobrecord.read("kept-job") == fresh
    finally:
        jobrecord.forget("kept-job")
        if launcher.poll() is None:
            launcher.kill()
