"""A small CNN with BatchNorm and random data augmentation, trained under TrainMover.

    trainmover run --nproc 2 --standby 1 examples/train_cnn.py --steps 60
    trainmover run --nproc 2 --standby 1 --faults "kill:rank=1,step=9,phase=exchange" examples/train_cnn.py --steps 30

What makes this script harder to replay than `train_mlp.py`, and what the runtime does about it:

- BatchNorm running statistics are buffers a forward pass changes: the runtime restores them before a replayed
  step and makes them equal on every rank after each exchange (rank 0's, as DDP's `broadcast_buffers` does).
- The dataset augments every sample with three global generators: torch's (random crop, horizontal flip),
  NumPy's (pixel noise) and Python's `random` (brightness). The runtime seeds all three from (seed, step, rank)
  before it fetches a batch, so a replayed step, or a standby taking over a rank, sees the same augmented images.
- SGD with (Nesterov) momentum and two parameter groups (no weight decay for BatchNorm and biases), a OneCycleLR
  schedule that cycles the learning rate and the momentum, gradient-norm clipping and optional bf16 autocast.

Every process runs this file, standbys too: they build the same model, warm up, and wait to be promoted.
"""

from __future__ import annotations

import argparse
import random
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

import runtime as tm

CHANNELS = 3  # RGB
NUM_CLASSES = 2 * CHANNELS  # brightest channel x (top half brighter or not)


def make_images(n: int = 4096, size: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic images and their labels, the same in every process.

    Each image is noise plus a per-channel offset plus a vertical brightness ramp. The label is a function of the
    pixels that the augmentations below (mostly) keep: which channel is brightest on average, and whether the top
    half is brighter than the bottom half (a horizontal flip keeps both, a brightness factor too).
    """
    g = torch.Generator().manual_seed(seed)
    noise = 0.3 * torch.randn(n, CHANNELS, size, size, generator=g)
    offset = 0.5 * torch.randn(n, CHANNELS, 1, 1, generator=g)
    ramp = torch.randn(n, 1, 1, 1, generator=g) * torch.linspace(-1.0, 1.0, size).view(1, 1, size, 1)
    images = noise + offset + ramp
    brightest = images.mean(dim=(2, 3)).argmax(dim=1)
    top_brighter = images[:, :, : size // 2].mean(dim=(1, 2, 3)) > images[:, :, size // 2 :].mean(dim=(1, 2, 3))
    labels = brightest * 2 + top_brighter.long()
    return images, labels


class AugmentedImages(Dataset[tuple[torch.Tensor, int]]):
    """A map-style image dataset whose `__getitem__` draws a random augmentation for every sample it returns.

    The draws come from the process-global generators on purpose (as most augmentation libraries do): the
    runtime seeds torch's, NumPy's and Python's before fetching each batch, so every draw replays exactly.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, *, pad: int = 2, noise_std: float = 0.05,
                 brightness: float = 0.2, augment: bool = True) -> None:
        self.images = images
        self.labels = labels.tolist()
        self.pad = pad
        self.noise_std = noise_std
        self.brightness = brightness
        self.augment = augment

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = self.images[index]
        if not self.augment:
            return image, self.labels[index]
        _, h, w = image.shape
        p = self.pad
        if p > 0:  # random crop: zero-pad, then cut an h x w window at a random offset (torch's generator)
            padded = nn.functional.pad(image, (p, p, p, p))
            dy, dx = torch.randint(0, 2 * p + 1, (2,)).tolist()
            image = padded[:, dy : dy + h, dx : dx + w]
        if torch.rand(()).item() < 0.5:  # horizontal flip (torch's generator)
            image = image.flip(-1)
        noise = np.random.standard_normal(image.shape).astype(np.float32)  # pixel noise (NumPy's generator)
        image = image + self.noise_std * torch.from_numpy(noise)
        image = image * random.uniform(1.0 - self.brightness, 1.0 + self.brightness)  # brightness (Python's)
        return image.contiguous(), self.labels[index]


class SmallCNN(nn.Module):
    """Two conv -> BatchNorm -> ReLU -> max-pool blocks and a linear head."""

    def __init__(self, in_channels: int = CHANNELS, width: int = 16, image_size: int = 16,
                 num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        if image_size % 4:
            raise ValueError(f"image_size must be a multiple of 4 (two 2x2 poolings), got {image_size}")
        c1, c2 = width, 2 * width
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, c1, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(c1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(c2),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Linear(c2 * (image_size // 4) ** 2, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two groups, in a fixed order: conv and linear weights decay; BatchNorm parameters and biases do not."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if isinstance(module, nn.modules.batchnorm._BatchNorm) or name == "bias":
                no_decay.append(p)
            else:
                decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, steps: int, lr: float = 0.05, weight_decay: float = 5e-4
                    ) -> tuple[torch.optim.SGD, torch.optim.lr_scheduler.OneCycleLR]:
    """SGD with Nesterov momentum over the two groups, and a one-cycle schedule of `steps` steps."""
    optimizer = torch.optim.SGD(param_groups(model, weight_decay), lr=lr, momentum=0.9, nesterov=True)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=[lr] * len(optimizer.param_groups), total_steps=steps, pct_start=0.25,
    )
    return optimizer, scheduler


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--width", type=int, default=16, help="channels of the first conv layer (the second: 2x)")
    parser.add_argument("--image-size", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--amp", choices=("bf16", "fp16"), default=None, help="autocast the forward pass")
    args = parser.parse_args()

    job = tm.init()  # joins the job; a standby learns here that it is one
    torch.manual_seed(0)
    model = SmallCNN(width=args.width, image_size=args.image_size)
    optimizer, scheduler = build_optimizer(model, args.steps, lr=args.lr)
    images, labels = make_images(size=args.image_size)
    data = tm.ShardedLoader(AugmentedImages(images, labels), batch_size=args.batch_size, seed=0)

    trainer = tm.Trainer(model, optimizer, loss_fn, data, scheduler=scheduler, seed=0,
                         clip_grad_norm=1.0, amp=args.amp)
    for result in trainer.fit(args.steps):
        if result.rank == 0 and result.step % 10 == 0:
            print(f"step {result.step:4d}  loss {result.loss:.4f}  lr {scheduler.get_last_lr()[0]:.4f}  "
                  f"world {result.world_size}  generation {result.generation}", flush=True)
    if trainer.rank == 0:
        print(f"{job.proc}: done, state digest {trainer.digest}", flush=True)


if __name__ == "__main__":
    main()
