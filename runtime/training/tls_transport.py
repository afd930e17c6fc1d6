"""TLS links for the state handoff (`--handoff-transport tls`): mutual TLS, one connection per (source, receiver).

The Gloo group carries the handoff in the clear. Where standbys sit across a trust boundary, `TlsLinks` carries
the same messages (`runtime.training.handoff.Links`) over TLS instead, with the standard library's `ssl` only:

- The job has one certificate (`make_job_certificate`: self-signed, EC P-256, CN "trainmover-job", 30 days).
  Every member presents it and trusts it alone (`TlsConfig.ca`, the certificate itself by default): a peer
  without the job's key is refused by the TLS handshake, in both directions (`ssl.CERT_REQUIRED` on both ends,
  no host names: the certificate is the identity). TLS 1.2 at least.
- Sources connect to nothing. Each binds a server socket on its own address (`TlsConfig.host`, only there) and
  publishes it as a sealed record `gen/<g>/tls/<rank>`; each receiver reads every source's address and connects
  to each, then names itself with its rank (8 bytes, little-endian). A source accepts exactly one connection per
  receiver of the plan and closes anything else (no TLS, a bad certificate, a rank that is not a receiver, a
  second connection for the same rank), handshaking concurrently so that a silent stranger holds up no one.
  Waiting for the addresses, connecting, accepting and handshaking all share one deadline (`timeout_s`).
  The rank a peer claims is not proof: the handoff's own HMAC challenge (`runtime.training.handoff`) binds both ranks.
- Data: per pair both ends send and receive in the same order, so one ordered byte stream per connection carries
  the protocol (tags are not sent). Every connection has one thread per direction that works through an ordered
  queue of pending operations, writing a tensor's bytes straight from its memory and receiving straight into it.
  OpenSSL's connection object may not be used by two threads at once, so its sockets are non-blocking and every
  SSL call is made under the connection's lock; a thread waits for its socket outside it. A connection that
  breaks, or makes no progress for `timeout_s`, fails its pending and later operations with `TlsLinkError`
  (a `ConnectionError`), which `wait()`, `send()` and `recv()` raise: nothing hangs.

Key material is never logged; errors name files, never their contents.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import logging
import os
import queue
import select
import selectors
import shutil
import socket
import ssl
import struct
import subprocess
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch

from runtime.training.handoff import HandoffPlan, Waiter
from runtime.wire.protocol import RecordError, TlsAddress
from runtime.wire.store import Records, StoreTimeout

log = logging.getLogger("trainmover.tls")

__all__ = [
    "TlsConfig",
    "TlsLinkError",
    "TlsLinks",
    "TlsSetupError",
    "k_tls_address",
    "make_job_certificate",
    "open_tls_links",
    "tls_context",
]

COMMON_NAME = "trainmover-job"
CERT_DAYS = 30
CERT_FILE = "cert.pem"
KEY_FILE = "key.pem"
RANK_BYTES = 8
SEND_PIECE = 1 << 20
"""Bytes per SSL write: a write's timeout then bounds a lack of progress, not the time a whole tensor takes."""
RECV_PIECE = 1 << 20
MAX_HANDSHAKES = 32
"""Connections a source handshakes at once; more are closed at once (a flood cannot exhaust its threads)."""
JOIN_S = 5.0


class TlsSetupError(ValueError):
    """The TLS transport cannot be set up: no way to make a certificate, unreadable files, a bad address."""


class TlsLinkError(ConnectionError):
    """A TLS link of the handoff could not be opened, broke, or made no progress in time."""


def k_tls_address(gen: int, rank: int) -> str:
    """Where source rank `rank` of generation `gen` publishes its TLS address (a sealed `TlsAddress`)."""
    return f"gen/{gen}/tls/{rank}"


# ------------------------------------------------------------------------------------------------ certificate

_OPENSSL_CONFIG = f"""[req]
distinguished_name = dn
x509_extensions = v3
prompt = no
[dn]
CN = {COMMON_NAME}
[v3]
basicConstraints = critical,CA:TRUE
keyUsage = critical,digitalSignature,keyCertSign
extendedKeyUsage = serverAuth,clientAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid:always
"""


def make_job_certificate(directory: str) -> tuple[str, str]:
    """Create a fresh self-signed certificate and key in `directory`: (cert.pem, key.pem), the key mode 0600.

    Files of those names already there are replaced. Uses the `openssl` command, else the `cryptography`
    package; raises `TlsSetupError` if neither is available (or both fail).
    """
    os.makedirs(directory, exist_ok=True)
    cert_path = os.path.join(directory, CERT_FILE)
    key_path = os.path.join(directory, KEY_FILE)
    problems: list[str] = []
    openssl = shutil.which("openssl")
    if openssl is not None:
        try:
            _fresh_key_file(key_path, cert_path)
            _certificate_with_openssl(openssl, directory, cert_path, key_path)
            return cert_path, key_path
        except (OSError, subprocess.SubprocessError) as exc:
            problems.append(f"`openssl req` failed: {_describe(exc)}")
    try:
        from cryptography import x509  # noqa: F401  (only: is it there?)
    except ImportError:
        problems.append("the Python package `cryptography` is not installed")
    else:
        try:
            _fresh_key_file(key_path, cert_path)
            _certificate_with_cryptography(cert_path, key_path)
            return cert_path, key_path
        except (OSError, ValueError) as exc:
            problems.append(f"`cryptography` failed: {_describe(exc)}")
    if openssl is None:
        problems.insert(0, "the `openssl` command is not on PATH")
    for path in (cert_path, key_path):
        with contextlib.suppress(OSError):
            os.unlink(path)
    raise TlsSetupError(
        "cannot create the job's TLS certificate (" + "; ".join(problems) + "). Install openssl (for example "
        "`apt-get install openssl`) or the Python package cryptography (`pip install cryptography`), or pass "
        "your own certificate and key with --tls-cert FILE --tls-key FILE"
    )


def _fresh_key_file(key_path: str, cert_path: str) -> None:
    """Replace both files by an empty key file that only its owner can read (the key is written into it)."""
    for path in (cert_path, key_path):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    os.close(os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))


def _certificate_with_openssl(openssl: str, directory: str, cert_path: str, key_path: str) -> None:
    # Our own config: the system's openssl.cnf may be missing or add extensions we do not want.
    with tempfile.NamedTemporaryFile("w", suffix=".cnf", dir=directory, delete=False) as f:
        f.write(_OPENSSL_CONFIG)
        config = f.name
    try:
        done = subprocess.run(
            [openssl, "req", "-x509", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-sha256", "-days", str(CERT_DAYS), "-config", config, "-keyout", key_path,
             "-out", cert_path],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=60, check=False,
        )
    finally:
        os.unlink(config)
    if done.returncode != 0:
        lines = done.stderr.decode(errors="replace").strip().splitlines()
        raise OSError(f"exit status {done.returncode}: {(lines or ['no message'])[0][:300]}")
    os.chmod(key_path, 0o600)
    if not os.path.getsize(cert_path) or not os.path.getsize(key_path):
        raise OSError("it wrote no certificate or key")


def _certificate_with_cryptography(cert_path: str, key_path: str) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, COMMON_NAME)])
    now = datetime.datetime.now(datetime.UTC)
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                          data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=False,
                          encipher_only=False, decipher_only=False),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False)
        .add_extension(ski, critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False)
        .sign(key, hashes.SHA256())
    )
    with open(key_path, "wb") as f:  # created 0600 by _fresh_key_file
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    with open(cert_path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))


# ------------------------------------------------------------------------------------------------ configuration


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """The job's certificate and key (files), the CA to trust (the certificate itself unless given), and the
    address this member binds and advertises when it is a source (an address of its own, not a wildcard)."""

    cert: str
    key: str
    ca: str | None = None
    host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if self.ca is None:
            object.__setattr__(self, "ca", self.cert)
        host = self.host.strip()
        unspecified = host in ("", "*")
        with contextlib.suppress(ValueError):
            unspecified = unspecified or ipaddress.ip_address(host.strip("[]")).is_unspecified
        if unspecified:
            raise TlsSetupError(f"the TLS host must be an address of this machine that its peers can reach, not "
                                f"{self.host!r} (a source binds and advertises that address only)")

    @property
    def trusted(self) -> str:
        return self.ca or self.cert


def tls_context(cfg: TlsConfig, server: bool) -> ssl.SSLContext:
    """A context that presents the job's certificate and requires the peer's, verified against `cfg.ca`."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = False  # the job's certificate is the identity; members have no host names to check
    ctx.verify_mode = ssl.CERT_REQUIRED
    if server:
        ctx.num_tickets = 0  # no session resumption: a ticket would be a message the receiver never reads
    try:
        ctx.load_cert_chain(cfg.cert, cfg.key)
    except (OSError, ValueError) as exc:
        raise TlsSetupError(f"cannot load the TLS certificate {cfg.cert} with its key {cfg.key}: "
                            f"{_describe(exc)}") from None
    try:
        ctx.load_verify_locations(cafile=cfg.trusted)
    except (OSError, ValueError) as exc:
        raise TlsSetupError(f"cannot load the trusted TLS certificate {cfg.trusted}: {_describe(exc)}") from None
    with contextlib.suppress(OSError):
        if os.stat(cfg.key).st_mode & 0o077 and cfg.key not in _WARNED_KEYS:
            _WARNED_KEYS.add(cfg.key)
            log.warning("the TLS key file %s is readable by other users; run `chmod 600 %s`", cfg.key, cfg.key)
    return ctx


_WARNED_KEYS: set[str] = set()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"{exc.verify_message or exc} (does the peer hold the job's certificate?)"
    if isinstance(exc, TimeoutError):
        return str(exc) or "timed out"
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


# ------------------------------------------------------------------------------------------------ one connection


class _Op:
    """One transfer queued on a connection; its own Waiter."""

    __slots__ = ("_after", "_done", "_error", "_keep", "kind", "peer", "tag", "view")

    def __init__(self, kind: str, peer: int, tag: int, view: memoryview, keep: torch.Tensor,
                 after: Callable[[], None] | None = None) -> None:
        self.kind = kind
        self.peer = peer
        self.tag = tag
        self.view = view
        self._keep = keep  # the memory behind `view` lives until the transfer is over
        self._after = after
        self._done = threading.Event()
        self._error: str | None = None

    def finish(self, error: str | None) -> None:
        if error is None and self._after is not None:
            try:
                self._after()
            except (RuntimeError, ValueError) as exc:
                error = f"could not copy the received bytes into the tensor: {_describe(exc)}"
        self._error = error
        self._after = None
        self._done.set()

    def wait(self) -> None:
        self._done.wait()
        if self._error is not None:
            way = "to" if self.kind == "send" else "from"
            raise TlsLinkError(f"{self.kind} of {len(self.view)} bytes {way} rank {self.peer} (tag {self.tag}) over "
                               f"TLS failed: {self._error}")


class _Conn:
    """A TLS connection to one peer: an ordered queue and a worker thread per direction."""

    def __init__(self, rank: int, peer: int, sock: ssl.SSLSocket, timeout_s: float) -> None:
        self.rank = rank
        self.peer = peer
        self.sock = sock
        self.timeout_s = timeout_s
        sock.setblocking(False)
        self._fd = sock.fileno()
        self._io = threading.Lock()  # one SSL call at a time: OpenSSL's connection is not thread safe
        self._cond = threading.Condition()
        self._queues: dict[str, deque[_Op]] = {"send": deque(), "recv": deque()}
        self._error: str | None = None
        self.threads = [
            threading.Thread(target=self._work, args=(kind,), name=f"tls-{kind}-{rank}-{peer}", daemon=True)
            for kind in ("send", "recv")
        ]
        for t in self.threads:
            t.start()

    def submit(self, op: _Op) -> None:
        with self._cond:
            if self._error is None:
                self._queues[op.kind].append(op)
                self._cond.notify_all()
                return
            error = self._error
        op.finish(error)

    def fail(self, error: str) -> None:
        """Fail every pending and later operation, and shut the connection (waking a worker that waits on it)."""
        with self._cond:
            if self._error is not None:
                return
            self._error = error
            pending = [op for q in self._queues.values() for op in q]
            for q in self._queues.values():
                q.clear()
            self._cond.notify_all()
        for op in pending:
            op.finish(error)
        with contextlib.suppress(OSError):
            # The plain socket's shutdown: SSLSocket.shutdown would drop the SSL object under a worker's feet.
            socket.socket.shutdown(self.sock, socket.SHUT_RDWR)

    def close(self, deadline: float) -> None:
        self.fail("the TLS links were closed")
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if self._io.acquire(timeout=max(0.0, deadline - time.monotonic())):
            try:
                self.sock.close()
            finally:
                self._io.release()

    def _work(self, kind: str) -> None:
        q = self._queues[kind]
        while True:
            with self._cond:
                while not q and self._error is None:
                    self._cond.wait()
                if self._error is not None:
                    return  # fail() finished whatever was queued
                op = q.popleft()
            try:
                if kind == "send":
                    self._send(op.view)
                else:
                    self._recv(op.view)
            except Exception as exc:
                error = self._error or _describe(exc)
                op.finish(error)
                self.fail(error)
                return
            op.finish(None)

    def _check(self) -> None:
        if self._error is not None:
            raise ConnectionError(self._error)

    def _await(self, write: bool) -> None:
        """Wait until the socket can make progress; no progress for timeout_s is a failure."""
        timeout_ms = max(1, int(self.timeout_s * 1000))
        if hasattr(select, "poll"):
            poller = select.poll()
            poller.register(self._fd, select.POLLOUT if write else select.POLLIN)
            ready = bool(poller.poll(timeout_ms))
        else:  # pragma: no cover - platforms without poll
            r, w, _ = select.select([] if write else [self._fd], [self._fd] if write else [], [], timeout_ms / 1000)
            ready = bool(r or w)
        if not ready:
            raise TimeoutError(f"no progress for {self.timeout_s:g} s (the peer stopped "
                               f"{'reading' if write else 'sending'})")

    def _send(self, view: memoryview) -> None:
        n = len(view)
        off = 0
        while off < n:
            piece = view[off : off + SEND_PIECE]  # a retried SSL write must repeat the same bytes: so it does
            while True:
                self._check()
                want_write: bool | None = None
                with self._io:
                    try:
                        sent = self.sock.send(piece)
                    except ssl.SSLWantWriteError:
                        want_write = True
                    except ssl.SSLWantReadError:
                        want_write = False
                if want_write is None:
                    break
                self._await(want_write)
            off += sent

    def _recv(self, view: memoryview) -> None:
        n = len(view)
        got = 0
        while got < n:
            self._check()
            want_write: bool | None = None
            with self._io:
                try:
                    k = self.sock.recv_into(view[got:], min(n - got, RECV_PIECE))
                except ssl.SSLWantReadError:
                    want_write = False
                except ssl.SSLWantWriteError:
                    want_write = True
            if want_write is not None:
                self._await(want_write)
                continue
            if k == 0:
                raise ConnectionError(f"the connection was closed after {got} of {n} bytes")
            got += k


def _send_view(t: torch.Tensor) -> tuple[memoryview, torch.Tensor]:
    """The bytes of `t`, without a copy for a contiguous CPU tensor (another is copied, to the host)."""
    flat = t.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.contiguous()
    if flat.numel() == 0:
        return memoryview(b""), flat
    return flat.view(torch.uint8).numpy().data, flat


def _recv_view(t: torch.Tensor) -> tuple[memoryview, torch.Tensor, Callable[[], None] | None]:
    """Where to receive `t`: its own memory if it is a contiguous CPU tensor, else a host buffer copied after."""
    if t.device.type == "cpu" and t.is_contiguous():
        flat = t.detach().reshape(-1)
        after = None
    else:
        flat = torch.empty(t.numel(), dtype=t.dtype)
        target = t.detach()

        def after() -> None:
            target.copy_(flat.view(target.shape))

    if flat.numel() == 0:
        return memoryview(bytearray()), flat, after
    return flat.view(torch.uint8).numpy().data, flat, after


# ------------------------------------------------------------------------------------------------ the links


class TlsLinks:
    """`runtime.training.handoff.Links` over one TLS connection per (source, receiver) pair of one handoff."""

    def __init__(self, rank: int, conns: dict[int, ssl.SSLSocket], timeout_s: float,
                 address: tuple[str, int] | None = None) -> None:
        self.rank = rank
        self.timeout_s = timeout_s
        self.address = address
        """The (host, port) this member listened on as a source; None otherwise."""
        self._conns = {peer: _Conn(rank, peer, sock, timeout_s) for peer, sock in conns.items()}
        self._closed = False
        self._lock = threading.Lock()

    @property
    def peers(self) -> tuple[int, ...]:
        return tuple(sorted(self._conns))

    def _conn(self, peer: int) -> _Conn:
        conn = self._conns.get(peer)
        if conn is None:
            raise TlsLinkError(f"rank {self.rank} has no TLS link to rank {peer} in this handoff")
        return conn

    def _post(self, op: _Op) -> Waiter:
        conn = self._conn(op.peer)
        if len(op.view) == 0:
            op.finish(None)
        else:
            conn.submit(op)
        return op

    def isend(self, t: torch.Tensor, peer: int, tag: int) -> Waiter:
        view, keep = _send_view(t)
        return self._post(_Op("send", peer, tag, view, keep))

    def irecv(self, t: torch.Tensor, peer: int, tag: int) -> Waiter:
        view, keep, after = _recv_view(t)
        return self._post(_Op("recv", peer, tag, view, keep, after))

    def send(self, t: torch.Tensor, peer: int, tag: int) -> None:
        self.isend(t, peer, tag).wait()

    def recv(self, t: torch.Tensor, peer: int, tag: int) -> None:
        self.irecv(t, peer, tag).wait()

    def close(self) -> None:
        """Close every connection and join its threads (bounded); pending operations fail. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        deadline = time.monotonic() + JOIN_S
        for conn in self._conns.values():
            conn.fail("the TLS links were closed")
        for conn in self._conns.values():
            conn.close(deadline)

    def __enter__(self) -> TlsLinks:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


# ------------------------------------------------------------------------------------------------ opening


def open_tls_links(
    plan: HandoffPlan, rank: int, gen: int, records: Records, cfg: TlsConfig, timeout_s: float, *,
    interrupt: Callable[[], str | None] | None = None,
) -> TlsLinks:
    """Open this member's TLS links for the handoff of generation `gen`, all within `timeout_s`.

    A source listens on `cfg.host`, publishes its address and accepts one connection per receiver; a receiver
    connects to every source; any other member opens nothing. Raises `TlsSetupError` for unusable files or
    addresses, `TlsLinkError` when a link cannot be opened in time, `runtime.wire.store.Interrupted` if `interrupt()`
    names a reason while a receiver waits for the sources' addresses.
    """
    deadline = time.monotonic() + timeout_s
    if rank in plan.sources and plan.receivers:
        ctx = tls_context(cfg, server=True)
        listener = _listen(cfg.host)
        try:
            address = (cfg.host, int(listener.getsockname()[1]))
            records.put(k_tls_address(gen, rank), TlsAddress(address[0], address[1]))
            log.debug("handoff source rank %d listens for TLS on %s:%d", rank, *address)
            accepted = _accept(listener, ctx, rank, plan.receivers, deadline, timeout_s)
        finally:
            listener.close()
        return TlsLinks(rank, accepted, timeout_s, address)
    if rank in plan.receivers:
        ctx = tls_context(cfg, server=False)
        keys = {s: k_tls_address(gen, s) for s in plan.sources}
        try:
            found = records.wait(list(keys.values()), max(0.0, deadline - time.monotonic()), interrupt,
                                 what=f"the TLS addresses of source ranks {list(plan.sources)}")
        except StoreTimeout as exc:
            raise TlsLinkError(f"rank {rank}: {exc}") from None
        conns: dict[int, ssl.SSLSocket] = {}
        try:
            for source in plan.sources:
                host, port = _address(found[keys[source]], source)
                try:
                    conns[source] = _connect(ctx, rank, host, port, deadline)
                except (OSError, ValueError) as exc:
                    raise TlsLinkError(f"rank {rank} could not open its TLS link to source rank {source} at "
                                       f"{host}:{port}: {_describe(exc)}") from None
        except BaseException:
            for sock in conns.values():
                sock.close()
            raise
        return TlsLinks(rank, conns, timeout_s)
    return TlsLinks(rank, {}, timeout_s)


def _address(value: Any, source: int) -> tuple[str, int]:
    try:
        address = TlsAddress.from_json(value)
    except RecordError:
        address = TlsAddress("", 0)
    if not address.host or not 0 < address.port < 65536:
        raise TlsLinkError(f"source rank {source} published no usable TLS address: {value!r}")
    return address.host, address.port


def _listen(host: str) -> socket.socket:
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        listener = socket.socket(family, kind, proto)
    except OSError as exc:
        raise TlsSetupError(f"cannot listen for the handoff's TLS links on {host!r}: {_describe(exc)}") from None
    try:
        listener.bind(addr)
        listener.listen(64)
    except OSError as exc:
        listener.close()
        raise TlsSetupError(f"cannot listen for the handoff's TLS links on {host!r}: {_describe(exc)}") from None
    return listener


def _connect(ctx: ssl.SSLContext, rank: int, host: str, port: int, deadline: float) -> ssl.SSLSocket:
    sock = socket.create_connection((host, port), timeout=_left(deadline))
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        tls = ctx.wrap_socket(sock, server_side=False, do_handshake_on_connect=False)
    except BaseException:
        sock.close()
        raise
    try:
        tls.settimeout(_left(deadline))
        tls.do_handshake()
        tls.sendall(struct.pack("<q", rank))
    except BaseException:
        tls.close()
        raise
    return tls


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("timed out")
    return left


def _read_exact(sock: ssl.SSLSocket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError(f"closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def _accept(listener: socket.socket, ctx: ssl.SSLContext, rank: int, receivers: tuple[int, ...], deadline: float,
            timeout_s: float) -> dict[int, ssl.SSLSocket]:
    """One TLS connection from each receiver, each naming its rank; anything else is closed. Bounded by deadline."""
    wanted = set(receivers)
    accepted: dict[int, ssl.SSLSocket] = {}
    results: queue.SimpleQueue[tuple[int, ssl.SSLSocket | None, str, str]] = queue.SimpleQueue()
    lock = threading.Lock()
    handshaking: set[ssl.SSLSocket] = set()
    busy = [0]
    over = [False]
    wake_r, wake_w = socket.socketpair()
    wake_r.setblocking(False)
    refused: list[str] = []

    def refuse(who: str, why: str) -> None:
        refused.append(f"{who}: {why}")
        (log.warning if len(refused) == 1 else log.debug)(
            "handoff source rank %d refused a TLS connection from %s: %s", rank, who, why)

    def handshake(conn: socket.socket, who: str) -> None:
        tls: ssl.SSLSocket | None = None
        outcome: tuple[int, ssl.SSLSocket | None, str, str] = (-1, None, who, "")
        try:
            conn.settimeout(_left(deadline))
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            tls = ctx.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
            with lock:
                if over[0]:
                    raise ConnectionError("every receiver is connected already")
                handshaking.add(tls)
            tls.do_handshake()
            (claimed,) = struct.unpack("<q", _read_exact(tls, RANK_BYTES))
            outcome = (int(claimed), tls, who, "")
        except (OSError, ValueError) as exc:
            outcome = (-1, None, who, _describe(exc))
        finally:
            with lock:
                if tls is not None:
                    handshaking.discard(tls)
                busy[0] -= 1
                keep = not over[0] and outcome[1] is not None
                if not over[0]:
                    results.put(outcome)
            if not keep:
                for s in (tls, conn):
                    if s is not None:
                        s.close()
            with contextlib.suppress(OSError):
                wake_w.send(b"\0")

    def take(outcome: tuple[int, ssl.SSLSocket | None, str, str]) -> None:
        claimed, tls, who, why = outcome
        if tls is None:
            refuse(who, why)
        elif claimed not in wanted:
            tls.close()
            refuse(who, f"it claims rank {claimed}, which is not a receiver of this handoff")
        elif claimed in accepted:
            tls.close()
            refuse(who, f"a second connection for receiver rank {claimed}")
        else:
            accepted[claimed] = tls

    sel = selectors.DefaultSelector()
    listener.setblocking(False)
    sel.register(listener, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    ok = False
    try:
        while True:
            while True:
                try:
                    take(results.get_nowait())
                except queue.Empty:
                    break
            if len(accepted) == len(wanted):
                ok = True
                return accepted
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(wanted - set(accepted))
                more = f"; refused {len(refused)} connection(s), the last {refused[-1]}" if refused else ""
                raise TlsLinkError(f"handoff source rank {rank} waited {timeout_s:g} s for the TLS connections of "
                                   f"receiver ranks {missing}{more}")
            for key, _ in sel.select(left):
                if key.fileobj is wake_r:
                    with contextlib.suppress(OSError):
                        wake_r.recv(4096)
                    continue
                try:
                    conn, addr = listener.accept()
                except (BlockingIOError, InterruptedError):
                    continue
                who = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
                with lock:
                    full = busy[0] >= MAX_HANDSHAKES
                    if not full:
                        busy[0] += 1
                if full:
                    conn.close()
                    refuse(who, f"{MAX_HANDSHAKES} handshakes are under way already")
                    continue
                threading.Thread(target=handshake, args=(conn, who), name=f"tls-accept-{rank}", daemon=True).start()
    finally:
        with lock:
            over[0] = True
            stragglers = list(handshaking)
        for s in stragglers:  # wake them: their connections are refused
            with contextlib.suppress(OSError):
                socket.socket.shutdown(s, socket.SHUT_RDWR)
        while True:  # outcomes queued after the last look
            try:
                late = results.get_nowait()
            except queue.Empty:
                break
            if late[1] is not None:
                late[1].close()
        if not ok:
            for s in accepted.values():
                s.close()
        sel.close()
        wake_r.close()
        wake_w.close()
