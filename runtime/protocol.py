"""The agent link: every message between a host's agent (`trainmover agent`) and the coordinator, in one place.

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
import hmac
import json
import os
import socket
import struct
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from runtime.auth import derive

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


@dataclass(frozen=True, slots=True)
class Welcome:
    """coordinator -> agent: admitted, with the link's timing."""

    TYPE: ClassVar[str] = "welcome"
    heartbeat_s: float
    lease_s: float
    """An agent that hears nothing from the coordinator for this long kills its processes (it is fenced)."""


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


@dataclass(frozen=True, slots=True)
class GenerationNotice:
    """coordinator -> agents: a new generation is published (every surviving agent learns it at once)."""

    TYPE: ClassVar[str] = "generation"
    gen: int
    members: list[str] = field(default_factory=list)


MESSAGES: dict[str, type] = {
    m.TYPE: m for m in (Hello, Welcome, Beat, Spawn, Started, Exited, Signal, Fence, Stop, GenerationNotice)
}
Message = Hello | Welcome | Beat | Spawn | Started | Exited | Signal | Fence | Stop | GenerationNotice

_CHECKS: dict[str, Any] = {"str": str, "int": int, "float": (int, float), "list[str]": list,
                           "dict[str, str]": dict, "Literal['kill', 'stop']": str}


def to_json(msg: Message) -> dict[str, Any]:
    body = {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}
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
    for f in dataclasses.fields(kind):
        if f.name not in raw:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ProtocolError(f"{kind.TYPE}: missing field {f.name!r}")  # type: ignore[attr-defined]
            continue
        value = raw[f.name]
        want = _CHECKS.get(str(f.type), object)
        if not isinstance(value, want) or (want is int and isinstance(value, bool)):
            raise ProtocolError(f"{kind.TYPE}: field {f.name!r} must be {f.type}, got {type(value).__name__}")  # type: ignore[attr-defined]
        if str(f.type) == "list[str]" and not all(isinstance(v, str) for v in value):
            raise ProtocolError(f"{kind.TYPE}: field {f.name!r} must hold strings")  # type: ignore[attr-defined]
        if str(f.type) == "dict[str, str]" and not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()
        ):
            raise ProtocolError(f"{kind.TYPE}: field {f.name!r} must map strings to strings")  # type: ignore[attr-defined]
        values[f.name] = value
    if kind is Signal and values.get("signal", "kill") not in ("kill", "stop"):
        raise ProtocolError("signal: must be kill or stop")
    return kind(**values)


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
        self.key: bytes | None = None
        self._out: Direction = "a2c" if side == "agent" else "c2a"
        self._in: Direction = "c2a" if side == "agent" else "a2c"
        self._sent = 0
        self._received = 0
        self._buf = bytearray()
        self.sealed_in = 0
        """Sealed frames received and verified (the agent's first one is its proof of the secret)."""
        self.last_frame: tuple[bytes, bytes] = (b"", b"")

    def check_last(self) -> bool:
        """Whether the last frame received (read before the key was known: the handshake) is sealed with it."""
        body, tag = self.last_frame
        return self.key is not None and hmac.compare_digest(tag, self._tag(self._in, self._received, body))

    def _tag(self, direction: str, seq: int, body: bytes) -> bytes:
        assert self.key is not None
        return hmac.digest(self.key, direction.encode() + struct.pack(">Q", seq) + body, "sha256")

    def encode(self, msg: Message, prefix: dict[str, Any] | None = None) -> bytes:
        """A frame; sealed once the session key is known."""
        self._sent += 1
        obj = {**to_json(msg), "n": self._sent, **(prefix or {})}
        body = json.dumps(obj, separators=(",", ":")).encode()
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

