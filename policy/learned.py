"""The learned standby policy: a fitted `FailurePredictor`'s per-node probabilities as the decision's hazards.

This module owns the bridge from prediction to decision. The predictor scores each node at the end of every
feature slot with P(fault within the horizon H) (`features.build_features`, 24 h by default). The standby rule
(`decision.decide_standby`) wants P(fault within the lead time L). Assuming a constant hazard over the horizon,

    p_L = 1 - (1 - p_H) ** (L / H)

and the policy decides every hour from each node's latest score. A node with no score yet (the first slot, or a
node just back from repair) gets the fleet's base rate. `multiplier` scales p_L for cost owners who want more or
less caution than the calibrated model (the tuning sweep varies it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from policy.features import FeatureSet
from policy.simulator import HazardPolicy


@dataclass(frozen=True, slots=True)
class HazardTable:
    """P(fault within `horizon_h`) per feature slot and node, NaN where the node had no row (down, or no data)."""

    node_ids: tuple[str, ...]
    bin_h: float
    horizon_h: float
    p_horizon: npt.NDArray[np.float64]
    """Shape (slots, nodes): row i holds the scores known at hour (i + 1) x bin_h."""
    base_p_horizon: float
    """The fleet's base rate over the horizon, used where a node has no score."""
    _column: dict[str, int] = field(default_factory=dict, repr=False, compare=False)
    _columns_of: dict[tuple[str, ...], npt.NDArray[np.int64]] = field(default_factory=dict, repr=False, compare=False)
    """The column of each node of a job's node tuple (a policy asks for the same tuple every hour)."""

    def __post_init__(self) -> None:
        self._column.update({n: i for i, n in enumerate(self.node_ids)})

    def _columns(self, node_ids: Sequence[str]) -> npt.NDArray[np.int64]:
        key = tuple(node_ids)
        cols = self._columns_of.get(key)
        if cols is None:
            cols = np.fromiter((self._column.get(x, -1) for x in key), dtype=np.int64, count=len(key))
            if len(self._columns_of) > 8:
                self._columns_of.clear()
            self._columns_of[key] = cols
        return cols

    def p_within(self, t_h: float, window_h: float, node_ids: Sequence[str]) -> npt.NDArray[np.float64]:
        """P(fault within `window_h` from `t_h`) for each node, from the latest score known at `t_h`."""
        slot = math.floor(t_h / self.bin_h + 1e-9) - 1
        n = len(node_ids)
        p_h = np.full(n, self.base_p_horizon)
        if 0 <= slot < self.p_horizon.shape[0]:
            cols = self._columns(node_ids)
            known = cols >= 0
            row = self.p_horizon[slot]
            vals = row[np.where(known, cols, 0)]
            p_h = np.where(known & np.isfinite(vals), vals, p_h)
        return self._within(p_h, window_h)

    def p_within_at(
        self, times_h: npt.NDArray[np.float64], window_h: float, node_ids: Sequence[str]
    ) -> npt.NDArray[np.float64]:
        """`p_within` for many times at once, (times, nodes): row i equals `p_within(times_h[i], ...)` to the last
        bit (the same element-wise arithmetic)."""
        t = np.asarray(times_h, dtype=np.float64)
        slots = np.floor(t / self.bin_h + 1e-9).astype(np.int64) - 1
        scored = (slots >= 0) & (slots < self.p_horizon.shape[0])
        cols = self._columns(node_ids)
        known = cols >= 0
        vals = self.p_horizon[np.ix_(np.where(scored, slots, 0), np.where(known, cols, 0))]
        use = scored[:, None] & known[None, :] & np.isfinite(vals)
        if not use.all():
            vals = np.where(use, vals, self.base_p_horizon)
        return self._within(vals, window_h, in_place=True)

    def _within(
        self, p_h: npt.NDArray[np.float64], window_h: float, *, in_place: bool = False
    ) -> npt.NDArray[np.float64]:
        """1 - (1 - p_h) ** (window / horizon), as -expm1(log1p(-p) x window / horizon); `in_place` overwrites
        `p_h` (the same arithmetic, without a fresh array per step)."""
        out = np.clip(p_h, 0.0, 1.0 - 1e-12, out=p_h if in_place else None)
        np.negative(out, out=out)
        np.log1p(out, out=out)
        np.multiply(out, window_h / self.horizon_h, out=out)
        np.expm1(out, out=out)
        return np.negative(out, out=out)

    def hazard_fn(self, lead_time_h: float, multiplier: float = 1.0) -> TableHazards:
        """The simulator's hazard function: P(fault within `lead_time_h`), scaled by `multiplier`, capped at 1."""
        if not multiplier > 0:
            raise ValueError(f"multiplier={multiplier} must be > 0")
        return TableHazards(self, lead_time_h, multiplier)


@dataclass(frozen=True, slots=True, eq=False)  # compared and hashed by identity, as a function is
class TableHazards:
    """A `HazardTable` read as the simulator's hazards (a `simulator.BatchHazardFn`): one time, or many at once."""

    table: HazardTable
    lead_time_h: float
    multiplier: float = 1.0

    def __call__(self, t_h: float, node_ids: tuple[str, ...]) -> npt.NDArray[np.float64]:
        return np.minimum(1.0, self.multiplier * self.table.p_within(t_h, self.lead_time_h, node_ids))

    def at_times(self, times_h: npt.NDArray[np.float64], node_ids: tuple[str, ...]) -> npt.NDArray[np.float64]:
        p = self.table.p_within_at(times_h, self.lead_time_h, node_ids)
        if self.multiplier == 1.0:
            return p  # 1 x p is p, and p < 1 already
        return np.minimum(1.0, self.multiplier * p)


def hazard_table(scores: npt.ArrayLike, features: FeatureSet, *, bin_h: float = 1.0) -> HazardTable:
    """Lay a predictor's scores for `features`' rows out as a (slot, node) table.

    `features` should hold every row, censored ones included (`build_features(..., drop_censored=False)`), so the
    last horizon of the window has scores too.
    """
    p = np.asarray(scores, dtype=np.float64)
    if p.shape != (features.times.size,):
        raise ValueError(f"scores must hold one probability per feature row ({features.times.size}), got {p.shape}")
    n_slots = round(float(features.times.max()) / bin_h) if features.times.size else 0
    table = np.full((n_slots, len(features.node_ids)), np.nan)
    slots = np.rint(features.times / bin_h).astype(np.int64) - 1
    table[slots, features.groups] = p
    base = float(np.mean(features.y)) if features.y.size else 0.0
    return HazardTable(features.node_ids, bin_h, features.horizon_h, table, base)


def learned_policy(
    table: HazardTable, lead_time_h: float, *, multiplier: float = 1.0, every_h: float = 1.0, name: str = "learned"
) -> HazardPolicy:
    """The standby decision every `every_h` hours, fed by the predictor's scores in `table`."""
    return HazardPolicy(table.hazard_fn(lead_time_h, multiplier), every_h=every_h, name=name)
