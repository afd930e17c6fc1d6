"""The training process's heartbeat thread against a real store: a new generation is seen when it is published, not
a beat later; a forged generation record is not."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from runtime.config import ProcessConfig
from runtime.training.job import Heartbeat
from runtime.wire import store as keys
from runtime.wire.auth import Sealer
from runtime.wire.protocol import CurrentGeneration

TOKEN = "a-test-secret-of-enough-length-0123456789"
BEAT_S = 60.0
"""Longer than any wait below: whatever the thread sees, it saw through the watch, not through its beat."""


@pytest.fixture
def store() -> Iterator[dist.TCPStore]:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield server


def _heartbeat(store: dist.TCPStore) -> tuple[Heartbeat, list[int], threading.Event]:
    cfg = ProcessConfig(store_host="127.0.0.1", store_port=store.port, job_id="j", job_token=TOKEN, proc="w0",
                        role="worker", heartbeat_s=BEAT_S)
    beat = Heartbeat(cfg, Sealer(TOKEN, "w0"))
    seen: list[int] = []
    called = threading.Event()

    def on_new(gen: int, records: keys.Records) -> None:
        seen.append(gen)
        called.set()

    beat.on_new_generation.append(on_new)
    return beat, seen, called


def _publish(records: keys.Records, g: int) -> None:
    """What the coordinator writes, in its order: the record, then the current generation."""
    records.put(keys.k_gen(g), {"gen": g})
    records.put(keys.k_current_gen(), CurrentGeneration(g))


def test_each_new_generation_reaches_the_callbacks_without_waiting_for_a_beat(store: dist.TCPStore) -> None:
    coordinator = keys.Records(keys.connect("127.0.0.1", store.port), Sealer(TOKEN, "coordinator"))
    beat, seen, called = _heartbeat(store)
    beat.start()
    try:
        for g in range(3):
            called.clear()
            _publish(coordinator, g)
            assert called.wait(10.0), f"generation {g} not seen within 10 s (the beat is {BEAT_S:.0f} s)"
            assert beat.latest_gen == g
        assert seen == [0, 1, 2]
    finally:
        beat.halt()
        beat.join(10.0)
    assert not beat.is_alive()


def test_a_forged_generation_record_wakes_nothing(store: dist.TCPStore) -> None:
    coordinator = keys.Records(keys.connect("127.0.0.1", store.port), Sealer(TOKEN, "coordinator"))
    beat, seen, called = _heartbeat(store)
    _publish(coordinator, 0)
    beat.start()
    try:
        assert called.wait(10.0) and seen == [0]
        called.clear()
        outsider = keys.connect("127.0.0.1", store.port)
        outsider.set(keys.k_gen(1), "not sealed")
        outsider.set(keys.k_current_gen(), "1")
        assert not called.wait(1.0), "a generation no coordinator sealed was taken for one"
        assert beat.latest_gen == 0
    finally:
        beat.halt()
        beat.join(10.0)
