"""Bursts: how a fleet's failures cluster in time, measured against independence and modelled for the decision.

Real fleets fail in bursts (a rack, a switch, a power feed, a bad rollout): on the InfiniteHBD and LANL traces
P(at least 4 failures within 0.5 h) is three to four orders of magnitude above what independent nodes at the
fleet's mean rate give. A pool sized under independence is empty exactly when it matters. The measurement lives
with the other statistics (`traces.burst_curve` against `traces.independent_curve`, reported by
`trace_statistics`); this module owns the model and the policy:

- `CompoundPoisson`: a count model that carries bursts, fitted to history: clusters (failures within L of the
  cluster's first one) arrive as a Poisson process, each with an empirical size; its tail comes from Panjer's
  recursion, and `decision.decide_from_tail` sizes a mixed-tier pool from it;
- `BurstAwarePool`: that decision as a policy, fitted on a training trace and held;
- `burst_aware_learned`: per-node hazards (a learned predictor's) for the single failures plus the fitted
  cluster tail for the bursts, decided every hour.

numpy only, like the decision.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from policy.costs import TIER_NAMES
from policy.decision import FleetState, decide_from_tail
from policy.simulator import HazardFn, HazardPolicy, JobView, ScaledHazards, StandbySchedule, constant_schedule
from policy.traces import FaultTrace, job_failure_times

DEFAULT_K_MAX = 64


@dataclass(frozen=True, slots=True)
class CompoundPoisson:
    """Failures in clusters: cluster starts are Poisson at `cluster_rate_per_h`; a cluster holds j failures with
    probability `size_pmf[j]` (j >= 1). Fitted by `fit`; `tail` gives P(N(window) >= k)."""

    cluster_rate_per_h: float
    size_pmf: tuple[float, ...]
    """size_pmf[j] = P(a cluster holds j failures); size_pmf[0] = 0."""
    window_h: float
    """The cluster window the model was fitted with (a cluster: failures within it of the cluster's first)."""

    @classmethod
    def fit(cls, trace: FaultTrace, window_h: float, *, prior_clusters: float = 1.0) -> CompoundPoisson:
        """Fit to a trace's job failures: greedy clusters of failures within `window_h` of the cluster's first.

        `prior_clusters` adds that many clusters of size 1 (a weak prior), so a trace without any failure still
        gives a positive rate (half a failure over the window would be a guess; one is the convention used here).
        """
        if not window_h > 0 or not trace.duration_h > 0:
            raise ValueError("a compound Poisson fit needs window_h > 0 and a trace of positive length")
        times = job_failure_times(trace)
        sizes: list[int] = []
        i = 0
        while i < times.size:
            j = int(np.searchsorted(times, times[i] + window_h, side="left"))
            sizes.append(j - i)
            i = j
        counts = np.bincount(np.asarray(sizes, dtype=np.int64), minlength=2).astype(np.float64)
        counts[1] += prior_clusters
        n_clusters = float(counts.sum())
        pmf = counts / n_clusters
        pmf[0] = 0.0
        return cls(n_clusters / trace.duration_h, tuple(float(x) for x in pmf), window_h)

    def tail(self, window_h: float | None = None, k_max: int = DEFAULT_K_MAX) -> npt.NDArray[np.float64]:
        """P(N >= k), k = 0..k_max, for the failures in a window (default: the fitted one), by Panjer's recursion:
        g(0) = exp(-lam), g(n) = lam / n x sum_j j f(j) g(n - j), with lam = cluster rate x window."""
        lam = self.cluster_rate_per_h * (self.window_h if window_h is None else window_h)
        f = np.zeros(k_max + 1)
        m = min(len(self.size_pmf), k_max + 1)
        f[:m] = self.size_pmf[:m]
        g = np.zeros(k_max + 1)
        g[0] = math.exp(-lam)
        jf = np.arange(k_max + 1) * f
        for n in range(1, k_max + 1):
            g[n] = lam / n * float(np.dot(jf[1 : n + 1], g[n - 1 :: -1][:n]))
        # The top down sum keeps small tails accurate; mass beyond k_max is at most 1 - sum(g).
        tail = np.empty(k_max + 1)
        tail[0] = 1.0
        tail[1:] = np.clip(1.0 - np.cumsum(g)[:-1], 0.0, 1.0)
        return tail

    @property
    def mean_size(self) -> float:
        return float(sum(j * f for j, f in enumerate(self.size_pmf)))

    @property
    def singles_share(self) -> float:
        """Share of the failures that came alone (clusters of size 1), 1 for a model without bursts."""
        mean = self.mean_size
        return float(self.size_pmf[1]) / mean if len(self.size_pmf) > 1 and mean > 0 else 1.0

    def multi(self) -> CompoundPoisson:
        """The clusters of two or more failures only: the common-cause part of the count, to add to a per-node
        model that carries the single failures (`singles_share` of them)."""
        pmf = list(self.size_pmf)
        multi_p = float(sum(pmf[2:]))
        if multi_p <= 0:
            return CompoundPoisson(0.0, (0.0, 1.0), self.window_h)
        return CompoundPoisson(
            self.cluster_rate_per_h * multi_p, (0.0, 0.0, *(f / multi_p for f in pmf[2:])), self.window_h
        )

    def pmf(self, window_h: float | None = None, k_max: int = DEFAULT_K_MAX) -> npt.NDArray[np.float64]:
        """P(N = k), k = 0..k_max - 1 (the mass P(N >= k_max) left out)."""
        tail = self.tail(window_h, k_max)
        return np.clip(tail[:-1] - tail[1:], 0.0, 1.0)


def burst_aware_learned(
    hazard_fn: HazardFn, history: FaultTrace, lead_time_h: float, *, every_h: float = 1.0, name: str = "learned-burst"
) -> HazardPolicy:
    """Per-node hazards combined with the burst tail: the count within L is the per-node Poisson-binomial count of
    the single failures plus an independent compound-Poisson count of the clusters of two or more, fitted on
    `history` (training data only). The per-node hazards are scaled by the share of failures that came alone in
    `history`, so the failures in clusters are not counted twice."""
    model = CompoundPoisson.fit(history, lead_time_h)
    share = model.singles_share
    extra = model.multi().pmf(lead_time_h)
    return HazardPolicy(
        ScaledHazards(hazard_fn, share), every_h=every_h, name=name, extra_pmf=tuple(float(x) for x in extra)
    )


@dataclass(frozen=True, slots=True)
class BurstAwarePool:
    """The standby decision (`decide_from_tail`) on a compound Poisson count fitted to history, held as a pool.

    Fit it on training data only (`fit` on the first part of a trace); it then holds the mixed-tier pool that the
    threshold rule gives for the bursts seen there. The model is per fleet: a job on part of the fleet is
    assumed to see the same bursts (a burst usually takes out nodes that sit together).
    """

    model: CompoundPoisson
    name: str = "burst-aware"

    @classmethod
    def fit(cls, history: FaultTrace, lead_time_h: float, name: str = "burst-aware") -> BurstAwarePool:
        return cls(CompoundPoisson.fit(history, lead_time_h), name)

    def schedule(self, job: JobView) -> StandbySchedule:
        tail = self.model.tail(job.costs.lead_time_h, k_max=min(DEFAULT_K_MAX, job.job_nodes))
        plan = decide_from_tail(tail, job.costs, FleetState(), now_s=0.0)
        return constant_schedule({t: plan.count(t) for t in TIER_NAMES})
