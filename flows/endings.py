"""How a training run that does not finish says so: failed, cancelled or crashed, and what it left running.

Two moments, because Prefect ends a flow run in two ways:

- The flow body sees the end as an exception, and holds the supervisor: `ending_of` tells a failure (an exception:
  from the job, a task, the deadline) from a cancellation (the SIGTERM Prefect sends while the flow run is
  Cancelling on the server) from a crash (any other SIGTERM, a Ctrl-C). Once the fleet is released, the flow
  publishes the cost report of what ran until then and emits `trainmover.job.failed`, `.cancelled` or `.crashed`
  with the reason (`flows.training`).
- A flow-run process that is killed (an OOM kill, the worker's grace period run out) runs no `finally` at all. Then
  the worker runs the flow's `on_crashed` or `on_cancellation` hook in a process of its own on the same host:
  `record_what_was_left` reads the job's holdings record (`flows.holdings`), which the supervisor removes once it
  has released everything, and when one is left names what still runs, in the run's log and as a
  `trainmover.job.orphaned` event (automations can page someone: those instances bill with nobody watching). When
  the body did release (every in-process end), the hook finds no record and only logs that nothing was left.
"""

from __future__ import annotations

import os
import signal
import socket
from dataclasses import dataclass
from typing import Any, Literal

from flows.holdings import Holdings, find_holdings

EndingKind = Literal["failed", "cancelled", "crashed"]
MAX_REASON_CHARS = 1000  # an event payload and an artifact line, not a traceback


@dataclass(frozen=True, slots=True)
class Ending:
    """Why a run ended before its job finished."""

    kind: EndingKind
    reason: str

    @property
    def event(self) -> str:
        return f"trainmover.job.{self.kind}"

    @property
    def verb(self) -> str:
        """How a sentence says it: 'the run failed', 'the run was cancelled'."""
        return "was cancelled" if self.kind == "cancelled" else self.kind


def _reason(exc: BaseException) -> str:
    text = str(exc).strip()
    return (f"{type(exc).__name__}: {text}" if text else type(exc).__name__)[:MAX_REASON_CHARS]


def ending_of(exc: BaseException, state: Any = None) -> Ending:
    """How a run that raised `exc` ended; `state` is the flow run's state on the server (read by the caller when
    `exc` is not an `Exception`: only the server tells a cancellation's SIGTERM from another one)."""
    from prefect.exceptions import TerminationSignal

    if isinstance(exc, Exception):
        return Ending("failed", _reason(exc))
    if isinstance(exc, TerminationSignal):
        if state is not None and (state.is_cancelling() or state.is_cancelled()):
            return Ending("cancelled", (state.message or "the flow run was cancelled")[:MAX_REASON_CHARS])
        try:
            name = signal.Signals(exc.signal).name
        except ValueError:
            name = f"signal {exc.signal}"
        return Ending("crashed", f"the flow-run process received {name} (not a cancellation)")
    return Ending("crashed", _reason(exc))


def server_state() -> Any:
    """The current flow run's state as the server has it, or None when it cannot be read."""
    from prefect import get_client
    from prefect.runtime import flow_run

    try:
        with get_client(sync_client=True) as client:
            return client.read_flow_run(flow_run.id).state
    except Exception:
        return None


def job_id_of(parameters: dict[str, Any]) -> str | None:
    """The job id of a `resilient_training` flow run's parameters (JSON from the server, or the model itself)."""
    run = parameters.get("run")
    job_id = run.get("job_id") if isinstance(run, dict) else getattr(run, "job_id", None)
    return job_id if isinstance(job_id, str) else None


def provider_of(parameters: dict[str, Any]) -> str:
    run = parameters.get("run")
    provider = run.get("provider") if isinstance(run, dict) else getattr(run, "provider", None)
    return provider if isinstance(provider, str) else "local"


def launcher_alive(h: Holdings) -> bool | None:
    """Whether the recorded launcher still runs; None when that cannot be told from here (another host)."""
    if h.launcher_pid is None:
        return False
    if h.host != socket.gethostname():
        return None
    try:
        os.kill(h.launcher_pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True


def record_what_was_left(flow: Any, flow_run: Any, state: Any) -> None:
    """The flow's `on_crashed` and `on_cancellation` hook: name what the run left running, and why."""
    from prefect.events import emit_event
    from prefect.logging.loggers import flow_run_logger

    logger = flow_run_logger(flow_run, flow)
    job_id = job_id_of(flow_run.parameters or {})
    if job_id is None:
        return
    why = f"{state.name}: {state.message}" if state.message else str(state.name)
    left = find_holdings(job_id, str(flow_run.id))
    if not left:
        logger.info("job %s: the flow run ended (%s) and left nothing running", job_id, why)
        return
    for h in left:
        alive = launcher_alive(h)
        status = {True: "running", False: "gone", None: "unknown from this host"}[alive]
        launcher = (
            f"launcher pid {h.launcher_pid} on {h.host} ({status}, store port {h.port})"
            if h.launcher_pid is not None
            else "no launcher"
        )
        logger.warning(
            "job %s was left running by this flow run (%s): %s; %d instance(s): %s; work directory %s. Stop the job "
            "(kill -TERM -%s) and release its instances (`trainmover cloud release --provider %s --job %s`).",
            job_id, why, launcher, len(h.instances), ", ".join(h.instances) or "none", h.workdir,
            h.launcher_pid or "<pid>", provider_of(flow_run.parameters or {}), job_id,
        )
        emit_event(
            event="trainmover.job.orphaned",
            resource={"prefect.resource.id": f"trainmover.job.{job_id}", "trainmover.job": job_id},
            related=[{"prefect.resource.id": f"prefect.flow-run.{flow_run.id}", "prefect.resource.role": "flow-run"}],
            payload={
                "why": why,
                "state": str(state.name),
                "host": h.host,
                "workdir": h.workdir,
                "launcher_pid": h.launcher_pid,
                "launcher_alive": alive,
                "port": h.port,
                "instances": list(h.instances),
            },
        )
