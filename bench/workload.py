"""The one workload every system in the recovery benchmark trains, so that they are compared on equal work.

A deep MLP regression with AdamW and a step LR schedule. Batches are a pure function of
(seed, step, rank), so any system that replays a step or restarts from a checkpoint sees the same samples.
The spec travels between processes as JSON in the ``TM_BENCH_SPEC`` environment variable.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

import torch
from torch import nn

from runtime.training.data import derive_seed

SPEC_ENV = "TM_BENCH_SPEC"


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """Size and schedule of the benchmark model."""

    width: int = 2560
    """Hidden width of each square linear layer."""
    depth: int = 8
    """Number of width x width linear layers (8 x 2560^2 = 52M parameters, about 630 MB with AdamW)."""
    batch_size: int = 16
    """Samples per worker per step."""
    seed: int = 0
    """Seed of the model's initial weights and of every batch."""
    lr: float = 1e-4
    """AdamW learning rate."""
    device_ms: float = 0.0
    """Milliseconds each forward pass spends off the CPU, as on an accelerator (a sleep in TrainMover's loss
    function, `bench.tm_worker`; numbers unchanged): 0, a step that keeps this machine's cores busy throughout."""

    @classmethod
    def full(cls) -> WorkloadSpec:
        """At least 50M parameters with Adam (about 600 MB of state)."""
        return cls()

    @classmethod
    def quick(cls) -> WorkloadSpec:
        """A small model for the quick benchmark and tests (about 4M parameters)."""
        return cls(width=1024, depth=4, batch_size=16)

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls) -> WorkloadSpec:
        raw = os.environ.get(SPEC_ENV)
        return cls(**json.loads(raw)) if raw else cls.quick()


def build(spec: WorkloadSpec) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """Model, optimizer and LR scheduler, identically initialised in every process."""
    torch.manual_seed(spec.seed)
    layers: list[nn.Module] = []
    for _ in range(spec.depth):
        layers += [nn.Linear(spec.width, spec.width), nn.GELU()]
    model = nn.Sequential(*layers, nn.Linear(spec.width, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.9)
    return model, optimizer, scheduler


def batch(spec: WorkloadSpec, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples of one worker at one step: a pure function of (seed, step, rank)."""
    g = torch.Generator().manual_seed(derive_seed(spec.seed, step, rank))
    x = torch.randn(spec.batch_size, spec.width, generator=g)
    y = x[:, :8].sum(dim=1, keepdim=True).tanh()
    return x, y


def loss_fn(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = data
    return nn.functional.mse_loss(model(x), y)
