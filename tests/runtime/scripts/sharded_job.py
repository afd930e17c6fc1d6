"""The sharded Llama-style decoder of examples/train_llama.py, under the runtime tests' scenario options."""

from __future__ import annotations

import argparse
from pathlib import Path

import scenario  # this directory's shared scenario options
import torch
from torch.distributed.tensor import DTensor

import runtime as tm
from examples.train_llama import make_trainer, parser


def save_params(trainer: tm.ShardedTrainer, out: Path, rank: int) -> None:
    """Every rank gathers the whole parameters (a collective); rank 0 writes them (read back weights-only)."""
    assert trainer.model is not None
    whole = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
             for n, p in trainer.model.named_parameters()}
    if rank == 0:
        torch.save(whole, out / "params.pt")


def main() -> None:
    p = scenario.add_options(parser())
    p.add_argument("--params-out", type=Path, default=None, help="write the last step's whole parameters here")
    args: argparse.Namespace = p.parse_args()
    job = tm.init()
    trainer = make_trainer(args)
    for result in trainer.fit(args.steps):
        scenario.after_step(args, job, result)
        if args.params_out and result.step == args.steps:
            save_params(trainer, args.params_out, result.rank)


if __name__ == "__main__":
    main()
