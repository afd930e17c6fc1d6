"""A small training script the runtime tests launch: dropout (RNG), AdamW, StepLR, a sharded dataset."""

from __future__ import annotations

import sys

import scenario  # this directory's shared scenario options
import torch
from torch import nn
from torch.utils.data import TensorDataset

import runtime as tm


def main() -> None:
    parser = scenario.parser()
    parser.add_argument("--odd-proc", default="", help="this process builds a wider model (a script bug)")
    parser.add_argument("--before-init", choices=("exit0", "raise"), default=None,
                        help="leave before runtime.init(): exit 0, or raise (an import error, a bad argument)")
    args = parser.parse_args()

    if args.before_init == "exit0":
        sys.exit(0)
    if args.before_init == "raise":
        raise FileNotFoundError("the dataset path does not exist")
    job = tm.init()
    width = 64 if job.proc == args.odd_proc else 128
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1024, 32, generator=g)
    data = tm.ShardedLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=16, seed=3)
    model = nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Dropout(0.2), nn.Linear(width, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.7)

    def loss_fn(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return nn.functional.cross_entropy(m(batch[0]), batch[1])

    trainer = tm.Trainer(model, optimizer, loss_fn, scenario.hot_hooks(args, job, data), scheduler=scheduler, seed=7)
    for result in trainer.fit(args.steps):
        scenario.after_step(args, job, result)


if __name__ == "__main__":
    main()
