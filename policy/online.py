"""Online failure hazards: live telemetry samples in, per-node P(fault within the lead time) out.

This module owns the step from a fleet's telemetry *as it arrives* to the `NodeHazards` that `decide_standby`
reads. `OnlineScorer` keeps the last day of samples per node and scores each node either with a fitted
`FailurePredictor` (the same rolling-window features as training, `features.build_features`) or, without a
model, with a transparent rule that cost owners can read: an XID 48/79 or a double-bit ECC error in the last
24 h, or a burst of corrected errors or link errors in the last 6 h, raises the node's probability.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from policy.decision import NodeHazards
from policy.features import build_features
from policy.telemetry import COLUMNS, TelemetrySample
from policy.traces import FaultTrace

RULE_P_CRITICAL = 0.8
"""P(fault within 24 h) the rule gives a node with an XID 48/79 or a double-bit ECC error in the last 24 h."""
RULE_P_WARNING = 0.3
"""... and a node with more than `RULE_BURST` corrected ECC, NVLink or NIC errors in the last 6 h."""
RULE_BURST = 20


@dataclass(frozen=True, slots=True)
class NodeScore:
    node_id: str
    p_horizon: float
    """P(fault within the horizon)."""
    why: str


class OnlineScorer:
    """Per-node failure probabilities from the last `window_h` hours of samples."""

    def __init__(
        self,
        node_ids: Iterable[str],
        *,
        model: Any | None = None,
        horizon_h: float = 24.0,
        base_p_horizon: float = 0.004,
        window_h: float = 30.0,
    ) -> None:
        self.node_ids = tuple(node_ids)
        if not self.node_ids or len(set(self.node_ids)) != len(self.node_ids):
            raise ValueError("OnlineScorer needs a non-empty list of distinct node ids")
        if not (horizon_h > 0 and window_h > 0 and 0 <= base_p_horizon < 1):
            raise ValueError("horizon_h and window_h must be > 0 and base_p_horizon in [0, 1)")
        self.model = model
        self.horizon_h = horizon_h
        self.base_p_horizon = base_p_horizon
        self.window_h = window_h
        self._samples: dict[str, deque[TelemetrySample]] = {n: deque() for n in self.node_ids}

    def replace_node(self, old: str, new: str) -> None:
        """A node left the job and another took its place: forget the old one's history."""
        if new in self._samples and new != old:
            raise ValueError(f"node {new!r} is already scored")
        self._samples.pop(old, None)
        self._samples[new] = deque()
        self.node_ids = tuple(new if n == old else n for n in self.node_ids)

    def observe(self, samples: Iterable[TelemetrySample]) -> None:
        for s in samples:
            buf = self._samples.get(s.node_id)
            if buf is None:
                raise ValueError(f"telemetry for unknown node {s.node_id!r}; known: {list(self._samples)[:5]}")
            if buf and s.t_h <= buf[-1].t_h:
                raise ValueError(f"node {s.node_id!r}: sample at t_h={s.t_h} is not after {buf[-1].t_h}")
            buf.append(s)
            while buf and buf[0].t_h < s.t_h - self.window_h:
                buf.popleft()

    def scores(self, now_h: float) -> list[NodeScore]:
        if self.model is not None:
            return self._model_scores(now_h)
        return [self._rule_score(n, now_h) for n in self.node_ids]

    def hazards(self, now_h: float, lead_time_h: float, multiplier: float = 1.0) -> tuple[NodeHazards, list[NodeScore]]:
        """P(fault within `lead_time_h`) per node (constant hazard over the horizon), and the scores behind it."""
        scores = self.scores(now_h)
        p = [
            min(1.0, multiplier * -math.expm1(math.log1p(-min(s.p_horizon, 1 - 1e-12)) * lead_time_h / self.horizon_h))
            for s in scores
        ]
        return NodeHazards(node_ids=tuple(s.node_id for s in scores), p_fail=tuple(p)), scores

    def _rule_score(self, node: str, now_h: float) -> NodeScore:
        recent = [s for s in self._samples[node] if now_h - 24.0 <= s.t_h <= now_h]
        last6 = [s for s in recent if s.t_h >= now_h - 6.0]
        xids = sorted({x for s in recent for x in s.xid_codes if x in (48, 79)})
        dbe = sum(s.ecc_dbe_count for s in recent)
        if xids or dbe:
            why = ", ".join([f"XID {x}" for x in xids] + ([f"{dbe} double-bit ECC"] if dbe else []))
            return NodeScore(node, max(RULE_P_CRITICAL, self.base_p_horizon), f"{why} in the last 24 h")
        bursts = {
            "corrected ECC": sum(s.ecc_sbe_count for s in last6),
            "NVLink": sum(s.nvlink_errors for s in last6),
            "NIC": sum(s.nic_errors for s in last6),
        }
        loud = {k: v for k, v in bursts.items() if v > RULE_BURST}
        if loud:
            what = ", ".join(f"{v} {k} errors" for k, v in loud.items())
            return NodeScore(node, max(RULE_P_WARNING, self.base_p_horizon), f"{what} in the last 6 h")
        return NodeScore(node, self.base_p_horizon, "no warning signs: the fleet's base rate")

    def _model_scores(self, now_h: float) -> list[NodeScore]:
        rows = [s for n in self.node_ids for s in self._samples[n] if s.t_h <= now_h]
        if not rows:
            return [NodeScore(n, self.base_p_horizon, "no telemetry yet: the fleet's base rate") for n in self.node_ids]
        rows.sort(key=lambda s: (s.t_h, s.node_id))
        batch: dict[str, np.ndarray] = {}
        for col in COLUMNS:
            values = [getattr(s, col) for s in rows]
            if col == "xid_codes":
                arr = np.empty(len(values), dtype=object)
                arr[:] = values
                batch[col] = arr
            else:
                batch[col] = np.asarray(values, dtype=object if col == "spot_interruption_band" else None)
        trace = FaultTrace((), len(self.node_ids), max(now_h, 1e-6))
        feats = build_features([batch], trace, self.node_ids, horizon_h=self.horizon_h, drop_censored=False)
        latest: dict[int, int] = {}
        for i, (g, t) in enumerate(zip(feats.groups.tolist(), feats.times.tolist(), strict=True)):
            if t <= now_h + 1.0 and (g not in latest or t >= feats.times[latest[g]]):
                latest[g] = i
        out = []
        model = self.model
        assert model is not None
        p = model.predict_proba(feats.X[list(latest.values())])[:, 1] if latest else np.empty(0)
        p_of = dict(zip(latest, p.tolist(), strict=True))
        for g, n in enumerate(self.node_ids):
            if g in p_of:
                out.append(NodeScore(n, float(p_of[g]), "FailurePredictor on the last 24 h of telemetry"))
            else:
                out.append(NodeScore(n, self.base_p_horizon, "no telemetry yet: the fleet's base rate"))
        return out
