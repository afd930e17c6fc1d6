"""The store's tunnel: across hosts, nobody without the job's secret reaches the job's store.

torch's TCPStore has no access control: whoever reaches its port can read, overwrite and delete every key (a
heartbeat deleted is a process declared hung and killed). So when the coordinator's address is not a loopback
address, the store itself listens on 127.0.0.1 only, and the job's public store port is a **gate**: mutual TLS
1.3, both ends presenting one certificate derived from the job's secret, then a byte relay to the store on
loopback. On each host the agent keeps a **door**: a listener on 127.0.0.1 whose every connection becomes one TLS
connection to the gate; its processes are given the door as their store (`TM_STORE_HOST=127.0.0.1`). A supervisor
elsewhere (`runtime.wire.control.JobControl`) opens a door of its own. TCPStore's protocol crosses unchanged.

The certificate: an Ed25519 key whose 32-byte seed is HMAC-SHA256(secret, "store-tunnel"), and a self-signed
certificate with fixed fields. Ed25519 signatures are deterministic, so every holder of the secret makes the same
certificate, byte for byte, and trusts that one alone; nothing is distributed but the secret. A peer without the
secret fails the TLS handshake in either direction. The key exists on disk only between writing it to a private
temporary directory and loading it (Python's ssl loads keys from files).

A connection the gate refuses (plain TCP, a TLS client with another certificate, a handshake that stalls past
`HANDSHAKE_S`) is counted and reported through `on_refused` (the coordinator's `untrusted_value` events and
`job_finished.refused_values["store/tunnel"]`), never relayed. Relaying runs on one asyncio loop per gate or door,
in a daemon thread; a closed side closes its pair.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import hmac
import ipaddress
import logging
import os
import shutil
import socket
import ssl
import tempfile
import threading
from collections.abc import Callable, Coroutine
from typing import Any

log = logging.getLogger("trainmover.tunnel")

HANDSHAKE_S = 5.0
"""A connection that has not finished its TLS handshake by then is refused (a silent stranger holds nothing)."""

REFUSED_KIND = "store/tunnel"
"""The kind under which refused connections are counted, beside the sealed records' kinds."""


class TunnelError(ConnectionError):
    """The tunnel could not be set up (no `cryptography` package, a door that cannot reach its gate)."""


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine's loopback (then the store needs no gate: nothing else reaches it)."""
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _certificate(secret: str) -> tuple[bytes, bytes]:
    """(certificate PEM, private key PEM), the same for every holder of `secret`."""
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
        from cryptography.x509.oid import NameOID
    except ImportError:
        raise TunnelError("the store's tunnel across hosts needs the `cryptography` package: pip install "
                          "'cryptography>=42'") from None
    seed = hmac.new(secret.encode(), b"store-tunnel", hashlib.sha256).digest()
    key = ed25519.Ed25519PrivateKey.from_private_bytes(seed)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "trainmover-job-store")])
    utc = datetime.UTC
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(int.from_bytes(seed[:8], "big") | 1)
        .not_valid_before(datetime.datetime(2020, 1, 1, tzinfo=utc))
        .not_valid_after(datetime.datetime(2100, 1, 1, tzinfo=utc))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, None)
    )
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def tunnel_context(secret: str, server: bool) -> ssl.SSLContext:
    """A TLS 1.3 context that presents the job's certificate and accepts a peer only with the same one."""
    cert_pem, key_pem = _certificate(secret)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False  # the certificate is the identity; there are no host names
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(cadata=cert_pem.decode())
    private = tempfile.mkdtemp(prefix="trainmover-tunnel-")  # mode 700
    try:
        cert_path, key_path = os.path.join(private, "job.crt"), os.path.join(private, "job.key")
        for path, data in ((cert_path, cert_pem), (key_path, key_pem)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        ctx.load_cert_chain(cert_path, key_path)
    finally:
        shutil.rmtree(private, ignore_errors=True)
    return ctx


class _Half(asyncio.Protocol):
    """One side of a relayed pair: what it receives is written to its peer, and a side that closes closes both.
    Data that arrives before the peer is connected waits in `pending`; a peer's full write buffer pauses reading."""

    def __init__(self, on_made: Callable[[_Half], None] | None = None) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: _Half | None = None
        self.pending: list[bytes] = []
        self.closed = False
        self._on_made = on_made

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if self._on_made is not None:
            self._on_made(self)

    def data_received(self, data: bytes) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.write(data)
        else:
            self.pending.append(data)

    def eof_received(self) -> bool:
        return False  # close this side; connection_lost closes the other

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()

    def pause_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()


def _join(a: _Half, b: _Half) -> None:
    """Relay between two connected sides from now on, first what either received while alone."""
    a.peer, b.peer = b, a
    for side, other in ((a, b), (b, a)):
        assert other.transport is not None
        if side.pending:
            other.transport.write(b"".join(side.pending))
            side.pending.clear()
        if side.closed:
            other.transport.close()


class _Loop:
    """One asyncio loop in a daemon thread, serving one listening socket."""

    def __init__(self, listener: socket.socket, name: str) -> None:
        listener.setblocking(False)
        self.listener = listener
        self.port: int = listener.getsockname()[1]
        self.loop = asyncio.new_event_loop()
        self._tasks: set[asyncio.Task[None]] = set()
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), name=name, daemon=True)
        self._thread.start()
        if not started.wait(10.0):
            raise TunnelError(f"{name} did not start")

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self._task(self._serve())
        self.loop.call_soon(started.set)
        self.loop.run_forever()
        with contextlib.suppress(Exception):
            tasks = asyncio.all_tasks(self.loop)
            for task in tasks:
                task.cancel()
            self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        self.loop.close()

    def _task(self, coro: Coroutine[Any, Any, None]) -> None:
        task = self.loop.create_task(coro)
        self._tasks.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(self._tasks.discard)

    async def _serve(self) -> None:
        """Accept from the listener until the loop stops."""
        loop = asyncio.get_running_loop()
        while True:
            conn, peer = await loop.sock_accept(self.listener)
            self._task(self._admit(conn, peer))

    async def _admit(self, conn: socket.socket, peer: Any) -> None:
        raise NotImplementedError

    def close(self) -> None:
        if self.loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10.0)
        self.listener.close()


class StoreGate(_Loop):
    """The coordinator's side: TLS on the job's public store port, relayed to the store on loopback."""

    def __init__(self, listener: socket.socket, store_port: int, secret: str,
                 on_refused: Callable[[str, str], None] | None = None) -> None:
        """`listener`: a bound, listening socket (the public port); `on_refused(key, why)` hears every refused
        connection (the coordinator passes its sealer's `refuse`, so they are counted with the records')."""
        self.ctx = tunnel_context(secret, server=True)
        self.store_port = store_port
        self.on_refused = on_refused
        self.refused = 0
        self.relayed = 0
        super().__init__(listener, "trainmover-store-gate")

    def _refuse(self, peer: object, why: str) -> None:
        self.refused += 1
        if self.on_refused is not None:
            self.on_refused(REFUSED_KIND, f"{why} (from {peer})")

    async def _admit(self, conn: socket.socket, peer: Any) -> None:
        # TLS on the bare accepted socket: a TLS server would drop a failed handshake without a word (nothing to
        # count), and a plain stream server would buffer the ClientHello where a later start_tls cannot see it.
        loop = asyncio.get_running_loop()
        try:
            _, outside = await loop.connect_accepted_socket(_Half, conn, ssl=self.ctx,
                                                            ssl_handshake_timeout=HANDSHAKE_S)
        except (OSError, ssl.SSLError, ConnectionError) as exc:
            conn.close()
            self._refuse(peer, f"a connection without the job's certificate ({type(exc).__name__})")
            return
        try:
            _, store = await loop.create_connection(_Half, "127.0.0.1", self.store_port)
        except OSError:
            outside.abort()
            return
        self.relayed += 1
        _join(outside, store)


class StoreDoor(_Loop):
    """A host's side: a listener on 127.0.0.1 whose connections go, over TLS, to the gate at (host, port)."""

    def __init__(self, host: str, port: int, secret: str) -> None:
        self.ctx = tunnel_context(secret, server=False)
        self.gate = (host, port)
        self.last_error = ""
        """Why the last connection to the gate failed ("" while none has)."""
        self.refused = False
        """Whether the gate refused this door's certificate (another secret): retrying cannot help."""
        super().__init__(socket.create_server(("127.0.0.1", 0)), "trainmover-store-door")

    async def _admit(self, conn: socket.socket, peer: Any) -> None:
        loop = asyncio.get_running_loop()
        _, inside = await loop.connect_accepted_socket(_Half, conn)
        host, port = self.gate
        try:
            _, gate = await asyncio.wait_for(
                loop.create_connection(_Half, host, port, ssl=self.ctx, server_hostname=""), HANDSHAKE_S)
        except (TimeoutError, OSError, ssl.SSLError) as exc:
            why = ("the gate refused this secret's certificate (another job's secret?)"
                   if isinstance(exc, ssl.SSLError) else f"{type(exc).__name__}: {exc}")
            if why != self.last_error:
                log.error("the job's store at %s:%d could not be reached through its tunnel: %s", host, port, why)
            self.last_error = why
            inside.abort()
            return
        _join(inside, gate)

    def reachable(self, timeout_s: float) -> bool:
        """Whether the gate answers and accepts this door's certificate (one TLS handshake; `last_error` says
        why not). A plain connection would count as a refused stranger at the gate."""
        host, port = self.gate
        try:
            with socket.create_connection((host, port), timeout=timeout_s) as raw, self.ctx.wrap_socket(raw):
                return True
        except ssl.SSLError:
            self.last_error = "the gate refused this secret's certificate (another job's secret?)"
            self.refused = True
        except OSError as exc:
            self.last_error = f"{type(exc).__name__}: {exc}"
        return False


class Doors:
    """The doors one process keeps, one per gate address, opened when first needed and closed together."""

    def __init__(self, secret: str) -> None:
        self.secret = secret
        self._doors: dict[tuple[str, int], StoreDoor] = {}
        self._lock = threading.Lock()

    def local(self, host: str, port: int) -> tuple[str, int]:
        """The address a store client on this host connects to for the store at (host, port): itself on
        loopback, else this process's door to that gate."""
        if is_loopback(host):
            return host, port
        with self._lock:
            door = self._doors.get((host, port))
            if door is None:
                door = self._doors[(host, port)] = StoreDoor(host, port, self.secret)
        return "127.0.0.1", door.port

    def close(self) -> None:
        with self._lock:
            doors, self._doors = list(self._doors.values()), {}
        for door in doors:
            door.close()
