"""The hot standby's link (runtime.training.hot) in one process: a real store, a real source and mirror on
loopback, a tiny model; what a stranger on either end gets, and a tampered byte."""

from __future__ import annotations

import datetime
import queue
import socket
import time
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from runtime.config import ProcessConfig
from runtime.training.comm import GradientBuckets
from runtime.training.hot import HotMirror, HotSource, Message, MirrorError, recv_message, send_message
from runtime.training.state import TrainingState
from runtime.wire import store as keys
from runtime.wire.auth import Sealer
from runtime.wire.protocol import HotClaim

TOKEN = "a-job-secret"
WAIT_S = 20.0


@pytest.fixture
def store() -> Iterator[dist.TCPStore]:
    s = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=5), wait_for_workers=False)
    yield s


def config(store: dist.TCPStore, proc: str, token: str = TOKEN) -> ProcessConfig:
    return ProcessConfig(store_host="127.0.0.1", store_port=store.port, job_id="job1", job_token=token, proc=proc,
                         role="standby" if proc.startswith("s") else "worker")


def until(condition, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {WAIT_S} s: {what}")
        time.sleep(0.01)


def replica() -> tuple[TrainingState, GradientBuckets, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    return TrainingState(model, optimizer), GradientBuckets(model.parameters()), model


def test_a_mirror_gets_the_state_then_each_step_and_a_stranger_gets_nothing(store: dist.TCPStore) -> None:
    got: queue.Queue[Message] = queue.Queue()
    mirror = HotMirror(config(store, "s0"), Sealer(TOKEN, "s0"), 1, got.put, got.put)
    source = HotSource(config(store, "w0"), Sealer(TOKEN, "w0"), 1)
    try:
        until(lambda: store.check([keys.k_hot_slot(0)]), "the standby claims slot 0")
        # A stranger reaches the standby's port first: it cannot answer the challenge, and is dropped.
        with socket.create_connection(mirror.listener.getsockname()[:2], timeout=WAIT_S) as stranger:
            stranger.sendall(bytes(32))
            stranger.recv(32 + 8 + 32)
            stranger.sendall(bytes(32))  # a wrong proof
            assert stranger.recv(1) == b"", "the standby hung up on the stranger"
        state, buckets, model = replica()
        source.place(0, 1)
        until(lambda: source._links.get(0) is not None, "the source links to the standby")
        source.boundary(1, state, buckets.flats, list(model.buffers()))
        source.settle(WAIT_S)  # the parameters and the optimizer's state went as they are: sent before they change
        assert not source._live
        first = got.get(timeout=WAIT_S)
        assert (first.kind, first.step) == ("sync", 1)
        assert [k for k, _ in first.parts] == [k for k, _ in state.tensors()]
        for (_, sent), (_, mine) in zip(first.parts, state.tensors(), strict=True):
            assert torch.equal(sent, mine)
        for g in buckets.flats:
            g.fill_(0.5)
        source.gradients(2, buckets.flats, 1.0)
        source.boundary(2, state, buckets.flats, list(model.buffers()))
        second = got.get(timeout=WAIT_S)
        assert (second.kind, second.step) == ("step", 2)
        grads = [t for k, t in second.parts if k.startswith("grad.")]
        assert len(grads) == len(buckets.flats) and all(bool((g == 0.5).all()) for g in grads)
        assert [k for k, _ in second.parts if k.startswith("buffer.")] == ["buffer.0", "buffer.1", "buffer.2"]
        # A boundary without that step's gradients (a source that just linked) sends the whole state instead.
        source.boundary(3, state, buckets.flats, list(model.buffers()))
        assert got.get(timeout=WAIT_S).kind == "sync"
    finally:
        source.close()
        held = mirror.stop()
    assert held == 3
    assert not store.check([keys.k_hot_slot(0)]) or store.get(keys.k_hot_slot(0)) == b"", "the slot was given back"


def test_a_slot_that_changes_hands_between_two_steps_is_relinked_to_its_new_standby(store: dist.TCPStore) -> None:
    """s0 is linked; its slot is freed (as the coordinator frees a dead standby's) and s1 claims it while no step is
    sent, so the old link cannot notice by a failed send: the source drops it and links s1 by itself."""
    mirrors = [HotMirror(config(store, "s0"), Sealer(TOKEN, "s0"), 1, lambda _: None, lambda _: None)]
    source = HotSource(config(store, "w0"), Sealer(TOKEN, "w0"), 1)
    try:
        source.place(0, 1)
        until(lambda: (link := source._links.get(0)) is not None and link.standby == "s0", "the source links s0")
        assert mirrors[0]._claim_raw is not None
        store.compare_set(keys.k_hot_slot(0), mirrors[0]._claim_raw, "")
        mirrors.append(HotMirror(config(store, "s1"), Sealer(TOKEN, "s1"), 1, lambda _: None, lambda _: None))
        until(lambda: mirrors[1].slot == 0, "s1 claims the freed slot")
        until(lambda: (link := source._links.get(0)) is not None and link.standby == "s1", "the source links s1")
        until(lambda: store.check([keys.k_hot_held("s1")]), "s1 says it is linked")
    finally:
        source.close()
        for m in mirrors:
            m.stop()


def test_a_source_sends_nothing_to_a_listener_that_cannot_prove_it_is_the_standby(store: dist.TCPStore) -> None:
    """The claim is genuine (sealed by the job) but another process listens at its address now."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    host, port = listener.getsockname()[:2]
    records = keys.Records(store, Sealer(TOKEN, "s0"))
    key = keys.k_hot_slot(0)
    store.compare_set(key, "", records.sealer.seal(key, HotClaim("s0", host, port).to_json()))
    source = HotSource(config(store, "w0"), Sealer(TOKEN, "w0"), 1)
    try:
        source.place(0, 1)
        listener.settimeout(WAIT_S)
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(WAIT_S)
            nonce = conn.recv(32)
            conn.sendall(bytes(32) + (5).to_bytes(8, "little", signed=True) + bytes(32))  # a made-up proof
            rest = b""
            while chunk := conn.recv(1 << 16):
                rest += chunk
        assert len(nonce) == 32 and rest == b"", "nothing of the state reached the impostor"
        assert source._links.get(0) is None
    finally:
        source.close()
        listener.close()


def test_a_tampered_byte_or_a_foreign_key_ends_the_link_before_anything_is_applied() -> None:
    state, _, _ = replica()
    msg = Message("sync", 4, state.meta(4).to_json(), list(state.tensors()))
    key = bytes(range(32))

    def wire() -> bytes:
        a, b = socket.socketpair()
        with a, b:
            send_message(a, key, 0, 0, msg)
            a.shutdown(socket.SHUT_WR)
            out = b""
            while chunk := b.recv(1 << 16):
                out += chunk
        return out

    def read(data: bytes, with_key: bytes = key, seq: int = 0) -> Message:
        a, b = socket.socketpair()
        with a, b:
            a.sendall(data)
            a.shutdown(socket.SHUT_WR)
            return recv_message(b, with_key, 0, seq)

    data = wire()
    assert read(data).step == 4
    tampered = bytearray(data)
    tampered[-40] ^= 1  # inside the last tensor's bytes
    with pytest.raises(MirrorError, match="failed its tag"):
        read(bytes(tampered))
    with pytest.raises(MirrorError, match="header failed its tag"):
        read(data, with_key=bytes(32))
    with pytest.raises(MirrorError):
        read(data, seq=1)  # a message replayed out of order
