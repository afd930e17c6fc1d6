"""The job's event stream: membership changes and recoveries as JSON lines, with DESIGN.md's metric names.

Each event is a typed, versioned record of `runtime.wire.event_records` (one frozen dataclass per kind); the file holds
one JSON object per line, `{"event": KIND, "version": 2, "time": ..., ...fields}`, readable by any tool. Kinds:
job_started, generation, member_failed, standby_spawned, standby_ready, standby_lost, standby_released,
standby_target_changed, move_accepted, control_rejected, recovered, untrusted_value, chaos_injected,
chaos_unresolved, job_finished, job_failed; across hosts also placed, host_joined, host_lost, host_notice,
agent_refused.

`read_records(path)` reads a file back as records; `read_events(path)` as the plain JSON objects, for tools that
want dicts.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TextIO, TypeVar

from runtime.wire.event_records import Event, EventError, parse_event

E = TypeVar("E", bound=Event)


class EventLog:
    """Appends events to a JSON-lines file (if given) and keeps them in memory for the caller."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.events: list[Event] = []
        self.listeners: list[Callable[[Event], None]] = []
        """Called with each event once it is written (the job's metrics, runtime.control.metrics)."""
        self._lock = threading.Lock()
        self._file: TextIO | None = None
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def emit(self, event: E) -> E:
        with self._lock:
            self.events.append(event)
            if self._file is not None:
                self._file.write(json.dumps(event.to_dict()) + "\n")
                self._file.flush()
            for listener in self.listeners:
                listener(event)
        return event

    def of_type(self, cls: type[E]) -> list[E]:
        return of_type(self.events, cls)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def of_type(events: Iterable[Event], cls: type[E]) -> list[E]:
    """The events of one kind, typed."""
    return [e for e in events if isinstance(e, cls)]


def read_records(path: str | Path) -> list[Event]:
    """A whole events file as records; EventError naming the line when one is not an event."""
    out: list[Event] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    out.append(parse_event(json.loads(line)))
                except (EventError, json.JSONDecodeError) as exc:
                    raise EventError(f"{path}, line {n}: {exc}") from None
    return out


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """A whole events file as its JSON objects (for tools that want dicts; `read_records` for the records)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
