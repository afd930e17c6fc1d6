"""What a stalled or failed job did last, printed into the test's report (a rare stall on a loaded CI machine is
explained by the job's own events, not guessed at)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_BULKY = ("members", "replaced", "helpers", "hosts", "reconfigure_split", "digests", "refused_values")


def events_tail(path: Path, n: int = 80) -> str:
    """The job's last `n` events, one short line each (times relative to the first event)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as exc:
        return f"(no events at {path}: {exc})"
    out: list[str] = []
    t0 = None
    for line in lines[-n:]:
        try:
            e = json.loads(line)
        except ValueError:
            out.append(line[:200])
            continue
        t0 = e.get("time", 0.0) if t0 is None else t0
        rest = {k: v for k, v in e.items() if k not in ("event", "time", *_BULKY)}
        out.append(f"{e.get('time', 0.0) - t0:8.3f} {e.get('event')} {json.dumps(rest)[:240]}")
    return f"last {len(out)} of {len(lines)} events in {path}:\n" + "\n".join(out)


JOBS_KEPT = 3
_jobs: list[str] = []
"""The events of the current test's last jobs (`keep_job_events`), for its report if it fails (tests/conftest.py)."""


def keep_job_events(path: Path) -> None:
    """A job of the current test ended: keep its events' tail (its events file may be deleted right after)."""
    _jobs.append(events_tail(path))
    del _jobs[:-JOBS_KEPT]


def take_job_events() -> list[str]:
    """The kept tails, oldest first, and forget them (a new test starts with none)."""
    kept = list(_jobs)
    _jobs.clear()
    return kept


def text_tail(path: Path, chars: int = 4000) -> str:
    try:
        return f"tail of {path}:\n{path.read_text(errors='replace')[-chars:]}"
    except OSError as exc:
        return f"(nothing at {path}: {exc})"


@contextmanager
def explained(*paths: Path) -> Iterator[None]:
    """On any failure inside (a timeout included), print the tails of the job's events and logs."""
    try:
        yield
    except BaseException:
        for p in paths:
            print(events_tail(p) if p.suffix == ".jsonl" else text_tail(p), flush=True)
        raise
