"""The holdings record: what one job's supervisor holds now, kept in its work directory for a post-mortem.

A flow run whose process is killed (an OOM kill, the worker's grace period run out) runs no `finally`: the job's
launcher keeps training under init and its instances keep billing. Whoever notices afterwards (Prefect's
`on_crashed` and `on_cancellation` hooks, run by the worker on the same host: `flows.endings`) reads this record to
say what was left running. The supervisor rewrites it whenever what it holds changes and removes it once it has
released everything, so a record found after a run ended means something was left behind.

One file per job run, `<tmp>/trainmover-<job_id>-XXXX/holdings.json`, JSON with a version, written atomically.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("trainmover.flows")

HOLDINGS_FILE = "holdings.json"
HOLDINGS_VERSION = 1


@dataclass(frozen=True, slots=True)
class Holdings:
    """What one job holds at a moment, as its supervisor last wrote it."""

    job_id: str
    owner: str | None
    """The flow run that supervises the job (its id), or None outside Prefect."""
    host: str
    workdir: str
    launcher_pid: int | None
    """The runtime's launcher while it runs (its process group holds the coordinator and the local workers)."""
    port: int
    """The job's store port (0 before `start`): where its coordinator can be reached."""
    instances: tuple[str, ...]
    """Every instance launched for the job and not terminated since."""
    version: int = HOLDINGS_VERSION

    def to_json(self) -> str:
        return json.dumps({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    @classmethod
    def from_json(cls, text: str) -> Holdings:
        raw = json.loads(text)
        if raw.get("version") != HOLDINGS_VERSION:
            raise ValueError(f"holdings record version {raw.get('version')!r}, expected {HOLDINGS_VERSION}")
        return cls(
            job_id=str(raw["job_id"]),
            owner=None if raw["owner"] is None else str(raw["owner"]),
            host=str(raw["host"]),
            workdir=str(raw["workdir"]),
            launcher_pid=None if raw["launcher_pid"] is None else int(raw["launcher_pid"]),
            port=int(raw["port"]),
            instances=tuple(str(i) for i in raw["instances"]),
        )


def workdir_prefix(job_id: str) -> str:
    """How a job's temporary work directory's name starts (`tempfile.mkdtemp(prefix=...)`)."""
    return f"trainmover-{job_id}-"


def write_holdings(path: Path, holdings: Holdings) -> None:
    """Replace the record at `path` atomically (a reader sees the old one or the new one, never half)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(holdings.to_json())
    os.replace(tmp, path)


def find_holdings(job_id: str, owner: str, tmp: Path | None = None) -> list[Holdings]:
    """The records that `owner`'s supervisor of `job_id` left on this host: none once it released everything."""
    found = []
    for path in sorted(Path(tmp or tempfile.gettempdir()).glob(f"{workdir_prefix(job_id)}*/{HOLDINGS_FILE}")):
        try:
            h = Holdings.from_json(path.read_text())
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("unreadable holdings record %s: %s", path, exc)
            continue
        if h.job_id == job_id and h.owner == owner:  # the glob of job "a" also matches job "a-b"'s directories
            found.append(h)
    return found
