"""Fixtures for the runtime scenarios: launch real multi-process jobs of a tiny training script."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from runtime.coordinator import JobResult
from runtime.launcher import LaunchConfig, launch

SCRIPTS = Path(__file__).parent / "scripts"
TINY_JOB = SCRIPTS / "tiny_job.py"


def run_job(*, nproc: int = 2, standby: int = 1, steps: int = 20, faults: str = "", script_args: tuple[str, ...] = (),
            **settings: Any) -> JobResult:
    """Run the tiny job to its end with real processes; every wait inside is bounded.

    Training starts once every standby is warm, so that a scenario's fault always finds the standbys it
    plans for (otherwise which standby is ready first is a race between process start-ups).
    """
    settings = {"wait_for_standbys": True, **settings}
    cfg = LaunchConfig(
        script=str(TINY_JOB), args=("--steps", str(steps), *script_args), nproc=nproc, standby=standby,
        faults=faults, num_threads=1, quiet=True, recovery_timeout_s=60.0, **settings,
    )
    return launch(cfg)


def events_of(result: JobResult, kind: str) -> list[dict[str, Any]]:
    return [e for e in result.events if e["event"] == kind]


@pytest.fixture(scope="session")
def reference_digest() -> Callable[[int, int], str]:
    """The final-state digest of an uninterrupted run with the same seed, world size and steps."""
    cache: dict[tuple[int, int], str] = {}

    def get(nproc: int, steps: int) -> str:
        if (nproc, steps) not in cache:
            result = run_job(nproc=nproc, standby=0, steps=steps)
            assert result.exit_code == 0, result.message
            digests = set(result.digests.values())
            assert len(result.digests) == nproc and len(digests) == 1, "replicas of a clean run must agree"
            cache[(nproc, steps)] = digests.pop()
        return cache[(nproc, steps)]

    return get
