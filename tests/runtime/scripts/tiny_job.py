"""A small training script the runtime tests launch: dropout (RNG), AdamW, StepLR, a sharded dataset."""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import TensorDataset

import runtime as tm


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--raise-at", type=int, default=0, help="raise a script error at this step (a bug)")
    args = parser.parse_args()

    tm.init()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1024, 32, generator=g)
    data = tm.ShardedLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=16, seed=3)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Dropout(0.2), nn.Linear(128, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.7)

    def loss_fn(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return nn.functional.cross_entropy(m(batch[0]), batch[1])

    trainer = tm.Trainer(model, optimizer, loss_fn, data, scheduler=scheduler, seed=7)
    for result in trainer.fit(args.steps):
        if result.step == args.raise_at:
            raise ValueError(f"a bug in the training script at step {result.step}")


if __name__ == "__main__":
    main()
