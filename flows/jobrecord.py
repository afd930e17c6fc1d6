"""Where a running job can be found again: its record in the Prefect Variable `trainmover-job-<job_id>`.

A training run writes the record when its job starts and refreshes `supervised_at` while it supervises (every
`HEARTBEAT_S`); it deletes the record once it has released everything. A record whose `supervised_at` is old names a
job nobody supervises any more (its flow-run process was killed: an OOM kill, a worker's grace period): a new run of
the job re-attaches to it (`flows.training`), and the `sweep-unsupervised-jobs` flow (`flows.sweep`) stops it and
releases its instances once `ttl_s` passed, so nothing bills forever.

The record holds where to reach the job (this host, the coordinator's address and store port, the launcher's pid,
the work directory with the job's events) and how to find its fleet (provider, region, the credentials block's
name); never the job's secret: that stays in a file only root can read in the work directory on the orchestrator's
host (`secret_file`), which a re-attaching run on that host reads.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("trainmover.flows")

PREFIX = "trainmover-job-"
HEARTBEAT_S = 30.0
"""How often a supervising run refreshes its record's `supervised_at`."""
RECORD_VERSION = 1
SECRET_FILE = "job.secret"
"""The job's secret, in its work directory on the orchestrator (`write_secret`); the sweep deletes it."""


@dataclass(frozen=True, slots=True)
class JobRecord:
    job_id: str
    flow_run_id: str | None
    host: str
    """The orchestrator's host name: the launcher, the work directory and the secret file are there."""
    workdir: str
    launcher_pid: int
    store_host: str
    store_port: int
    secret_file: str
    events: str
    provider: str
    region: str | None = None
    azure_subscription_id: str | None = None
    azure_resource_group: str | None = None
    credentials_block: str | None = None
    key_vault_url: str | None = None
    key_vault_resource_id: str | None = None
    """Azure: where the job's secret and its readers' grants are, for a release by the sweep."""
    on_instances: bool = False
    owner_lease: str | None = None
    """The id of the lease by which the supervising flow run owns the job (flows.ownership)."""
    supervised_at: float = 0.0
    version: int = RECORD_VERSION

    def to_value(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_value(cls, value: Any) -> JobRecord:
        if not isinstance(value, dict) or value.get("version") != RECORD_VERSION:
            raise ValueError(f"not a version-{RECORD_VERSION} job record: {str(value)[:80]}")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in value.items() if k in names})

    def beat(self, now: float | None = None) -> JobRecord:
        return dataclasses.replace(self, supervised_at=time.time() if now is None else now)

    def launcher_alive(self) -> bool:
        """Whether the job's launcher still runs, on this host (its pid, running from the job's work directory)."""
        if self.host != socket.gethostname():
            return False
        try:
            cmdline = Path(f"/proc/{self.launcher_pid}/cmdline").read_bytes()
        except OSError:
            return False
        return self.workdir.encode() in cmdline  # not a pid reused by another program

    def read_secret(self) -> str:
        from runtime.wire.auth import read_secret_file  # refuses a file others can read

        return read_secret_file(self.secret_file)


def variable_name(job_id: str) -> str:
    return f"{PREFIX}{job_id}"


def publish(record: JobRecord) -> None:
    """Write (or refresh) the job's record. A failure is logged: the job goes on without it."""
    from prefect.variables import Variable

    try:
        Variable.set(variable_name(record.job_id), record.to_value(), tags=["trainmover"], overwrite=True)
    except Exception as exc:
        log.warning("could not record job %s in Prefect: %s", record.job_id, exc)


def read(job_id: str) -> JobRecord | None:
    from prefect.variables import Variable

    value = Variable.get(variable_name(job_id), default=None)
    if value is None:
        return None
    try:
        return JobRecord.from_value(value)
    except (TypeError, ValueError) as exc:
        log.warning("ignoring the unreadable record of job %s: %s", job_id, exc)
        return None


def forget(job_id: str) -> None:
    from prefect.variables import Variable

    try:
        Variable.unset(variable_name(job_id))
    except Exception as exc:
        log.warning("could not delete the record of job %s: %s", job_id, exc)


def all_records() -> list[JobRecord]:
    from prefect import get_client

    with get_client(sync_client=True) as client:
        variables = client.read_variables()
    found = []
    for v in variables:
        if v.name.startswith(PREFIX):
            try:
                found.append(JobRecord.from_value(v.value))
            except (TypeError, ValueError) as exc:
                log.warning("ignoring the unreadable job record %s: %s", v.name, exc)
    return found


def write_secret(workdir: Path, secret: str) -> Path:
    """The job's secret in a file only its owner can read, in the job's work directory (for a re-attaching run)."""
    from runtime.wire.auth import write_secret_file

    path = Path(workdir) / SECRET_FILE
    write_secret_file(str(path), secret)
    return path


__all__ = ["HEARTBEAT_S", "JobRecord", "all_records", "forget", "publish", "read", "variable_name", "write_secret"]
