"""A training script for the elastic-width tests: BatchNorm, dropout, random augmentation, two parameter groups,
an EMA of the weights, AdamW and StepLR, on a small classification task with a held-out set.

`--out DIR`: every member writes its final state (`final-PROC.pt`: the model's and the EMA's tensors) when training
is over; rank 0 writes the held-out loss and accuracy every `--eval-every` steps (`curve.json`), measured after the
step's commit (evaluation changes nothing the training sees).
"""

from __future__ import annotations

import json
from pathlib import Path

import scenario  # this directory's shared scenario options
import torch
from torch import nn
from torch.utils.data import Dataset

import runtime as tm


class Noisy(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Random augmentation: each sample gets fresh noise from torch's global generator (seeded per unit of data)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] + 0.1 * torch.randn(self.x.shape[1]), self.y[i]


class Ema:
    def __init__(self, model: nn.Module, decay: float = 0.9) -> None:
        self.decay = decay
        self.shadow = {k: v.detach().clone() for k, v in model.state_dict().items() if v.is_floating_point()}

    def update(self, model: nn.Module) -> None:
        with torch.no_grad():
            for k, v in model.state_dict().items():
                if k in self.shadow:
                    self.shadow[k].mul_(self.decay).add_(v, alpha=1 - self.decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.shadow

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for k, v in state.items():
            self.shadow[k].copy_(v)


def task(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Four classes: the quadrant of a random projection of 16 features, with label noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    w = torch.randn(16, 2, generator=torch.Generator().manual_seed(99))
    z = x @ w
    y = (z[:, 0] > 0).long() * 2 + (z[:, 1] > 0).long()
    flip = torch.rand(n, generator=g) < 0.05
    y[flip] = torch.randint(0, 4, (int(flip.sum()),), generator=g)
    return x, y


def main() -> None:
    parser = scenario.parser()
    parser.add_argument("--out", default="")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--accumulation", type=int, default=1)
    args = parser.parse_args()

    job = tm.init()
    torch.manual_seed(0)
    x, y = task(4096, 1)
    held_x, held_y = task(1024, 2)
    data = tm.ShardedLoader(Noisy(x, y), batch_size=16, seed=3)
    model = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 4))
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() > 1]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and p.dim() > 1)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": rest, "weight_decay": 0.0}],
                                  lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=40, gamma=0.5)
    ema = Ema(model)

    def loss_fn(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return nn.functional.cross_entropy(m(batch[0]), batch[1])

    trainer = tm.Trainer(model, optimizer, loss_fn, data, scheduler=scheduler, seed=7,
                         accumulation_steps=args.accumulation)
    trainer.register_state("ema", ema)
    curve = []
    for result in trainer.fit(args.steps):
        ema.update(model)
        if result.rank == 0 and args.out and result.step % args.eval_every == 0:
            model.eval()
            with torch.no_grad():
                logits = model(held_x)
                curve.append([result.step, float(nn.functional.cross_entropy(logits, held_y)),
                              float((logits.argmax(1) == held_y).float().mean())])
            model.train()
        scenario.after_step(args, job, result)
    if args.out:
        out = Path(args.out)
        torch.save({"model": model.state_dict(), "ema": ema.state_dict()}, out / f"final-{job.proc}.pt")
        if trainer.rank == 0:
            (out / "curve.json").write_text(json.dumps(curve))


if __name__ == "__main__":
    main()
