"""Runs one rank of a bare handoff between processes:
`handoff_group.py RANK WORLD PORT TOKEN RECEIVERS CHUNK OUT [OPTIONS_JSON]`.

Sources hold a trained state (3 steps); receivers hold a different one. Each rank writes a JSON result.
TOKEN is the receivers' secret; the sources hold "the-secret". Options: `source_token` (the sources' secret
instead), `corrupt` ([rank, chunk]: that source flips a bit of its chunk-th chunk), `die_on_repair` (that
source is SIGKILLed as it reads the receiver's repair request: every chunk of its share has landed by then),
`keep_own` (receivers hold a complete state of an older step and keep it until the handoff completes), `overlap`
(`start_handoff(overlap=True)`: the result also has `model_early`, the model's digest once `start_handoff` returned,
before the optimizer's state arrived), `die_on_repair_phase` (the phase whose repair request kills that source:
default 0).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch import nn

from runtime.training.handoff import (
    TAG_REPAIR,
    GlooLinks,
    HandoffError,
    HandoffSession,
    MemberStatus,
    plan_handoff,
    start_handoff,
)
from runtime.training.state import TrainingState


class DyingLinks(GlooLinks):
    """This source's links, until the receiver asks it to resend a chunk: then it is SIGKILLed (its result says so)."""

    def __init__(self, out: str, phase: int = 0) -> None:
        super().__init__()
        self.out = out
        self.phase = phase

    def recv(self, t: torch.Tensor, peer: int, tag: int) -> None:
        if tag == TAG_REPAIR + self.phase:
            with open(self.out, "w") as f:
                json.dump({"died": True}, f)
            os.kill(os.getpid(), signal.SIGKILL)
        super().recv(t, peer, tag)


def model_digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    token, receivers, chunk, out = sys.argv[4], {int(r) for r in sys.argv[5].split(",")}, int(sys.argv[6]), sys.argv[7]
    options = json.loads(sys.argv[8]) if len(sys.argv) > 8 else {}
    corrupt = options.get("corrupt")
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    torch.manual_seed(0 if rank not in receivers else 100 + rank)
    model = nn.Sequential(nn.Linear(16, 300), nn.BatchNorm1d(300), nn.Linear(300, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
    steps = 3 if rank not in receivers else 1
    for _ in range(steps):
        model(torch.randn(8, 16, generator=torch.Generator().manual_seed(5))).sum().backward()
        opt.step()
        sched.step()
    state = TrainingState(model, opt, sched)
    before = state.digest()
    statuses = [MemberStatus(r, 0 if r in receivers else 3, r not in receivers) for r in range(world)]
    plan = plan_handoff(statuses)
    result: dict[str, object] = {"rank": rank, "before": before}
    try:
        def fault(phase: str, **where: object) -> bool:
            return corrupt is not None and rank == corrupt[0] and phase == "handoff_send" \
                and where.get("chunk") == corrupt[1]

        session = HandoffSession(1, tuple(f"p{r}" for r in range(world)), "job",
                                 token if rank in receivers else options.get("source_token", "the-secret"), chunk,
                                 fault=fault)
        links = DyingLinks(out, options.get("die_on_repair_phase", 0)) if options.get("die_on_repair") == rank \
            else GlooLinks()
        handoff = start_handoff(plan, session, rank, state, links=links, keep_own=bool(options.get("keep_own")),
                                on_own_lost=lambda: result.update(own_lost=True), overlap=bool(options.get("overlap")))
        result["model_early"] = model_digest(model)
        stats, meta = handoff.wait(60)
        result.update(ok=True, role=stats.role, bytes=stats.bytes, step=None if meta is None else meta.step,
                      refetched=stats.refetched,
                      lr=opt.param_groups[0]["lr"], sched_epoch=sched.last_epoch)
    except (HandoffError, RuntimeError) as exc:
        result.update(ok=False, error=f"{type(exc).__name__}: {exc}")
    result["after"] = state.digest()
    result["model_after"] = model_digest(model)
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
