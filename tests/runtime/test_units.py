"""Pure pieces of the runtime: fault plans, membership records, proofs, sharding, launch settings."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from runtime.config import LaunchError, ProcessConfig
from runtime.control.membership import Generation
from runtime.faults import Fault, FaultPlanError, parse_plan
from runtime.launcher import ConfigError, LaunchConfig
from runtime.training.data import ShardedLoader, as_step_data
from runtime.wire.auth import prove, verify


def test_fault_plan_parses_every_field() -> None:
    plan = parse_plan("kill:rank=1,step=5,phase=exchange; stop:role=sender,phase=handoff_send,chunk=2,gen=1")
    assert plan == [
        Fault("kill", "exchange", step=5, rank=1),
        Fault("stop", "handoff_send", role="sender", chunk=2, gen=1),
    ]


@pytest.mark.parametrize(("spec", "message"), [
    ("explode:rank=1", "action must be one of"),
    ("kill:rank=one", "invalid literal"),
    ("kill:phase=lunch", "phase must be one of"),
    ("kill:rank", "expected key=value"),
    ("kill:colour=red", "unknown keys"),
])
def test_bad_fault_plans_say_what_is_expected(spec: str, message: str) -> None:
    with pytest.raises(FaultPlanError, match=message):
        parse_plan(spec)


def test_a_new_generation_puts_the_standby_in_the_lost_rank_only() -> None:
    g0 = Generation(0, ("w0", "w1", "w2"))
    g1 = g0.replace({1: "s0"}, "w1 killed")
    assert g1.gen == 1 and g1.members == ("w0", "s0", "w2")
    assert g1.replaced == ((1, "w1", "s0"),)
    assert Generation.from_json(g1.to_json()) == g1
    assert g1.rank_of("s0") == 1 and g1.rank_of("w1") is None


def test_proofs_bind_the_job_the_process_and_the_purpose() -> None:
    proof = prove("secret", "handoff", "job", 3, 1, "s0")
    assert verify("secret", proof, "handoff", "job", 3, 1, "s0")
    assert not verify("secret", proof, "handoff", "job", 4, 1, "s0")
    assert not verify("other", proof, "handoff", "job", 3, 1, "s0")


def test_sharded_loader_sees_every_sample_once_per_epoch_across_ranks() -> None:
    data = ShardedLoader(list(range(100)), batch_size=5, seed=1, collate_fn=list)
    world = 4
    epoch = [i for step in range(1, data.steps_per_epoch(world) + 1) for r in range(world)
             for i in data.batch_at(step, r, world)]
    assert sorted(epoch) == list(range(100))
    next_epoch = [i for r in range(world) for i in data.batch_at(6, r, world)]
    assert next_epoch != epoch[:20], "each epoch is a new permutation"
    assert data.batch_at(7, 2, world) == ShardedLoader(list(range(100)), 5, seed=1, collate_fn=list).batch_at(7, 2, 4)


def test_sharded_loader_collates_tensors_and_refuses_tiny_datasets() -> None:
    x = torch.arange(12.0).reshape(6, 2)
    batch = ShardedLoader(TensorDataset(x), batch_size=2, shuffle=False).batch_at(1, 1, 2)
    assert torch.equal(batch[0], x[2:4])
    with pytest.raises(ValueError, match="lower batch_size"):
        ShardedLoader(TensorDataset(x), batch_size=4).batch_at(1, 0, 2)


def test_data_must_be_addressable_by_step() -> None:
    assert as_step_data(lambda s, r, w: (s, r, w)).batch_at(3, 1, 2) == (3, 1, 2)
    with pytest.raises(TypeError, match="batch_at"):
        as_step_data([1, 2, 3])  # type: ignore[arg-type]


def test_process_config_round_trips_and_never_shows_the_token() -> None:
    cfg = ProcessConfig("127.0.0.1", 1234, "job", "top-secret-token", "s0", "standby", num_threads=2)
    assert ProcessConfig.from_env(cfg.to_env()) == cfg
    assert "top-secret-token" not in repr(cfg)
    with pytest.raises(LaunchError, match="trainmover run"):
        ProcessConfig.from_env({})


@pytest.mark.parametrize(("changes", "message"), [
    ({"nproc": 0}, "--nproc must be at least 1"),
    ({"standby": -1}, "--standby must be 0 or more"),
    ({"script": "no/such/script.py"}, "does not exist"),
    ({"hang_timeout_s": 0.3}, "must exceed two heartbeats"),
    ({"faults": "kill:step=x"}, "invalid literal"),
    ({"backend": "nccl", "nproc": 64}, "GPU"),
    ({"num_threads": 0}, "--threads must be 1 or more"),
    ({"num_threads": -1}, "--threads must be 1 or more"),
    ({"chaos": "every_s=0"}, "every_s must be positive"),
])
def test_bad_launch_settings_are_refused_before_anything_starts(changes: dict[str, object], message: str) -> None:
    settings: dict[str, object] = {"script": str(Path(__file__)), **changes}
    with pytest.raises(ConfigError, match=message):
        LaunchConfig(**settings).validate()  # type: ignore[arg-type]
