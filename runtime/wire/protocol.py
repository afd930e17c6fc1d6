"""Every message of a job, in one place: the agent link (agent <-> coordinator) first, then the store records
(processes <-> coordinator <-> orchestrator) at the end of this module.

The agent link, between a host's agent (`trainmover agent`) and the coordinator:

One TCP connection per agent, opened by the agent to the coordinator's agent port. Frames are a 4-byte
big-endian length and a JSON object ``{"v": 1, "t": TYPE, "n": SEQ, ...fields}`` followed by a 32-byte
HMAC-SHA256 tag. The handshake:

1. agent -> coordinator: `Hello` (unsealed; it carries the agent's nonce).
2. coordinator -> agent: `Welcome`, sealed with the session key ``HMAC(derive(secret, "agent-link"),
   agent_nonce || coordinator_nonce)``, and the coordinator's nonce in the frame's clear prefix. An agent
   that cannot verify it talks to an impostor and hangs up: it never starts a process for one.
3. From there every frame both ways is sealed with the session key, its direction and its sequence number
   (each side's count, +1 per frame): a frame replayed, reordered, forged or from another session is refused
   and the connection is closed. The first sealed frame from the agent is its proof of the job's secret; a
   host is admitted only then.

The link is authenticated, not encrypted: it carries no secret (the agent holds the job's secret itself and
hands it to the processes it starts) and nothing of the training state.

Each message type is a frozen dataclass with a `TYPE`; `decode` checks every field's type, so a peer that
speaks another version or sends a malformed frame gets one clear refusal, never a crash deep in the loop.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
import socket
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from runtime.wire.auth import derive

VERSION = 1
TAG_BYTES = 32
MAX_FRAME = 1 << 20
"""Largest frame either side accepts (a spawn order with a long environment is a few KB)."""

Direction = Literal["a2c", "c2a"]


class ProtocolError(Exception):
    """A frame that is malformed, of another version, out of sequence or not sealed with the job's secret."""


@dataclass(frozen=True, slots=True)
class Hello:
    """agent -> coordinator, first frame, unsealed."""

    TYPE: ClassVar[str] = "hello"
    job_id: str
    host: str
    """The host's name (its hostname by default); with `incarnation`, the host's identity in the job."""
    incarnation: str
    """New at every start and after every self-fencing: a host that comes back is a new host."""
    slots: int
    """Processes this host runs at once (its GPUs)."""
    address: str
    """Where this host's processes listen for their peers (Gloo, TLS handoffs)."""
    pid: int
    nonce: str
    role: str = "any"
    """What this host may run: "worker", "standby" or "any" (`trainmover agent --role`)."""
    children: list[str] = field(default_factory=list)
    """When it re-attaches to a coordinator that took the job over (`CoordinatorLease`): each process it still runs,
    as "NAME ROLE SLOT PID", and each one that exited while no coordinator ran, as "NAME ROLE SLOT PID CODE AT" (its
    exit status and wall-clock moment); empty on a first join."""


HOST_ROLES = ("any", "worker", "standby")


@dataclass(frozen=True, slots=True)
class Welcome:
    """coordinator -> agent: admitted, with the link's timing."""

    TYPE: ClassVar[str] = "welcome"
    heartbeat_s: float
    lease_s: float
    """An agent that hears nothing from the coordinator for this long kills its processes (it is fenced)."""
    job_id: str = ""
    """The job this coordinator runs: an agent started without --job-id serves this one from then on."""
    store: str = ""
    """The job's store ("HOST:PORT", as processes reach it) when it lives apart from the coordinator (`trainmover
    store`): the agent then keeps its processes through a coordinator's loss while the store says no coordinator
    holds the job (runtime.control.lease). Empty: the store dies with the coordinator, and so does the job."""
    epoch: int = 0
    """The coordinator's lease epoch (runtime.control.lease): a later coordinator of the job has a larger one."""


@dataclass(frozen=True, slots=True)
class Beat:
    """Either way: a sign of life. The coordinator's beats renew the agents' leases."""

    TYPE: ClassVar[str] = "beat"


@dataclass(frozen=True, slots=True)
class Spawn:
    """coordinator -> agent: start a training process in a slot."""

    TYPE: ClassVar[str] = "spawn"
    proc: str
    role: str
    slot: int
    argv: list[str]
    """The script and its arguments (the script is at this path on every host: the image contract)."""
    env: dict[str, str]
    """Launch variables (runtime.config) without the job's secret, which the agent adds itself."""
    output: bool = False
    """Send the process's stdout and stderr to the coordinator (`Output` frames) for its rank logs."""


@dataclass(frozen=True, slots=True)
class Output:
    """agent -> coordinator: what one of its processes wrote to stdout or stderr (UTF-8; invalid bytes replaced)."""

    TYPE: ClassVar[str] = "output"
    proc: str
    text: str


@dataclass(frozen=True, slots=True)
class ProcBeats:
    """agent -> coordinator, in place of its beat while it runs processes: how long ago each of them last beat, as
    the process told the agent itself (a Unix socket in a private directory, not the job's store). A heartbeat
    missing from the store (deleted or overwritten by someone who reached it) is no sign of a hang while its agent
    still sees beats."""

    TYPE: ClassVar[str] = "proc_beats"
    ages: dict[str, float]


OUTPUT_CHUNK = 32768
"""Bytes of a process's output read (and sent) at a time."""


@dataclass(frozen=True, slots=True)
class Started:
    """agent -> coordinator: a process started (or could not: pid -1 and why)."""

    TYPE: ClassVar[str] = "started"
    proc: str
    pid: int
    error: str = ""


@dataclass(frozen=True, slots=True)
class Exited:
    """agent -> coordinator: a process exited, as its pidfd told at `at` (wall clock)."""

    TYPE: ClassVar[str] = "exited"
    proc: str
    pid: int
    code: int
    at: float


@dataclass(frozen=True, slots=True)
class Signal:
    """coordinator -> agent: send a signal to one process ("kill" fences it; "stop" is the chaos monkey's hang)."""

    TYPE: ClassVar[str] = "signal"
    proc: str
    signal: Literal["kill", "stop"] = "kill"


@dataclass(frozen=True, slots=True)
class Fence:
    """coordinator -> agent: this host is out of the job; kill every process, then leave or come back as new."""

    TYPE: ClassVar[str] = "fence"
    reason: str


@dataclass(frozen=True, slots=True)
class Stop:
    """coordinator -> agent: the job is over; kill what is left and exit."""

    TYPE: ClassVar[str] = "stop"
    exit_code: int = 0


NOTICE_KINDS = ("spot_interruption", "rebalance_recommendation", "scheduled_maintenance", "predicted_host_failure",
                "eviction")
"""What a host's cloud may announce (cloud.base.NoticeKind, which runtime/ does not import)."""


@dataclass(frozen=True, slots=True)
class HostNotice:
    """agent -> coordinator: this host's cloud announced it will go away or be disturbed (the agent's own metadata
    watcher: EC2 instance metadata, Azure Scheduled Events); the coordinator moves its ranks to standbys before."""

    TYPE: ClassVar[str] = "host_notice"
    kind: str
    deadline_at: float = 0.0
    """Epoch seconds when the cloud acts; 0 when it did not say."""
    detail: str = ""


@dataclass(frozen=True, slots=True)
class GenerationNotice:
    """coordinator -> agents: a new generation is published (every surviving agent learns it at once)."""

    TYPE: ClassVar[str] = "generation"
    gen: int
    members: list[str] = field(default_factory=list)


MESSAGES: dict[str, type] = {
    m.TYPE: m for m in (Hello, Welcome, Beat, Spawn, Started, Exited, Signal, Fence, Stop, GenerationNotice, HostNotice,
                        Output, ProcBeats)
}
Message = (Hello | Welcome | Beat | Spawn | Started | Exited | Signal | Fence | Stop | GenerationNotice | HostNotice
           | Output | ProcBeats)

_CHECKS: dict[str, Any] = {"str": str, "int": int, "float": (int, float), "bool": bool, "list[str]": list,
                           "dict[str, str]": dict, "dict[str, float]": dict, "Literal['kill', 'stop']": str}


@dataclass(frozen=True, slots=True)
class _FieldSpec:
    """One field of a message type, as `decode` checks it (computed once per type, not per frame)."""

    name: str
    required: bool
    type_name: str
    want: Any


_SPECS: dict[type, tuple[_FieldSpec, ...]] = {}


def _specs(kind: type) -> tuple[_FieldSpec, ...]:
    specs = _SPECS.get(kind)
    if specs is None:
        specs = _SPECS[kind] = tuple(
            _FieldSpec(f.name, f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
                       str(f.type), _CHECKS.get(str(f.type), object))
            for f in dataclasses.fields(kind))
    return specs


def to_json(msg: Message) -> dict[str, Any]:
    body = {f.name: getattr(msg, f.name) for f in _specs(type(msg))}
    return {"v": VERSION, "t": msg.TYPE, **body}


def decode(raw: dict[str, Any]) -> Message:
    """The typed message in a frame's JSON, or ProtocolError saying what is wrong with it."""
    if raw.get("v") != VERSION:
        raise ProtocolError(f"protocol version {raw.get('v')!r}, this side speaks {VERSION}: run the same "
                            "trainmover version on every host and the coordinator")
    kind = MESSAGES.get(raw.get("t"))  # type: ignore[arg-type]
    if kind is None:
        raise ProtocolError(f"unknown message type {raw.get('t')!r}")
    values = {}
    for f in _specs(kind):
        if f.name not in raw:
            if f.required:
                raise ProtocolError(f"{kind.TYPE}: missing field {f.name!r}")  # type: ignore[attr-defined]
            continue
        value = raw[f.name]
        if not isinstance(value, f.want) or (f.want is int and isinstance(value, bool)):
            raise ProtocolError(f"{kind.TYPE}: field {f.name!r} must be {f.type_name}, got {type(value).__name__}")  # type: ignore[attr-defined]
        if f.type_name == "list[str]" and not all(isinstance(v, str) for v in value):
            raise ProtocolError(f"{kind.TYPE}: field {f.name!r} must hold strings")  # type: ignore[attr-defined]
        if f.type_name == "dict[str, float]" and not all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) for k, v in value.items()
        ):
            raise ProtocolError(f"{kind.TYPE}: field {f.name!r} must map strings to numbers")  # type: ignore[attr-defined]
        if f.type_name == "dict[str, str]" and not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()
        ):
            raise ProtocolError(f"{kind.TYPE}: field {f.name!r} must map strings to strings")  # type: ignore[attr-defined]
        values[f.name] = value
    if kind is Signal and values.get("signal", "kill") not in ("kill", "stop"):
        raise ProtocolError("signal: must be kill or stop")
    if kind is Hello and values.get("role", "any") not in HOST_ROLES:
        raise ProtocolError(f"hello: role must be one of {', '.join(HOST_ROLES)}")
    if kind is HostNotice and values.get("kind") not in NOTICE_KINDS:
        raise ProtocolError(f"host_notice: kind must be one of {', '.join(NOTICE_KINDS)}")
    return kind(**values)


_COMPACT = json.JSONEncoder(separators=(",", ":"))
"""One encoder for every frame (`json.dumps` with options builds a new one per call)."""


def new_nonce() -> str:
    return os.urandom(16).hex()


def session_key(token: str, agent_nonce: str, coordinator_nonce: str) -> bytes:
    return hmac.digest(derive(token, "agent-link"), f"{agent_nonce}|{coordinator_nonce}".encode(), "sha256")


class Link:
    """One end of an agent link over a connected socket: framing, sealing and sequence numbers.

    `send` may be called from one thread and `feed`/`messages` from another only if the caller serialises
    each side; the coordinator and the agent both drive a link from one loop.
    """

    def __init__(self, sock: socket.socket, side: Literal["agent", "coordinator"]) -> None:
        self.sock = sock
        self.side = side
        self._key: bytes | None = None
        self._mac: Any = None
        """HMAC-SHA256 keyed with the session key, copied per frame (keying it each time cost a third more)."""
        self._out: Direction = "a2c" if side == "agent" else "c2a"
        self._in: Direction = "c2a" if side == "agent" else "a2c"
        self._sent = 0
        self._received = 0
        self._buf = bytearray()
        self.sealed_in = 0
        """Sealed frames received and verified (the agent's first one is its proof of the secret)."""
        self.last_frame: tuple[bytes, bytes] = (b"", b"")

    @property
    def key(self) -> bytes | None:
        """The session key (None during the handshake: frames go unsealed)."""
        return self._key

    @key.setter
    def key(self, value: bytes | None) -> None:
        self._key = value
        self._mac = hmac.new(value, digestmod=hashlib.sha256) if value is not None else None

    def check_last(self) -> bool:
        """Whether the last frame received (read before the key was known: the handshake) is sealed with it."""
        body, tag = self.last_frame
        return self.key is not None and hmac.compare_digest(tag, self._tag(self._in, self._received, body))

    def _tag(self, direction: str, seq: int, body: bytes) -> bytes:
        assert self._mac is not None
        mac = self._mac.copy()
        mac.update(direction.encode() + struct.pack(">Q", seq))
        mac.update(body)
        return bytes(mac.digest())

    def encode(self, msg: Message, prefix: dict[str, Any] | None = None) -> bytes:
        """A frame; sealed once the session key is known."""
        self._sent += 1
        obj = {**to_json(msg), "n": self._sent, **(prefix or {})}
        body = _COMPACT.encode(obj).encode()
        tag = self._tag(self._out, self._sent, body) if self.key is not None else b"\0" * TAG_BYTES
        return struct.pack(">I", len(body)) + body + tag

    def send(self, msg: Message, prefix: dict[str, Any] | None = None) -> None:
        self.sock.sendall(self.encode(msg, prefix))

    def feed(self, data: bytes) -> list[tuple[Message, dict[str, Any]]]:
        """Take received bytes; return the complete messages (each with its raw JSON), verified in order."""
        self._buf += data
        out = []
        while (got := self._next()) is not None:
            out.append(got)
        return out

    def push(self, data: bytes) -> None:
        self._buf += data

    def next_message(self) -> tuple[Message, dict[str, Any]] | None:
        return self._next()

    def _next(self) -> tuple[Message, dict[str, Any]] | None:
        """The next complete frame in the buffer, verified with the key known now; None if incomplete."""
        if len(self._buf) < 4:
            return None
        (size,) = struct.unpack(">I", self._buf[:4])
        if size > MAX_FRAME:
            raise ProtocolError(f"a frame of {size} bytes (the limit is {MAX_FRAME})")
        if len(self._buf) < 4 + size + TAG_BYTES:
            return None
        body = bytes(self._buf[4:4 + size])
        tag = bytes(self._buf[4 + size:4 + size + TAG_BYTES])
        del self._buf[:4 + size + TAG_BYTES]
        try:
            raw = json.loads(body)
        except ValueError:
            raise ProtocolError("a frame that is not JSON") from None
        if not isinstance(raw, dict):
            raise ProtocolError("a frame that is not a JSON object")
        self._received += 1
        self.last_frame = (body, tag)
        if raw.get("n") != self._received:
            raise ProtocolError(f"frame {raw.get('n')!r} out of sequence (expected {self._received})")
        if self.key is not None:
            if not hmac.compare_digest(tag, self._tag(self._in, self._received, body)):
                raise ProtocolError("a frame not sealed with the job's secret (or from another session)")
            self.sealed_in += 1
        return decode(raw), raw

    def recv(self, timeout_s: float) -> tuple[Message, dict[str, Any]]:
        """Block for the next message (the handshake: one frame only, the rest stays buffered for the key);
        ProtocolError on a closed link or at the timeout."""
        self.sock.settimeout(timeout_s)
        try:
            while True:
                got = self._next()
                if got is not None:
                    return got
                data = self.sock.recv(65536)
                if not data:
                    raise ProtocolError("the other side closed the link")
                self._buf += data
        except TimeoutError:
            raise ProtocolError(f"no answer within {timeout_s:.0f} s") from None
        finally:
            self.sock.settimeout(None)



# =================================================================================================================
# Store records: every value written to the job's store, typed and versioned.
#
# The agent link above carries the hosts' orders; everything else the job's processes, its coordinator and an
# orchestrator say to each other is a record in the job's `TCPStore`, under a key named in `runtime.wire.store` and
# sealed with the job's secret by `runtime.wire.store.Records`. Each record below is a frozen dataclass: `to_json()`
# is its JSON value, ``{"v": RECORD_VERSION, ...fields}``; `from_json()` checks the version and every field's
# type and raises `RecordError` saying what is wrong. A reader that gets a sealed value it cannot decode (a peer
# of another version) refuses it the way it refuses an unsealed one (`Records.get_record`: ignored, counted,
# warned about once), never crashes on it.
#
# Version 1 was the plain JSON objects of before (the same field names, no "v"); a record without "v" is read as
# version 1, so what a writer of the version before wrote is still read.
# Three records are bare JSON numbers (`BARE`), because thousands of them are read per second (heartbeats) or
# older readers take them as plain integers (`Records.get_int`).
#
#   record            key                                   writer                  readers
#   JobConfig         job/config                            coordinator             every process, JobControl
#   Generation        gen/<g>/record                        coordinator             members
#   CurrentGeneration gen/current                           coordinator             every process
#   Assignment        proc/<name>/assign                    coordinator             that standby
#   StopOrder         job/stop                              coordinator             every process
#   JobOver           job/over                              coordinator             JobControl
#   ChaosDone         chaos/done                            coordinator             test scripts
#   MoveResult        control/move_result                   coordinator             JobControl
#   ControlCommand    control/standby_target, control/move  JobControl              coordinator
#   MoveRequest       (the `request` of a move command)     JobControl              coordinator
#   ProcessHello      proc/<name>/hello                     every process           coordinator
#   Heartbeat         proc/<name>/heartbeat                 heartbeat thread        coordinator
#   Progress          progress/step                         heartbeat thread        JobControl
#   FatalError        proc/<name>/fatal                     excepthook              coordinator
#   FaultFired        fault/<i>/fired                       injected fault          coordinator
#   ModelSpec         proc/<name>/spec, job/spec            every process           every process
#   StandbyReady      proc/<name>/ready                     standby                 coordinator
#   Joined            gen/<g>/joined/<rank>                 member                  members
#   StepStatus        gen/<g>/status/<rank>                 member                  members
#   HoldsState        gen/<g>/holds/<rank>                  member                  coordinator
#   FailureReport     gen/<g>/failed/<name>                 member                  coordinator
#   RecoveryReport    gen/<g>/report/<rank>                 member                  coordinator
#   Finished          gen/<g>/done/<rank>                   member                  members, coordinator
#   FinalDigest       proc/<name>/digest                    member                  coordinator
#   TlsAddress        gen/<g>/tls/<rank>                    handoff source (TLS)    that handoff's receivers
#   HotClaim          hot/slot/<i> (compare_set)            hot standby             the member serving slot i
#   HotHeld           proc/<name>/hot_held                  hot standby             coordinator
#
# Plain counters kept with `add` (fault claims, failure counts, the control sequence dispenser) are not records:
# none of them is believed without a sealed record.
# =================================================================================================================

RECORD_VERSION = 2
READABLE_VERSIONS = (1, 2)


class RecordError(ValueError):
    """A store value that is not the record its key holds: another version, a missing field, a wrong type."""


def _is(value: Any, kind: str) -> bool:
    """Whether a JSON value fits a field's annotation (as written in the source: annotations are strings here)."""
    if kind.endswith(" | None"):
        return value is None or _is(value, kind[: -len(" | None")])
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "float":
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind == "str":
        return isinstance(value, str)
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "list[float]":
        return isinstance(value, list) and all(_is(v, "float") for v in value)
    if kind in ("tuple[str, ...]", "list[str]"):
        return isinstance(value, list | tuple) and all(isinstance(v, str) for v in value)
    if kind == "tuple[int, ...]":
        return isinstance(value, list | tuple) and all(_is(v, "int") for v in value)
    if kind.startswith("tuple[tuple[") and kind.endswith("], ...]"):  # rows of fixed types
        parts = _row_types(kind)
        return isinstance(value, list | tuple) and all(
            isinstance(v, list | tuple) and len(v) == len(parts)
            and all(_is(x, t) for x, t in zip(v, parts, strict=True)) for v in value)
    if kind == "list[Any]":
        return isinstance(value, list)
    if kind == "list[int]":
        return isinstance(value, list) and all(_is(v, "int") for v in value)
    if kind == "list[list[int]]":
        return isinstance(value, list) and all(_is(v, "list[int]") for v in value)
    if kind == "list[dict[str, Any]]":
        return isinstance(value, list) and all(isinstance(v, dict) for v in value)
    if kind == "dict[str, Any]":
        return isinstance(value, dict) and all(isinstance(k, str) for k in value)
    if kind in ("dict[str, str]", "dict[str, int]"):
        return isinstance(value, dict) and all(isinstance(k, str) and _is(v, kind[10:-1]) for k, v in value.items())
    if kind.startswith("Literal["):
        return value in [part.strip().strip("'\"") for part in kind[len("Literal["):-1].split(",")]
    raise TypeError(f"no check for field type {kind}")  # a record declared with a type this module cannot check


def _convert(value: Any, kind: str) -> Any:
    """The field's value in its Python form (JSON lists become tuples, integers in float fields floats)."""
    if value is None:
        return None
    kind = kind.removesuffix(" | None")
    if kind == "float":
        return float(value)
    if kind == "list[float]":
        return [float(v) for v in value]
    if kind in ("tuple[str, ...]", "tuple[int, ...]"):
        return tuple(value)
    if kind.startswith("tuple[tuple[") and kind.endswith("], ...]"):
        parts = _row_types(kind)
        return tuple(tuple(_convert(x, t) for x, t in zip(v, parts, strict=True)) for v in value)
    return value


def _row_types(kind: str) -> list[str]:
    """The column types of a "tuple[tuple[A, B, ...], ...]" annotation."""
    return [t.strip() for t in kind[len("tuple[tuple["):-len("], ...]")].split(",")]


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


class StoreRecord:
    """Base of the store records: JSON with a version, decoded with every field checked."""

    __slots__ = ()
    BARE: ClassVar[bool] = False
    """The record is its single field's bare JSON value (no object, no version)."""

    def to_json(self) -> Any:
        fields = dataclasses.fields(self)  # type: ignore[arg-type]
        if self.BARE:
            return _plain(getattr(self, fields[0].name))
        return {"v": RECORD_VERSION, **{f.name: _plain(getattr(self, f.name)) for f in fields}}

    @classmethod
    def from_json(cls, raw: Any) -> Any:
        """The record in `raw` (a JSON value as read from the store), or RecordError saying what is wrong."""
        name = cls.__name__
        fields = dataclasses.fields(cls)  # type: ignore[arg-type]
        if cls.BARE:
            (f,) = fields
            if not _is(raw, str(f.type)):
                raise RecordError(f"{name}: must be a bare {f.type}, got {type(raw).__name__}")
            return cls(_convert(raw, str(f.type)))  # type: ignore[call-arg]
        if not isinstance(raw, dict):
            raise RecordError(f"{name}: must be a JSON object, got {type(raw).__name__}")
        version = raw.get("v", 1)
        if version not in READABLE_VERSIONS:
            raise RecordError(f"{name}: record version {version!r}, this side reads {list(READABLE_VERSIONS)}: run "
                              "the same trainmover version in every process of the job")
        return cls(**checked_fields(fields, raw, name))


def checked_fields(fields: Iterable[dataclasses.Field[Any]], raw: dict[str, Any], name: str,
                   error: type[Exception] = RecordError) -> dict[str, Any]:
    """The values of a record's `fields` in the JSON object `raw`, each checked against its annotation and in its
    Python form; a field with a default may be missing. Raises `error` naming the record (`name`) and the field."""
    values = {}
    for f in fields:
        if f.name not in raw:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise error(f"{name}: missing field {f.name!r}")
            continue
        value = raw[f.name]
        if not _is(value, str(f.type)):
            raise error(f"{name}: field {f.name!r} must be {f.type}, got {value!r:.40}")
        values[f.name] = _convert(value, str(f.type))
    return values


# -- coordinator -> processes --------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class JobConfig(StoreRecord):
    """The job as the coordinator started it (written first: a client that finds it knows a job runs there)."""

    nproc: int
    """Number of workers (logical ranks)."""
    job_id: str


@dataclass(frozen=True, slots=True)
class Generation(StoreRecord):
    """One membership of the job: which process holds each logical rank. Every membership change makes a new
    generation; its process groups are built from a `PrefixStore` named after it, so survivors build new groups
    in-process without clashing with the old ones (runtime.control.membership tells the story)."""

    gen: int
    """Generation number, 0 at start, +1 at every change."""
    members: tuple[str, ...]
    """Process name holding each logical rank (index = rank)."""
    reason: str = "start"
    """Why this generation exists, in words."""
    replaced: tuple[tuple[int, str, str], ...] = field(default_factory=tuple)
    """(rank, old process, new process) for every rank that changed hands (ranks of this generation)."""
    logical: int = 0
    """The job's data-parallel width in logical ranks; 0: one per member. With fewer members than logical ranks the
    job runs shrunk: member i covers logical ranks i, i + world_size, ... (runtime.training.elastic)."""
    planned: bool = False
    """The members switch to this generation at a step boundary they agree on (a grow, a requested shrink), instead
    of abandoning the step in flight as after a failure."""
    released: tuple[str, ...] = ()
    """Live members of the previous generation left out of this one (the rest of a sharded job's replica group
    whose other member was lost): they exit cleanly instead of as fenced members."""

    @property
    def world_size(self) -> int:
        return len(self.members)

    @property
    def logical_width(self) -> int:
        """The logical ranks the job's data is split into (its full width)."""
        return self.logical or len(self.members)

    def rank_of(self, proc: str) -> int | None:
        return self.members.index(proc) if proc in self.members else None

    def replace(self, rank_to_proc: dict[int, str], reason: str) -> Generation:
        return self.change(reason, assign=rank_to_proc)

    def change(self, reason: str, *, assign: Mapping[int, str] | None = None, drop: Iterable[int] = (),
               add: Sequence[str] = (), planned: bool = False, released: Iterable[int] = ()) -> Generation:
        """The next generation: the ranks in `assign` given to new processes, the ranks in `drop` left out (the
        survivors keep their order, so their ranks shift down), the processes in `add` appended as new ranks;
        `released`: those of `drop` whose processes are alive and leave (`Generation.released`).
        Its logical width is this one's (written 0 at full width); no member, or more members than logical ranks, is a
        ValueError."""
        assign = dict(assign or {})
        dropped = set(drop)
        members: list[str] = []
        replaced = []
        for rank, proc in enumerate(self.members):
            if rank in dropped:
                continue
            if rank in assign:
                replaced.append((len(members), proc, assign[rank]))
                proc = assign[rank]
            members.append(proc)
        members += add
        width = self.logical_width
        if not 1 <= len(members) <= width:
            raise ValueError(f"a generation of {len(members)} members for a job of {width} logical ranks")
        return Generation(self.gen + 1, tuple(members), reason, tuple(replaced),
                          logical=0 if len(members) == width else width, planned=planned,
                          released=tuple(self.members[r] for r in sorted(set(released))))


@dataclass(frozen=True, slots=True)
class SwitchPoint(StoreRecord):
    """The step after which every member switches to a planned generation (`Generation.planned`)."""

    step: int


@dataclass(frozen=True, slots=True)
class CurrentGeneration(StoreRecord):
    """The newest generation's number (bare: every process's heartbeat thread reads it as an integer)."""

    BARE: ClassVar[bool] = True
    gen: int


@dataclass(frozen=True, slots=True)
class Assignment(StoreRecord):
    """A standby's promotion: the generation it joins, or -1 when the job ends without needing it."""

    gen: int


@dataclass(frozen=True, slots=True)
class StopOrder(StoreRecord):
    """Every process leaves (the job ended, failed or was interrupted)."""

    reason: str = ""


@dataclass(frozen=True, slots=True)
class JobOver(StoreRecord):
    """Written as the coordinator ends the job, before its store closes: clients stop using the store."""

    exit_code: int


@dataclass(frozen=True, slots=True)
class CoordinatorLease(StoreRecord):
    """Who coordinates the job (runtime.control.lease): written and renewed with compare_set only, so that exactly one
    coordinator holds each epoch and a coordinator that lost it finds out at its next renewal."""

    epoch: int
    """1 for the first coordinator, +1 at every takeover."""
    holder: str
    """The holding coordinator, as "HOSTNAME/PID/NONCE" (for messages only)."""
    count: int
    """+1 at every renewal: a count that stops moving for the agents' lease is a coordinator gone."""
    agents: str
    """Where its agents connect ("HOST:PORT"): an agent that lost its coordinator re-attaches there."""
    renewed_at: float = 0.0
    """When (wall clock, the holder's) it was last renewed: a coordinator that takes over need not watch a lease
    that has been stale for longer than it has been watching (clocks agree to well under the staleness, by NTP)."""


@dataclass(frozen=True, slots=True)
class RecoveryOpened(StoreRecord):
    """The deaths a generation answers (written before the generation is published), so that a coordinator that
    takes over mid-recovery still reports the recovery it did not start."""

    deaths: tuple[tuple[int, str, int, str, float, float], ...]
    """(rank, process, pid, cause, failure_at, declared_at) of each death."""
    declared_at: float


@dataclass(frozen=True, slots=True)
class ChaosDone(StoreRecord):
    """The chaos monkey injected its last fault (runtime.control.chaos)."""

    injected: int


# -- orchestrator <-> coordinator (runtime.wire.control) ----------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ControlCommand(StoreRecord):
    """A command from an orchestrator: its sequence number (only grows: an older one is a replay) and its request
    (for the standby target an integer as text, for a move a `MoveRequest`'s JSON), parsed by runtime.wire.control."""

    seq: int
    request: str


@dataclass(frozen=True, slots=True)
class MoveRequest:
    """Move these worker ranks to standbys, on purpose (spot notice, maintenance, rebalancing): the `request` of a
    move `ControlCommand`, parsed and checked by `runtime.wire.control.parse_move`."""

    seq: int
    """Sequence number: a request is new when its seq is larger than the last one the coordinator handled."""
    ranks: tuple[int, ...]
    """Logical ranks whose current processes leave."""
    reason: str
    """Why; in the `moved` event (a data-parallel job, moved at a step boundary), or as the cause
    `planned_move:<reason>` in `member_failed` and `recovered` (a sharded job's move takes the failure path)."""

    def to_json(self) -> str:
        return json.dumps({"seq": self.seq, "ranks": list(self.ranks), "reason": self.reason})


@dataclass(frozen=True, slots=True)
class ResizeRequest:
    """Run the job at `width` members (1 up to its logical width): shrink to free capacity, grow back onto standbys
    (the `request` of a resize `ControlCommand`, parsed by `runtime.wire.control.parse_resize`)."""

    seq: int
    width: int
    reason: str

    def to_json(self) -> str:
        return json.dumps({"seq": self.seq, "width": self.width, "reason": self.reason})


@dataclass(frozen=True, slots=True)
class MoveResult(StoreRecord):
    """The coordinator's answer to the latest move request (and, under its own key, to the latest resize)."""

    seq: int
    accepted: bool
    reason: str
    """Empty when accepted; otherwise why the move was refused (e.g. "no standby ready")."""


# -- processes -> coordinator --------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ProcessHello(StoreRecord):
    """A process joined the job; the seal is its proof of membership, the pid ties it to what the pool started."""

    pid: int
    role: str


@dataclass(frozen=True, slots=True)
class Heartbeat(StoreRecord):
    """A count that only grows (bare: the coordinator reads thousands per tick); an older one is no sign of life."""

    BARE: ClassVar[bool] = True
    count: int


@dataclass(frozen=True, slots=True)
class Progress(StoreRecord):
    """The last step committed, as the members' heartbeat threads publish it (bare)."""

    BARE: ClassVar[bool] = True
    step: int


@dataclass(frozen=True, slots=True)
class FatalError(StoreRecord):
    """The script itself raised: stop the job instead of promoting a standby that would fail the same way."""

    message: str


@dataclass(frozen=True, slots=True)
class FaultFired(StoreRecord):
    """An injected fault fired (runtime.faults): when, where, and what it does."""

    time: float
    proc: str
    action: str
    pid: int = -1
    rank: int | None = None
    step: int | None = None
    phase: str = ""


@dataclass(frozen=True, slots=True)
class StateHomes(StoreRecord):
    """A sharded job's copies of each rank's state: `homes[r]` lists the other ranks that hold rank r's state
    (its replica peers, or the keeper of its buddy copy). The coordinator promotes a standby for rank r on a host
    where none of them lives, where it can (a host lost later must not take both homes of a shard)."""

    homes: list[list[int]]
    replica_size: int = 0
    """Ranks per replica group when the job can run with fewer replica groups (HSDP or DP x TP with more than one,
    no buddy copies): it shrinks and grows by whole groups of this many ranks. 0: it runs at its full width only."""


@dataclass(frozen=True, slots=True)
class ModelSpec(StoreRecord):
    """What a process built (runtime.training.state's spec: tensor names, shapes, dtypes, param groups, registered
    state)."""

    spec: list[Any]


@dataclass(frozen=True, slots=True)
class StandbyReady(StoreRecord):
    """A standby finished its warm-up step and may be promoted."""

    warmup_s: float


@dataclass(frozen=True, slots=True)
class HotClaim(StoreRecord):
    """A standby mirrors the job's state through a hot slot (runtime.training.hot): who, and where its source
    connects."""

    proc: str
    host: str
    port: int


@dataclass(frozen=True, slots=True)
class HotHeld(StoreRecord):
    """The newest step whose whole state a hot standby holds (the coordinator promotes the most current first)."""

    step: int


@dataclass(frozen=True, slots=True)
class Joined(StoreRecord):
    """A member entered generation g's rendezvous. A sharded member says which mesh groups it holds
    (`runtime.training.groups`): the generation that built each, and the collectives issued on it (-1: cut)."""

    built: dict[str, int] = field(default_factory=dict)
    issued: dict[str, int] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    """Each group's number of ranks (a group kept into a generation of another shape must still have them all)."""


@dataclass(frozen=True, slots=True)
class StepStatus(StoreRecord):
    """A member's last committed step in generation g and whether it holds the training state."""

    step: int
    has_state: bool
    pending: bool = False
    """A sharded member only: its gradients of step `step + 1` were complete when its group failed, so it can
    still commit that step if any member did (`runtime.training.sharded`)."""
    own: tuple[int, ...] = ()
    """Steps of this member's own complete buddy-copy snapshots (`runtime.training.buddy`)."""
    copies: tuple[int, ...] = ()
    """Steps of the complete copies it keeps of its buddy's state."""
    mirrored: bool = False
    """A hot standby promoted into this generation: its state came from a mirror (runtime.training.hot). Behind the
    newest step it is sent the state as a new member is, and does not keep its own meanwhile."""


@dataclass(frozen=True, slots=True)
class HoldsState(StoreRecord):
    """A member holds the complete training state of generation g (after its handoff), as of `step`."""

    step: int


@dataclass(frozen=True, slots=True)
class BackupRecord(StoreRecord):
    """A persistent backup rank 0 finished writing (runtime.training.backup): complete on disk, as of `step`."""

    step: int
    path: str
    bytes: int
    stage_s: float
    """What the training thread spent staging the copy."""
    write_s: float
    """From the staging to the backup's folder renamed complete, in the writer's thread."""


@dataclass(frozen=True, slots=True)
class FailureReport(StoreRecord):
    """A member saw a collective (or a handoff) of generation g fail."""

    message: str
    time: float
    step: int
    """The member's last committed step."""
    kind: Literal["comm", "state_lost"] = "comm"
    """`state_lost`: no surviving copy of the state is intact; the coordinator stops the job."""
    untrusted_rank: int | None = None
    """A peer that failed to prove it belongs to the job during a handoff (the coordinator fences it)."""


@dataclass(frozen=True, slots=True)
class RecoveryReport(StoreRecord):
    """A member's figures of a recovery: published once the replayed step committed, and again (`final`) after
    the steps that follow it (runtime.control.decisions.recovery_metrics turns them into the `recovered` event)."""

    rank: int
    role: str
    """The member's part in the handoff: "source", "receiver" or "idle"."""
    group_ready_at: float
    handoff_s: float
    """Until the member could train on: the whole handoff, or its first phase when the optimizer's state streamed
    beside the replayed step (`handoff_rest_s`)."""
    handoff_bytes: int
    handoff_end_at: float
    replay_step: int
    proc: str = ""
    handoff_rest_s: float = 0.0
    """The optimizer's state, streamed beside the replayed step's passes (runtime.training.handoff, overlap)."""
    failure_seen_at: float | None = None
    gen_seen_at: float | None = None
    refetched_chunks: int = 0
    steady_step_s: float | None = None
    teardown_s: float = 0.0
    joined_at: float | None = None
    join_wait_s: float = 0.0
    group_init_s: float = 0.0
    group_build_s: float = 0.0
    """Of `group_init_s`: building the groups (the rest: the members' proofs over them)."""
    groups_rebuilt: int = 0
    """Process groups this recovery rebuilt in the whole job (a sharded job keeps the ones no loss touched)."""
    groups_total: int = 0
    groups_for_new_members: int = 0
    """Of `groups_rebuilt`, those a member did not hold (a standby's): what the loss itself forces; the rest were cut
    while draining, or their members had issued different numbers of collectives (which depends on the moment)."""
    replay_done_at: float | None = None
    replay_step_s: float | None = None
    post_steps_s: list[float] = field(default_factory=list)
    final: bool = False


@dataclass(frozen=True, slots=True)
class Finished(StoreRecord):
    """A member committed the last step of generation g."""

    step: int


@dataclass(frozen=True, slots=True)
class FinalDigest(StoreRecord):
    """A member's digest of its final training state (every replica's must agree)."""

    digest: str


@dataclass(frozen=True, slots=True)
class TlsAddress(StoreRecord):
    """Where a handoff source listens for its receivers' TLS links (runtime.training.tls_transport)."""

    host: str
    port: int


RECORDS: tuple[type[StoreRecord], ...] = (
    JobConfig, Generation, CurrentGeneration, Assignment, StopOrder, JobOver, ChaosDone, ControlCommand,
    MoveResult, ProcessHello, Heartbeat, Progress, FatalError, FaultFired, ModelSpec, StandbyReady, Joined,
    StepStatus, HoldsState, FailureReport, RecoveryReport, Finished, FinalDigest, TlsAddress, HotClaim, HotHeld,
)
