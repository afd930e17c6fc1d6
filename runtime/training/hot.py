"""Hot standbys: a standby that mirrors a data-parallel job's state every step, so that its takeover moves nothing.

A warm standby holds the script's model but not the job's state: its promotion waits for a handoff of the whole
state (`runtime.training.handoff`). A hot standby (`--hot-standbys N`: up to N of the standbys) keeps a copy of
the state as of the last committed step, in its own memory, and joins a new generation holding it: the handoff's
plan (`plan_handoff`) then finds it among the holders of the newest step and sends it nothing.

**Which standby mirrors, from whom**: the job has N hot slots (`hot/slot/<i>` in the store). A warm standby claims a
free one with a sealed `HotClaim` (its name and the address it listens on, `bind_host`), written by compare_set so
that two standbys never hold one slot. The member at rank `i % world` of the current generation serves slot i (in
a data-parallel job every member holds the same state): a thread of its own (`HotSource`) looks at its slots every
`SLOT_POLL_S`, and connects to a claimant it has no link to. A promoted standby gives its slot back; the coordinator
frees the slot of a standby that died (`free_hot_slot`).

**The link** is one TCP connection, source to standby. Before anything of the state is sent, the standby proves that
it belongs to the job (an HMAC of the job's secret over both sides' fresh nonces, its slot, its name and the step it
holds), then the source proves it too (a standby applies nothing from a stranger). Every message then carries a
Poly1305 tag per part under a one-time key derived from the link's own key (`chunk_mac`, as the handoff's chunks):
a part that fails its tag ends the link and leaves the standby's state as it was (every part is verified before any
is applied). The link is one-way: the source never reads from it after the proofs.

**What travels** (`HotSource.boundary`, after the script's loop body ran for step s):

* `sync`: the whole state of step s (the handoff's tensors and its metadata), when the standby holds another step
  (it is new, or it fell behind). The parameters and the optimizer's state are sent as they are, beside the next
  step's forward and backward passes, which only read them; the optimizer step waits until they are sent
  (`HotSource.settle`). The buffers and the registered state, which a forward pass or a loop body may change, are
  cloned;
* `step`: what turns the state of step s - 1 into that of step s: the step's averaged gradients (cloned right after
  the exchange, before clipping or a GradScaler touch them), its learning-rate factor (a shrunk job), the model's
  buffers (BatchNorm statistics) and the registered state's tensors after the loop body (EMA weights, the
  GradScaler, the data cursor), with the state's metadata (scheduler, parameter groups, RNG, optimizer values).
  The standby runs the same optimizer step on the same gradients (`Trainer._optimizer_step`: clipping, unscaling,
  the step), then takes the rest as sent: its state is the source's, bit for bit.

A `step` message is a third of the state's bytes (no optimizer moments), cloned in the training thread (one memory
copy of the gradients per step) and sent from a thread per link. A link whose standby falls two messages behind
gets a `sync` once its queue drains, instead of growing memory. A lost source leaves its standby holding the last
step it applied; the new member at its slot's rank connects again, and sends a `sync` only if the standby holds
another step than its own.

A promoted hot standby stops its mirror between two messages (`HotMirror.stop`): it joins holding the newest step
it applied. If that is the generation's target step, nothing is sent to it; if it is older (a message was in
flight), it is a survivor behind the others and receives the state as one (`keep_own`), never worse than warm.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import queue
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from runtime.config import ProcessConfig
from runtime.training.handoff import chunk_mac, tensor_bytes
from runtime.training.state import TrainingState, _dtype_from_name, _dtype_name
from runtime.wire import store as keys
from runtime.wire.auth import Sealer, derive, prove
from runtime.wire.protocol import HotClaim, HotHeld

log = logging.getLogger("trainmover.runtime")

SLOT_POLL_S = 0.25
"""How often a source looks at its slots, and a standby without a slot tries to claim one."""
LINK_TIMEOUT_S = 30.0
"""A link that makes no progress this long (connecting, proving, sending, receiving a message) is closed."""
MAX_QUEUED = 2
"""Messages a source keeps queued for one standby; beyond, the standby is sent a `sync` once the queue drains."""
MAX_HEADER_BYTES = 64 << 20
NONCE_BYTES = 32
PROOF_BYTES = 32
TAG_BYTES = 16
HEADER_INDEX = -1


class MirrorError(ConnectionError):
    """A link broke, a peer failed its proof or a part its tag: the link ends; nothing half-received is applied."""


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray(n)
    _recv_into(sock, memoryview(out))
    return bytes(out)


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise MirrorError("the link was closed by its peer")
        got += n


def _link_key(token: str, job_id: str, slot: int, nonce_c: bytes, nonce_s: bytes) -> bytes:
    return hmac.new(derive(token, "hot-mirror"), b"\x1f".join([job_id.encode(), str(slot).encode(), nonce_c, nonce_s]),
                    "sha256").digest()


def _standby_proof(token: str, job_id: str, slot: int, standby: str, held: int, nonce_c: bytes,
                   nonce_s: bytes) -> bytes:
    return bytes.fromhex(prove(token, "hot", "standby", job_id, slot, standby, held, nonce_c.hex(), nonce_s.hex()))


def _source_proof(token: str, job_id: str, slot: int, standby: str, nonce_c: bytes, nonce_s: bytes) -> bytes:
    return bytes.fromhex(prove(token, "hot", "source", job_id, slot, standby, nonce_c.hex(), nonce_s.hex()))


@dataclass
class Message:
    """One message of a link: its header (JSON) and its parts, in order."""

    kind: str
    """"sync" (the whole state of `step`) or "step" (from the state of `step - 1` to that of `step`)."""
    step: int
    meta: dict[str, Any]
    parts: list[tuple[str, torch.Tensor]]
    lr_factor: float = 1.0

    def header(self, seq: int) -> bytes:
        return json.dumps({"seq": seq, "kind": self.kind, "step": self.step, "lr_factor": self.lr_factor,
                           "meta": self.meta,
                           "parts": [[name, list(t.shape), _dtype_name(t.dtype)] for name, t in self.parts]}).encode()


def send_message(sock: socket.socket, key: bytes, slot: int, seq: int, msg: Message) -> int:
    """Write one message (header, then each part's bytes and tag); returns the bytes written."""
    header = msg.header(seq)
    sock.sendall(struct.pack("<q", len(header)) + header + chunk_mac(key, slot, seq, HEADER_INDEX, header))
    sent = len(header) + 8 + TAG_BYTES
    for j, (_, t) in enumerate(msg.parts):
        data = tensor_bytes(t)
        sock.sendall(data)
        sock.sendall(chunk_mac(key, slot, seq, j, data))
        sent += len(data) + TAG_BYTES
    return sent


def recv_message(sock: socket.socket, key: bytes, slot: int, seq: int) -> Message:
    """Read and verify one message; `MirrorError` for a broken link, a bad tag or a malformed header."""
    (n,) = struct.unpack("<q", _recv_exact(sock, 8))
    if not 0 < n <= MAX_HEADER_BYTES:
        raise MirrorError(f"a mirror message header of {n} bytes")
    header = _recv_exact(sock, n)
    if not hmac.compare_digest(_recv_exact(sock, TAG_BYTES), chunk_mac(key, slot, seq, HEADER_INDEX, header)):
        raise MirrorError("a mirror message header failed its tag")
    try:
        raw = json.loads(header)
        if raw["seq"] != seq:
            raise ValueError(f"sequence {raw['seq']}, expected {seq}")
        shapes = [(str(name), tuple(int(d) for d in shape), _dtype_from_name(str(dtype)))
                  for name, shape, dtype in raw["parts"]]
        kind, step, lr_factor, meta = str(raw["kind"]), int(raw["step"]), float(raw["lr_factor"]), raw["meta"]
    except (ValueError, KeyError, TypeError) as exc:
        raise MirrorError(f"a malformed mirror message header: {exc}") from None
    if kind not in ("sync", "step"):
        raise MirrorError(f"a mirror message of kind {kind!r}")
    parts = []
    for j, (name, shape, dtype) in enumerate(shapes):
        t = torch.empty(shape, dtype=dtype)
        view = tensor_bytes(t)
        _recv_into(sock, view)
        if not hmac.compare_digest(_recv_exact(sock, TAG_BYTES), chunk_mac(key, slot, seq, j, view)):
            raise MirrorError(f"part {name!r} of the mirror message of step {step} failed its tag")
        parts.append((name, t))
    return Message(kind, step, meta, parts, lr_factor)


# -- the source: a member of the current generation --------------------------------------------------------------
@dataclass
class _Link:
    slot: int
    standby: str
    sock: socket.socket
    key: bytes
    step: int | None
    """The step the standby will hold once every queued message is applied (None: it needs a `sync`)."""
    queue: queue.Queue[tuple[Message, threading.Event] | None] = field(default_factory=lambda: queue.Queue())
    """Messages to send, each with the event set once it is sent (or the link ended)."""
    seq: int = 0
    dead: bool = False
    thread: threading.Thread | None = None
    bytes_sent: int = 0

    def send_loop(self) -> None:
        try:
            while True:
                item = self.queue.get()
                if item is None:
                    return
                msg, sent = item
                try:
                    self.bytes_sent += send_message(self.sock, self.key, self.slot, self.seq, msg)
                finally:
                    sent.set()
                self.seq += 1
        except (OSError, MirrorError) as exc:
            log.info("hot standby %s: its link ended (%s)", self.standby, exc)
        finally:
            self.dead = True
            _close(self.sock)
            while True:  # whoever waits for a message that will not be sent now
                try:
                    left = self.queue.get_nowait()
                except queue.Empty:
                    break
                if left is not None:
                    left[1].set()

    def close(self) -> None:
        """End the link: its thread's send fails at once and the thread closes the socket (never closed under it,
        whose descriptor another connection could take)."""
        self.dead = True
        self.queue.put(None)
        _shut(self.sock)


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def _close(sock: socket.socket) -> None:
    _shut(sock)
    sock.close()


class HotSource:
    """A member's side of the hot standbys it serves (the slots `i` with `i % world == rank`)."""

    def __init__(self, cfg: ProcessConfig, sealer: Sealer, slots: int) -> None:
        self.cfg = cfg
        self.sealer = sealer
        self.slots = slots
        self._where: tuple[int, int] | None = None
        self._links: dict[int, _Link] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._grads: tuple[int, float, list[torch.Tensor]] | None = None
        self._live: list[tuple[_Link, threading.Event]] = []
        """`sync` messages that read the live parameters and optimizer state: sent before the next optimizer step."""
        self._refused: dict[str, float] = {}
        self._thread = threading.Thread(target=self._discover, name="tm-hot-source", daemon=True)
        self._thread.start()

    # -- the training thread -----------------------------------------------------------------------------
    def place(self, rank: int, world: int) -> None:
        """This member's rank and world size in the generation it trains in now."""
        self._where = (rank, world)

    def wants_gradients(self) -> bool:
        with self._lock:
            return any(not link.dead and link.step is not None for link in self._links.values())

    def gradients(self, step: int, flats: list[torch.Tensor], lr_factor: float) -> None:
        """Right after step `step`'s exchange: keep a copy of its averaged gradients for the `step` messages."""
        self._grads = (step, lr_factor, [f.detach().clone() for f in flats]) if self.wants_gradients() else None

    def boundary(self, step: int, state: TrainingState, flats: list[torch.Tensor], buffers: list[torch.Tensor]) -> None:
        """Step `step` committed and the script's loop body ran: send each standby what brings it there."""
        with self._lock:
            for slot in [s for s, link in self._links.items() if link.dead]:
                del self._links[slot]
            links = list(self._links.values())
        if not links:
            self._grads = None
            return
        grads, self._grads = self._grads, None
        sync: Message | None = None
        stepped: Message | None = None
        for link in links:
            if link.step == step:
                continue  # it already holds this step (a new source reached it where the old one left it)
            if link.queue.qsize() >= MAX_QUEUED:
                link.step = None  # fell behind: a sync once its queue drains
                continue
            if link.step == step - 1 and grads is not None and grads[0] == step:
                if stepped is None:
                    stepped = self._step_message(step, state, grads, buffers)
                link.queue.put((stepped, threading.Event()))
            elif link.queue.qsize() == 0:
                if sync is None:
                    sync = self._sync_message(step, state, buffers)
                sent = threading.Event()
                link.queue.put((sync, sent))
                self._live.append((link, sent))
            else:
                continue
            link.step = step

    def settle(self, timeout_s: float = LINK_TIMEOUT_S) -> None:
        """Before anything changes the parameters or the optimizer's state (the optimizer step, a handoff received):
        the `sync` messages that read them live are sent; a link that does not send its in `timeout_s` is ended
        (its socket shut first, so that nothing read after this point can reach its standby)."""
        live, self._live = self._live, []
        deadline = time.monotonic() + timeout_s
        for link, sent in live:
            if not sent.wait(max(0.0, deadline - time.monotonic())):
                log.info("hot standby %s: the state was not sent within %.0f s; its link ended", link.standby,
                         timeout_s)
                link.close()

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            links, self._links = list(self._links.values()), {}
        for link in links:
            link.close()
        self._live = []

    @staticmethod
    def _sync_message(step: int, state: TrainingState, buffers: list[torch.Tensor]) -> Message:
        """The whole state of step `step`: the parameters and the optimizer's state as they are (only the next
        optimizer step changes them: `settle` waits for the message before it), the buffers (a forward pass changes
        them) and the registered state (the next loop body may) cloned."""
        meta = state.meta(step)
        moving = {b.data_ptr() for b in buffers}
        parts = [(k, t.detach().clone() if k.startswith("extra.") or t.data_ptr() in moving else t.detach())
                 for k, t in state.tensors()]
        return Message("sync", step, meta.to_json(), parts)

    @staticmethod
    def _step_message(step: int, state: TrainingState, grads: tuple[int, float, list[torch.Tensor]],
                      buffers: list[torch.Tensor]) -> Message:
        _, lr_factor, flats = grads
        meta = state.meta(step)
        parts = [(f"grad.{i}", f) for i, f in enumerate(flats)]
        parts += [(f"buffer.{i}", b.detach().clone()) for i, b in enumerate(buffers)]
        parts += [(k, t.detach().clone()) for k, t in state.tensors() if k.startswith("extra.")]
        return Message("step", step, meta.to_json(), parts, lr_factor)

    # -- the discovery thread ----------------------------------------------------------------------------
    def _discover(self) -> None:
        store: dist.Store | None = None
        while not self._closed.wait(SLOT_POLL_S):
            try:
                if store is None:
                    store = keys.connect(self.cfg.store_host, self.cfg.store_port)
                self._look(keys.Records(store, self.sealer))
            except Exception as exc:  # the store gone (the job ends), a peer gone: look again later
                log.debug("hot standbys: %s", exc)
                store = None

    def _look(self, records: keys.Records) -> None:
        where = self._where
        if where is None:
            return
        rank, world = where
        for slot in range(self.slots):
            with self._lock:
                link = self._links.get(slot)
            if slot % world != rank:
                if link is not None:
                    with self._lock:
                        self._links.pop(slot, None)
                    link.close()
                continue
            _, claim = records.get_slot(keys.k_hot_slot(slot), HotClaim)
            if link is not None and not link.dead:
                if claim is not None and claim.proc == link.standby:
                    continue
                # The slot changed hands (its standby died and the coordinator freed it): without a step to send,
                # this link would not notice by itself, and the new claimant would wait for it.
                log.info("hot standby %s (slot %d) no longer holds the slot: unlinked", link.standby, slot)
                with self._lock:
                    if self._links.get(slot) is link:
                        self._links.pop(slot)
                link.close()
            if claim is None or time.monotonic() < self._refused.get(claim.proc, 0.0):
                continue
            try:
                link = self._connect(slot, claim)
            except (OSError, MirrorError) as exc:
                log.info("hot standby %s (slot %d): could not link to it: %s", claim.proc, slot, exc)
                self._refused[claim.proc] = time.monotonic() + 1.0
                continue
            with self._lock:
                if self._closed.is_set():
                    link.close()
                    return
                self._links[slot] = link
            link.thread = threading.Thread(target=link.send_loop, name=f"tm-hot-send-{slot}", daemon=True)
            link.thread.start()

    def _connect(self, slot: int, claim: HotClaim) -> _Link:
        cfg = self.cfg
        sock = socket.create_connection((claim.host, claim.port), timeout=LINK_TIMEOUT_S)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            nonce_c = secrets.token_bytes(NONCE_BYTES)
            sock.sendall(nonce_c)
            nonce_s = _recv_exact(sock, NONCE_BYTES)
            (held,) = struct.unpack("<q", _recv_exact(sock, 8))
            proof = _recv_exact(sock, PROOF_BYTES)
            if not hmac.compare_digest(proof, _standby_proof(cfg.job_token, cfg.job_id, slot, claim.proc, held,
                                                             nonce_c, nonce_s)):
                raise MirrorError(f"the process at {claim.host}:{claim.port} failed to prove it is {claim.proc} of "
                                  "the job; nothing was sent to it")
            sock.sendall(_source_proof(cfg.job_token, cfg.job_id, slot, claim.proc, nonce_c, nonce_s))
        except BaseException:
            _close(sock)
            raise
        key = _link_key(cfg.job_token, cfg.job_id, slot, nonce_c, nonce_s)
        log.info("hot standby %s (slot %d): linked, it holds step %d", claim.proc, slot, held)
        return _Link(slot, claim.proc, sock, key, held if held >= 0 else None)


# -- the standby ---------------------------------------------------------------------------------------------------
Apply = Callable[[Message], None]


class HotMirror:
    """A standby's side: claims a slot, accepts its source, applies each message (`apply_sync`, `apply_step`)."""

    def __init__(self, cfg: ProcessConfig, sealer: Sealer, slots: int, apply_sync: Apply, apply_step: Apply) -> None:
        self.cfg = cfg
        self.sealer = sealer
        self.slots = slots
        self.apply_sync = apply_sync
        self.apply_step = apply_step
        self.held: int | None = None
        """The newest step whose whole state this standby holds (None: none)."""
        self.applied = 0
        self.slot: int | None = None
        self._claim_raw: str | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        """Held while a message is applied: `stop` waits for the one in progress."""
        self._conn: socket.socket | None = None
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.bind((cfg.bind_host, 0))
        self.listener.listen(4)
        self.listener.settimeout(SLOT_POLL_S)
        self._thread = threading.Thread(target=self._run, name="tm-hot-mirror", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = LINK_TIMEOUT_S) -> int | None:
        """End the mirror between two messages (promoted, or the job ended); give the slot back; the step held."""
        self._stop.set()
        with self._lock:
            conn, self._conn = self._conn, None
            held = self.held
        if conn is not None:
            _shut(conn)  # its thread closes it
        self._thread.join(timeout_s)
        self.listener.close()
        return held

    def _run(self) -> None:
        store: dist.Store | None = None
        records: keys.Records | None = None
        try:
            while not self._stop.is_set():
                try:
                    if store is None:
                        store = keys.connect(self.cfg.store_host, self.cfg.store_port)
                        records = keys.Records(store, self.sealer)
                    assert records is not None
                    if self.slot is None and not self._claim(records):
                        self._stop.wait(SLOT_POLL_S)
                        continue
                    try:
                        conn, _ = self.listener.accept()
                    except TimeoutError:
                        continue
                    self._serve(conn, records)
                except (OSError, MirrorError, dist.DistStoreError) as exc:
                    if not self._stop.is_set():
                        log.info("hot standby %s: %s", self.cfg.proc, exc)
                    store = None
        finally:
            if records is not None:
                self._release(records)

    def _claim(self, records: keys.Records) -> bool:
        host, port = self.listener.getsockname()[:2]
        for slot in range(self.slots):
            key = keys.k_hot_slot(slot)
            ours = records.sealer.seal(key, HotClaim(self.cfg.proc, host, port).to_json())
            current = records.store.compare_set(key, "", ours)
            if current == ours.encode():
                self.slot, self._claim_raw = slot, ours
                records.put(keys.k_hot_of(self.cfg.proc), slot)
                log.info("hot standby %s: holds slot %d, listening on %s:%d", self.cfg.proc, slot, host, port)
                return True
        return False

    def _release(self, records: keys.Records) -> None:
        if self.slot is None or self._claim_raw is None:
            return
        try:
            records.store.compare_set(keys.k_hot_slot(self.slot), self._claim_raw, "")
        except (OSError, dist.DistStoreError) as exc:  # the store gone: the job is over
            log.debug("hot standby %s: giving the slot back: %s", self.cfg.proc, exc)

    def _serve(self, conn: socket.socket, records: keys.Records) -> None:
        cfg = self.cfg
        assert self.slot is not None
        conn.settimeout(LINK_TIMEOUT_S)
        with self._lock:
            if self._stop.is_set():
                _close(conn)
                return
            self._conn = conn
        try:
            nonce_c = _recv_exact(conn, NONCE_BYTES)
            nonce_s = secrets.token_bytes(NONCE_BYTES)
            held = -1 if self.held is None else self.held
            conn.sendall(nonce_s + struct.pack("<q", held)
                         + _standby_proof(cfg.job_token, cfg.job_id, self.slot, cfg.proc, held, nonce_c, nonce_s))
            proof = _recv_exact(conn, PROOF_BYTES)
            if not hmac.compare_digest(proof, _source_proof(cfg.job_token, cfg.job_id, self.slot, cfg.proc,
                                                            nonce_c, nonce_s)):
                raise MirrorError("a process that linked to this hot standby failed to prove it is of the job")
            key = _link_key(cfg.job_token, cfg.job_id, self.slot, nonce_c, nonce_s)
            records.put(keys.k_hot_held(cfg.proc), HotHeld(held))  # linked (-1: holding nothing yet)
            conn.settimeout(None)  # between messages the source may be slow (a long step); its death closes it
            seq = 0
            while not self._stop.is_set():
                msg = recv_message(conn, key, self.slot, seq)
                seq += 1
                with self._lock:
                    if self._stop.is_set():
                        return
                    if msg.kind == "step" and self.held != msg.step - 1:
                        raise MirrorError(f"a step message for step {msg.step} while holding {self.held}")
                    self.held = None  # until the message is applied whole
                    try:
                        (self.apply_sync if msg.kind == "sync" else self.apply_step)(msg)
                    except Exception as exc:  # a script whose state does not match: this standby is warm only
                        raise MirrorError(f"applying the mirror message of step {msg.step} failed: {exc}") from None
                    self.held = msg.step
                    self.applied += 1
                records.put(keys.k_hot_held(cfg.proc), HotHeld(msg.step))
        finally:
            with self._lock:
                if self._conn is conn:
                    self._conn = None
            _close(conn)


__all__ = ["HotMirror", "HotSource", "Message", "MirrorError", "recv_message", "send_message"]
