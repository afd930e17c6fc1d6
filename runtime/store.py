"""The job's key-value store: its key names, JSON records, and bounded waits.

The coordinator hosts a torch `TCPStore`; every process connects as a client. All membership and recovery
records live here under the names below, so a reader can see the whole protocol in one place.
Waits poll `check()` (a ~25 us round trip) instead of `TCPStore.wait`, whose timeouts print C++ warnings,
and every wait has a deadline and a way to be cut short.
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

POLL_S = 0.002


class StoreTimeout(TimeoutError):
    """A bounded wait on the store ran out."""


class Interrupted(Exception):
    """A wait was cut short because something it watches changed (a new generation, a stop)."""


# Key names: one function each, so that writer and reader cannot disagree.
def k_job_config() -> str:
    return "job/config"


def k_current_gen() -> str:
    return "gen/current"


def k_gen(g: int) -> str:
    return f"gen/{g}/record"


def k_joined(g: int, rank: int) -> str:
    return f"gen/{g}/joined/{rank}"


def k_status(g: int, rank: int) -> str:
    return f"gen/{g}/status/{rank}"


def k_report(g: int, rank: int) -> str:
    return f"gen/{g}/report/{rank}"


def k_failed(g: int, proc: str) -> str:
    return f"gen/{g}/failed/{proc}"


def k_failed_count(g: int) -> str:
    return f"gen/{g}/failed_count"


def k_done(g: int, rank: int) -> str:
    return f"gen/{g}/done/{rank}"


def k_holds(g: int, rank: int) -> str:
    """Set once rank `rank` of generation g holds the complete training state (after its handoff)."""
    return f"gen/{g}/holds/{rank}"


def k_spec(proc: str) -> str:
    """What this process built: tensor names, shapes and dtypes, param groups, registered state (JSON)."""
    return f"proc/{proc}/spec"


def k_job_spec() -> str:
    """The first spec published; every process must match it (set once, with compare_set)."""
    return "job/spec"


def k_chaos_done() -> str:
    """Set once the chaos monkey injected its last fault (runtime.chaos)."""
    return "chaos/done"


def k_hello(proc: str) -> str:
    return f"proc/{proc}/hello"


def k_ready(proc: str) -> str:
    return f"proc/{proc}/ready"


def k_heartbeat(proc: str) -> str:
    return f"proc/{proc}/heartbeat"


def k_fatal(proc: str) -> str:
    return f"proc/{proc}/fatal"


def k_digest(proc: str) -> str:
    return f"proc/{proc}/digest"


def k_assign(proc: str) -> str:
    return f"proc/{proc}/assign"


def k_progress() -> str:
    """The last step committed, as the members' heartbeats publish it (for orchestrators' progress bars)."""
    return "progress/step"


def k_stop() -> str:
    return "job/stop"


def k_fault(index: int) -> str:
    return f"fault/{index}/fired"


# Control keys: written by an orchestrator through `runtime.control.JobControl`, read by the coordinator.
def k_control_standby_target() -> str:
    """How many unpromoted standbys to keep (an integer as text)."""
    return "control/standby_target"


def k_control_move() -> str:
    """The latest planned-move request: JSON `{"seq": n, "ranks": [...], "reason": "..."}`."""
    return "control/move"


def k_control_move_seq() -> str:
    """A counter that hands out move sequence numbers, so that concurrent clients never reuse one."""
    return "control/move_seq"


def k_control_move_result() -> str:
    """The coordinator's answer to the latest move request: JSON `{"seq", "accepted", "reason"}`."""
    return "control/move_result"


def connect(host: str, port: int, timeout_s: float = 30.0) -> dist.TCPStore:
    return dist.TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=timeout_s))


def set_json(store: dist.Store, key: str, value: Any) -> None:
    store.set(key, json.dumps(value))


def get_json(store: dist.Store, key: str) -> Any:
    return json.loads(store.get(key))


def get_json_or_none(store: dist.Store, key: str) -> Any:
    return get_json(store, key) if store.check([key]) else None


def get_int(store: dist.Store, key: str, default: int = -1) -> int:
    return int(store.get(key)) if store.check([key]) else default


def read_counter(store: dist.Store, key: str) -> int:
    """A counter kept with `add`, read in one round trip (adding 0 creates it at 0 if absent)."""
    return int(store.add(key, 0))


def wait_keys(
    store: dist.Store,
    keys: Sequence[str],
    timeout_s: float,
    interrupt: Callable[[], str | None] | None = None,
    what: str = "",
) -> None:
    """Return once every key exists.

    Raises `Interrupted` if `interrupt()` names a reason, `StoreTimeout` at the deadline.
    """
    deadline = time.monotonic() + timeout_s
    pending = list(keys)
    while pending:
        pending = [k for k in pending if not store.check([k])]
        if not pending:
            return
        if interrupt is not None and (reason := interrupt()):
            raise Interrupted(reason)
        if time.monotonic() > deadline:
            raise StoreTimeout(f"waited {timeout_s:.0f} s for {what or pending[0]}")
        time.sleep(POLL_S)
