"""Where each step's samples come from, so that a replayed or handed-over step sees exactly the same ones.

The runtime asks the data pipeline for "the batch of step s for logical rank r of a world of w", never for
"the next batch": a standby that takes rank r at step s continues at exactly rank r's position, and a step
replayed after a failure reads the same samples, so no sample is skipped or seen twice. `ShardedLoader`
gives any map-style dataset this shape; any object with a `batch_at(step, rank, world_size)` method, or a
plain function of those three arguments, works as well.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch.utils.data import Dataset, default_collate


def derive_seed(*values: int) -> int:
    """A stable 63-bit seed from integers (Python's `hash()` is salted per process, so it cannot serve)."""
    digest = hashlib.blake2b(repr(values).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@runtime_checkable
class StepData(Protocol):
    """A data pipeline addressed by step: the protocol the Trainer consumes."""

    def batch_at(self, step: int, rank: int, world_size: int) -> Any: ...


class FunctionData:
    """Adapts a function `(step, rank, world_size) -> batch` to `StepData`."""

    def __init__(self, fn: Callable[[int, int, int], Any]) -> None:
        self.fn = fn

    def batch_at(self, step: int, rank: int, world_size: int) -> Any:
        return self.fn(step, rank, world_size)


def as_step_data(data: StepData | Callable[[int, int, int], Any]) -> StepData:
    if isinstance(data, StepData):
        return data
    if callable(data):
        return FunctionData(data)
    raise TypeError(
        "data must have a batch_at(step, rank, world_size) method (e.g. runtime.ShardedLoader(dataset, ...)) "
        f"or be a function of (step, rank, world_size); got {type(data).__name__}"
    )


class ShardedLoader:
    """Deterministic, resumable sharding of a map-style dataset over the job's logical ranks.

    Every epoch is one permutation of the dataset drawn from (seed, epoch). Step s (1-based) of epoch e uses
    samples [i*B*W, (i+1)*B*W) of that permutation, and rank r takes its B of them. Samples that do not fill a
    whole global batch at the end of an epoch are dropped, as `DistributedSampler(drop_last=True)` does.
    """

    def __init__(
        self,
        dataset: Dataset[Any] | Sequence[Any],
        batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        collate_fn: Callable[[list[Any]], Any] = default_collate,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.collate_fn = collate_fn
        self._perm_cache: tuple[int, torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def steps_per_epoch(self, world_size: int) -> int:
        return len(self) // (self.batch_size * world_size)

    def _permutation(self, epoch: int) -> torch.Tensor:
        if self._perm_cache is None or self._perm_cache[0] != epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(derive_seed(self.seed, epoch))
                perm = torch.randperm(len(self), generator=g)
            else:
                perm = torch.arange(len(self))
            self._perm_cache = (epoch, perm)
        return self._perm_cache[1]

    def indices_at(self, step: int, rank: int, world_size: int) -> list[int]:
        per_epoch = self.steps_per_epoch(world_size)
        if per_epoch == 0:
            raise ValueError(
                f"the dataset has {len(self)} samples, fewer than one global batch "
                f"({self.batch_size} x {world_size} ranks); lower batch_size"
            )
        epoch, index = divmod(step - 1, per_epoch)
        start = index * self.batch_size * world_size + rank * self.batch_size
        return self._permutation(epoch)[start : start + self.batch_size].tolist()

    def batch_at(self, step: int, rank: int, world_size: int) -> Any:
        return self.collate_fn([self.dataset[i] for i in self.indices_at(step, rank, world_size)])
