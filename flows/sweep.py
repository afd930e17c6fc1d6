"""`sweep_unsupervised_jobs`: stop and release jobs that nobody has supervised for `ttl_s`, so nothing bills forever.

A training run refreshes its job's record (`flows.jobrecord`) every 30 s while it supervises. When its flow-run
process dies, the job keeps training (its launcher runs in a session of its own; on instances, the hosts keep their
agents), and its instances keep billing. A new run of the job re-attaches to it (`flows.training`); when none
comes, this flow, scheduled (prefect.yaml's `sweep-unsupervised-jobs`), finds every record older than `ttl_s` whose
flow run is not running, stops its launcher (on this host: run the flow on the orchestrator's work pool), releases
every instance carrying the job's tag and what the job made in the cloud (its notice queue, its secret), deletes the
record, and emits `trainmover.job.swept`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from typing import Annotated, Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact
from prefect.events import emit_event
from pydantic import Field

from flows import jobrecord
from flows.jobrecord import JobRecord

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


def release_fleet(record: JobRecord) -> list[str]:
    """Release every instance tagged with the job, and what the flow made for it in the cloud."""
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
        released = provider.release_job(record.job_id)
        from cloud.aws import delete_notice_queue
        from cloud.secrets import AwsParameterStore, SecretRef, secret_name_for

        session = options.get("session")
        delete_notice_queue(record.job_id, region=str(record.region), session=session)
        AwsParameterStore(str(record.region), session=session).delete(
            SecretRef("aws-ssm", secret_name_for(record.job_id, "aws-ssm"), record.region))
        return released
    provider = make_provider("azure", subscription_id=record.azure_subscription_id,
                             resource_group=record.azure_resource_group, location=record.region, **options)
    return provider.release_job(record.job_id)


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
        jobrecord.forget(record.job_id)
        logger.warning("job %s unsupervised for %.0f s (flow run %s): %s; released %d instance(s)", record.job_id,
                       idle_s, record.flow_run_id, launcher, len(released))
        emit_event(
            event="trainmover.job.swept",
            resource={"prefect.resource.id": f"trainmover.job.{record.job_id}", "trainmover.job": record.job_id},
            payload={"idle_s": round(idle_s), "flow_run": record.flow_run_id, "launcher": launcher,
                     "released": released},
        )
        swept.append({"job": record.job_id, "idle_s": round(idle_s), "flow_run": record.flow_run_id,
                      "launcher": launcher, "released": ", ".join(released) or "-"})
    create_table_artifact(swept or [{"job": "none", "idle_s": 0}], key="trainmover-sweep",
                          description=f"Jobs unsupervised for over {ttl_s:.0f} s, stopped and released")
    return {"swept": swept}


__all__ = ["release_fleet", "stop_launcher", "sweep_unsupervised_jobs"]
