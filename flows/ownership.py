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
the job go on, rather than stopping a training run for a bookkeeping error. The sweep (`flows.sweep`), which stops
a job nobody supervises, gives its dead owner's lease back too (`release_lease`), so a new run can start at once.

A refusal names the flow run that holds the job (from the job's record, else from the job's flow runs on the
server) and says what to do: cancel a live holder, or, for one that died before it recorded its lease, when that
lease lapses.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
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


@dataclass(frozen=True, slots=True)
class Holder:
    """The flow run that holds a job, as the server shows it (for the refusal)."""

    flow_run_id: UUID
    name: str
    state: str
    """Its state's name: Running, Crashed, ..."""
    over: bool
    """Whether it is in a final state: then nobody renews its lease any more."""
    since: datetime | None
    """When it entered that state."""

    @classmethod
    def of(cls, flow_run: Any) -> Holder:
        state = flow_run.state
        return cls(flow_run.id, flow_run.name, state.name if state is not None else "unknown",
                   state is not None and state.is_final(), state.timestamp if state is not None else None)


def _holder(job_id: str, me: UUID) -> Holder | None:
    """Who holds the job (best effort, None when not found), among the flow run its record names and the job's flow
    runs (named after it): a live one, else the recorded one, else the last one that crashed (a run that ends in its
    own process gives its slot back), else the last one that ended."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.client.schemas.sorting import FlowRunSort

    from flows import jobrecord
    from flows.endings import job_id_of

    recorded: list[Any] = []
    try:
        record = jobrecord.read(job_id)
        with get_client(sync_client=True) as client:
            if record is not None and record.flow_run_id not in (None, str(me)):
                with suppress(Exception):  # a run the server no longer has: the job's runs may still tell
                    recorded.append(client.read_flow_run(UUID(record.flow_run_id)))
            runs = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_=f"{job_id}-")),
                sort=FlowRunSort.EXPECTED_START_TIME_DESC,
                limit=50,
            )
    except Exception as exc:
        log.warning("could not tell which flow run holds job %s: %s", job_id, exc)
        return None
    found = [fr for fr in [*recorded, *runs] if fr.id != me and fr.state is not None
             and (fr in recorded or job_id_of(fr.parameters or {}) == job_id)]
    ranked = ([fr for fr in found if not fr.state.is_final()] + recorded
              + [fr for fr in found if fr.state.is_crashed()] + found)
    return Holder.of(ranked[0]) if ranked else None


def release_lease(lease_id: UUID | str) -> bool:
    """Give back the slot held under `lease_id` (one that is gone already is no error); False when the server could
    not be told (the lease then lapses by itself within OWNER_LEASE_S of its last renewal)."""
    from prefect import get_client

    try:
        with get_client(sync_client=True) as client:
            client.release_concurrency_slots_with_lease(UUID(str(lease_id)))
    except Exception as exc:
        log.warning("could not release the job's ownership lease %s: %s", lease_id, exc)
        return False
    return True


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
        self._stop.set()
        self._renewer.join(timeout=30)
        release_lease(self.lease_id)


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
    """Who holds the job and what to do about it: stop a live holder, or wait for a dead one's lease to lapse."""
    holder = _holder(job_id, me)
    other = "or give this run another run.job_id."
    if holder is None:
        return JobAlreadyRunning(
            f"job {job_id!r} is held by a flow run that this server no longer shows (deleted?); its hold lapses by "
            f"itself within {OWNER_LEASE_S:.0f} s of its last renewal: start this run again then, {other}"
        )
    run = f"flow run {holder.name!r} (id {holder.flow_run_id}, {holder.state})"
    if not holder.over:
        return JobAlreadyRunning(
            f"job {job_id!r} is already running under another flow run: {run}; a second run would launch a second "
            f"fleet under the same tag. To stop that run and its job, cancel it (Cancel on its page in the UI, or "
            f"`prefect flow-run cancel {holder.flow_run_id}`) and start this run again; or let it end, {other}"
        )
    by = f" by {(holder.since + timedelta(seconds=OWNER_LEASE_S)).astimezone(UTC):%H:%M:%S} UTC at the latest" \
        if holder.since is not None else ""
    return JobAlreadyRunning(
        f"job {job_id!r} is still held by {run}, which ended without giving the job back and recorded no hold that "
        f"a new run could take over (its process was killed before its job started): that hold lapses by itself{by} "
        f"({OWNER_LEASE_S:.0f} s after that run ended). Start this run again then, {other}"
    )


@contextmanager
def owning(job_id: str, flow_run_id: UUID) -> Iterator[UUID]:
    """Hold `job_id` for the block (yields the lease's id, for the job's record); `JobAlreadyRunning` at once when
    another live flow run holds it. A holder that is over is relieved of its slot (see the module docstring)."""
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
        release_lease(stale)
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
