"""State handoff: healthy replicas stream the training state, from memory, to the members that lack it.

The plan is a pure function of what every member reports (its committed step and whether it holds state):
the target is the newest committed step; members at the target are sources, the others receive.

Both ends prove they belong to the job before anything is sent, each over a nonce the other just drew: the
receiver sends a nonce, the source answers with its own nonce and an HMAC over both (naming the job, the
generation, both ranks and both processes), the receiver checks it and answers with its HMAC. A stranger on
either end, or a replayed proof, is refused before a byte of state moves. Then the first source sends the
metadata, and every source streams a share of the tensors in chunks, straight into the receiver's own buffers
(the ones a standby allocated while warming up), followed by a MAC per chunk under a key of this generation:
Poly1305 under a one-time key derived by keyed BLAKE3 from the generation's key, the receiver, the step and the
chunk's index (`chunk_mac`; about 6x HMAC-SHA256's throughput here: `trainmover bench security`). A chunk whose
MAC fails (a bad link, a forger) is fetched again, from another source where there is one, in one repair round;
only a chunk bad from two sources fails the handoff.

The messages travel over `Links`: the generation's Gloo group by default, or TLS connections
(`runtime.training.tls_transport`) for standbys across a trust boundary. Per pair of peers both ends send and receive
in the same order, so an ordered stream carries the protocol as well as tagged messages do.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import os
import secrets
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import blake3
import torch
import torch.distributed as dist
from cryptography.hazmat.primitives.poly1305 import Poly1305

from runtime.config import KNOBS
from runtime.training.comm import CommFailure, error_text
from runtime.training.state import StateMeta, TrainingState
from runtime.wire.auth import derive, prove

TAG_NONCE = 1
TAG_PROOF = 2
TAG_META = 3
TAG_REPAIR = 4
TAG_MACS = 1 << 20  # + 1 for the repair round's MACs; chunk tags stay below it
TAG_CHUNK0 = 16
NONCE_BYTES = 32
MAC_BYTES = 32
"""A proof's length (HMAC-SHA256)."""
TAG_BYTES = 16
"""A chunk's MAC (Poly1305)."""


class HandoffError(RuntimeError):
    """The state could not be handed over: no source, a bad proof or a corrupted chunk."""


class StateLost(HandoffError):
    """No member of the new generation holds the training state: no handoff can rebuild it."""


class UntrustedPeer(HandoffError):
    """A peer of the handoff failed to prove it belongs to the job; nothing was sent to it or taken from it."""

    def __init__(self, rank: int, role: str) -> None:
        super().__init__(f"{role} rank {rank} failed to prove it belongs to the job; no state was exchanged with it")
        self.rank = rank


class UntrustedReceiver(UntrustedPeer):
    def __init__(self, rank: int) -> None:
        super().__init__(rank, "receiving")


class UntrustedSource(UntrustedPeer):
    def __init__(self, rank: int) -> None:
        super().__init__(rank, "sending")


@dataclass(frozen=True, slots=True)
class MemberStatus:
    """What a member of a new generation holds when it joins."""

    rank: int
    step: int
    has_state: bool
    pending: bool = False
    """Its gradients of step `step + 1` are complete (sharded jobs: it can still commit that step)."""
    own: tuple[int, ...] = ()
    """Steps of its own buddy-copy snapshots (`runtime.training.buddy`)."""
    copies: tuple[int, ...] = ()
    """Steps of the copies it keeps of its buddy's state."""
    mirrored: bool = False
    """A hot standby just promoted (runtime.training.hot): behind the newest step, it does not keep its own state."""

    @property
    def keeps_own(self) -> bool:
        """Behind the newest step, whether it keeps its own state whole until the handoff completes: a survivor does
        (it may hold the last copy left if the sources die); a standby promoted from its mirror is sent the state as
        a new member is, in the handoff's faster overlapped form."""
        return self.has_state and not self.mirrored


@dataclass(frozen=True, slots=True)
class HandoffPlan:
    """Who sends the state of which step to whom."""

    target_step: int
    sources: tuple[int, ...]
    receivers: tuple[int, ...]


def plan_handoff(statuses: list[MemberStatus]) -> HandoffPlan:
    holders = [s for s in statuses if s.has_state]
    if not holders:
        raise StateLost(
            "every copy of the training state was lost at once (no surviving replica holds it); "
            "restart the job from its last backup (trainmover run --resume-from DIR)"
        )
    target = max(s.step for s in holders)
    sources = tuple(sorted(s.rank for s in holders if s.step == target))
    receivers = tuple(sorted(s.rank for s in statuses if s.rank not in sources))
    return HandoffPlan(target, sources, receivers)


@dataclass(frozen=True, slots=True)
class Chunk:
    tensor: int
    start: int
    stop: int


def chunk_layout(shapes: list[tuple[list[int], int]], chunk_bytes: int) -> list[Chunk]:
    """Split tensors (shape, element size) into messages of at most chunk_bytes; small tensors travel whole."""
    chunks = []
    for i, (shape, elem) in enumerate(shapes):
        n = 1
        for d in shape:
            n *= d
        step = max(1, chunk_bytes // elem)
        start = 0
        while True:
            chunks.append(Chunk(i, start, min(n, start + step)))
            start += step
            if start >= n:
                break
    return chunks


def _started(work: dist.Work | None) -> dist.Work:
    if work is None:  # only ranks outside the group get None, and every member of a handoff is inside it
        raise CommFailure("point-to-point operation was not started: this rank is not in the group")
    return work


def _slice(t: torch.Tensor, c: Chunk) -> torch.Tensor:
    return t.reshape(-1)[c.start : c.stop]


class Waiter(Protocol):
    def wait(self) -> Any: ...


class Links(Protocol):
    """Point-to-point messages between the members of one handoff; per pair of peers, in order."""

    def send(self, t: torch.Tensor, peer: int, tag: int) -> None: ...

    def recv(self, t: torch.Tensor, peer: int, tag: int) -> None: ...

    def isend(self, t: torch.Tensor, peer: int, tag: int) -> Waiter: ...

    def irecv(self, t: torch.Tensor, peer: int, tag: int) -> Waiter: ...


class GlooLinks:
    """The generation's own process group (Gloo or NCCL), tagged messages.

    Every wait is bounded by `timeout_s` (a peer that stops sending without dying fails the handoff instead of
    holding it for the group's collective timeout); a new generation aborts the group sooner still."""

    def __init__(self, timeout_s: float = KNOBS.collective_timeout_s, group: dist.ProcessGroup | None = None) -> None:
        """`group`: the group to talk over (peers named by their global ranks); default: the default group."""
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.group = group

    def send(self, t: torch.Tensor, peer: int, tag: int) -> None:
        self.isend(t, peer, tag).wait()

    def recv(self, t: torch.Tensor, peer: int, tag: int) -> None:
        self.irecv(t, peer, tag).wait()

    def isend(self, t: torch.Tensor, peer: int, tag: int) -> Waiter:
        return _Bounded(_started(dist.isend(t, dst=peer, group=self.group, tag=tag)), self.timeout)

    def irecv(self, t: torch.Tensor, peer: int, tag: int) -> Waiter:
        return _Bounded(_started(dist.irecv(t, src=peer, group=self.group, tag=tag)), self.timeout)


class _Bounded:
    def __init__(self, work: dist.Work, timeout: datetime.timedelta) -> None:
        self.work = work
        self.timeout = timeout

    def wait(self) -> Any:
        return self.work.wait(self.timeout)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes, without a copy for a contiguous CPU tensor (a GPU one is copied to the host)."""
    flat = t.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    if flat.numel() == 0:
        return memoryview(b"")
    return flat.contiguous().view(torch.uint8).numpy().data


def _as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)


@dataclass(frozen=True, slots=True)
class HandoffSession:
    """What both ends of one generation's handoff agree on."""

    gen: int
    members: tuple[str, ...]
    job_id: str
    token: str = field(repr=False)
    chunk_bytes: int = KNOBS.chunk_bytes
    fault: Callable[..., bool | None] = lambda *_, **__: None

    def proof(self, role: str, source: int, receiver: int, nonce_r: bytes, nonce_s: bytes) -> bytes:
        """What `role` ("source" or "receiver") answers to the pair's challenge: bound to both nonces."""
        return bytes.fromhex(prove(self.token, "handoff", role, self.job_id, self.gen, source,
                                   self.members[source], receiver, self.members[receiver], nonce_r.hex(),
                                   nonce_s.hex()))

    def chunk_key(self) -> bytes:
        """The MAC key of this generation's chunks (the same for every source: any of them can resend one)."""
        return hmac.new(derive(self.token, "handoff-chunks"), f"{self.job_id}\x1f{self.gen}".encode(),
                        hashlib.sha256).digest()


def chunk_mac(key: bytes, receiver: int, target_step: int, index: int, data: memoryview | bytes) -> bytes:
    """The MAC of chunk `index` (-1: the metadata) of the state of `target_step` sent to `receiver`: Poly1305 (16
    bytes, on the CPU's wide multiplies; `trainmover bench security` has its throughput) under a one-time key
    derived from the generation's chunk key by keyed BLAKE3 over (receiver, step, index).

    Poly1305 is secure for one message per key. Within a generation (whose chunk key is its own) the chunk that a
    receiver gets at an index of a step is one message: every source of it holds the same bits of that step, and a
    refetch sends them again; another receiver, step or index derives another key."""
    one_time = blake3.blake3(b"trainmover/chunk/" + struct.pack("<qqq", receiver, target_step, index),
                             key=key).digest()
    return Poly1305.generate_tag(one_time, data)


_macs: ThreadPoolExecutor | None = None


def _timed_mac(key: bytes, receiver: int, target_step: int, index: int,
               data: memoryview | bytes) -> tuple[bytes, float]:
    t0 = time.perf_counter()
    return chunk_mac(key, receiver, target_step, index, data), time.perf_counter() - t0


def _mac_later(key: bytes, receiver: int, target_step: int, index: int,
               data: memoryview | bytes) -> Future[tuple[bytes, float]]:
    """Compute a chunk's MAC on a pool of threads: hashing runs on every core, beside the transfer."""
    global _macs
    if _macs is None:
        _macs = ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1)), thread_name_prefix="tm-mac")
    return _macs.submit(_timed_mac, key, receiver, target_step, index, data)


@dataclass
class HandoffStats:
    role: str
    bytes: int = 0
    seconds: float = 0.0
    """Until `start_handoff` returned: the whole handoff, or with `overlap` its first phase (what the member waited
    for before training on)."""
    refetched: int = 0
    """Chunks that failed their MAC and were fetched again (a receiver's count)."""
    mac_s: float = 0.0
    """Time this member spent computing chunk MACs (a source while its chunks are on the wire, a receiver
    while later chunks arrive): what authenticating the state costs, inside `seconds` (and `rest_s`)."""
    rest_s: float = 0.0
    """With `overlap`: the optimizer's state, streamed on a thread after `seconds`, beside the replayed step."""


def run_handoff(
    plan: HandoffPlan, session: HandoffSession, rank: int, state: TrainingState, extra: Any = None,
    links: Links | None = None, keep_own: bool = False, on_own_lost: Callable[[], None] | None = None,
) -> tuple[HandoffStats, StateMeta | None]:
    """Run this member's part of the plan. Returns its stats and, for a receiver, the metadata it applied.

    `keep_own`: this receiver holds a complete state of an older step (a survivor that was behind when a peer
    died). It receives into a second copy and writes its own tensors only once every chunk is verified, so that a
    handoff cut short (its only source lost) leaves it holding that older state, from which every member can
    replay; without it, a survivor one step behind whose sole source died took the last copy of the state with it.
    `on_own_lost` is called if matching the sender's optimizer layout changed its own state before that."""
    return start_handoff(plan, session, rank, state, extra, links, keep_own, on_own_lost).wait()


class Handoff:
    """A member's part of a handoff, begun by `start_handoff`: `wait()` ends it. With `overlap`, what the next step's
    forward and backward passes read has arrived (and is verified and applied) when `start_handoff` returns; the
    optimizer's state still streams, on a thread of its own, until `wait()`."""

    def __init__(self, stats: HandoffStats, meta: StateMeta | None, rest: Callable[[], None] | None) -> None:
        self.stats = stats
        self.meta = meta
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if rest is not None:
            self._thread = threading.Thread(target=self._run, args=(rest,), name="tm-handoff-rest", daemon=True)
            self._thread.start()

    def _run(self, rest: Callable[[], None]) -> None:
        t0 = time.perf_counter()
        try:
            rest()
        except BaseException as exc:  # handed to wait(), in the member's own thread
            self._error = exc
        self.stats.rest_s = time.perf_counter() - t0

    @property
    def pending(self) -> bool:
        """Whether the optimizer's state is still streaming."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout_s: float | None = None) -> tuple[HandoffStats, StateMeta | None]:
        """The end of the handoff: this member's stats and, for a receiver, the metadata it applied. Raises what
        the handoff failed with (`HandoffError`, or `CommFailure` for a lost peer); `timeout_s` bounds the wait
        (the streaming thread's own waits are bounded by its links' timeout)."""
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise CommFailure(f"handoff interrupted: the optimizer state did not arrive in {timeout_s} s")
        if self._error is not None:
            raise _as_handoff_failure(self._error)
        return self.stats, self.meta


def _as_handoff_failure(exc: BaseException) -> BaseException:
    if isinstance(exc, HandoffError | CommFailure):
        return exc
    if isinstance(exc, RuntimeError | OSError):
        return CommFailure(f"handoff interrupted: {error_text(exc) if isinstance(exc, RuntimeError) else exc}")
    return exc


def _in_optimizer(key: str) -> bool:
    """Whether a streamed tensor is the optimizer's (`TrainingState.tensors` names them `optim.*`): the part of the
    state that only the optimizer step reads."""
    return key.startswith("optim.")


def _phases(layout: list[Chunk], keys: list[str], overlap: bool) -> list[list[int]]:
    """The chunk indices of each phase: everything at once; or (`overlap`) what the forward and backward passes
    read (the model, the registered state), then the optimizer's state."""
    if not overlap:
        return [list(range(len(layout)))]
    early = [j for j, c in enumerate(layout) if not _in_optimizer(keys[c.tensor])]
    late = [j for j, c in enumerate(layout) if _in_optimizer(keys[c.tensor])]
    return [early, late] if late else [early]


def start_handoff(
    plan: HandoffPlan, session: HandoffSession, rank: int, state: TrainingState, extra: Any = None,
    links: Links | None = None, keep_own: bool = False, on_own_lost: Callable[[], None] | None = None,
    overlap: bool = False,
) -> Handoff:
    """Begin this member's part of the plan (`run_handoff` for the arguments); `Handoff.wait()` ends it.

    `overlap` (not with `keep_own`, and the same in every member of the handoff): the state travels in two phases,
    each with its chunks, their MACs and its repair round. First the model's tensors and the registered state, with
    the metadata applied: all that the next step's forward and backward passes read. Then the optimizer's state,
    on a thread, while the members run those passes; a member waits for it (`Handoff.wait`) before its optimizer
    step, a source because the step changes what it sends. The replayed step and the larger part of the transfer
    (Adam's two moments) then overlap instead of following one another."""
    t0 = time.perf_counter()
    links = links or GlooLinks()
    overlap = overlap and not keep_own
    stats = HandoffStats("source" if rank in plan.sources else "receiver" if rank in plan.receivers else "none")
    meta_in: StateMeta | None = None
    rest: Callable[[], None] | None = None
    try:
        if rank in plan.sources:
            served = [_open_source(plan, session, rank, receiver, state, extra, links, overlap)
                      for receiver in plan.receivers]
            for s in served:
                stats.bytes += s.serve(0, stats)
            if any(len(s.phases) > 1 for s in served):
                def rest() -> None:
                    for s in served:
                        stats.bytes += s.serve(1, stats)
        elif rank in plan.receivers:
            receiving = _open_receiver(plan, session, rank, state, links, keep_own, on_own_lost, overlap)
            receiving.receive(0, stats)
            stats.bytes = state.state_bytes()
            if len(receiving.phases) > 1:
                receiving.finish(0)  # the forward pass may read what arrived; the optimizer's state follows
                meta_in = receiving.meta

                def rest() -> None:
                    receiving.receive(1, stats)
                    receiving.finish(1)
            else:
                receiving.finish(None)
                meta_in = receiving.meta
    except (RuntimeError, OSError) as exc:
        raise _as_handoff_failure(exc) from None
    stats.seconds = time.perf_counter() - t0
    return Handoff(stats, meta_in, rest)


def _shares(plan: HandoffPlan, n_chunks: int) -> list[list[int]]:
    """Chunk indices each source sends, by its position in `plan.sources`."""
    k = len(plan.sources)
    return [[j for j in range(n_chunks) if j % k == share] for share in range(k)]


def _phase_tags(phase: int) -> tuple[int, int, int]:
    """(MACs, repair request, repair MACs) tags of a phase."""
    return TAG_MACS + 2 * phase, TAG_REPAIR + phase, TAG_MACS + 2 * phase + 1


@dataclass
class _Serving:
    """A source's side of the handoff to one receiver, once both proved themselves and the metadata went."""

    plan: HandoffPlan
    session: HandoffSession
    receiver: int
    links: Links
    key: bytes
    tensors: list[torch.Tensor]
    layout: list[Chunk]
    share: list[int]
    phases: list[list[int]]
    sent_chunks: int = 0

    def serve(self, phase: int, stats: HandoffStats) -> int:
        """Send this source's share of a phase's chunks, their MACs, then what the receiver asks again."""
        macs_tag, repair_tag, repair_macs_tag = _phase_tags(phase)
        mine = set(self.share)
        indices = [j for j in self.phases[phase] if j in mine]
        sent = _send_chunks(self.session, self.key, self.plan.target_step, self.tensors, self.layout, indices,
                            self.receiver, macs_tag, self.links, stats, first=self.sent_chunks)
        self.sent_chunks += len(indices)
        # The repair round: the receiver names the chunks that failed their MAC and that this source is to resend.
        count = torch.zeros(1, dtype=torch.int64)
        self.links.recv(count, self.receiver, repair_tag)
        if int(count.item()) > 0:
            wanted = torch.zeros(int(count.item()), dtype=torch.int64)
            self.links.recv(wanted, self.receiver, repair_tag)
            asked = wanted.tolist()
            if any(j not in self.phases[phase] for j in asked if 0 <= j < len(self.layout)):
                raise HandoffError("the receiver asked again for a chunk of another phase of the handoff")
            sent += _send_chunks(self.session, self.key, self.plan.target_step, self.tensors, self.layout, asked,
                                 self.receiver, repair_macs_tag, self.links, stats, repair=True)
        return sent


def _open_source(plan: HandoffPlan, session: HandoffSession, rank: int, receiver: int, state: TrainingState,
                 extra: Any, links: Links, overlap: bool) -> _Serving:
    nonce_r = torch.zeros(NONCE_BYTES, dtype=torch.uint8)
    links.recv(nonce_r, receiver, TAG_NONCE)
    nonce_s = secrets.token_bytes(NONCE_BYTES)
    r_nonce = nonce_r.numpy().tobytes()
    links.send(_as_tensor(nonce_s + session.proof("source", rank, receiver, r_nonce, nonce_s)), receiver, TAG_PROOF)
    answer = torch.zeros(MAC_BYTES, dtype=torch.uint8)
    links.recv(answer, receiver, TAG_PROOF)
    if not hmac.compare_digest(answer.numpy().tobytes(), session.proof("receiver", rank, receiver, r_nonce, nonce_s)):
        raise UntrustedReceiver(receiver)
    key = session.chunk_key()
    named = state.tensors()
    tensors = [t for _, t in named]
    if rank == plan.sources[0]:
        payload = state.meta(plan.target_step, extra).to_bytes()
        links.send(torch.tensor([len(payload)], dtype=torch.int64), receiver, TAG_META)
        links.send(_as_tensor(payload + chunk_mac(key, receiver, plan.target_step, -1, payload)), receiver, TAG_META)
    layout = chunk_layout([(list(t.shape), t.element_size()) for t in tensors], session.chunk_bytes)
    share = _shares(plan, len(layout))[plan.sources.index(rank)]
    return _Serving(plan, session, receiver, links, key, tensors, layout, share,
                    _phases(layout, [k for k, _ in named], overlap))


def _send_chunks(session: HandoffSession, key: bytes, target_step: int, tensors: list[torch.Tensor],
                 layout: list[Chunk], indices: list[int], receiver: int, macs_tag: int, links: Links,
                 stats: HandoffStats, repair: bool = False, first: int = 0) -> int:
    """`first`: chunks this source already sent this receiver (in earlier phases): fault points count on."""
    works = []
    macs = []
    sent = 0
    for n, j in enumerate(indices):
        if not 0 <= j < len(layout):
            raise HandoffError(f"the receiver asked for chunk {j}, which does not exist")
        c = layout[j]
        piece = _slice(tensors[c.tensor].contiguous(), c)
        macs.append(_mac_later(key, receiver, target_step, j, tensor_bytes(piece)))  # read-only, beside the send
        if not repair and session.fault("handoff_send", role="sender", chunk=first + n + 1):
            piece = piece.clone()
            piece.view(torch.uint8)[0] ^= 1  # one bit flipped on the way, after the MAC was taken
        works.append(links.isend(piece, receiver, TAG_CHUNK0 + j))
        sent += piece.numel() * piece.element_size()
    done = [f.result() for f in macs]  # the MACs follow the chunks: the data never waits for the hashing
    stats.mac_s += sum(t for _, t in done)
    links.send(_as_tensor(b"".join(m for m, _ in done)), receiver, macs_tag)
    for w in works:
        w.wait()
    return sent


def _layout_of(state: TrainingState) -> list[tuple[str, int, tuple[int, ...], torch.dtype]]:
    """Which tensors a state holds and where (its storage), to tell whether matching a sender's changed them."""
    return [(k, t.data_ptr(), tuple(t.shape), t.dtype) for k, t in state.tensors()]


@dataclass
class _Receiving:
    """A receiver's side of the handoff, once every source proved itself and the metadata arrived."""

    plan: HandoffPlan
    session: HandoffSession
    rank: int
    links: Links
    state: TrainingState
    key: bytes
    meta: StateMeta
    tensors: list[torch.Tensor]
    targets: list[torch.Tensor]
    layout: list[Chunk]
    phases: list[list[int]]
    refetched: int = 0

    def receive(self, phase: int, stats: HandoffStats) -> None:
        """Take a phase's chunks from every source, check each against its MAC as the later ones arrive, and have
        the bad ones sent again."""
        plan, links, layout, targets = self.plan, self.links, self.layout, self.targets
        macs_tag, repair_tag, repair_macs_tag = _phase_tags(phase)
        indices = self.phases[phase]
        shares = _shares(plan, len(layout))
        owner = {j: share for share, mine in enumerate(shares) for j in mine}
        works = [links.irecv(_slice(targets[layout[j].tensor], layout[j]), plan.sources[owner[j]], TAG_CHUNK0 + j)
                 for j in indices]
        expected: dict[int, bytes] = {}
        wanted = set(indices)
        for share, source in enumerate(plan.sources):
            theirs = [j for j in shares[share] if j in wanted]
            macs = torch.zeros(len(theirs) * TAG_BYTES, dtype=torch.uint8)
            links.recv(macs, source, macs_tag)
            raw_macs = macs.numpy().tobytes()
            expected.update((j, raw_macs[i * TAG_BYTES : (i + 1) * TAG_BYTES]) for i, j in enumerate(theirs))
        checks = []
        for j, w in zip(indices, works, strict=True):
            w.wait()  # in order: each chunk is checked while the later ones are still arriving
            piece = tensor_bytes(_slice(targets[layout[j].tensor], layout[j]))
            checks.append((j, _mac_later(self.key, self.rank, plan.target_step, j, piece)))
        bad = []
        for j, f in checks:
            got, took = f.result()
            stats.mac_s += took
            if not hmac.compare_digest(got, expected[j]):
                bad.append(j)
        # The repair round: every source hears which chunks it is to resend (usually none). A bad chunk goes to the
        # next source after the one that sent it, so that a bad link or a bad source is not asked twice.
        again: dict[int, list[int]] = {s: [] for s in range(len(plan.sources))}
        for j in bad:
            again[(owner[j] + 1) % len(plan.sources)].append(j)
        for share, source in enumerate(plan.sources):
            links.send(torch.tensor([len(again[share])], dtype=torch.int64), source, repair_tag)
            if again[share]:
                links.send(torch.tensor(again[share], dtype=torch.int64), source, repair_tag)
        for share, source in enumerate(plan.sources):
            if not again[share]:
                continue
            redo = [links.irecv(_slice(targets[layout[j].tensor], layout[j]), source, TAG_CHUNK0 + j)
                    for j in again[share]]
            macs = torch.zeros(len(again[share]) * TAG_BYTES, dtype=torch.uint8)
            links.recv(macs, source, repair_macs_tag)
            raw_macs = macs.numpy().tobytes()
            for i, (j, w) in enumerate(zip(again[share], redo, strict=True)):
                w.wait()
                c = layout[j]
                got = chunk_mac(self.key, self.rank, plan.target_step, j, tensor_bytes(_slice(targets[c.tensor], c)))
                if not (hmac.compare_digest(got, raw_macs[i * TAG_BYTES : (i + 1) * TAG_BYTES])
                        and hmac.compare_digest(got, expected[j])):
                    name = self.meta.tensors[c.tensor].key
                    raise HandoffError(f"chunk {j} of tensor {name!r} failed its MAC from two sources (ranks "
                                       f"{plan.sources[owner[j]]} and {source}); the state was not applied")
        self.refetched += len(bad)
        stats.refetched = self.refetched

    def finish(self, phase: int | None) -> None:
        """Write what a phase (None: the whole handoff) received into the state's own tensors where it landed
        elsewhere; the metadata is applied with the first phase, or at the end of the whole."""
        tensors = set() if phase is None else {self.layout[j].tensor for j in self.phases[phase]}
        for i, (t, target) in enumerate(zip(self.tensors, self.targets, strict=True)):
            if target is not t and (phase is None or i in tensors):
                t.copy_(target)
        if phase in (None, 0):
            self.state.apply_meta(self.meta)


def _open_receiver(plan: HandoffPlan, session: HandoffSession, rank: int, state: TrainingState, links: Links,
                   keep_own: bool, on_own_lost: Callable[[], None] | None, overlap: bool) -> _Receiving:
    nonces = {s: secrets.token_bytes(NONCE_BYTES) for s in plan.sources}
    pending = [links.isend(_as_tensor(nonces[s]), s, TAG_NONCE) for s in plan.sources]
    for source in plan.sources:
        reply = torch.zeros(NONCE_BYTES + MAC_BYTES, dtype=torch.uint8)
        links.recv(reply, source, TAG_PROOF)
        raw = reply.numpy().tobytes()
        nonce_s, proof = raw[:NONCE_BYTES], raw[NONCE_BYTES:]
        # Our answer first (bound to both nonces, it is worth nothing to anyone else), so that each end judges
        # the other: a stranger at either end is named by the honest one.
        links.send(_as_tensor(session.proof("receiver", source, rank, nonces[source], nonce_s)), source, TAG_PROOF)
        if not hmac.compare_digest(proof, session.proof("source", source, rank, nonces[source], nonce_s)):
            raise UntrustedSource(source)
    for w in pending:
        w.wait()
    key = session.chunk_key()
    length = torch.zeros(1, dtype=torch.int64)
    first = plan.sources[0]
    links.recv(length, first, TAG_META)
    n = int(length.item())
    if not 0 < n <= 1 << 30:
        raise HandoffError(f"the metadata announced by source rank {first} has an impossible length ({n})")
    raw_meta = torch.zeros(n + TAG_BYTES, dtype=torch.uint8)
    links.recv(raw_meta, first, TAG_META)
    data = raw_meta.numpy().tobytes()
    payload, mac = data[:n], data[n:]
    if not hmac.compare_digest(mac, chunk_mac(key, rank, plan.target_step, -1, payload)):
        raise HandoffError(f"the metadata from source rank {first} failed its MAC")
    meta = StateMeta.from_bytes(payload)
    session.fault("handoff_recv", role="receiver")
    own_before = _layout_of(state) if keep_own else []
    named = state.prepare_receive(meta)
    tensors = [t for _, t in named]
    if keep_own and _layout_of(state) != own_before:
        keep_own = False  # its optimizer's layout was not the sender's: what it held is no longer whole
        if on_own_lost is not None:
            on_own_lost()
    layout = chunk_layout([(list(t.shape), t.element_size()) for t in tensors], session.chunk_bytes)
    # Write straight into our own tensors where they are contiguous (and nothing of ours is to be kept); else into
    # a buffer copied after.
    targets = [t if t.is_contiguous() and not keep_own else torch.empty_like(t, memory_format=torch.contiguous_format)
               for t in tensors]
    return _Receiving(plan, session, rank, links, state, key, meta, tensors, targets, layout,
                      _phases(layout, [k for k, _ in named], overlap))
