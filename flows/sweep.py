"""`sweep_unsupervised_jobs`: stop and release jobs that nobody has supervised for `ttl_s`, so nothing bills forever.

A training run refreshes its job's record (`flows.jobrecord`) every 30 s while it supervises. When its flow-run
process dies, the job keeps training (its launcher runs in a session of its own; on instances, the hosts keep their
agents), and its instances keep billing. A new run of the job re-attaches to it (`flows.training`); when none
comes, this flow, scheduled (prefect.yaml's `sweep-unsupervised-jobs`), finds every record older than `ttl_s` whose
flow run is not running, stops its launcher (on this host: run the flow on the orchestrator's work pool), releases
every instance carrying the job's tag and what the job made in the cloud (its notice queue, its secret, the wheel
and script it staged in S3), deletes the job's secret files on this host (its work directory keeps the job's events
and logs, for a post-mortem), gives the dead run's hold on the job back (`flows.ownership`: a new run of the job can
start at once), deletes the record, and emits `trainmover.job.swept`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import time
from pathlib import Path
from typing import Annotated, Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact
from prefect.events import emit_event
from pydantic import Field

from flows import jobrecord
from flows.holdings import HOLDINGS_FILE, workdir_prefix
from flows.jobrecord import SECRET_FILE, JobRecord
from flows.ownership import release_lease

STOP_WAIT_S = 30.0


def _flow_run_running(flow_run_id: str | None) -> bool:
    if not flow_run_id:
        return False
    from uuid import UUID

    from prefect import get_client

    try:
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(UUID(flow_run_id)).state
    except Exception:
        return False  # unknown to this server (deleted, or never a flow run): nobody supervises it
    return state is not None and (state.is_running() or state.is_pending())


def stop_launcher(record: JobRecord, wait_s: float = STOP_WAIT_S) -> str:
    """Stop the job's launcher if it runs on this host (its process group: the coordinator and local workers)."""
    if record.host != socket.gethostname():
        return f"launcher on host {record.host}: run the sweep there to stop it"
    if not record.launcher_alive():
        return "launcher gone"
    with contextlib.suppress(ProcessLookupError):
        os.killpg(record.launcher_pid, signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    while record.launcher_alive() and time.monotonic() < deadline:
        time.sleep(0.2)  # another process's exit: no fd to wait on
    if record.launcher_alive():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(record.launcher_pid, signal.SIGKILL)
        return "launcher killed"
    return "launcher stopped"


LOCAL_HOSTS_SECRETS = "secrets"
"""Where a job on local hosts keeps its secret for them, in its work directory (`flows.hosts`' LocalFileStore)."""


def remove_secrets(record: JobRecord) -> str:
    """Delete the job's secret files from its work directory on this host (the one a re-attaching run would read,
    and the local hosts' copy) and its holdings record (it holds nothing any more); its events and logs stay, for
    whoever looks into why the job was left. Only in the job's own work directory: the record is a Prefect
    Variable, and what it names is checked before anything is deleted."""
    if record.host != socket.gethostname():
        return f"secret file on host {record.host}: run the sweep there to delete it"
    workdir = Path(record.workdir)
    secret = workdir / SECRET_FILE
    if not workdir.name.startswith(workdir_prefix(record.job_id)) or Path(record.secret_file) != secret:
        return f"secret file {record.secret_file} kept: not in a work directory of job {record.job_id}"
    (workdir / HOLDINGS_FILE).unlink(missing_ok=True)
    hosts_secrets = workdir / LOCAL_HOSTS_SECRETS
    found = [secret] if secret.exists() else []
    found += [p for p in hosts_secrets.iterdir() if p.is_file()] if hosts_secrets.is_dir() else []
    secret.unlink(missing_ok=True)
    shutil.rmtree(hosts_secrets, ignore_errors=True)
    return f"{len(found)} secret file(s) deleted; events and logs kept in {workdir}"


def release_fleet(record: JobRecord) -> list[str]:
    """Release every resource of the job in its cloud (`Provider.release_all`: its instances, network, notice
    queue and secret; on AWS also the files it staged in S3, from the staging record in its work directory on this
    host, `flows.hosts.delete_staged_files`); returns the terminated instances' ids. A deletion that failed is
    logged by name (the others still ran); a later sweep or `trainmover cloud release` deletes what is left."""
    if record.provider == "local":
        return []  # local instances are the dead run's bookkeeping; stopping the launcher stopped its processes
    from cloud.registry import make_provider
    from flows.credentials import load_credentials, provider_options

    options: dict[str, Any] = {}
    if record.credentials_block:
        options = provider_options(load_credentials(record.credentials_block, record.provider),  # type: ignore[arg-type]
                                   record.region)
    if record.provider == "aws":
        provider = make_provider("aws", region=record.region, **options)
    else:
        # The job's Key Vault, where its record names one; without it the secret is reported as not looked for.
        if record.key_vault_url:
            from cloud.secrets import AzureKeyVaultStore

            options["key_vault"] = AzureKeyVaultStore(record.key_vault_url, credential=options.get("credential"))
        provider = make_provider("azure", subscription_id=record.azure_subscription_id,
                                 resource_group=record.azure_resource_group, location=record.region,
                                 key_vault_resource_id=record.key_vault_resource_id, **options)
    report = provider.release_all(record.job_id)
    logger = get_run_logger()
    logger.info("%s", report.summary())
    for note in report.not_looked_for:
        logger.warning("job %s: not looked for: %s", record.job_id, note)
    if not report.complete:
        logger.warning("%s", report.failure())
    if record.provider == "aws":
        # The job's staged wheel and script (flows.hosts.S3Staging): the dead run's staging record names them.
        if record.host != socket.gethostname():
            logger.warning("job %s: staged files recorded on host %s: run the sweep there to delete them",
                           record.job_id, record.host)
        elif not Path(record.workdir).name.startswith(workdir_prefix(record.job_id)):  # the record is a Variable
            logger.warning("job %s: staged files not looked for: %s is not a work directory of the job",
                           record.job_id, record.workdir)
        else:
            from flows.hosts import delete_staged_files

            logger.info("job %s: %s", record.job_id,
                        delete_staged_files(Path(record.workdir), record.job_id, session=options.get("session")))
    return list(report.instances)


@flow(name="sweep-unsupervised-jobs")
def sweep_unsupervised_jobs(ttl_s: Annotated[float, Field(ge=60, le=7 * 86400)] = 900.0) -> dict[str, Any]:
    """Stop and release every job whose supervising run has not refreshed its record for `ttl_s` seconds and is
    not running any more.

    Args:
        ttl_s: Seconds without supervision after which a job is stopped and its instances released, 60 s to
            7 days. A new run of the job re-attaches instead, if it comes first.
    """
    logger = get_run_logger()
    now = time.time()
    swept: list[dict[str, Any]] = []
    for record in jobrecord.all_records():
        idle_s = now - record.supervised_at
        if idle_s < ttl_s or _flow_run_running(record.flow_run_id):
            continue
        launcher = stop_launcher(record)
        released = release_fleet(record)
        secrets = remove_secrets(record)
        # The dead run's hold on the job (flows.ownership): given back, so that a new run starts now, not once
        # its lease has lapsed; the record that names it goes next.
        hold = "no hold recorded"
        if record.owner_lease is not None:
            hold = "hold released" if release_lease(record.owner_lease) else "hold left to lapse"
        jobrecord.forget(record.job_id)
        logger.warning("job %s unsupervised for %.0f s (flow run %s): %s; released %d instance(s); %s; %s",
                       record.job_id, idle_s, record.flow_run_id, launcher, len(released), secrets, hold)
        emit_event(
            event="trainmover.job.swept",
            resource={"prefect.resource.id": f"trainmover.job.{record.job_id}", "trainmover.job": record.job_id},
            payload={"idle_s": round(idle_s), "flow_run": record.flow_run_id, "launcher": launcher,
                     "released": released, "secrets": secrets, "workdir": record.workdir, "hold": hold},
        )
        swept.append({"job": record.job_id, "idle_s": round(idle_s), "flow_run": record.flow_run_id,
                      "launcher": launcher, "released": ", ".join(released) or "-", "secrets": secrets,
                      "hold": hold})
    create_table_artifact(swept or [{"job": "none", "idle_s": 0}], key="trainmover-sweep",
                          description=f"Jobs unsupervised for over {ttl_s:.0f} s, stopped and released")
    return {"swept": swept}


__all__ = ["release_fleet", "remove_secrets", "stop_launcher", "sweep_unsupervised_jobs"]
