"""The sweep of a job nobody supervises, against the session's real Prefect server: it leaves no secret file on the
orchestrator (the job's events and logs stay, for a post-mortem), and a run of the job started right after it takes
the job at once (the dead run's hold given back), rather than being refused until that hold lapses."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from uuid import UUID

import pytest
from prefect import flow, get_client
from prefect.states import Crashed, Running

from cloud.local.secrets import LocalFileStore
from flows import jobrecord
from flows.holdings import HOLDINGS_FILE, workdir_prefix
from flows.jobrecord import JobRecord
from flows.ownership import _ensure_limit, _take, owning
from flows.sweep import remove_secrets, sweep_unsupervised_jobs
from runtime.wire.auth import new_token

pytestmark = pytest.mark.usefixtures("prefect_harness")


@flow(name="sweep-probe")
def _probe() -> None:
    """Only a flow for the flow runs below to belong to."""


def _flow_run(job_id: str, crashed: bool) -> UUID:
    """A flow run of `job_id` (named and parametrised as the training flow's are), Running or Crashed."""
    with get_client(sync_client=True) as client:
        fr = client.create_flow_run(_probe, name=f"{job_id}-{uuid.uuid4().hex[:6]}",
                                    parameters={"run": {"job_id": job_id}})
        client.set_flow_run_state(fr.id, Running(), force=True)
        if crashed:
            client.set_flow_run_state(fr.id, Crashed(message="the flow-run process was SIGKILLed"), force=True)
        return fr.id


@pytest.fixture
def launcher() -> Iterator[tuple[Path, subprocess.Popen[bytes]]]:
    """A job's work directory as a run leaves it, and a stand-in for its launcher (a process whose command line names
    the directory, in a session of its own); stopped by the test's end whatever happens."""
    job_id = "swept-secrets"
    workdir = Path(tempfile.mkdtemp(prefix=workdir_prefix(job_id)))
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", str(workdir)],
                            start_new_session=True)
    try:
        yield workdir, proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        jobrecord.forget(job_id)
        shutil.rmtree(workdir, ignore_errors=True)


def _record(job_id: str, workdir: Path, launcher_pid: int, **extra: object) -> JobRecord:
    return JobRecord(job_id=job_id, host=socket.gethostname(), workdir=str(workdir), launcher_pid=launcher_pid,
                     store_host="127.0.0.1", store_port=1, secret_file=str(workdir / jobrecord.SECRET_FILE),
                     events=str(workdir / "events.jsonl"), provider="local", supervised_at=time.time() - 3600,
                     **extra)  # type: ignore[arg-type]


def test_the_sweep_leaves_no_secret_file_and_keeps_the_jobs_events_and_logs(
    launcher: tuple[Path, subprocess.Popen[bytes]],
) -> None:
    workdir, proc = launcher
    secret = new_token()
    jobrecord.write_secret(workdir, secret)  # what the run wrote for a run that would re-attach
    LocalFileStore(workdir / "secrets").put("swept-secrets", secret)  # the local hosts' copy
    (workdir / "events.jsonl").write_text('{"event": "generation"}\n')
    (workdir / "job.log").write_text("step 40\n")
    (workdir / HOLDINGS_FILE).write_text("{}")
    jobrecord.publish(_record("swept-secrets", workdir, proc.pid, flow_run_id=None))

    out = sweep_unsupervised_jobs(ttl_s=600.0)

    row = next(r for r in out["swept"] if r["job"] == "swept-secrets")
    assert proc.wait(timeout=10) == -15 and row["launcher"] == "launcher stopped"
    left = sorted(str(p.relative_to(workdir)) for p in workdir.rglob("*"))
    assert left == ["events.jsonl", "job.log"], left  # no secret, no holdings record (nothing is held)
    assert row["secrets"] == f"2 secret file(s) deleted; events and logs kept in {workdir}"
    assert jobrecord.read("swept-secrets") is None


def test_a_run_started_right_after_the_sweep_takes_the_job_at_once() -> None:
    job_id = "swept-hold"
    dead = _flow_run(job_id, crashed=True)  # its process was killed while its job trained
    _ensure_limit(job_id)
    lease = _take(job_id, dead)
    gone = Path(tempfile.gettempdir()) / f"{workdir_prefix(job_id)}gone"  # its launcher is gone too
    jobrecord.publish(_record(job_id, gone, launcher_pid=1, flow_run_id=str(dead), owner_lease=str(lease)))
    try:
        out = sweep_unsupervised_jobs(ttl_s=600.0)
        with owning(job_id, _flow_run(job_id, crashed=False)) as taken:  # not refused: no wait for the lease
            assert isinstance(taken, UUID) and taken != lease
        assert next(r for r in out["swept"] if r["job"] == job_id)["hold"] == "hold released"
    finally:
        jobrecord.forget(job_id)


def test_a_record_that_names_files_outside_its_jobs_work_directory_gets_nothing_deleted(tmp_path: Path) -> None:
    """A record is a Prefect Variable that anyone with the API can write: the sweep deletes only in a directory named
    as the job's work directories are, and only the files a run puts there."""
    kept = tmp_path / jobrecord.SECRET_FILE
    kept.write_text("not the job's\n")
    note = remove_secrets(_record("swept-elsewhere", tmp_path, launcher_pid=1, flow_run_id=None))
    assert note == f"secret file {kept} kept: not in a work directory of job swept-elsewhere" and kept.exists()
