"""A complete TrainMover training script: plain PyTorch, the runtime owns the step.

    trainmover run --nproc 2 --standby 1 examples/train_mlp.py --steps 60

Every process runs this file, standbys too: they build the same model, warm up, and wait to be promoted.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

import runtime as tm


def make_dataset(n: int = 8192, dim: int = 64, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    y = (x[:, :4].sum(dim=1) > 0).long()
    return TensorDataset(x, y)


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--min-step-ms", type=float, default=0.0,
                        help="wall time each step takes at least (a sleep after a faster one: a bigger model's pace "
                             "without its CPU, numbers unchanged); the demo's drill needs the run to outlast it")
    args = parser.parse_args()

    job = tm.init()  # joins the job; a standby learns here that it is one
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, args.width), nn.ReLU(), nn.Dropout(0.1),
        nn.Linear(args.width, args.width), nn.ReLU(),
        nn.Linear(args.width, 2),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    data = tm.ShardedLoader(make_dataset(), batch_size=args.batch_size, seed=0)

    trainer = tm.Trainer(model, optimizer, loss_fn, data, scheduler=scheduler, seed=0)
    last = time.monotonic()
    for result in trainer.fit(args.steps):
        if result.rank == 0 and result.step % 10 == 0:
            print(f"step {result.step:4d}  loss {result.loss:.4f}  world {result.world_size}  "
                  f"generation {result.generation}", flush=True)
        if args.min_step_ms > 0:
            time.sleep(max(0.0, last + args.min_step_ms / 1000 - time.monotonic()))
        last = time.monotonic()
    if trainer.rank == 0:
        print(f"{job.proc}: done, state digest {trainer.digest}", flush=True)


if __name__ == "__main__":
    main()
