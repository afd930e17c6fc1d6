"""The state a handoff moves: metadata round trips exactly and a receiver is shaped like its sender."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from runtime.training.state import StateMeta, StateMismatchError, TrainingState


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
    meta = StateMeta.from_bytes(src.meta(step=3).to_bytes())  # exactly what travels
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


def with_extras(state: TrainingState, seed: int) -> TrainingState:
    """An EMA of the weights and a GradScaler, registered as extra state, made different per seed."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    ema = AveragedModel(state.model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    for _ in range(seed + 1):
        ema.update_parameters(state.model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** (8 + seed))
    state.register("ema", ema)
    state.register("grad_scaler", scaler)
    return state


def test_registered_state_and_every_generator_travel_with_the_handoff() -> None:
    import random

    import numpy as np

    sender, receiver = with_extras(trained(0, 3), 2), with_extras(trained(1, 1), 0)
    random.seed(11)
    np.random.seed(12)
    meta = sender.meta(step=3).copy()
    expected = (random.random(), float(np.random.random()))
    random.seed(99)
    np.random.seed(98)

    targets = receiver.prepare_receive(meta)
    for (_, t), (_, s) in zip(targets, sender.tensors(), strict=True):
        t.copy_(s)
    receiver.apply_meta(meta)

    assert receiver.digest() == sender.digest()  # the EMA's weights and counter included
    assert receiver.extras["ema"].n_averaged.item() == 3
    assert receiver.extras["grad_scaler"].get_scale() == sender.extras["grad_scaler"].get_scale()
    assert (random.random(), float(np.random.random())) == expected


def test_processes_that_built_different_models_are_told_the_first_differing_tensor() -> None:
    from runtime.training.state import spec_difference

    a = with_extras(trained(0, 0), 0)
    other = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(9), nn.Linear(9, 2))
    b = TrainingState(other, torch.optim.AdamW(other.parameters()))
    assert spec_difference(a.spec(), a.spec(), "w0", "w1") is None
    message = spec_difference(a.spec(), b.spec(), "w0", "s1")
    assert message is not None and "'model.1.weight'" in message and "(8,)" in message and "(9,)" in message
    assert "registered.ema" in (spec_difference(a.spec(), trained(0, 0).spec(), "w0", "w1") or "")
    assert TrainingState.spec_hash(a.spec()) != TrainingState.spec_hash(b.spec())


def test_the_metadata_is_one_typed_record_that_round_trips_and_refuses_anything_else() -> None:
    meta = trained(0, 2).meta(step=5, extra={"note": 1})
    back = StateMeta.from_bytes(meta.to_bytes())
    assert back == meta.copy() and back.step == 5 and back.extra == {"note": 1}
    assert back.to_json() == json.loads(meta.to_bytes()), "the JSON on the wire is the record's, key for key"
    wire = meta.to_json()
    for bad, says in ((b"[1, 2]", "not a JSON object"), (b"{", "not JSON"),
                      (json.dumps({**wire, "version": 1}).encode(), "version 1"),
                      (json.dumps({**wire, "tensors": [["x", "not a shape", "float32"]]}).encode(), "malformed"),
                      (json.dumps({k: v for k, v in wire.items() if k != "rng"}).encode(), "malformed")):
        with pytest.raises(StateMismatchError, match=says):
            StateMeta.from_bytes(bad)
