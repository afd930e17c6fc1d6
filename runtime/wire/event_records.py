"""The job's events as typed, versioned records: one frozen dataclass per kind.

The coordinator writes each event as one JSON line (`runtime.wire.events.EventLog`): `{"event": KIND, "version": 2,
"time": ..., ...fields}`, readable by any tool. Readers in Python get the records back: `parse_event` turns one JSON
object into its record, checking every field's type (`EventError` says what is wrong), and
`runtime.wire.events.read_records` / `runtime.client.RuntimeJob.read_events` return them; `Event.to_dict` gives the JSON
object again, for tools that want dicts.

Versions: 2 is the schema of this module; a line without `"version"` (written before events had one) is version 1,
with the same fields, and reads the same way. Tolerance: a line of a kind this module does not know becomes an
`UnknownEvent` (its kind and its fields, kept as they are); fields a record does not declare (a newer writer's) are
ignored; a missing required field or a field of the wrong type is an `EventError`.

Nested values (a generation's members, a recovery's ranks and figures) stay JSON objects (`dict`), as written.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from runtime.wire.protocol import _is, checked_fields

EVENT_VERSION = 2
"""The schema version this module writes; lines without a version are version 1 (same fields)."""

SOMETIMES = {"omit_if_none": True}
"""Field metadata of a field only some writers of the kind fill in: None by default, and then absent from the JSON
line."""


class EventError(ValueError):
    """A JSON line that is not the event it names: a missing field, a field of the wrong type, not an object."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """Base of the event records: the kind (`KIND`, the JSON line's `"event"`), its wall-clock time (seconds since
    the epoch; set when the record is made) and the schema version it was written with."""

    KIND: ClassVar[str] = ""
    time: float = field(default_factory=time.time)
    version: int = EVENT_VERSION

    @property
    def kind(self) -> str:
        return self.KIND

    def to_dict(self) -> dict[str, Any]:
        """The event as its JSON line's object."""
        out: dict[str, Any] = {"event": self.kind, "version": self.version, "time": self.time}
        for f in dataclasses.fields(self):
            if f.name in ("time", "version"):
                continue
            value = getattr(self, f.name)
            if value is None and f.metadata.get("omit_if_none"):
                continue
            out[f.name] = value
        return out


# -- the job ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class JobStarted(Event):
    """The coordinator published the job's config and starts its processes."""

    KIND: ClassVar[str] = "job_started"
    job_id: str
    nproc: int
    standby: int
    port: int
    """The job's store (control) port."""
    helpers: dict[str, int] = field(default_factory=dict)
    """Helper processes by name (the zygote) and their pids."""
    agent_port: int | None = field(default=None, metadata=SOMETIMES)
    """Across hosts (and on one machine, whose agent is local): where the agents connect."""
    hosts: list[dict[str, Any]] | None = field(default=None, metadata=SOMETIMES)
    """The hosts that joined before the job started: host, incarnation, slots, address."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerationStarted(Event):
    """A generation was published: its members by rank, and the ranks that changed hands."""

    KIND: ClassVar[str] = "generation"
    generation: int
    reason: str
    world_size: int
    members: list[dict[str, Any]]
    """{"rank", "proc", "pid"} per rank."""
    replaced: list[dict[str, Any]] = field(default_factory=list)
    """{"rank", "old", "new"} per rank given to a standby."""


@dataclass(frozen=True, slots=True, kw_only=True)
class JobFinished(Event):
    KIND: ClassVar[str] = "job_finished"
    wall_s: float
    generation: int
    digests: dict[str, str]
    step: int
    final_digest: str | None
    refused_values: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class JobFailed(Event):
    KIND: ClassVar[str] = "job_failed"
    wall_s: float
    reason: str
    exit_code: int
    refused_values: dict[str, int] = field(default_factory=dict)


# -- failures and recoveries --------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class MemberFailed(Event):
    """A worker was declared dead (`cause` starts with `planned_move:` for a sharded job's move)."""

    KIND: ClassVar[str] = "member_failed"
    generation: int
    rank: int
    proc: str
    pid: int
    cause: str
    step: int | None
    failure_at: float
    declared_at: float
    detect_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Recovered(Event):
    """A recovery, from its first failure to the commit of the replayed step (DESIGN.md's metric names)."""

    KIND: ClassVar[str] = "recovered"
    generation: int
    step: int
    ranks: list[dict[str, Any]]
    """{"rank", "old", "new"} per rank recovered."""
    causes: list[str]
    recovery_s: float
    handoff_bytes: int
    sources: list[int]
    detect_s: float
    reconfigure_s: float
    handoff_s: float
    replay_s: float
    warmup_penalty_s: float = 0.0
    reconfigure_split: dict[str, Any] = field(default_factory=dict)
    tier: str = "warm"
    generations: int = 1
    failed_attempts: list[dict[str, Any]] = field(default_factory=list)
    refetched_chunks: int = 0
    handoff_overlapped_s: float = 0.0
    """The optimizer's state streamed after `handoff_s`, beside the replayed step's forward and backward passes
    (inside `replay_s`): the slowest member's."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BackupWritten(Event):
    """Rank 0 finished a persistent backup (runtime.training.backup; `--backup-dir`)."""

    KIND: ClassVar[str] = "backup_written"
    step: int
    path: str
    bytes: int
    stage_s: float
    """What the step waited: the staging of the copy in host memory."""
    write_s: float
    """The write itself, beside training: files, digests, manifest, rename."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RestoringFromBackup(Event):
    """Every copy of the state was lost: the next generation starts from the newest backup instead of stopping."""

    KIND: ClassVar[str] = "restored_from_backup"
    generation: int
    """The generation that was lost (the restore happens in the next one)."""
    backup_step: int
    """The newest backup rank 0 had reported; the members load the newest complete one, which may be newer (one
    finished but not yet reported): the `recovered` event's step, minus one, is the one loaded."""
    path: str
    committed_step: int
    """The job's last committed step before the loss: the steps after `backup_step` are trained again."""
    steps_redone: int


# -- elastic width (runtime.training.elastic) ---------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class Shrunk(Event):
    """The job runs at fewer members than its logical width: no standby took a lost rank within the standby wait
    (`planned` false: its cost is the `recovered` event's, repeated in `lost_s`), or a resize asked for it
    (`planned`: the members switched at a step boundary; `lost_s` is the stall)."""

    KIND: ClassVar[str] = "shrunk"
    generation: int
    width_from: int
    width_to: int
    logical_width: int
    ranks: list[dict[str, Any]]
    """{"rank", "proc"} per rank left out (numbered as in the generation before)."""
    cause: str
    planned: bool
    mode: str
    """How the smaller width trains: accumulate (the same global batch), lr-linear or lr-sqrt."""
    lost_s: float
    """Failure: from the first failure to the commit of the replayed step; planned: from the members leaving the
    old generation to every member holding the state in the new one."""
    first_step_s: float | None = field(default=None, metadata=SOMETIMES)
    """The first step at the new width (the slowest member's)."""
    steady_step_s: float | None = field(default=None, metadata=SOMETIMES)
    """The step before the change (the members' median of recent steps)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Grew(Event):
    """Members joined a shrunk job at a step boundary, with the state handed over from memory."""

    KIND: ClassVar[str] = "grew"
    generation: int
    width_from: int
    width_to: int
    logical_width: int
    procs: list[str]
    """The processes that joined (standbys promoted, or new instances)."""
    cause: str
    stall_s: float
    """From the members leaving the old generation to every member holding the state in the new one."""
    handoff_bytes: int
    first_step_s: float | None = field(default=None, metadata=SOMETIMES)
    steady_step_s: float | None = field(default=None, metadata=SOMETIMES)
    group_s: float | None = field(default=None, metadata=SOMETIMES)
    """Of the stall, the slowest member's new group (built, and every peer's proof)."""
    handoff_s: float | None = field(default=None, metadata=SOMETIMES)
    """Of the stall, the slowest member's part of the handoff."""


# -- standbys -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class StandbySpawned(Event):
    KIND: ClassVar[str] = "standby_spawned"
    proc: str
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class StandbyWarm(Event):
    """A standby finished its warm-up (the kind is `standby_ready`)."""

    KIND: ClassVar[str] = "standby_ready"
    proc: str
    pid: int
    warmup_s: float | None
    ready_after_s: float | None


@dataclass(frozen=True, slots=True, kw_only=True)
class StandbyLost(Event):
    KIND: ClassVar[str] = "standby_lost"
    proc: str
    pid: int
    cause: str
    was_ready: bool
    failure_at: float
    declared_at: float
    detect_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class StandbyReleased(Event):
    KIND: ClassVar[str] = "standby_released"
    proc: str
    pid: int
    was_ready: bool
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Coverage(Event):
    """The job turned uncovered (no warm standby left to take a lost rank: a loss now waits for one to start, up to
    the standby wait) or covered again; the first one says how the job starts."""

    KIND: ClassVar[str] = "coverage"
    covered: bool
    warm: int
    warming: int
    target: int


# -- control ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class StandbyTargetChanged(Event):
    KIND: ClassVar[str] = "standby_target_changed"
    old: int
    new: int


@dataclass(frozen=True, slots=True, kw_only=True)
class WidthTargetChanged(Event):
    """A resize request was accepted: the job moves to `new` members (a `shrunk` or `grew` event says when it did)."""

    KIND: ClassVar[str] = "width_target_changed"
    old: int
    new: int
    reason: str
    seq: int


@dataclass(frozen=True, slots=True, kw_only=True)
class MoveAccepted(Event):
    """Ranks leave on purpose: an orchestrator's move (`seq`) or a host's notice (`host`, no seq)."""

    KIND: ClassVar[str] = "move_accepted"
    seq: int | None
    ranks: list[int]
    procs: list[str]
    reason: str
    host: str | None = field(default=None, metadata=SOMETIMES)


@dataclass(frozen=True, slots=True, kw_only=True)
class Moved(Event):
    """A planned move completed at a step boundary (a data-parallel job): the standbys hold the moved ranks, the
    leaving processes exited once the others switched, and no step was replayed."""

    KIND: ClassVar[str] = "moved"
    generation: int
    ranks: list[dict[str, Any]]
    """{"rank", "old", "new"} per rank moved."""
    reason: str
    stall_s: float
    """From the first member leaving the old generation to the last one holding the state in the new one."""
    handoff_bytes: int
    group_s: float | None = field(default=None, metadata=SOMETIMES)
    handoff_s: float | None = field(default=None, metadata=SOMETIMES)
    first_step_s: float | None = field(default=None, metadata=SOMETIMES)
    steady_step_s: float | None = field(default=None, metadata=SOMETIMES)


@dataclass(frozen=True, slots=True, kw_only=True)
class ControlRejected(Event):
    """A control value or a host notice the coordinator did not act on, and why."""

    KIND: ClassVar[str] = "control_rejected"
    control: str
    """"standby_target", "move" or "host_notice"."""
    reason: str
    value: str | None = field(default=None, metadata=SOMETIMES)
    seq: int | None = field(default=None, metadata=SOMETIMES)
    ranks: list[int] | None = field(default=None, metadata=SOMETIMES)
    host: str | None = field(default=None, metadata=SOMETIMES)


@dataclass(frozen=True, slots=True, kw_only=True)
class UntrustedValue(Event):
    """A store value the job's seal refused."""

    KIND: ClassVar[str] = "untrusted_value"
    key: str
    key_kind: str
    reason: str


# -- chaos --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class ChaosInjected(Event):
    """A signal the chaos monkey sent; `time` is the signal's moment."""

    KIND: ClassVar[str] = "chaos_injected"
    proc: str
    pid: int
    signal: str
    role: str
    state: str
    rank: int | None
    generation: int
    n: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ChaosUnresolved(Event):
    """A chaos hit not detected before the job ended; `time` is the signal's moment."""

    KIND: ClassVar[str] = "chaos_unresolved"
    proc: str
    pid: int
    reason: str


# -- hosts (the pool across hosts) --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class Placed(Event):
    KIND: ClassVar[str] = "placed"
    proc: str
    role: str
    host: str
    incarnation: str
    slot: int
    pid: int


@dataclass(frozen=True, slots=True, kw_only=True)
class HostJoined(Event):
    KIND: ClassVar[str] = "host_joined"
    host: str
    incarnation: str
    slots: int
    address: str


@dataclass(frozen=True, slots=True, kw_only=True)
class HostLost(Event):
    KIND: ClassVar[str] = "host_lost"
    host: str
    incarnation: str
    cause: str
    procs: list[str]
    failure_at: float


@dataclass(frozen=True, slots=True, kw_only=True)
class CoordinatorTookOver(Event):
    """A coordinator took the job over from one that was gone (runtime.control.lease): the generation it found, the
    processes its agents re-attached with, and the members none reported (declared dead next)."""

    KIND: ClassVar[str] = "coordinator_took_over"
    epoch: int
    previous: str
    """The coordinator it replaced (its lease's holder)."""
    generation: int
    stale_s: float
    """How long the previous coordinator's lease had not moved when this one took it."""
    adopted: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    adopt_s: float = 0.0
    """From taking the lease to the last member re-attached (or to giving up on the missing)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class HostNoticed(Event):
    """A host's agent relayed its cloud's notice (the kind is `host_notice`)."""

    KIND: ClassVar[str] = "host_notice"
    host: str
    incarnation: str
    notice: str
    deadline_at: float
    detail: str
    procs: list[str]


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentRefused(Event):
    KIND: ClassVar[str] = "agent_refused"
    peer: str
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class UnknownEvent(Event):
    """A line of a kind this version does not know: its kind and its other fields, as written."""

    event: str
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return self.event

    def to_dict(self) -> dict[str, Any]:
        return {"event": self.event, "version": self.version, "time": self.time, **self.data}


EVENT_TYPES: dict[str, type[Event]] = {cls.KIND: cls for cls in (
    JobStarted, GenerationStarted, JobFinished, JobFailed, MemberFailed, Recovered, StandbySpawned, StandbyWarm,
    StandbyLost, StandbyReleased, Coverage, StandbyTargetChanged, MoveAccepted, ControlRejected, UntrustedValue,
    ChaosInjected, ChaosUnresolved, Placed, HostJoined, HostLost, HostNoticed, AgentRefused, CoordinatorTookOver,
    BackupWritten, RestoringFromBackup, Shrunk, Grew, WidthTargetChanged, Moved,
)}
"""Every kind the coordinator writes, by its name."""

ENDINGS: tuple[type[Event], ...] = (JobFinished, JobFailed)
"""The kinds that end a job's events."""

def parse_event(raw: Any) -> Event:
    """The record of one JSON line's object; EventError when it is not one (see the module's docstring)."""
    if not isinstance(raw, dict):
        raise EventError(f"an event must be a JSON object, got {type(raw).__name__}")
    kind = raw.get("event")
    if not isinstance(kind, str):
        raise EventError(f"an event needs its kind in \"event\", got {kind!r:.40}")
    version = raw.get("version", 1)
    if not _is(version, "int"):
        raise EventError(f"{kind}: version must be an integer, got {version!r:.40}")
    at = raw.get("time", 0.0)
    if not _is(at, "float"):
        raise EventError(f"{kind}: time must be a number, got {at!r:.40}")
    cls = EVENT_TYPES.get(kind)
    if cls is None:
        data = {k: v for k, v in raw.items() if k not in ("event", "version", "time")}
        return UnknownEvent(event=kind, data=data, time=float(at), version=version)
    fields = [f for f in dataclasses.fields(cls) if f.name not in ("time", "version")]
    return cls(time=float(at), version=version, **checked_fields(fields, raw, kind, EventError))

