"""The job's key-value store: its key names, sealed JSON records, and bounded waits.

The coordinator hosts a torch `TCPStore`; every process connects as a client. All membership and recovery
records live here under the names below, so a reader can see the whole protocol in one place. Records are
written and read through `Records`, which seals them with the job's secret (`runtime.wire.auth.Sealer`): a value
anyone else wrote is ignored, counted and warned about once, never obeyed. What each key holds is a typed,
versioned record of runtime.wire.protocol (`put` takes one, `get_record` returns one); a sealed value that is not the
record its key holds (a process of another version) is refused the same way as an unsealed one. Only counters
kept with `add` (claims, sequence dispensers, failure counts) are plain; none is believed without a sealed record.
Waits poll `check()` (a ~25 us round trip) instead of `TCPStore.wait`, whose timeouts print C++ warnings,
and every wait has a deadline and a way to be cut short.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch.distributed as dist

from runtime.wire.auth import Sealer
from runtime.wire.protocol import CoordinatorLease, RecordError, StoreRecord

R = TypeVar("R", bound=StoreRecord)

POLL_S = 0.002


class StoreTimeout(TimeoutError):
    """A bounded wait on the store ran out."""


class Interrupted(Exception):
    """A wait was cut short because something it watches changed (a new generation, a stop)."""


# Key names: one function each, so that writer and reader cannot disagree. What each holds: runtime.wire.protocol.
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


def k_state_homes() -> str:
    """Which ranks hold a copy of each rank's state (`StateHomes`: a sharded job's rank 0 writes it once)."""
    return "job/state-homes"


def k_job_spec() -> str:
    """The first spec published; every process must match it (set once, with compare_set)."""
    return "job/spec"


def k_chaos_done() -> str:
    """Set once the chaos monkey injected its last fault (runtime.control.chaos)."""
    return "chaos/done"


def k_hello(proc: str) -> str:
    return f"proc/{proc}/hello"


def k_ready(proc: str) -> str:
    return f"proc/{proc}/ready"


def k_heartbeat(proc: str) -> str:
    """A sealed count that only grows: a replayed old beat is not a sign of life."""
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


def k_over() -> str:
    """Set (sealed) as the coordinator ends the job, before its store closes: clients stop using the store."""
    return "job/over"


def k_lease() -> str:
    """The coordinator's lease (`CoordinatorLease`), set and renewed with compare_set only (runtime.control.lease)."""
    return "coordinator/lease"


def k_recovery(g: int) -> str:
    """The deaths generation g answers (`RecoveryOpened`), for a coordinator that takes over mid-recovery."""
    return f"gen/{g}/recovery"


def k_placed(proc: str) -> str:
    """The host ("NAME#INCARNATION") process `proc` was placed on: a coordinator that takes over knows a member
    is gone, not late, once that host re-attached without it."""
    return f"proc/{proc}/placed"


def k_standby_names() -> str:
    """A counter that names standbys (s0, s1, ...): a coordinator that takes over never reuses a name."""
    return "coordinator/standby_names"


def k_backup() -> str:
    """The newest persistent backup rank 0 finished writing (`BackupRecord`, runtime.training.backup)."""
    return "backup/newest"


def k_switch_at(g: int) -> str:
    """The step after which the members switch to planned generation g: the first member to see g writes its own
    committed step + 1 (sealed, with compare_set), and every member reads the value that won."""
    return f"gen/{g}/switch_at"


def k_hot_slot(slot: int) -> str:
    """A hot slot: a sealed `HotClaim` of the standby that mirrors through it (compare_set), empty when free."""
    return f"hot/slot/{slot}"


def k_hot_of(proc: str) -> str:
    """The hot slot a standby claimed (a bare integer), for the coordinator to free when the standby dies."""
    return f"proc/{proc}/hot_slot"


def k_hot_held(proc: str) -> str:
    """The newest step whose whole state a hot standby holds (`HotHeld`), after each message it applied."""
    return f"proc/{proc}/hot_held"


def k_fault(index: int) -> str:
    return f"fault/{index}/fired"


# Control keys: written by an orchestrator through `runtime.wire.control.JobControl`, read by the coordinator.
def k_control_standby_target() -> str:
    """How many unpromoted standbys to keep: a sealed `ControlCommand` whose request is "<integer>"."""
    return "control/standby_target"


def k_control_move() -> str:
    """The latest planned-move request: a sealed `ControlCommand` whose request is a `MoveRequest`'s JSON."""
    return "control/move"


def k_control_resize() -> str:
    """The latest resize request: a sealed `ControlCommand` whose request is a `ResizeRequest`'s JSON."""
    return "control/resize"


def k_control_resize_result() -> str:
    """The coordinator's answer to the latest resize request: a sealed `MoveResult`."""
    return "control/resize_result"


def k_control_seq() -> str:
    """A counter that hands out control sequence numbers, so that concurrent clients never reuse one.

    Plain (an outsider can raise it, which costs nothing); the seq a command carries is sealed with it."""
    return "control/seq"


def k_control_move_result() -> str:
    """The coordinator's answer to the latest move request: a sealed `MoveResult`."""
    return "control/move_result"


class Records:
    """The store seen through the job's seal: sealed writes, verified reads, bounded waits for sealed values."""

    def __init__(self, store: dist.Store, sealer: Sealer) -> None:
        self.store = store
        self.sealer = sealer
        self._refused_raw: dict[str, bytes] = {}
        self._malformed_raw: dict[str, bytes] = {}

    def put(self, key: str, value: Any) -> None:
        """Write `value` (a runtime.wire.protocol record, or any JSON value) sealed under `key`."""
        if isinstance(value, StoreRecord):
            value = value.to_json()
        self.store.set(key, self.sealer.seal(key, value))

    def _raw(self, key: str) -> bytes | None:
        if not self.store.check([key]):
            return None
        try:
            return self.store.get(key)
        except dist.DistStoreError:  # deleted between check and get
            return None

    def get(self, key: str) -> Any:
        """The sealed value at `key`; None when there is none or what is there was not sealed by the job."""
        raw = self._raw(key)
        return None if raw is None else self.open(key, raw)

    def get_record(self, key: str, kind: type[R]) -> R | None:
        """The record of type `kind` sealed at `key`; None when there is none, or when what is there is unsealed
        or not such a record (both refused: ignored, counted once, warned about once)."""
        raw = self._raw(key)
        return None if raw is None else self.open_record(key, raw, kind)

    def get_slot(self, key: str, kind: type[R]) -> tuple[bytes | None, R | None]:
        """A key that compare_set fills and empties (a hot slot): its raw value (None when never written, b"" when
        emptied: both free) and its record (None when free, or refused); an empty value is no refusal."""
        raw = self._raw(key)
        return raw, self.open_record(key, raw, kind) if raw else None

    def open_record(self, key: str, raw: bytes, kind: type[R]) -> R | None:
        if self._malformed_raw.get(key) == raw:
            return None  # the same malformed record read again: counted once
        value = self.open(key, raw)
        if value is None:
            return None
        try:
            return kind.from_json(value)
        except RecordError as exc:
            self._malformed_raw[key] = raw
            self.sealer.refuse(key, f"a sealed value that is not a {kind.__name__} record: {exc}")
            return None

    def open(self, key: str, raw: bytes) -> Any:
        if self._refused_raw.get(key) == raw:
            return None  # the same bad value read again: counted once
        value = self.sealer.open(key, raw)
        if value is None:
            self._refused_raw[key] = raw
        return value

    def get_present(self, keys: Sequence[str]) -> dict[str, Any]:
        """The sealed values of keys that exist (each written before), in one round trip: what a coordinator
        watching thousands of heartbeats needs. A key gone missing falls back to one `get` each."""
        if not keys:
            return {}
        try:
            raws = self.store.multi_get(list(keys))
        except dist.DistStoreError:
            return {k: self.get(k) for k in keys}
        return {k: self.open(k, raw) for k, raw in zip(keys, raws, strict=True)}

    def get_present_records(self, keys: Sequence[str], kind: type[R]) -> dict[str, R | None]:
        """`get_present` for records: each key's record, None where refused."""
        if not keys:
            return {}
        try:
            raws = self.store.multi_get(list(keys))
        except dist.DistStoreError:
            return {k: self.get_record(k, kind) for k in keys}
        return {k: self.open_record(k, raw, kind) for k, raw in zip(keys, raws, strict=True)}

    def get_int(self, key: str, default: int = -1) -> int:
        value = self.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else default

    def has(self, key: str) -> bool:
        return self.get(key) is not None

    def has_all(self, keys: Sequence[str]) -> bool:
        """Whether every key holds a sealed value: one round trip while any is missing (the usual answer)."""
        return self.store.check(list(keys)) and all(self.get(k) is not None for k in keys)

    def wait(
        self,
        keys: Sequence[str],
        timeout_s: float,
        interrupt: Callable[[], str | None] | None = None,
        what: str = "",
    ) -> dict[str, Any]:
        """Return each key's sealed value once every key holds one (unsealed values are waited past).

        Raises `Interrupted` if `interrupt()` names a reason, `StoreTimeout` at the deadline.
        """
        deadline = time.monotonic() + timeout_s
        found: dict[str, Any] = {}
        while True:
            for k in keys:
                if k not in found and (value := self.get(k)) is not None:
                    found[k] = value
            if len(found) == len(keys):
                return found
            if interrupt is not None and (reason := interrupt()):
                raise Interrupted(reason)
            if time.monotonic() > deadline:
                pending = next(k for k in keys if k not in found)
                raise StoreTimeout(f"waited {timeout_s:.0f} s for {what or pending}")
            time.sleep(POLL_S)

    def wait_records(
        self,
        keys: Sequence[str],
        kind: type[R],
        timeout_s: float,
        interrupt: Callable[[], str | None] | None = None,
        what: str = "",
    ) -> dict[str, R]:
        """`wait` for records of type `kind`: RecordError names the key of a sealed value that is not one (a
        process of the same job built by another version: nothing to wait for)."""
        out = {}
        for key, value in self.wait(keys, timeout_s, interrupt, what).items():
            try:
                out[key] = kind.from_json(value)
            except RecordError as exc:
                raise RecordError(f"{key}: {exc}") from None
        return out


def connect(host: str, port: int, timeout_s: float = 30.0) -> dist.TCPStore:
    return dist.TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=timeout_s))


def read_counter(store: dist.Store, key: str) -> int:
    """A counter kept with `add`, read in one round trip (adding 0 creates it at 0 if absent)."""
    return int(store.add(key, 0))


def read_lease(store: dist.Store, sealer: Sealer) -> tuple[bytes, CoordinatorLease] | None:
    """The lease's raw bytes and record; None when there is none or what is there is not a sealed lease."""
    if not store.check([k_lease()]):
        return None
    raw = store.get(k_lease())
    value = sealer.open(k_lease(), raw)
    if value is None:
        return None
    try:
        return raw, CoordinatorLease.from_json(value)
    except RecordError:
        return None
