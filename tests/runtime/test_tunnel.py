"""The store's tunnel in-process: a real TCPStore behind a gate, reached through doors, and outsiders refused."""

from __future__ import annotations

import datetime
import secrets
import socket
import time
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from runtime.wire import tunnel
from runtime.wire.tunnel import Doors, StoreDoor, StoreGate, is_loopback

SECRET = "a" * 64


@pytest.fixture
def gate() -> Iterator[tuple[StoreGate, dist.TCPStore, list[tuple[str, str]]]]:
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=5), wait_for_workers=False)
    refused: list[tuple[str, str]] = []
    g = StoreGate(socket.create_server(("127.0.0.1", 0)), store.port, SECRET, lambda k, why: refused.append((k, why)))
    try:
        yield g, store, refused
    finally:
        g.close()


def _wait(cond: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "not within the bound"
        time.sleep(0.01)


def test_every_holder_of_the_secret_makes_the_same_certificate_and_no_one_else() -> None:
    assert tunnel._certificate(SECRET) == tunnel._certificate(SECRET)
    assert tunnel._certificate(SECRET)[0] != tunnel._certificate("b" * 64)[0]


def test_a_door_carries_the_stores_protocol_both_ways(gate: tuple[StoreGate, dist.TCPStore, list]) -> None:
    g, store, refused = gate
    door = StoreDoor("127.0.0.1", g.port, SECRET)
    try:
        client = dist.TCPStore("127.0.0.1", door.port, None, False, timeout=datetime.timedelta(seconds=5))
        client.set("k", "x" * 70_000 + "end")  # larger than one relay chunk
        assert store.get("k")[-3:] == b"end" and len(store.get("k")) == 70_003
        store.set("back", "v")
        assert client.get("back") == b"v"
        assert client.add("n", 2) == 2 and store.add("n", 1) == 3
        assert door.reachable(5.0) and refused == []
    finally:
        door.close()


def test_a_plain_store_client_at_the_gate_reads_nothing_and_is_counted(
        gate: tuple[StoreGate, dist.TCPStore, list]) -> None:
    g, store, refused = gate
    store.set("job/config", "the job's spec")
    with pytest.raises((RuntimeError, OSError)):
        outsider = dist.TCPStore("127.0.0.1", g.port, None, False, timeout=datetime.timedelta(seconds=1))
        outsider.get("job/config")
    _wait(lambda: refused)
    assert {k for k, _ in refused} == {"store/tunnel"} and g.refused == len(refused)


def test_another_secrets_certificate_is_refused_with_a_clear_reason(
        gate: tuple[StoreGate, dist.TCPStore, list]) -> None:
    g, _, refused = gate
    door = StoreDoor("127.0.0.1", g.port, "b" * 64)
    try:
        assert not door.reachable(5.0)
        assert "another job's secret" in door.last_error
        _wait(lambda: refused)
    finally:
        door.close()


def test_a_silent_connection_is_refused_after_the_handshake_bound(
        gate: tuple[StoreGate, dist.TCPStore, list], monkeypatch: pytest.MonkeyPatch) -> None:
    g, _, refused = gate
    monkeypatch.setattr(tunnel, "HANDSHAKE_S", 0.3)  # read when each connection is admitted
    with socket.create_connection(("127.0.0.1", g.port)) as silent:
        _wait(lambda: refused)
        silent.settimeout(5.0)
        assert silent.recv(1) == b"", "the gate closes a connection that never shakes hands"
    assert "TimeoutError" in refused[0][1] or "Abort" in refused[0][1]


def test_junk_floods_are_each_refused_and_the_gate_keeps_serving(gate: tuple[StoreGate, dist.TCPStore, list]) -> None:
    g, store, refused = gate
    for _ in range(20):
        with socket.create_connection(("127.0.0.1", g.port)) as s:
            s.sendall(secrets.token_bytes(300))
    _wait(lambda: len(refused) >= 20)
    door = StoreDoor("127.0.0.1", g.port, SECRET)
    try:
        client = dist.TCPStore("127.0.0.1", door.port, None, False, timeout=datetime.timedelta(seconds=5))
        client.set("after", "ok")
        assert store.get("after") == b"ok"
    finally:
        door.close()


def test_a_store_on_loopback_needs_no_door() -> None:
    doors = Doors(SECRET)
    try:
        assert doors.local("127.0.0.1", 1234) == ("127.0.0.1", 1234)
        assert doors.local("::1", 1234) == ("::1", 1234)
        assert [is_loopback(h) for h in ("localhost", "127.0.0.2", "10.0.0.1", "vm", "::1")] == [
            True, True, False, False, True]
    finally:
        doors.close()
