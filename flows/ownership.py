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

The run renews the slot's lease while it lives (every third of `OWNER_LEASE_S`) and records the lease's id in its
job's record (`flows.jobrecord`). A run whose process is killed renews nothing: its slot would stay taken until the
lease runs out. A new run of the job does not wait for that when the record names the dead run's lease and the
server says that run is over (Crashed, Failed, Cancelled, Completed): it releases that lease and takes the job
over (then re-attaches to its job, `flows.training`). A killed run that had not recorded its lease yet (it died
before its job started) holds its job until the lease runs out. A failed renewal (a server blip) logs and lets
the job go on, rather than stopping a training run for a bookkeeping error.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from uuid import UUID

log = logging.getLogger("trainmover.flows")

LIMIT_PREFIX = "trainmover-job-"
OWNER_LEASE_S = 300.0
"""How long a run whose process died keeps its job unless a new run finds it over: renewed while the run lives."""


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


class OwnerLease:
    """The slot a run holds, renewed on a thread until `release`."""

    def __init__(self, lease_id: UUID, duration_s: float = OWNER_LEASE_S) -> None:
        self.lease_id = lease_id
        self.duration_s = duration_s
        self._stop = threading.Event()
        self._renewer = threading.Thread(target=self._renew, name=f"owner-lease-{lease_id}", daemon=True)
        self._renewer.start()

    def _renew(self) -> None:
        from prefect import get_client

        while not self._stop.wait(self.duration_s / 3):
            try:
                with get_client(sync_client=True) as client:
                    client.renew_concurrency_lease(self.lease_id, self.duration_s)
            except Exception as exc:  # the job goes on; the next renewal may succeed
                log.warning("could not renew the job's ownership lease %s: %s", self.lease_id, exc)

    def release(self) -> None:
        from prefect import get_client

        self._stop.set()
        self._renewer.join(timeout=30)
        try:
            with get_client(sync_client=True) as client:
                client.release_concurrency_slots_with_lease(self.lease_id)
        except Exception as exc:  # it lapses by itself within OWNER_LEASE_S
            log.warning("could not release the job's ownership lease %s: %s", self.lease_id, exc)


def _take(job_id: str, flow_run_id: UUID) -> UUID:
    """The job's slot, or an HTTP 423 error when another run holds it."""
    from prefect import get_client
    from prefect.client.schemas.objects import ConcurrencyLeaseHolder

    with get_client(sync_client=True) as client:
        response = client.increment_concurrency_slots_with_lease(
            names=[limit_name(job_id)], slots=1, mode="concurrency", lease_duration=OWNER_LEASE_S,
            holder=ConcurrencyLeaseHolder(type="flow_run", id=flow_run_id),
        )
    return UUID(str(response.json()["lease_id"]))


def _lapsed_owner(job_id: str, me: UUID) -> tuple[str, UUID] | None:
    """(the previous owner, its lease) when the job's record names a flow run that is over and the lease it held:
    nobody renews that lease any more."""
    from prefect import get_client

    from flows import jobrecord

    record = jobrecord.read(job_id)
    if record is None or record.owner_lease is None or record.flow_run_id in (None, str(me)):
        return None
    try:
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(UUID(record.flow_run_id)).state
    except Exception as exc:
        log.warning("could not read the state of flow run %s, which owned job %s: %s", record.flow_run_id, job_id,
                    exc)
        return None
    if state is None or not state.is_final():
        return None
    return f"flow run {record.flow_run_id} ({state.name})", UUID(record.owner_lease)


def _refusal(job_id: str, me: UUID) -> JobAlreadyRunning:
    return JobAlreadyRunning(
        f"job {job_id!r} is already running under another flow run{_owner_of(job_id, me)}; a second run would "
        "launch a second fleet under the same tag. Wait for that run to end or cancel it, or give this run another "
        f"run.job_id. (A run whose process was killed before its job started holds the job for up to "
        f"{OWNER_LEASE_S:.0f} s.)"
    )


@contextmanager
def owning(job_id: str, flow_run_id: UUID) -> Iterator[UUID]:
    """Hold `job_id` for the block (yields the lease's id, for the job's record); `JobAlreadyRunning` at once when
    another live flow run holds it. A holder that is over is relieved of its slot (see the module docstring)."""
    from prefect import get_client

    _ensure_limit(job_id)
    try:
        lease_id = _take(job_id, flow_run_id)
    except Exception as exc:
        if not _locked(exc):
            raise
        lapsed = _lapsed_owner(job_id, flow_run_id)
        if lapsed is None:
            raise _refusal(job_id, flow_run_id) from None
        previous, stale = lapsed
        with get_client(sync_client=True) as client, suppress(Exception):
            client.release_concurrency_slots_with_lease(stale)
        log.warning("job %s was held by %s, which is over: its hold released, this run takes the job over",
                    job_id, previous)
        try:
            lease_id = _take(job_id, flow_run_id)
        except Exception as again:
            if not _locked(again):
                raise
            raise _refusal(job_id, flow_run_id) from None  # another run took it over first
    lease = OwnerLease(lease_id)
    try:
        yield lease_id
    finally:
        lease.release()
