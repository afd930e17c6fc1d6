"""A test-sized job with registered extra state: an EMA of the weights, updated after every committed step.

The model and helpers come from `examples/train_ema.py`, made tiny (a one-layer transformer of width 16 over
8-token sequences): `trainer.register_state("ema", ema)` puts the EMA into every handoff and into
`trainer.digest`, so a final digest equal to an uninterrupted run's means the EMA was replayed exactly too.
Also: two micro-batches per step (accumulation), AdamW over two parameter groups, ReduceLROnPlateau stepped
with the global mean loss (patience 3, so the LR drops within a 20-step run) and dropout.
"""

from __future__ import annotations

import scenario  # this directory's shared scenario options
import torch

import runtime as tm
from examples.train_ema import TinyTransformer, build_ema, build_optimizer, loss_fn, make_dataset

SEQ_LEN = 8
VOCAB = 8


def main() -> None:
    parser = scenario.parser()
    args = parser.parse_args()

    job = tm.init()
    torch.manual_seed(0)
    model = TinyTransformer(vocab=VOCAB, seq_len=SEQ_LEN, d_model=16, nhead=2, dim_feedforward=32, dropout=0.1)
    optimizer, scheduler = build_optimizer(model, patience=3)
    ema = build_ema(model, decay=0.9)
    data = tm.ShardedLoader(make_dataset(n=1024, seq_len=SEQ_LEN, vocab=VOCAB, seed=1), batch_size=8, seed=3)

    data = scenario.hot_hooks(args, job, data, accumulation=2)
    trainer = tm.Trainer(model, optimizer, loss_fn, data, scheduler=scheduler, seed=7, accumulation_steps=2)
    trainer.register_state("ema", ema)  # part of the handoff and of trainer.digest
    for result in trainer.fit(args.steps):
        ema.update_parameters(model)  # after the step committed, never inside loss_fn
        scenario.after_step(args, job, result)


if __name__ == "__main__":
    main()
