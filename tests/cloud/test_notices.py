"""Scenarios for `cloud.notices.NoticeWatcher`: every channel polled, each notice handed on once, failures survived."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import pytest

from cloud.base import LaunchRequest, Notice, NoticeSource
from cloud.local import LocalProvider
from cloud.notices import NoticeWatcher, notice_key

JOB = "job-notices"
WAIT_S = 10.0  # the bound of every wait in this file; a healthy run needs milliseconds


class RepeatingSource(NoticeSource):
    """Like instance metadata: returns the pending notices again on every poll until they pass."""

    def __init__(self, *notices: Notice) -> None:
        self.notices = list(notices)
        self.polls = 0

    def poll(self) -> list[Notice]:
        self.polls += 1
        return list(self.notices)


class BrokenSource(NoticeSource):
    """An endpoint that always fails, e.g. metadata unreachable; says when it has been polled `enough` times."""

    def __init__(self, enough: int) -> None:
        self.polls = 0
        self.enough = enough
        self.polled_enough = threading.Event()

    def poll(self) -> list[Notice]:
        self.polls += 1
        if self.polls >= self.enough:
            self.polled_enough.set()
        raise ConnectionError("169.254.169.254 unreachable")


class StuckSource(NoticeSource):
    """A poll that hangs until released (an HTTP call without a timeout)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def poll(self) -> list[Notice]:
        self.entered.set()
        self.release.wait(WAIT_S)
        return []


@pytest.fixture
def cloud() -> Iterator[LocalProvider]:
    provider = LocalProvider(slots=4)
    try:
        yield provider
    finally:
        provider.release_job(JOB)


def notice(
    kind: str = "spot_interruption",
    instance: str = "i-1",
    event_id: str | None = None,
    deadline: float | None = 2000.0,
    source: str = "imds",
    received: float = 1000.0,
) -> Notice:
    return Notice(
        kind=kind,
        instance_id=instance,
        received_at=received,
        source=source,  # type: ignore[arg-type]
        deadline_at=deadline,
        event_id=event_id,
    )


def test_a_notice_injected_from_another_thread_reaches_the_callback(cloud: LocalProvider) -> None:
    (inst,) = cloud.launch(LaunchRequest(job_id=JOB, role="worker", instance_type="g5.xlarge", market="spot"))
    received: list[Notice] = []
    arrived = threading.Event()

    def on_notice(n: Notice) -> None:
        received.append(n)
        arrived.set()

    with NoticeWatcher(cloud, on_notice=on_notice, poll_s=0.01) as watcher:
        assert watcher.running
        injector = threading.Thread(target=cloud.inject_notice, args=(inst.instance_id, "spot_interruption"))
        injector.start()
        injector.join(WAIT_S)
        assert arrived.wait(WAIT_S)
    assert not watcher.running
    assert [(n.kind, n.instance_id) for n in received] == [("spot_interruption", inst.instance_id)]
    assert received[0].lead_s == pytest.approx(120.0)
    assert watcher.drain() == received  # the same notices, for callers that poll
    assert watcher.drain() == []
    cloud.release_job(JOB)
    assert cloud.describe(job_id=JOB) == []


def test_repeated_notices_are_handed_on_once() -> None:
    with_id = notice(event_id="evt-1")
    same_id_new_deadline = notice(event_id="evt-1", deadline=2500.0)  # a re-sent event keeps its id
    without_id = notice(kind="rebalance_recommendation", deadline=None)
    same_fields = notice(kind="rebalance_recommendation", deadline=None, received=1005.0)
    other_instance = notice(kind="rebalance_recommendation", instance="i-2", deadline=None)
    source = RepeatingSource(with_id, same_id_new_deadline, without_id, same_fields, other_instance)
    handed_on: list[Notice] = []
    watcher = NoticeWatcher(sources=[source], on_notice=handed_on.append)

    first = watcher.poll_once()
    for _ in range(3):
        assert watcher.poll_once() == []

    assert first == [with_id, without_id, other_instance]
    assert handed_on == first
    assert source.polls == 4
    assert notice_key(with_id) == notice_key(same_id_new_deadline)
    assert notice_key(with_id) != notice_key(notice(event_id="evt-1", source="eventbridge"))


def test_the_dedup_memory_is_bounded() -> None:
    source = RepeatingSource(*(notice(event_id=f"e{i}") for i in range(5)))
    watcher = NoticeWatcher(sources=[source], max_remembered=3)
    assert len(watcher.poll_once()) == 5
    assert [n.event_id for n in watcher.drain()] == ["e2", "e3", "e4"]  # the buffer keeps the newest
    source.notices = [source.notices[0], source.notices[4]]
    assert [n.event_id for n in watcher.poll_once()] == ["e0"]  # the oldest was forgotten, the newest is known


def test_a_failing_source_is_logged_once_and_the_other_channels_keep_working(
    cloud: LocalProvider, caplog: pytest.LogCaptureFixture
) -> None:
    (inst,) = cloud.launch(LaunchRequest(job_id=JOB, role="worker", instance_type="g5.xlarge"))
    broken = BrokenSource(enough=5)
    arrived = threading.Event()
    caplog.set_level(logging.WARNING, logger="cloud.notices")

    with NoticeWatcher(cloud, sources=[broken], on_notice=lambda n: arrived.set(), poll_s=0.001) as watcher:
        assert broken.polled_enough.wait(WAIT_S)
        cloud.inject_notice(inst.instance_id, "scheduled_maintenance", lead_s=900.0)
        assert arrived.wait(WAIT_S)
        assert watcher.running
    assert watcher.stop(WAIT_S)

    warnings = [r.getMessage() for r in caplog.records if r.name == "cloud.notices"]
    assert len(warnings) == 1, warnings
    assert "BrokenSource" in warnings[0] and "169.254.169.254 unreachable" in warnings[0]
    cloud.release_job(JOB)
    assert cloud.describe(job_id=JOB) == []


def test_a_callback_that_raises_does_not_stop_the_watcher(caplog: pytest.LogCaptureFixture) -> None:
    source = RepeatingSource(notice(event_id="a"))
    calls: list[str] = []

    def on_notice(n: Notice) -> None:
        calls.append(n.event_id or "")
        if n.event_id == "a":
            raise RuntimeError("callback bug")

    watcher = NoticeWatcher(sources=[source], on_notice=on_notice)
    caplog.set_level(logging.WARNING, logger="cloud.notices")
    watcher.poll_once()
    source.notices.append(notice(event_id="b"))
    watcher.poll_once()
    assert calls == ["a", "b"]
    assert any("callback bug" in r.getMessage() for r in caplog.records)


def test_stop_is_bounded_even_when_a_source_hangs() -> None:
    stuck = StuckSource()
    watcher = NoticeWatcher(sources=[stuck], poll_s=0.01).start()
    try:
        assert stuck.entered.wait(WAIT_S)
        started = time.monotonic()
        assert watcher.stop(timeout_s=0.1) is False
        assert time.monotonic() - started < 2.0
    finally:
        stuck.release.set()
    assert watcher.stop(timeout_s=WAIT_S) is True
    assert not watcher.running


def test_start_is_idempotent_and_the_watcher_can_be_restarted(cloud: LocalProvider) -> None:
    watcher = NoticeWatcher(cloud, poll_s=0.01)
    assert watcher.stop() is True  # never started
    assert watcher.start() is watcher.start()
    assert watcher.running
    assert watcher.stop(WAIT_S)
    watcher.start()
    assert watcher.running
    assert watcher.stop(WAIT_S)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="poll_s"):
        NoticeWatcher(poll_s=0.0)
    with pytest.raises(ValueError, match="max_remembered"):
        NoticeWatcher(max_remembered=0)
