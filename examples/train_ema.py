"""A tiny transformer with an EMA copy of its weights, trained under TrainMover.

    trainmover run --nproc 2 --standby 1 examples/train_ema.py --steps 60
    trainmover run --nproc 2 --standby 1 --faults "kill:rank=1,step=9,phase=exchange" examples/train_ema.py --steps 30

What this script adds to `train_mlp.py`, and what the runtime does about it:

- An exponential moving average of the weights (`torch.optim.swa_utils.AveragedModel` with an EMA update),
  registered with `trainer.register_state("ema", ema)`: it is handed over with the model and the optimizer, and
  is part of the final state digest. It is updated only after a step commits, in the body of the `fit` loop.
- Gradient accumulation: two micro-batches per step, one gradient exchange.
- AdamW with two parameter groups (no weight decay for biases, LayerNorm, embeddings and positions) and a
  ReduceLROnPlateau scheduler, which the runtime steps with the loss averaged over every rank.
- Dropout in attention and feed-forward layers, replayed exactly from per-step seeds.

Every process runs this file, standbys too: they build the same model, warm up, and wait to be promoted.
"""

from __future__ import annotations

import argparse
import hashlib
from typing import Any

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import TensorDataset

import runtime as tm


def make_dataset(n: int = 4096, seq_len: int = 16, vocab: int = 16, seed: int = 0) -> TensorDataset:
    """Random token sequences; the label says whether token 0 occurs more often than token 1."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (n, seq_len), generator=g)
    labels = ((tokens == 0).sum(dim=1) > (tokens == 1).sum(dim=1)).long()
    return TensorDataset(tokens, labels)


class TinyTransformer(nn.Module):
    """Token and position embeddings, pre-norm transformer encoder layers, mean pooling, a linear head."""

    def __init__(self, vocab: int = 16, seq_len: int = 16, d_model: int = 64, nhead: int = 4,
                 dim_feedforward: int = 128, num_layers: int = 1, dropout: float = 0.1, num_classes: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(0.02 * torch.randn(1, seq_len, d_model))
        layer = nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward, dropout, batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[:, : tokens.shape[1]]
        h = self.encoder(self.dropout(h))
        return self.head(self.norm(h).mean(dim=1))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two groups, in a fixed order: matrices decay; biases, LayerNorm, embeddings and positions do not."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for module_name, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            full = f"{module_name}.{name}" if module_name else name
            if isinstance(module, nn.LayerNorm | nn.Embedding) or name == "bias" or full == "pos":
                no_decay.append(p)
            else:
                decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, lr: float = 3e-3, weight_decay: float = 0.05, patience: int = 20
                    ) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.ReduceLROnPlateau]:
    """AdamW over the two groups; the LR halves after `patience` steps without a new best global loss."""
    optimizer = torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=(0.9, 0.98))
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=0.5, patience=patience,
                                                           threshold=1e-3, min_lr=lr / 100)
    return optimizer, scheduler


def build_ema(model: nn.Module, decay: float = 0.99) -> AveragedModel:
    """An EMA copy of `model`'s weights; `ema.update_parameters(model)` after every committed step."""
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay))
    ema.requires_grad_(False)
    return ema


def tensor_digest(module: nn.Module) -> str:
    """SHA-256 over a module's state_dict, names and bytes: equal digests mean bit-identical weights."""
    h = hashlib.sha256()
    for name, t in module.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    tokens, y = batch
    return nn.functional.cross_entropy(model(tokens), y)


@torch.no_grad()
def accuracy(model: nn.Module, data: TensorDataset) -> float:
    was_training = model.training
    model.eval()
    tokens, y = data.tensors
    acc = (model(tokens).argmax(dim=1) == y).float().mean().item()
    model.train(was_training)
    return acc


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank and micro-batch")
    parser.add_argument("--accumulation-steps", type=int, default=2)
    parser.add_argument("--ema-decay", type=float, default=0.99)
    parser.add_argument("--patience", type=int, default=20, help="ReduceLROnPlateau: steps without improvement")
    args = parser.parse_args()

    job = tm.init()  # joins the job; a standby learns here that it is one
    torch.manual_seed(0)
    model = TinyTransformer(d_model=args.d_model, num_layers=args.layers, dim_feedforward=2 * args.d_model)
    optimizer, scheduler = build_optimizer(model, patience=args.patience)
    ema = build_ema(model, args.ema_decay)
    data = tm.ShardedLoader(make_dataset(), batch_size=args.batch_size, seed=0)

    trainer = tm.Trainer(model, optimizer, loss_fn, data, scheduler=scheduler, seed=0,
                         accumulation_steps=args.accumulation_steps)
    trainer.register_state("ema", ema)  # handed over with the model, part of trainer.digest
    for result in trainer.fit(args.steps):
        ema.update_parameters(model)  # the step has committed: the EMA may follow it
        if result.rank == 0 and result.step % 10 == 0:
            global_loss = "-" if result.global_loss is None else f"{result.global_loss:.4f}"
            print(f"step {result.step:4d}  loss {result.loss:.4f}  global loss {global_loss}  "
                  f"lr {optimizer.param_groups[0]['lr']:.2e}  world {result.world_size}  "
                  f"generation {result.generation}", flush=True)
    if trainer.rank == 0:
        held_out = make_dataset(n=1024, seed=1)
        print(f"{job.proc}: held-out accuracy {accuracy(model, held_out):.3f}, "
              f"EMA {accuracy(ema, held_out):.3f}", flush=True)
        print(f"{job.proc}: EMA digest {tensor_digest(ema)}", flush=True)
        print(f"{job.proc}: done, state digest {trainer.digest}", flush=True)


if __name__ == "__main__":
    main()
