"""Shared fixtures of the flow tests: one real Prefect server for the whole session.

The end-to-end tests need a real `prefect server start` with its UI, a work pool and a worker (`PrefectStack`); the
tests that run flows in this process (Prefect's real engine) talk to the same server instead of starting a second
one with Prefect's test harness: one server start per session, not two.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.flows.prefect_server import PrefectStack

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")


@pytest.fixture(scope="session")
def prefect_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectStack]:
    """A Prefect server with its UI, the local process work pool and a worker; stopped at the session's end."""
    s = PrefectStack(tmp_path_factory.mktemp("prefect"))
    try:
        s.start()
        yield s
    finally:
        s.close()
        print(f"\n[prefect timings] {', '.join(f'{k}={v:.1f}' for k, v in s.timings.items())}")


@pytest.fixture(scope="session")
def prefect_harness(prefect_stack: PrefectStack) -> Iterator[None]:
    """Flows run in this process report to the session's server (what Prefect's test harness does with a server of
    its own): its API URL for this process's settings, the global ones included, and the run logs and events
    drained before the server goes."""
    import prefect.context
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    with prefect_stack.settings(), prefect.context._temporary_global_settings_context(
        prefect.context.get_settings_context()
    ):
        yield
        APILogWorker.drain_all()
        EventsWorker.drain_all()
