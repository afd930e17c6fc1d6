"""Fixtures for the runtime scenarios: launch real multi-process jobs of a tiny training script."""

from __future__ import annotations

import socket
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from runtime.control.coordinator import JobResult
from runtime.control.hosts import HostPool, HostTiming
from runtime.launcher import LaunchConfig, launch
from runtime.wire.auth import new_token
from runtime.wire.event_records import Event
from runtime.wire.events import of_type
from tests.diagnostics import explained, keep_job_events
from tests.tiers import OBSERVER

E = TypeVar("E", bound=Event)

FAST = HostTiming(heartbeat_s=0.05, lease_s=0.3, host_timeout_s=0.5)
"""Host timing for in-process agent tests: a silent host is lost in half a second."""


@pytest.fixture
def pool() -> Iterator[tuple[HostPool, str]]:
    """A HostPool on 127.0.0.1 with a fresh job secret, closed afterwards; (pool, secret)."""
    token = new_token()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    p = HostPool(listener, token, "job1", [], {"TM_X": "1"}, FAST)
    yield p, token
    p.close()

SCRIPTS = Path(__file__).parent / "scripts"
TINY_JOB = SCRIPTS / "tiny_job.py"


def run_job(*, nproc: int = 2, standby: int = 1, steps: int = 20, faults: str = "", script_args: tuple[str, ...] = (),
            script: Path = TINY_JOB, **settings: Any) -> JobResult:
    """Run the tiny job to its end with real processes; every wait inside is bounded.

    Training starts once every standby is warm, so that a scenario's fault always finds the standbys it
    plans for (otherwise which standby is ready first is a race between process start-ups).
    """
    settings = {"wait_for_standbys": True, "recovery_timeout_s": 60.0, **settings}
    with tempfile.TemporaryDirectory(prefix="tm-job-") as tmp:
        settings.setdefault("events_path", str(Path(tmp) / "events.jsonl"))
        cfg = LaunchConfig(
            script=str(script), args=("--steps", str(steps), *script_args), nproc=nproc, standby=standby,
            faults=faults, num_threads=1, quiet=True, **settings,
        )
        with explained(Path(cfg.events_path or "")):
            result = launch(cfg)
        keep_job_events(Path(cfg.events_path or ""))  # in the test's report if an assertion on the result fails
        return result


def events_of(result: JobResult, kind: type[E]) -> list[E]:
    return of_type(result.events, kind)


_REFERENCES: dict[tuple[int, int, str, tuple[str, ...]], str] = {}


PACING = frozenset({"--pace-ms", "--pace-end-factor", "--step-ms", "--step-ms-until-gen", "--full-speed-file"})
"""The scenario's options that only add wall time (tests/runtime/scripts/scenario.py): a reference runs without them."""


def without_pacing(script_args: tuple[str, ...]) -> tuple[str, ...]:
    """`script_args` less the pacing options and their values (each is `--option VALUE`)."""
    kept: list[str] = []
    words = iter(script_args)
    for word in words:
        if word in PACING:
            next(words, None)
        elif word.split("=", 1)[0] not in PACING:
            kept.append(word)
    return tuple(kept)


def clean_digest(nproc: int, steps: int, script: Path = TINY_JOB, script_args: tuple[str, ...] = ()) -> str:
    """The final-state digest of an uninterrupted run with the same seed, world size, steps and script (run at full
    speed: pacing changes no number)."""
    key = (nproc, steps, str(script), without_pacing(script_args))
    OBSERVER.needs([sys.executable, str(script)])  # a job, whether this call runs it or the cache holds it
    if key not in _REFERENCES:
        result = run_job(nproc=nproc, standby=0, steps=steps, script=script, script_args=key[3])
        assert result.exit_code == 0, result.message
        digests = set(result.digests.values())
        assert len(result.digests) == nproc and len(digests) == 1, "replicas of a clean run must agree"
        _REFERENCES[key] = digests.pop()
    return _REFERENCES[key]


@pytest.fixture(scope="session")
def reference_digest() -> Callable[[int, int], str]:
    """The final-state digest of an uninterrupted run of the tiny job with the same world size and steps."""
    return lambda nproc, steps: clean_digest(nproc, steps)
