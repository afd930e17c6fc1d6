"""State handoff: healthy replicas stream the training state, from memory, to the members that lack it.

The plan is a pure function of what every member reports (its committed step and whether it holds state):
the target is the newest committed step; members at the target are sources, the others receive. Each receiver
first proves it belongs to the job; then the first source sends a JSON metadata record and every source
streams a share of the tensors, in chunks, straight into the receiver's own buffers (the ones a standby
allocated while warming up), followed by a 64-bit additive checksum per chunk that the receiver verifies.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from runtime.auth import prove, verify
from runtime.comm import CommFailure, error_text
from runtime.state import TrainingState

TAG_PROOF = 1
TAG_META = 2
TAG_CHECKSUM = 1 << 20  # + source share; chunk tags stay below it
TAG_CHUNK0 = 16
PROOF_LEN = 64


class HandoffError(RuntimeError):
    """The state could not be handed over: no source, a bad proof or a corrupted chunk."""


class StateLost(HandoffError):
    """No member of the new generation holds the training state: no handoff can rebuild it."""


class UntrustedReceiver(HandoffError):
    """A receiver failed to prove it belongs to the job; nothing was sent to it."""

    def __init__(self, rank: int) -> None:
        super().__init__(f"rank {rank} failed to prove it belongs to the job; no state was sent")
        self.rank = rank


@dataclass(frozen=True, slots=True)
class MemberStatus:
    """What a member of a new generation holds when it joins."""

    rank: int
    step: int
    has_state: bool


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
            "restart the job from its last backup checkpoint"
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


def checksum(t: torch.Tensor) -> int:
    """Wrapping 64-bit sum of the tensor's bytes read as integers: order-independent, so any thread count agrees."""
    flat = t.reshape(-1)
    nbytes = flat.numel() * flat.element_size()
    if nbytes == 0:
        return 0
    for dtype, width in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if nbytes % width == 0 and (flat.storage_offset() * flat.element_size()) % width == 0:
            try:
                words = flat.view(torch.uint8).view(dtype)
            except RuntimeError:
                continue
            return int(words.sum(dtype=torch.int64).item())
    return int(flat.view(torch.uint8).sum(dtype=torch.int64).item())


def _started(work: dist.Work | None) -> dist.Work:
    if work is None:  # only ranks outside the group get None, and every member of a handoff is inside it
        raise CommFailure("point-to-point operation was not started: this rank is not in the group")
    return work


def _slice(t: torch.Tensor, c: Chunk) -> torch.Tensor:
    return t.reshape(-1)[c.start : c.stop]


@dataclass(frozen=True, slots=True)
class HandoffSession:
    """What both ends of one generation's handoff agree on."""

    gen: int
    members: tuple[str, ...]
    job_id: str
    token: str = field(repr=False)
    chunk_bytes: int = 64 << 20
    fault: Callable[..., None] = lambda *_, **__: None

    def proof_statement(self, rank: int) -> tuple[object, ...]:
        return ("handoff", self.job_id, self.gen, rank, self.members[rank])


@dataclass
class HandoffStats:
    role: str
    bytes: int = 0
    seconds: float = 0.0


def run_handoff(
    plan: HandoffPlan, session: HandoffSession, rank: int, state: TrainingState, extra: Any = None
) -> tuple[HandoffStats, dict[str, Any] | None]:
    """Run this member's part of the plan. Returns its stats and, for a receiver, the metadata it applied."""
    t0 = time.perf_counter()
    meta_in: dict[str, Any] | None = None
    failure: str | None = None
    stats = HandoffStats("source" if rank in plan.sources else "receiver" if rank in plan.receivers else "none")
    try:
        if rank in plan.sources:
            for receiver in plan.receivers:
                stats.bytes += _serve(plan, session, rank, receiver, state, extra)
        elif rank in plan.receivers:
            meta_in = _receive(plan, session, rank, state)
            stats.bytes = state.state_bytes()
    except RuntimeError as exc:
        if isinstance(exc, HandoffError):
            raise
        failure = error_text(exc)
    if failure is not None:
        raise CommFailure(f"handoff interrupted: {failure}")
    stats.seconds = time.perf_counter() - t0
    return stats, meta_in


def _serve(plan: HandoffPlan, session: HandoffSession, rank: int, receiver: int, state: TrainingState,
           extra: Any) -> int:
    proof = torch.zeros(PROOF_LEN, dtype=torch.uint8)
    dist.recv(proof, src=receiver, tag=TAG_PROOF)
    if not verify(session.token, proof.numpy().tobytes().decode(errors="replace"), *session.proof_statement(receiver)):
        raise UntrustedReceiver(receiver)
    tensors = [t for _, t in state.tensors()]
    if rank == plan.sources[0]:
        payload = json.dumps(state.meta(plan.target_step, extra)).encode()
        dist.send(torch.tensor([len(payload)], dtype=torch.int64), dst=receiver, tag=TAG_META)
        dist.send(torch.frombuffer(bytearray(payload), dtype=torch.uint8), dst=receiver, tag=TAG_META)
    layout = chunk_layout([(list(t.shape), t.element_size()) for t in tensors], session.chunk_bytes)
    share = plan.sources.index(rank)
    mine = [j for j in range(len(layout)) if j % len(plan.sources) == share]
    works = []
    sums = []
    sent = 0
    for n, j in enumerate(mine):
        c = layout[j]
        piece = _slice(tensors[c.tensor].contiguous(), c)
        works.append(_started(dist.isend(piece, dst=receiver, tag=TAG_CHUNK0 + j)))
        sums.append(checksum(piece))  # computed while the previous chunks are on the wire
        sent += piece.numel() * piece.element_size()
        session.fault("handoff_send", role="sender", chunk=n + 1)
    dist.send(torch.tensor(sums, dtype=torch.int64), dst=receiver, tag=TAG_CHECKSUM + share)
    for w in works:
        w.wait()
    return sent


def _receive(plan: HandoffPlan, session: HandoffSession, rank: int, state: TrainingState) -> dict[str, Any]:
    proof = prove(session.token, *session.proof_statement(rank)).encode()
    for source in plan.sources:
        dist.send(torch.frombuffer(bytearray(proof), dtype=torch.uint8), dst=source, tag=TAG_PROOF)
    length = torch.zeros(1, dtype=torch.int64)
    first = plan.sources[0]
    dist.recv(length, src=first, tag=TAG_META)
    raw = torch.zeros(int(length.item()), dtype=torch.uint8)
    dist.recv(raw, src=first, tag=TAG_META)
    meta = json.loads(raw.numpy().tobytes())
    session.fault("handoff_recv", role="receiver")
    tensors = [t for _, t in state.prepare_receive(meta)]
    layout = chunk_layout([(list(t.shape), t.element_size()) for t in tensors], session.chunk_bytes)
    # Write straight into our own tensors where they are contiguous; else into a buffer copied after.
    targets = [t if t.is_contiguous() else torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    works = [_started(dist.irecv(_slice(targets[c.tensor], c), src=plan.sources[j % len(plan.sources)],
                                 tag=TAG_CHUNK0 + j))
             for j, c in enumerate(layout)]
    expected: dict[int, int] = {}
    for share, source in enumerate(plan.sources):
        mine = [j for j in range(len(layout)) if j % len(plan.sources) == share]
        sums = torch.zeros(len(mine), dtype=torch.int64)
        dist.recv(sums, src=source, tag=TAG_CHECKSUM + share)
        expected.update(zip(mine, sums.tolist(), strict=True))
    for w in works:
        w.wait()
    for j, c in enumerate(layout):
        if checksum(_slice(targets[c.tensor], c)) != expected[j]:
            name = meta["tensors"][c.tensor][0]
            raise HandoffError(f"chunk {j} of tensor {name!r} arrived corrupted (checksum mismatch)")
    for t, target in zip(tensors, targets, strict=True):
        if target is not t:
            t.copy_(target)
    state.apply_meta(meta)
    return meta
