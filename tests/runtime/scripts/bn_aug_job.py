"""A test-sized job with BatchNorm and random augmentation: what a replayed step must restore besides weights.

The model and dataset come from `examples/train_cnn.py`, made tiny (8x8 images, 4 and 8 channels, 16 images per
rank): BatchNorm running statistics (buffers a forward pass changes, broadcast from rank 0 after each exchange),
augmentation drawing from torch's, NumPy's and Python's global generators inside `Dataset.__getitem__`, SGD with
momentum over two parameter groups, OneCycleLR (LR and momentum cycled) and gradient-norm clipping.
"""

from __future__ import annotations

import scenario  # this directory's shared scenario options
import torch

import runtime as tm
from examples.train_cnn import AugmentedImages, SmallCNN, build_optimizer, loss_fn, make_images

IMAGE_SIZE = 8


def main() -> None:
    parser = scenario.parser()
    parser.add_argument("--amp", choices=("bf16", "fp16"), default=None)
    parser.add_argument("--per-rank-buffers", action="store_true", help="broadcast_buffers=False")
    parser.add_argument("--accumulation-steps", type=int, default=1)
    args = parser.parse_args()

    job = tm.init()
    torch.manual_seed(0)
    model = SmallCNN(width=4, image_size=IMAGE_SIZE)
    optimizer, scheduler = build_optimizer(model, args.steps, lr=0.05)
    images, labels = make_images(n=1024, size=IMAGE_SIZE, seed=1)
    data = tm.ShardedLoader(AugmentedImages(images, labels, pad=1), batch_size=16, seed=3)

    data = scenario.hot_hooks(args, job, data, accumulation=args.accumulation_steps)
    trainer = tm.Trainer(model, optimizer, loss_fn, data, scheduler=scheduler, seed=7, clip_grad_norm=1.0,
                         amp=args.amp, broadcast_buffers=not args.per_rank_buffers,
                         accumulation_steps=args.accumulation_steps)
    for result in trainer.fit(args.steps):
        scenario.after_step(args, job, result)


if __name__ == "__main__":
    main()
