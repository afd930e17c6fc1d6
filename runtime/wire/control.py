"""The control channel: how an orchestrator steers a running job through the job's store.

An orchestrator (a Prefect flow, another process) connects to the coordinator's `TCPStore` as a client and
writes control keys (`runtime.wire.store`, `control/...`); the coordinator reads them in its health tick and answers
with events (and, for moves, a result key). This module owns the requests' format: the parsers the coordinator
applies to what it reads, and `JobControl`, the client that writes them. The records themselves (`ControlCommand`,
`MoveRequest`, `MoveResult`) are defined with every other message in runtime.wire.protocol.

Commands are sealed with the job's secret (`runtime.wire.auth`) and carry a sequence number that only grows: the
coordinator obeys nothing unsealed and refuses a replayed command. So an orchestrator needs the job's secret:
start the job with `TRAINMOVER_JOB_SECRET` set (or `--secret-file`) and give `JobControl` the same.

    with JobControl("127.0.0.1", port, secret=secret) as job:
        job.set_standby_target(2)
        outcome = job.wait_move(job.move([1], "spot_interruption"), timeout_s=10)
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch.distributed as dist

from runtime.wire import store as keys
from runtime.wire.auth import ENV_SECRET, Sealer
from runtime.wire.protocol import ControlCommand, JobConfig, MoveRequest, MoveResult, Progress, ResizeRequest
from runtime.wire.tunnel import StoreDoor, is_loopback

__all__ = ["MAX_STANDBY_TARGET", "ControlValueError", "JobControl", "JobEnded", "JobNotFound", "MoveOutcome",
           "MoveRequest", "ResizeRequest", "parse_move", "parse_resize", "parse_standby_target"]

MAX_STANDBY_TARGET = 64
"""Upper bound of a standby target: a typo (640 instead of 64) must not start hundreds of processes."""
MAX_REASON_CHARS = 100


class ControlValueError(ValueError):
    """A control value the coordinator cannot apply; the message says why."""

    def __init__(self, message: str, seq: int | None = None) -> None:
        super().__init__(message)
        self.seq = seq


class JobNotFound(ConnectionError):
    """No trainmover job answers at the given address."""


class JobEnded(RuntimeError):
    """The job this client steered has ended (or the client was closed)."""


MoveOutcome = MoveResult
"""The coordinator's answer to a move request (`seq`, `accepted`, `reason`: empty when accepted, otherwise why the
move was refused, e.g. "no standby ready"); the record is runtime.wire.protocol's `MoveResult`."""


def parse_standby_target(raw: bytes | str) -> int:
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    try:
        target = int(text.strip())
    except ValueError:
        raise ControlValueError(f"standby target {text[:40]!r} is not an integer") from None
    if not 0 <= target <= MAX_STANDBY_TARGET:
        raise ControlValueError(f"standby target {target} is outside 0..{MAX_STANDBY_TARGET}")
    return target


def _check_reason(reason: object) -> str:
    if not isinstance(reason, str) or not reason or len(reason) > MAX_REASON_CHARS or not reason.isprintable():
        raise ControlValueError(f"reason must be 1 to {MAX_REASON_CHARS} printable characters, got {reason!r:.60}")
    return reason


def parse_move(raw: bytes | str) -> MoveRequest:
    """Read a move request; the ranks are checked against the current generation by the coordinator."""
    record, seq = _request_object(raw, "move", '{"seq": n, "ranks": [...], "reason": "..."}')
    ranks = record.get("ranks")
    if (
        not isinstance(ranks, list) or not ranks
        or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks)
    ):
        raise ControlValueError(f"move ranks must be a non-empty list of ranks, got {ranks!r:.60}", seq)
    if len(set(ranks)) != len(ranks):
        raise ControlValueError(f"move ranks repeat a rank: {ranks}", seq)
    try:
        reason = _check_reason(record.get("reason", "requested"))
    except ControlValueError as exc:
        raise ControlValueError(str(exc), seq) from None
    return MoveRequest(seq, tuple(ranks), reason)


def _request_object(raw: bytes | str, what: str, shape: str) -> tuple[dict[str, Any], int]:
    """A control request's JSON object and its seq, or ControlValueError saying what is wrong."""
    try:
        record: Any = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise ControlValueError(f"{what} request is not JSON") from None
    if not isinstance(record, dict):
        raise ControlValueError(f"{what} request must be a JSON object {shape}")
    seq = record.get("seq")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 1:
        raise ControlValueError(f"{what} request needs a positive integer seq, got {seq!r:.40}")
    return record, seq


def parse_resize(raw: bytes | str) -> ResizeRequest:
    """Read a resize request; the width is checked against the job's logical width by the coordinator."""
    record, seq = _request_object(raw, "resize", '{"seq": n, "width": n, "reason": "..."}')
    width = record.get("width")
    if not isinstance(width, int) or isinstance(width, bool) or width < 1:
        raise ControlValueError(f"resize width must be a positive integer, got {width!r:.40}", seq)
    try:
        reason = _check_reason(record.get("reason", "requested"))
    except ControlValueError as exc:
        raise ControlValueError(str(exc), seq) from None
    return ResizeRequest(seq, width, reason)


class JobControl:
    """A client of a running job's control channel (`trainmover run --port P`)."""

    def __init__(self, host: str, port: int, timeout_s: float = 10.0, secret: str | None = None) -> None:
        """Connect, waiting at most `timeout_s` for the job to answer; raises `JobNotFound` otherwise.

        `secret` is the job's secret (default: the `TRAINMOVER_JOB_SECRET` environment variable); a job answers
        no one without it."""
        self.host = host
        self.port = port
        self.timeout_s = timeout_s
        secret = secret if secret is not None else os.environ.get(ENV_SECRET)
        if not secret:
            raise ValueError(f"JobControl needs the job's secret: pass secret=... or set {ENV_SECRET} to the value "
                             "the job was started with (trainmover run reads it from there, or from --secret-file)")
        self._sealer = Sealer(secret, "control")
        deadline = time.monotonic() + timeout_s
        # Probe with a plain socket first: a TCPStore client that finds nobody prints C++ tracebacks while it
        # retries, which is noise for the common mistake of a wrong port or a job that has ended.
        # A store off loopback is behind its gate (runtime.wire.tunnel): this client goes through a door of its own,
        # and probes with a TLS handshake (a plain connection would count as a refused stranger there).
        self._door = None if is_loopback(host) else StoreDoor(host, port, secret)
        try:
            wait_for_listener(host, port, deadline, self._door)
        except JobNotFound:
            if self._door is not None:
                self._door.close()
            raise
        at = ("127.0.0.1", self._door.port) if self._door is not None else (host, port)
        try:
            self._store: dist.TCPStore | None = dist.TCPStore(
                *at, None, False, timeout=datetime.timedelta(seconds=max(1.0, deadline - time.monotonic()))
            )
        except (RuntimeError, OSError) as exc:
            self.close()
            raise JobNotFound(f"{host}:{port} accepts connections but is not a job store ({exc})") from exc
        try:
            _wait_for_key(self._store, keys.k_job_config(), deadline)
        except TimeoutError:
            self.close()
            raise JobNotFound(
                f"the store at {host}:{port} holds no trainmover job; is `trainmover run --port {port}` running?"
            ) from None
        if keys.Records(self._store, self._sealer).get_record(keys.k_job_config(), JobConfig) is None:
            self.close()
            raise JobNotFound(f"the job at {host}:{port} was started with another secret than the one given "
                              f"(or {ENV_SECRET}); use the secret it was started with")

    @property
    def store(self) -> dist.TCPStore:
        """The job's store, while the job runs. Once the coordinator said the job is over, the client is closed
        before its store goes away (torch prints a C++ stack trace for every call on a closed store)."""
        if self.ended:
            raise JobEnded(f"the job at {self.host}:{self.port} has ended (or this client was closed)")
        assert self._store is not None
        return self._store

    @property
    def ended(self) -> bool:
        """Whether the job is over (or this client was closed); no call reaches the store after that."""
        if self._store is None:
            return True
        # A plain connection first: the store's socket closes while the launcher process is still exiting, and
        # a call on the client then would print torch's C++ trace.
        try:
            if self._door is not None:
                if not self._door.reachable(1.0):
                    raise OSError(self._door.last_error)
            else:
                socket.create_connection((self.host, self.port), timeout=1.0).close()
            over = self._store.check([keys.k_over()])
        except (OSError, RuntimeError):
            over = True
        if over:
            self.close()
        return over

    @property
    def records(self) -> keys.Records:
        """The store through the job's seal (one liveness check per call that takes it)."""
        return keys.Records(self.store, self._sealer)

    def _command(self, key: str, request: Callable[[int], str]) -> int:
        """Write a sealed command with a fresh sequence number (the coordinator refuses one it has seen)."""
        records = self.records
        seq = int(records.store.add(keys.k_control_seq(), 1))
        records.put(key, ControlCommand(seq, request(seq)))
        return seq

    def set_standby_target(self, n: int) -> None:
        """Keep `n` unpromoted warm standbys from now on (more are started, surplus ones are stopped)."""
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_STANDBY_TARGET:
            raise ValueError(f"the standby target must be an integer in 0..{MAX_STANDBY_TARGET}, got {n!r}")
        self._command(keys.k_control_standby_target(), lambda _: str(n))

    def move(self, ranks: list[int] | tuple[int, ...], reason: str = "requested") -> int:
        """Ask the coordinator to move `ranks` to standbys; returns the request's seq (see `wait_move`)."""
        if not ranks or len(set(ranks)) != len(ranks) or not all(isinstance(r, int) and r >= 0 for r in ranks):
            raise ValueError(f"ranks must be distinct non-negative integers, got {ranks!r}")
        _check_reason(reason)
        return self._command(keys.k_control_move(), lambda seq: MoveRequest(seq, tuple(ranks), reason).to_json())

    def move_outcome(self, seq: int) -> MoveOutcome | None:
        """The answer to request `seq`, or None while it is unanswered (or was overwritten by a newer one)."""
        return self._answer(keys.k_control_move_result(), seq)

    def _answer(self, key: str, seq: int) -> MoveOutcome | None:
        result = self.records.get_record(key, MoveResult)
        return result if result is not None and result.seq == seq else None

    def wait_move(self, seq: int, timeout_s: float) -> MoveOutcome:
        """Wait for the answer to request `seq`; raises `TimeoutError` if none comes within `timeout_s`."""
        return self._wait_answer(keys.k_control_move_result(), seq, timeout_s, "move")

    def _wait_answer(self, key: str, seq: int, timeout_s: float, what: str) -> MoveOutcome:
        deadline = time.monotonic() + timeout_s
        while (outcome := self._answer(key, seq)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the job did not answer {what} request {seq} within {timeout_s:.0f} s")
            time.sleep(0.05)
        return outcome

    def resize(self, width: int, reason: str = "requested") -> int:
        """Ask the coordinator to run the job at `width` members (1 up to its `--nproc`): fewer frees capacity (the
        highest ranks leave at a step boundary), more grows back onto ready standbys. Returns the request's seq
        (see `wait_resize`); the `shrunk` or `grew` event says when the job reached the width."""
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise ValueError(f"the width must be a positive integer, got {width!r}")
        _check_reason(reason)
        return self._command(keys.k_control_resize(), lambda seq: ResizeRequest(seq, width, reason).to_json())

    def wait_resize(self, seq: int, timeout_s: float) -> MoveOutcome:
        """Wait for the answer to resize request `seq` (accepted, or refused and why)."""
        return self._wait_answer(keys.k_control_resize_result(), seq, timeout_s, "resize")

    def committed_step(self) -> int | None:
        """The last step the job committed (published by the members' heartbeats), None before the first or
        once the job is over."""
        if self.ended:
            return None
        progress = self.records.get_record(keys.k_progress(), Progress)
        return progress.step if progress is not None else None

    def close(self) -> None:
        self._store = None  # a TCPStore client closes its socket when released
        if self._door is not None:
            self._door.close()

    def __enter__(self) -> JobControl:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def wait_for_listener(host: str, port: int, deadline: float, door: StoreDoor | None = None) -> None:
    """Until `deadline` (monotonic), wait for a store to answer at host:port (through `door` when it is behind its
    gate); JobNotFound when none did, or the gate refused the secret."""
    while True:
        timeout = max(0.1, min(1.0, deadline - time.monotonic()))
        if door is not None:
            if door.reachable(timeout):
                return
            if door.refused:
                raise JobNotFound(f"the job's store at {host}:{port} did not let this client in ({door.last_error}); "
                                  f"use the secret the job was started with (or {ENV_SECRET})")
            why = door.last_error
        else:
            try:
                with socket.create_connection((host, port), timeout=timeout):
                    return
            except OSError as exc:
                why = str(exc.strerror or exc)
        if time.monotonic() >= deadline:
            raise JobNotFound(f"no trainmover job answers at {host}:{port} ({why}); start it with "
                              f"`trainmover run --port {port} ...`, or check the host and port")
        time.sleep(0.1)


def _wait_for_key(store: dist.TCPStore, key: str, deadline: float) -> None:
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise TimeoutError(key)
        time.sleep(0.02)
