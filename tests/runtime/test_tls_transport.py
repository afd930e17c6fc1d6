"""The handoff over TLS links (runtime.training.tls_transport): exact copies, refused certificates, outsiders, no hangs.

Every rank runs in a thread of this process with its own store client; every wait is bounded.
"""

from __future__ import annotations

import contextlib
import datetime
import random
import shutil
import socket
import ssl
import struct
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from runtime.training.handoff import HandoffPlan, HandoffSession, run_handoff
from runtime.training.state import StateMeta, TrainingState
from runtime.training.tls_transport import (
    TlsConfig,
    TlsLinkError,
    TlsLinks,
    TlsSetupError,
    k_tls_address,
    make_job_certificate,
    open_tls_links,
    tls_context,
)
from runtime.wire.auth import Sealer
from runtime.wire.store import Records

TOKEN = "the-secret-" + "x" * 32
MEMBERS = ("p0", "p1", "p2")
PLAN = HandoffPlan(target_step=3, sources=(0, 1), receivers=(2,))
JOIN_BOUND_S = 10.0


@pytest.fixture
def store_port() -> Iterator[int]:
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=30),
                           wait_for_workers=False)
    yield server.port
    del server


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> TlsConfig:
    cert, key = make_job_certificate(str(tmp_path_factory.mktemp("job")))
    return TlsConfig(cert, key)


@pytest.fixture(scope="module")
def stranger(tmp_path_factory: pytest.TempPathFactory, job: TlsConfig) -> TlsConfig:
    """Another self-signed certificate, which trusts the job's: so that the honest end is the one that refuses."""
    cert, key = make_job_certificate(str(tmp_path_factory.mktemp("stranger")))
    return TlsConfig(cert, key, ca=job.cert)


@pytest.fixture(autouse=True)
def keep_rng_states() -> Iterator[None]:
    """A receiver applies the sources' RNG states to this process: put them back for the other tests."""
    saved = torch.get_rng_state(), random.getstate(), np.random.get_state()
    yield
    torch.set_rng_state(saved[0])
    random.setstate(saved[1])
    np.random.set_state(saved[2])


def make_state(rank: int, plan: HandoffPlan = PLAN) -> TrainingState:
    receiver = rank in plan.receivers
    torch.manual_seed(100 + rank if receiver else 0)
    model = nn.Sequential(nn.Linear(16, 300), nn.BatchNorm1d(300), nn.Linear(300, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
    for _ in range(1 if receiver else 3):
        model(torch.randn(8, 16, generator=torch.Generator().manual_seed(5))).sum().backward()
        opt.step()
        sched.step()
    return TrainingState(model, opt, sched)


def records_for(port: int) -> Records:
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=10))
    return Records(store, Sealer(TOKEN))


class Rank(threading.Thread):
    """One member's whole part: open its TLS links, run the handoff, close."""

    def __init__(self, port: int, rank: int, cfg: TlsConfig, state: TrainingState, timeout_s: float,
                 corrupt_chunk: int | None = None) -> None:
        super().__init__(name=f"rank-{rank}", daemon=True)
        self.port, self.rank, self.cfg, self.state, self.timeout_s = port, rank, cfg, state, timeout_s
        self.corrupt_chunk = corrupt_chunk
        self.error: BaseException | None = None
        self.meta: StateMeta | None = None
        self.refetched = -1
        self.finished = False

    def fault(self, phase: str, **where: object) -> bool:
        return phase == "handoff_send" and where.get("chunk") == self.corrupt_chunk

    def run(self) -> None:
        session = HandoffSession(1, MEMBERS, "job", TOKEN, chunk_bytes=4096, fault=self.fault)
        try:
            with open_tls_links(PLAN, self.rank, 1, records_for(self.port), self.cfg, self.timeout_s) as links:
                stats, self.meta = run_handoff(PLAN, session, self.rank, self.state, links=links)
                self.refetched = stats.refetched
        except Exception as exc:
            self.error = exc
        self.finished = True


def join_all(ranks: list[Rank], bound_s: float = JOIN_BOUND_S) -> None:
    deadline = time.monotonic() + bound_s
    for r in ranks:
        r.join(max(0.0, deadline - time.monotonic()))
    assert all(r.finished for r in ranks), f"ranks still running after {bound_s} s: a wait is unbounded"


@pytest.mark.parametrize("corrupt", [False, True], ids=["clean", "a-corrupted-chunk-is-fetched-again"])
def test_a_handoff_over_tls_leaves_the_receiver_identical_to_the_sources(
    store_port: int, job: TlsConfig, corrupt: bool
) -> None:
    states = [make_state(r) for r in range(3)]
    before = [s.digest() for s in states]
    assert before[0] == before[1] != before[2]
    # Source 0 flips a bit of its 2nd chunk after taking its MAC: the repair round runs over the same streams.
    ranks = [Rank(store_port, r, job, states[r], timeout_s=10, corrupt_chunk=2 if corrupt and r == 0 else None)
             for r in range(3)]
    t0 = time.monotonic()
    for r in ranks:
        r.start()
    join_all(ranks)

    assert [r.error for r in ranks] == [None, None, None]
    assert ranks[2].meta is not None and ranks[2].meta.step == 3
    assert ranks[2].refetched == (1 if corrupt else 0)
    assert states[2].digest() == states[0].digest() == states[1].digest() == before[0]
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("who", ["receiver", "source"])
def test_a_peer_with_another_certificate_is_refused_and_nothing_is_applied(
    store_port: int, job: TlsConfig, stranger: TlsConfig, who: str
) -> None:
    states = [make_state(r) for r in range(3)]
    before = states[2].digest()
    odd = 2 if who == "receiver" else 1
    timeout_s = 2.0
    ranks = [Rank(store_port, r, stranger if r == odd else job, states[r], timeout_s) for r in range(3)]
    t0 = time.monotonic()
    for r in ranks:
        r.start()
    join_all(ranks)

    assert time.monotonic() - t0 < timeout_s + 3
    assert all(isinstance(r.error, (OSError, RuntimeError)) for r in ranks), [r.error for r in ranks]
    assert ranks[2].meta is None and states[2].digest() == before, "nothing may be applied"
    # The honest end's TLS refused the stranger's certificate.
    honest = ranks[0] if who == "receiver" else ranks[2]
    assert "certificate" in str(honest.error), honest.error


def refused(sock: socket.socket, bound_s: float = 3.0) -> bool:
    """Whether the far end closed `sock` (or reset it) within bound_s."""
    sock.settimeout(bound_s)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


def test_outsiders_at_a_sources_port_do_not_disturb_the_handoff(
    store_port: int, job: TlsConfig, stranger: TlsConfig
) -> None:
    states = [make_state(r) for r in range(3)]
    ranks = [Rank(store_port, r, job, states[r], timeout_s=5) for r in range(3)]
    t0 = time.monotonic()
    ranks[0].start()
    ranks[1].start()
    found = records_for(store_port).wait([k_tls_address(1, 0), k_tls_address(1, 1)], 5)
    addr0, addr1 = ((v["host"], v["port"]) for v in found.values())
    client = tls_context(job, server=False)
    outsiders: list[socket.socket] = []
    try:
        silent = socket.create_connection(addr0, timeout=3)  # plain TCP that never says a word
        outsiders.append(silent)
        junk = socket.create_connection(addr1, timeout=3)  # plain TCP that speaks something else
        outsiders.append(junk)
        junk.sendall(b"GET / HTTP/1.0\r\n\r\n")
        assert refused(junk)
        # A wrong certificate, claiming the receiver's rank: TLS itself refuses it.
        raw = socket.create_connection(addr0, timeout=3)
        outsiders.append(raw)
        try:
            bad = tls_context(stranger, server=False).wrap_socket(raw)
            outsiders.append(bad)
            bad.sendall(struct.pack("<q", 2))
            assert refused(bad)
        except ssl.SSLError:
            pass  # refused during the handshake (TLS 1.2)
        # The job's certificate, but a rank that is not a receiver.
        member = client.wrap_socket(socket.create_connection(addr1, timeout=3))
        outsiders.append(member)
        member.sendall(struct.pack("<q", 0))
        assert refused(member)

        ranks[2].start()
        join_all(ranks)
        assert [r.error for r in ranks] == [None, None, None]
        assert states[2].digest() == states[0].digest() == states[1].digest()
        assert refused(silent, 1.0), "a connection still handshaking when the receivers are in must be closed"
        assert time.monotonic() - t0 < 8
    finally:
        for s in outsiders:
            s.close()


def open_pair(port: int, cfg: TlsConfig, timeout_s: float) -> tuple[TlsLinks, TlsLinks]:
    plan = HandoffPlan(target_step=1, sources=(0,), receivers=(1,))
    opened: dict[int, TlsLinks] = {}

    def open_rank(rank: int) -> None:
        opened[rank] = open_tls_links(plan, rank, 7, records_for(port), cfg, timeout_s=5)

    threads = [threading.Thread(target=open_rank, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert set(opened) == {0, 1}
    # The data phase's own bound: no progress for timeout_s is a failure.
    for links in opened.values():
        for conn in links._conns.values():
            conn.timeout_s = timeout_s
    return opened[0], opened[1]


def test_links_carry_exact_bytes_in_order_and_a_silent_peer_times_out(store_port: int, job: TlsConfig) -> None:
    source, receiver = open_pair(store_port, job, timeout_s=0.5)
    with source, receiver:
        assert source.address is not None and source.peers == (1,) and receiver.peers == (0,)
        big = torch.randint(0, 255, (3_000_001,), dtype=torch.uint8)
        small = torch.arange(12, dtype=torch.float64).reshape(3, 4)
        out_big = torch.zeros_like(big)
        out_small = torch.zeros(4, 3, dtype=torch.float64).t()  # not contiguous: received through a buffer
        works = [receiver.irecv(out_big, 0, 16), receiver.irecv(out_small, 0, 17)]
        sent = [source.isend(big, 1, 16)]
        source.send(small, 1, 17)
        for w in works + sent:
            w.wait()
        assert torch.equal(out_big, big) and torch.equal(out_small, small)

        t0 = time.monotonic()
        with pytest.raises(TlsLinkError, match="no progress"):
            receiver.recv(torch.zeros(8, dtype=torch.uint8), 0, 1)
        assert time.monotonic() - t0 < 3
        with pytest.raises(TlsLinkError):  # the link stays failed
            receiver.send(torch.zeros(8, dtype=torch.uint8), 0, 1)
        with pytest.raises(TlsLinkError, match="no TLS link to rank 5"):
            receiver.send(torch.zeros(1), 5, 1)


def test_a_closed_link_fails_pending_operations_at_once(store_port: int, job: TlsConfig) -> None:
    source, receiver = open_pair(store_port, job, timeout_s=30)
    with receiver:
        pending = receiver.irecv(torch.zeros(1 << 20, dtype=torch.uint8), 0, 16)
        source.send(torch.ones(1000, dtype=torch.uint8), 1, 16)  # part of what the receiver waits for
        t0 = time.monotonic()
        source.close()
        source.close()  # idempotent
        with pytest.raises(TlsLinkError, match="closed"):
            pending.wait()
        assert time.monotonic() - t0 < 3, "a closed peer must not wait out the 30 s timeout"
        with pytest.raises(TlsLinkError):
            source.send(torch.ones(1), 1, 16)
    receiver.close()


def handshake(server_cfg: TlsConfig, client_cfg: TlsConfig) -> bytes:
    a, b = socket.socketpair()
    a.settimeout(5)
    b.settimeout(5)

    def serve() -> None:
        with contextlib.suppress(OSError), tls_context(server_cfg, server=True).wrap_socket(a, server_side=True) as s:
            s.sendall(b"ok")
            s.recv(1)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        with tls_context(client_cfg, server=False).wrap_socket(b) as c:
            got = c.recv(2)
            c.sendall(b"!")
            return got
    finally:
        t.join(5)
        a.close()
        b.close()


@pytest.mark.parametrize("maker", ["openssl", "cryptography"])
def test_make_job_certificate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, maker: str) -> None:
    x509 = pytest.importorskip("cryptography.x509")
    if maker == "openssl" and shutil.which("openssl") is None:
        pytest.skip("no openssl command")
    if maker == "cryptography":
        monkeypatch.setattr("runtime.training.tls_transport.shutil.which", lambda name: None)
    (tmp_path / "cert.pem").write_text("an old one")
    cert_path, key_path = make_job_certificate(str(tmp_path))

    assert Path(key_path).stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cert.pem", "key.pem"]
    cert = x509.load_pem_x509_certificate(Path(cert_path).read_bytes())
    assert cert.subject.rfc4514_string() == "CN=trainmover-job" == cert.issuer.rfc4514_string()
    assert cert.public_key().curve.name == "secp256r1"
    lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert datetime.timedelta(days=29.9) < lifetime < datetime.timedelta(days=30.1)
    cfg = TlsConfig(cert_path, key_path)
    assert cfg.ca == cert_path
    assert handshake(cfg, cfg) == b"ok", "mutual TLS with the job's certificate on both ends"


def test_no_way_to_make_a_certificate_says_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("runtime.training.tls_transport.shutil.which", lambda name: None)
    monkeypatch.setitem(sys.modules, "cryptography", None)
    with pytest.raises(TlsSetupError, match=r"openssl.*--tls-cert"):
        make_job_certificate(str(tmp_path))
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(TlsSetupError, match=r"not '0\.0\.0\.0'"):
        TlsConfig("c", "k", host="0.0.0.0")
