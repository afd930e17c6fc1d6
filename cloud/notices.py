"""The notice watcher: one daemon thread that polls every notice channel and hands each notice on exactly once.

A job hears about coming interruptions from two kinds of channel: the provider's fleet-wide `poll_notices`
(AWS EventBridge via SQS) and per-instance `NoticeSource`s (AWS instance metadata, Azure Scheduled Events). Each
may repeat a notice on every poll until the event passes, so the watcher de-duplicates: by (source, event_id)
when the cloud gave an id, else by (kind, instance, deadline). A channel that fails is logged, once per distinct
message, and polled again next round: losing the notice channel must never stop the job.

    with NoticeWatcher(provider, sources=[imds], on_notice=plan_move, poll_s=1.0):
        ...  # train

Callers without a callback call `drain()` now and then instead.

Shared by the clouds' per-instance sources (`cloud.aws.notices.ImdsNoticeSource`,
`cloud.azure.notices.ScheduledEventsSource`) and the Azure managed identity: `IMDS_URL`, `imds_opener` (never
through a proxy) and `SeenOnce` (report each event once, with bounded memory).
"""

from __future__ import annotations

import logging
import threading
import urllib.request
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from types import TracebackType
from typing import Generic, TypeVar

from cloud.base import Notice, NoticeSource, Provider

log = logging.getLogger(__name__)

_DedupKey = tuple[object, ...]
K = TypeVar("K", bound=Hashable)

IMDS_URL = "http://169.254.169.254"  # AWS's and Azure's instance metadata service (link-local)


def imds_opener() -> urllib.request.OpenerDirector:
    """An opener that ignores HTTP(S)_PROXY: IMDS is link-local, so a proxy cannot reach it (Azure refuses proxied
    IMDS calls), and a proxy must never see its tokens."""
    return urllib.request.build_opener(urllib.request.ProxyHandler({}))


class SeenOnce(Generic[K]):
    """The keys seen so far, oldest forgotten first beyond `max_remembered` (None: never forgotten), so that each
    event is reported once. Not thread-safe: callers that share one hold their own lock."""

    def __init__(self, max_remembered: int | None = None) -> None:
        self.max_remembered = max_remembered
        self._keys: dict[K, None] = {}  # insertion-ordered: the first key is the oldest

    def first_time(self, key: K) -> bool:
        """True, and `key` remembered, when it was not seen (or has been forgotten); False otherwise."""
        if key in self._keys:
            return False
        self._keys[key] = None
        if self.max_remembered is not None and len(self._keys) > self.max_remembered:
            del self._keys[next(iter(self._keys))]
        return True


def notice_key(notice: Notice) -> _DedupKey:
    """What makes two notices the same event: the provider's id where it gave one, else kind+instance+deadline."""
    if notice.event_id:
        return ("id", notice.source, notice.event_id)
    return ("fields", notice.kind, notice.instance_id, notice.deadline_at)


class NoticeWatcher:
    """Poll `provider.poll_notices` and `sources` every `poll_s` seconds on a daemon thread.

    Args:
        provider: polled fleet-wide with `timeout_s=0`, so one slow channel never delays the others; may be None
            on a node that only has its own instance's source.
        sources: per-instance notice endpoints.
        on_notice: called once per new notice, on the watcher's thread; its exceptions are logged.
        poll_s: seconds between rounds.
        max_remembered: de-duplication memory (oldest forgotten first) and the size of the `drain()` buffer.
    """

    def __init__(
        self,
        provider: Provider | None = None,
        sources: Sequence[NoticeSource] = (),
        *,
        on_notice: Callable[[Notice], None] | None = None,
        poll_s: float = 1.0,
        max_remembered: int = 10_000,
        name: str = "trainmover-notices",
    ) -> None:
        if not poll_s > 0.0:
            raise ValueError(f"poll_s must be > 0, got {poll_s}")
        if max_remembered < 1:
            raise ValueError(f"max_remembered must be >= 1, got {max_remembered}")
        self.provider = provider
        self.sources = tuple(sources)
        self.on_notice = on_notice
        self.poll_s = poll_s
        self.max_remembered = max_remembered
        self.name = name
        self._lock = threading.Lock()
        self._seen: SeenOnce[_DedupKey] = SeenOnce(max_remembered)
        self._pending: deque[Notice] = deque(maxlen=max_remembered)
        self._logged: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.rounds = 0  # completed polling rounds, for callers that wait for "at least one more round"

    def __repr__(self) -> str:
        return f"NoticeWatcher(provider={self.provider!r}, sources={len(self.sources)}, poll_s={self.poll_s})"

    # ------------------------------------------------------------------------------------------------ lifecycle

    def start(self) -> NoticeWatcher:
        """Start the polling thread (a no-op when it already runs)."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return self
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Ask the thread to stop and wait at most `timeout_s`; False when it is still stuck in a channel's poll
        (it is a daemon thread and ends after that poll returns)."""
        self._stop.set()
        thread = self._thread
        if thread is None:
            return True
        thread.join(timeout=max(0.0, timeout_s))
        if thread.is_alive():
            log.warning("notice watcher %s still in a poll after %.1f s; leaving it to end on its own", self.name,
                        timeout_s)
            return False
        return True

    @property
    def running(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive() and not self._stop.is_set()

    def __enter__(self) -> NoticeWatcher:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # ------------------------------------------------------------------------------------------------- polling

    def poll_once(self) -> list[Notice]:
        """One round over every channel, on the caller's thread; returns the notices not seen before (they are
        also passed to `on_notice` and buffered for `drain`)."""
        fresh: list[Notice] = []
        channels: list[tuple[str, Callable[[], list[Notice]]]] = []
        if self.provider is not None:
            provider = self.provider
            channels.append((f"provider {provider.name}", lambda: provider.poll_notices(timeout_s=0.0)))
        for source in self.sources:
            channels.append((f"source {type(source).__name__}", source.poll))
        for label, poll in channels:
            try:
                notices = poll()
            except Exception as exc:  # any failure of a channel: log it, keep watching the others
                self._log_once(f"{label}: {type(exc).__name__}: {exc}")
                continue
            for notice in notices:
                if self._remember(notice):
                    fresh.append(notice)
        for notice in fresh:
            if self.on_notice is not None:
                try:
                    self.on_notice(notice)
                except Exception as exc:  # the callback is the caller's code: its bug must not end the watching
                    self._log_once(f"on_notice: {type(exc).__name__}: {exc}")
        with self._lock:
            self.rounds += 1
        return fresh

    def drain(self) -> list[Notice]:
        """The new notices seen since the last `drain`, oldest first."""
        with self._lock:
            drained = list(self._pending)
            self._pending.clear()
            return drained

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll_once()
            self._stop.wait(self.poll_s)

    def _remember(self, notice: Notice) -> bool:
        key = notice_key(notice)
        with self._lock:
            if not self._seen.first_time(key):
                return False
            self._pending.append(notice)
            return True

    def _log_once(self, message: str) -> None:
        with self._lock:
            if message in self._logged:
                return
            if len(self._logged) >= self.max_remembered:
                self._logged.clear()  # messages that embed changing details must not grow memory for ever
            self._logged.add(message)
        log.warning("notice watcher %s: %s (polling goes on; logged once)", self.name, message)


__all__ = ["IMDS_URL", "NoticeWatcher", "SeenOnce", "imds_opener", "notice_key"]
