"""The job's event stream: membership changes and recoveries as JSON lines, with DESIGN.md's metric names.

Every event has `event` (its kind) and `time` (wall clock, seconds). Kinds: job_started, generation,
member_failed, standby_spawned, standby_ready, standby_lost, standby_released, standby_target_changed,
move_accepted, control_rejected, recovered, job_finished, job_failed; across hosts also placed, host_joined,
host_lost, host_notice, agent_refused.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, TextIO


class EventLog:
    """Appends events to a JSON-lines file (if given) and keeps them in memory for the caller."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._file: TextIO | None = None
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def emit(self, kind: str, **fields: Any) -> dict[str, Any]:
        record = {"event": kind, "time": time.time(), **fields}
        with self._lock:
            self.events.append(record)
            if self._file is not None:
                self._file.write(json.dumps(record) + "\n")
                self._file.flush()
        return record

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == kind]

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_events(path: str | Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
