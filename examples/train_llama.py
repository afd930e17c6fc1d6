"""A small Llama-style decoder, sharded by torch's own parallelism, trained under TrainMover.

    trainmover run --nproc 4 --standby 1 examples/train_llama.py --layout hsdp --steps 40
    trainmover run --nproc 4 --standby 1 --faults "kill:rank=2,step=9,phase=exchange" \\
        examples/train_llama.py --layout hsdp --steps 40
    trainmover run --nproc 4 --standby 1 examples/train_llama.py --layout dp-tp --steps 40

The model: token embeddings, decoder blocks of RMSNorm -> multi-head attention with rotary position embeddings
-> RMSNorm -> SwiGLU feed-forward, a final RMSNorm and an output projection, tied to the embeddings or not.

The layouts (`--layout`), each a `runtime.MeshSpec` and a `build(mesh)` that parallelises the model on it:

- `hsdp`: 2 replica groups x 2 shards (`fully_shard` on the 2-D mesh, per block and at the root). A lost rank's
  shard comes from the rank holding the same shard in the other replica group.
- `fsdp`: FSDP over every rank, no replica. A lost shard has no second home (yet): the job stops at once and
  names it.
- `dp-tp`: 2 data-parallel replicas x 2-way tensor parallelism (`parallelize_module`: attention and
  feed-forward projections column-/row-wise). The runtime averages gradients over the replicas.

Every process runs this file, standbys too. `build(mesh)` is called again in each generation of the job; the
runtime copies the trained state into what it returns.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import TensorDataset

import runtime as tm

LAYOUTS = {
    "hsdp": tm.MeshSpec(replicate=2, shard=2),
    "fsdp": tm.MeshSpec(shard=4),
    "dp-tp": tm.MeshSpec(replicate=2, tp=2),
}


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    vocab: int = 128
    dim: int = 64
    layers: int = 2
    heads: int = 4
    hidden: int = 128
    seq: int = 32
    tied: bool = False
    rope_theta: float = 10000.0


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_tables(head_dim: int, seq: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(seq).float(), freqs)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of x's last dimension by position: x is (batch, seq, heads, head_dim)."""
    even, odd = x[..., 0::2], x[..., 1::2]
    c, s = cos[None, : x.shape[1], None, :], sin[None, : x.shape[1], None, :]
    return torch.stack((even * c - odd * s, even * s + odd * c), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.heads
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds heads / tp of them.
        q = apply_rotary(self.wq(x).view(b, s, -1, self.head_dim), cos, sin)
        k = apply_rotary(self.wk(x).view(b, s, -1, self.head_dim), cos, sin)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        out = nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                         is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w2 = nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        if cfg.tied:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rotary_tables(cfg.dim // cfg.heads, cfg.seq, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.rope_cos, self.rope_sin)
        return self.output(self.norm(h))


DEFAULT = LlamaConfig()

TP_PLAN = {
    "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
    "attention.wo": RowwiseParallel(),
    "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
    "feed_forward.w2": RowwiseParallel(),
}


def parallelize(model: Llama, mesh: DeviceMesh) -> Llama:
    """Tensor parallelism inside each block (on the `tp` dimension), then FSDP/HSDP over the data dimensions."""
    names = mesh.mesh_dim_names or ()
    if "tp" in names:
        for block in model.layers:
            parallelize_module(block, mesh["tp"], TP_PLAN)
    data_dims = tuple(n for n in ("replicate", "shard") if n in names)
    if "shard" in data_dims:
        fsdp_mesh = mesh[data_dims] if len(data_dims) > 1 else mesh["shard"]
        for block in model.layers:
            fully_shard(block, mesh=fsdp_mesh)
        fully_shard(model, mesh=fsdp_mesh)
    return model


def make_tokens(cfg: LlamaConfig, n: int = 1024, seed: int = 0) -> torch.Tensor:
    """Sequences a model can learn: each continues an arithmetic progression modulo the vocabulary."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, cfg.vocab, (n, 1), generator=g)
    stride = torch.randint(1, 8, (n, 1), generator=g)
    return (start + stride * torch.arange(cfg.seq + 1)) % cfg.vocab


def loss_fn(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    (tokens,) = batch
    tokens = tokens.to(next(model.buffers()).device)  # the batch is in host memory; the model may be on a GPU
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))


Build = Callable[[DeviceMesh], tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]]


def make_builder(cfg: LlamaConfig, lr: float = 3e-3) -> Build:
    """`build(mesh)` for the trainer: the model parallelised on the mesh, AdamW with two parameter groups (no
    weight decay for norms) and a warm-up-then-cosine schedule."""

    def build(mesh: DeviceMesh) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        model = parallelize(Llama(cfg), mesh)
        decay = [p for n, p in model.named_parameters() if not n.endswith("norm.weight")]
        no_decay = [p for n, p in model.named_parameters() if n.endswith("norm.weight")]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                       {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))
        warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=5)
        cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=200)
        scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine], milestones=[5])
        return model, optimizer, scheduler

    return build


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--layout", choices=sorted(LAYOUTS), default="hsdp")
    p.add_argument("--tied", action="store_true", help="tie the output projection to the token embeddings")
    p.add_argument("--accumulation-steps", type=int, default=1)
    p.add_argument("--clip-grad-norm", type=float, default=1.0)
    p.add_argument("--bf16", action="store_true", help="forward under bf16 autocast")
    p.add_argument("--buddy-every", type=int, default=None,
                   help="refresh buddy copies every N steps (0: off; default: 10 for fsdp, off otherwise)")
    p.add_argument("--reconfigure", choices=("delta", "full"), default="delta",
                   help="after a loss, rebuild only the process groups it touched (delta) or every group (full)")
    p.add_argument("--mesh", default=None, metavar="R,S,T",
                   help="replicate,shard,tp sizes instead of the layout's own (their product: the job's workers)")
    p.add_argument("--dim", type=int, default=DEFAULT.dim, help="model width")
    p.add_argument("--layers", type=int, default=DEFAULT.layers)
    p.add_argument("--hidden", type=int, default=DEFAULT.hidden, help="SwiGLU hidden width")
    p.add_argument("--vocab", type=int, default=DEFAULT.vocab)
    return p


def make_trainer(args: argparse.Namespace) -> tm.ShardedTrainer:
    cfg = LlamaConfig(tied=args.tied, dim=args.dim, layers=args.layers, hidden=args.hidden, vocab=args.vocab)
    data = tm.ShardedLoader(TensorDataset(make_tokens(cfg)), batch_size=8, seed=1)
    mesh = LAYOUTS[args.layout]
    if args.mesh:
        replicate, shard, tp = (int(x) for x in args.mesh.split(","))
        mesh = tm.MeshSpec(replicate=replicate, shard=shard, tp=tp)
    return tm.ShardedTrainer(make_builder(cfg), mesh, loss_fn, data, seed=5,
                             clip_grad_norm=args.clip_grad_norm or None, accumulation_steps=args.accumulation_steps,
                             amp="bf16" if args.bf16 else None, buddy_every=args.buddy_every,
                             reconfigure=args.reconfigure)


def main() -> None:
    args = parser().parse_args()
    tm.init()
    trainer = make_trainer(args)
    for result in trainer.fit(args.steps):
        if result.rank == 0 and (result.step % 10 == 0 or result.step == args.steps):
            print(f"step {result.step} loss {result.global_loss:.4f}", flush=True)


if __name__ == "__main__":
    main()
