"""Elastic width: which samples a member of a shrunk job trains on, and how its optimizer step is scaled.

A job's data is split into `logical_width` logical ranks (its `--nproc`). The unit of data is one logical rank's
batch of one data step: unit u is `(data step u // W + 1, logical rank u % W)` for a logical width W, which is
exactly what rank u % W reads at step u // W + 1 when the job runs at full width. A step consumes consecutive
units starting at a cursor; member i of w takes the units i, i + w, ... of them. So no sample of an epoch is
skipped or seen twice whatever the width does, and a unit's random numbers (seeded from its data step and logical
rank) are the same at any width.

- **accumulate** (the default): every step consumes W units, whatever the width, so the cursor is (step - 1) x W and
  the optimizer sees the same global batch as at full width. A member of a shrunk job runs the micro-batches of
  each of its units in turn and sums their gradients; the exchange divides by W. The result is the full-width step's
  up to floating-point summation order: the units' gradients are the same numbers, summed in another order
  (docs/elastic.md states the guarantee and what the tests measured).
- **lr-linear**, **lr-sqrt**: a step consumes one unit per member (a smaller global batch), and the learning rate is
  scaled for that step by w / W (linear) or sqrt(w / W) (square root). The cursor is part of the training state
  (`DataCursor`, handed over and backed up with it), since it depends on the widths the job ran at.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from runtime.config import ShrinkMode

CURSOR_STATE = "trainmover_data_cursor"
"""The name `DataCursor` is registered under (lr-* modes)."""


class DataCursor:
    """The units of data consumed by the committed steps (lr-* modes), part of the training state."""

    def __init__(self) -> None:
        self.units = 0

    def state_dict(self) -> dict[str, Any]:
        return {"units": self.units}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.units = int(state["units"])


@dataclass(frozen=True, slots=True)
class Layout:
    """One member's share of a step at the generation's width."""

    logical_width: int
    world_size: int
    rank: int
    mode: ShrinkMode

    @property
    def shrunk(self) -> bool:
        return self.world_size < self.logical_width

    def units_per_step(self) -> int:
        """Units one step consumes: W (accumulate, or full width), else one per member."""
        return self.logical_width if self.mode in ("accumulate", "off") else self.world_size

    def first_unit(self, step: int, cursor: DataCursor | None) -> int:
        """The first unit step `step` consumes: (step - 1) x W, or the cursor (lr-* modes)."""
        if cursor is None:
            return (step - 1) * self.logical_width
        return cursor.units

    def units(self, step: int, cursor: DataCursor | None) -> list[tuple[int, int]]:
        """(data step, logical rank) of each unit this member trains on at step `step`, in order."""
        first, n, w, width = self.first_unit(step, cursor), self.units_per_step(), self.world_size, self.logical_width
        return [((u // width) + 1, u % width) for u in range(first + self.rank, first + n, w)]

    def lr_factor(self) -> float:
        """The learning rate's scale at this width (1 at full width, or with accumulation)."""
        if not self.shrunk or self.mode in ("accumulate", "off"):
            return 1.0
        ratio = self.world_size / self.logical_width
        return ratio if self.mode == "lr-linear" else math.sqrt(ratio)
