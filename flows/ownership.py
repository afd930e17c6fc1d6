"""One owner per job: a training run holds its job's Prefect global concurrency limit for as long as it runs.

Every instance carries its job's tag, and a run ends by releasing everything under that tag; two live runs of one
`job_id` would therefore build one fleet between them and the first to end would terminate the other's. So a run
takes the one slot of the global concurrency limit `trainmover-job-<job_id>` before it launches anything, with its
flow run as the lease's holder, and gives it back when it ends. A second run finds the slot taken and is refused at
once with `JobAlreadyRunning`, before it launches anything: it does not queue, because a run that started a fleet
whenever the first one ended is never what pressing "Run" twice meant.

Why a concurrency limit rather than a look at the running flow runs: two runs that start together would both see
none; the server counts slots atomically. The limit is created on first use and kept (one row per job id under
Concurrency in the UI, one slot): deleting it at the end would race with a run about to take it.

Prefect renews the slot's lease while the run lives. A run whose process is killed keeps the slot until the lease
runs out (`OWNER_LEASE_S`); a run after that is no longer refused (what was left running is in the crash hook's
`trainmover.job.orphaned` event). A failed lease renewal (a server blip) logs and lets the job go on, rather than
stopping a training run for a bookkeeping error.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from uuid import UUID

LIMIT_PREFIX = "trainmover-job-"
OWNER_LEASE_S = 300.0
"""How long a run whose process died keeps its job: Prefect's default lease, renewed while the run lives."""
ACQUIRE_TIMEOUT_S = 30.0
"""A bound on asking the server for the slot (no waiting for it: a taken slot is refused at once)."""


class JobAlreadyRunning(RuntimeError):
    """Another flow run owns this job: refused before anything is launched."""


def limit_name(job_id: str) -> str:
    return f"{LIMIT_PREFIX}{job_id}"


def _locked(exc: BaseException) -> bool:
    """Whether Prefect's acquisition error comes from the server's 423 Locked (the slot is taken)."""
    import httpx

    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, httpx.HTTPStatusError) and seen.response.status_code == 423:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _ensure_limit(job_id: str) -> None:
    from prefect import get_client
    from prefect.exceptions import ObjectAlreadyExists

    # ObjectAlreadyExists: another run of the job created it between the upsert's read and its create.
    with get_client(sync_client=True) as client, suppress(ObjectAlreadyExists):
        client.upsert_global_concurrency_limit_by_name(limit_name(job_id), limit=1)


def _owner_of(job_id: str, me: UUID) -> str:
    """The running flow run that holds the job, for the refusal message (best effort: '' when not found)."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterName,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType

    try:
        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(
                    name=FlowRunFilterName(like_=f"{job_id}-"),  # flow-run names start with the job id
                    state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.RUNNING])),
                ),
                limit=20,
            )
    except Exception:
        return ""
    for fr in runs:
        run = fr.parameters.get("run")
        held = run.get("job_id") if isinstance(run, dict) else getattr(run, "job_id", None)
        if fr.id != me and held == job_id:
            return f" (flow run {fr.name!r}, id {fr.id})"
    return ""


@contextmanager
def owning(job_id: str, flow_run_id: UUID) -> Iterator[None]:
    """Hold `job_id` for the block; `JobAlreadyRunning` at once when another flow run holds it."""
    from prefect.client.schemas.objects import ConcurrencyLeaseHolder
    from prefect.concurrency.sync import concurrency

    _ensure_limit(job_id)
    with ExitStack() as stack:
        try:
            stack.enter_context(
                concurrency(
                    limit_name(job_id),
                    occupy=1,
                    timeout_seconds=ACQUIRE_TIMEOUT_S,
                    max_retries=0,  # a taken slot is an answer, not something to wait out
                    lease_duration=OWNER_LEASE_S,
                    strict=True,
                    holder=ConcurrencyLeaseHolder(type="flow_run", id=flow_run_id),
                    raise_on_lease_renewal_failure=False,
                )
            )
        except Exception as exc:
            if not _locked(exc):
                raise
            raise JobAlreadyRunning(
                f"job {job_id!r} is already running under another flow run{_owner_of(job_id, flow_run_id)}; a "
                "second run would launch a second fleet under the same tag. Wait for that run to end or cancel it, "
                "or give this run another run.job_id."
            ) from None
        yield
