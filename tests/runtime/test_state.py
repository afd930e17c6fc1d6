"""The state a handoff moves: metadata round trips exactly and a receiver is shaped like its sender."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from runtime.state import StateMismatchError, TrainingState


def trained(seed: int, steps: int) -> TrainingState:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.8, 0.95))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(steps):
        model(torch.randn(6, 4)).pow(2).mean().backward()
        opt.step()
        sched.step()
    return TrainingState(model, opt, sched)


def copy_state(src: TrainingState, dst: TrainingState) -> None:
    meta = json.loads(json.dumps(src.meta(step=3)))  # exactly what travels
    targets = dst.prepare_receive(meta)
    for (_, t), (_, s) in zip(targets, src.tensors(), strict=True):
        t.copy_(s)
    dst.apply_meta(meta)


def test_copying_tensors_and_metadata_makes_replicas_bit_identical() -> None:
    sender, receiver = trained(0, 3), trained(1, 1)
    assert sender.digest() != receiver.digest()

    copy_state(sender, receiver)

    assert receiver.digest() == sender.digest()
    assert receiver.optimizer.param_groups[0]["betas"] == (0.8, 0.95)
    assert receiver.scheduler is not None and receiver.scheduler.last_epoch == 3
    assert receiver.optimizer.param_groups[0]["lr"] == sender.optimizer.param_groups[0]["lr"]


def test_a_receiver_with_optimizer_state_takes_a_sender_without_any() -> None:
    sender, receiver = trained(0, 0), trained(1, 2)  # step 0: Adam has no state yet

    copy_state(sender, receiver)

    assert not receiver.optimizer.state
    assert receiver.digest() == sender.digest()


def test_a_receiver_with_another_model_is_refused_with_a_clear_message() -> None:
    sender = trained(0, 1)
    other = nn.Sequential(nn.Linear(4, 9), nn.BatchNorm1d(9), nn.Linear(9, 2))
    receiver = TrainingState(other, torch.optim.AdamW(other.parameters()))

    with pytest.raises(StateMismatchError, match="same script and arguments"):
        receiver.prepare_receive(sender.meta(step=1))


def test_unencodable_scheduler_state_is_refused_before_sending() -> None:
    state = trained(0, 1)
    state.optimizer.param_groups[0]["callback"] = object()

    with pytest.raises(TypeError, match="cannot hand off"):
        state.meta(step=1)
