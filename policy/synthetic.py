"""Synthetic fleets calibrated to the real InfiniteHBD fault trace, with telemetry that carries precursors.

This module owns *making up a fleet that behaves like the real one*: `SyntheticFleetConfig` holds the
calibration (defaults fitted to `trace_statistics(load_infinitehbd())`), and `generate_fleet` draws

- a `FaultTrace` of bursty, repeat-offender faults (per node, Weibull up times with shape below 1 alternating
  with repairs, and a gamma-distributed per-node rate multiplier), optionally with common-cause bursts across
  the nodes of a failure domain (`burst_share`, off by default; `BURSTS_LIKE_INFINITEHBD` matches the real
  trace's burst curve), and optionally with hazard shifts (`hazard_shifts`: a rollout or an ageing period in
  which the fleet fails a factor more often; off by default), scaled to a target rate, with repair times
  from a mixture of quick fixes and a slow lognormal, and
  causes drawn from the trace's Level/Class mix;
- spot preemptions, each with the provider's notice (AWS 120 s, Azure 30 s);
- on demand, per-node telemetry at a fixed interval (`SyntheticFleet.telemetry`), whose baseline follows the
  AcmeTrace A100 marginals roughly and where precursors (rising ECC SBE counts, XID 48/79/63/64, temperature
  drift, or NIC/NVLink errors for those causes) appear in the hours before the faults that have them, while
  false-alarm bursts appear elsewhere.

Everything is vectorized numpy and seeded: the same config gives the same fleet, bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from policy.telemetry import COLUMNS, SPOT_BANDS, SpotInterruptionBand
from policy.traces import FaultRecord, FaultTrace

_HOURS_PER_DAY = 24.0

INFINITEHBD_CAUSE_COUNTS: dict[str, int] = {
    "Hardware Failure/GPU": 158,
    "Other Failure/Unknown Error": 144,
    "Other Failure/Stress Test Failure": 97,
    "Hardware Failure/Parameter Plane Cable": 40,
    "Hardware Failure/Fan": 33,
    "Hardware Failure/NIC": 30,
    "Hardware Failure/Power Supply": 26,
    "Other Failure/Training Task Troubleshooting": 14,
    "Software Failure/Other Failures": 12,
    "Software Failure/Software Tool": 7,
    "Other Failure/Change": 4,
    "Hardware Failure/Motherboard": 4,
    "Software Failure/File System": 3,
    "Hardware Failure/CPU": 3,
    "Other Failure/Test": 2,
    "Other Failure/System Crash": 1,
    "Hardware Failure/Motherboard Battery": 1,
    "Software Failure/Operating System": 1,
    "Software Failure/Firmware": 1,
    "Hardware Failure/Other Failures": 1,
    "Hardware Failure/RAID Card": 1,
    "Hardware Failure/Riser Card": 1,
}
"""Faults per Level/Class in the InfiniteHBD trace (584 faults); a test checks these against the shipped file."""

SPOT_NOTICE_S: dict[str, float] = {"aws": 120.0, "azure": 30.0}
"""Warning before a spot VM is reclaimed: AWS's two-minute interruption notice, Azure's 30 s Scheduled Event."""

PRECURSOR_XID_CODES = (48, 79, 63, 64)
"""XIDs that precede GPU faults: 48 double-bit ECC, 79 fallen off the bus, 63/64 row-remap events/failures."""

# Piecewise-linear quantile functions through the AcmeTrace Kalos figures (SOURCE.md): GPU core temperature
# p10/p50/p90/p99 = 27/40/58/66 C, HBM p50/p90/p99 = 51/61/67 C, power p50/p90/p99 = 100/400/440 W. The end
# knots are guesses; the match is rough on purpose (only the quoted percentiles are pinned).
_Q_KNOTS = np.array([0.0, 0.1, 0.5, 0.9, 0.99, 1.0])
_GPU_TEMP_KNOTS = np.array([20.0, 27.0, 40.0, 58.0, 66.0, 72.0])
_HBM_TEMP_KNOTS = np.array([30.0, 40.0, 51.0, 61.0, 67.0, 72.0])
_POWER_KNOTS = np.array([50.0, 60.0, 100.0, 400.0, 440.0, 460.0])

_REBALANCE_LEAD_H = 0.25
"""AWS sends a rebalance recommendation ahead of the interruption notice; we assume 15 minutes ahead."""


class HazardShift(BaseModel):
    """A stretch of the window in which the whole fleet fails `factor` times as often: a rollout (a new driver or
    firmware), an ageing period, or a calm spell (factor below 1)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    start_day: float = Field(ge=0, description="Day of the window on which the shift begins.")
    days: float = Field(gt=0, description="How many days it lasts (cut at the window's end).")
    factor: float = Field(gt=0, le=20, description="The fleet's fault rate during the shift over its usual rate.")

    @classmethod
    def parse(cls, text: str) -> HazardShift:
        """`START_DAY:DAYS:FACTOR`, e.g. `60:14:3` (from day 60, for 14 days, three times the rate)."""
        parts = text.split(":")
        if len(parts) != 3:
            raise ValueError(f"{text!r}: expected START_DAY:DAYS:FACTOR, e.g. 60:14:3")
        try:
            start, days, factor = (float(x) for x in parts)
        except ValueError:
            raise ValueError(f"{text!r}: START_DAY, DAYS and FACTOR must be numbers, e.g. 60:14:3") from None
        return cls(start_day=start, days=days, factor=factor)


class SyntheticFleetConfig(BaseModel):
    """Calibration of a synthetic fleet. Defaults reproduce the InfiniteHBD trace's statistics."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    n_nodes: int = Field(default=1024, ge=1, le=100_000, description="Nodes in the fleet.")
    days: float = Field(default=365.0, gt=0, le=3650, description="Length of the observation window in days.")
    faults_per_1000_node_days: float = Field(
        default=4.2, ge=2, le=8, description="Target fleet fault rate (the trace has 4.18 per 1,000 node-days)."
    )
    weibull_shape: float = Field(
        default=0.35,
        gt=0.2,
        le=1.5,
        description=(
            "Shape of each node's Weibull up times (repair end to next fault start); below 1 makes faults bursty. "
            "The repair inside every start-to-start gap, the per-node frailty and the finite window move the "
            "*pooled* fitted shape: 0.35 here gives 0.58-0.64 against the trace's 0.52, and the gap distribution "
            "closest to the trace's by the KS distance (0.08-0.12 over seeds 0-5; 0.30 fits the shape better but "
            "the distribution worse)."
        ),
    )
    frailty_shape: float = Field(
        default=2.0,
        gt=0.05,
        le=100,
        description=(
            "Gamma shape of the per-node rate multiplier (mean 1): smaller concentrates faults on repeat "
            "offenders; large values make all nodes alike."
        ),
    )
    repair_median_h: float = Field(default=20.4, gt=0, description="Median repair time in hours (trace: 20.4 h).")
    repair_mean_h: float = Field(
        default=132.8, gt=0, description="Mean repair time in hours (trace: 132.8 h); must exceed the median."
    )
    repair_quick_share: float = Field(
        default=0.32,
        ge=0,
        lt=0.5,
        description=(
            "Share of faults fixed quickly (a reset or reboot): the trace has 20% of repairs under an hour, which "
            "one lognormal through its median and mean cannot give. 0.32 is the weight of the short component of "
            "a two-Gaussian mixture fitted to the trace's log repair times; 0 gives a single lognormal."
        ),
    )
    repair_quick_median_h: float = Field(
        default=0.62, gt=0, description="Median of the quick repairs in hours (the same fit: 0.62 h)."
    )
    repair_quick_sigma: float = Field(
        default=1.5, gt=0, le=5, description="Log-scale spread of the quick repairs (the same fit: 1.5)."
    )
    cause_mix: dict[str, float] = Field(
        default_factory=lambda: {k: float(v) for k, v in INFINITEHBD_CAUSE_COUNTS.items()},
        description="Relative weight of each fault cause (Level/Class); normalized to shares.",
    )
    precursor_fraction: float = Field(
        default=0.6, ge=0, le=1, description="Share of faults preceded by telemetry precursors."
    )
    precursor_lead_min_h: float = Field(
        default=2.0, gt=0, le=168, description="Shortest time a precursor shows before its fault (hours)."
    )
    precursor_lead_max_h: float = Field(
        default=24.0, gt=0, le=168, description="Longest time a precursor shows before its fault (hours)."
    )
    false_alarms_per_node_year: float = Field(
        default=2.0, ge=0, le=365, description="Precursor-like bursts per node-year that no fault follows."
    )
    spot_preemptions_per_node_day: float = Field(
        default=0.0015,
        ge=0,
        le=1,
        description="Spot reclaims per node-day (0.0015 is about 4.5% a month, AWS's '<5%' band); 0 = on-demand.",
    )
    spot_provider: Literal["aws", "azure"] = Field(
        default="aws", description="Cloud whose notice applies: AWS gives 120 s, Azure 30 s."
    )
    spot_price_ratio: float = Field(default=0.35, gt=0, le=10, description="Typical spot price over on-demand price.")
    telemetry_interval_s: float = Field(
        default=300.0, ge=10, le=86_400, description="Seconds between a node's telemetry samples."
    )
    burst_share: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        description=(
            "Share of faults that come in common-cause bursts (a rack, switch or power feed takes several nodes of "
            "one failure domain at once); the rest stay per-node renewals. 0 keeps nodes independent (the default, "
            "so existing fleets are unchanged); 0.3 matches InfiniteHBD's burst curve (see BURSTS_LIKE_INFINITEHBD)."
        ),
    )
    burst_size_exponent: float = Field(
        default=3.3,
        gt=1,
        le=10,
        description="Nodes a burst takes: P(m) proportional to m^-exponent for m >= 2, up to the domain size "
        "(3.3 gives InfiniteHBD's cluster sizes within 0.5 h: 68% pairs, 18% triples, then a heavy tail).",
    )
    domain_size: int = Field(
        default=16, ge=2, le=1024, description="Nodes per failure domain (consecutive node ids); caps a burst."
    )
    burst_spread_h: float = Field(
        default=0.25, ge=0, le=24, description="The faults of one burst start within this many hours of each other."
    )
    hazard_shifts: tuple[HazardShift, ...] = Field(
        default=(),
        description=(
            "Periods in which the fleet's fault rate is multiplied by a factor (a rollout, an ageing period); "
            "none by default, so existing fleets stay bit for bit unchanged. A factor above 1 adds faults in the "
            "period (nodes drawn by their frailty, repairs as usual), one below 1 thins them."
        ),
    )
    seed: int = Field(default=0, ge=0, description="Seed of every random draw; equal configs give equal fleets.")

    @model_validator(mode="after")
    def _check(self) -> SyntheticFleetConfig:
        if self.repair_mean_h <= self.repair_median_h:
            raise ValueError(
                f"repair_mean_h={self.repair_mean_h} must exceed repair_median_h={self.repair_median_h} "
                "(a lognormal's mean is above its median)"
            )
        self.repair_lognormal  # noqa: B018 - raises a ValueError that names the fields to change
        if self.precursor_lead_max_h < self.precursor_lead_min_h:
            raise ValueError("precursor_lead_max_h must be >= precursor_lead_min_h")
        if not self.cause_mix or any(not (w > 0 and math.isfinite(w)) for w in self.cause_mix.values()):
            raise ValueError("cause_mix must name at least one cause, each with a positive finite weight")
        return self

    @property
    def repair_lognormal(self) -> tuple[float, float]:
        """(mu, sigma) of ln(repair hours) of the slow repairs, so that the whole mixture has the configured
        median and mean.

        Without quick repairs it is one lognormal, median exp(mu) and mean exp(mu + sigma^2 / 2): mu = ln(median),
        sigma = sqrt(2 ln(mean / median)) (20.4 h and 132.8 h give 3.02 and 1.94). With a quick share w, the
        slow part's mean is fixed by the mixture's mean, which gives mu for each sigma; sigma is then found by
        bisection so that the mixture's CDF at the configured median is 1/2 (the defaults give about 56 h and
        1.57, the trace's own mixture fit).
        """
        w = self.repair_quick_share
        if w == 0:
            return math.log(self.repair_median_h), math.sqrt(2 * math.log(self.repair_mean_h / self.repair_median_h))
        quick_mean = self.repair_quick_median_h * math.exp(self.repair_quick_sigma**2 / 2)
        slow_mean = (self.repair_mean_h - w * quick_mean) / (1 - w)
        if slow_mean <= self.repair_median_h:
            raise ValueError(
                f"repair_mean_h={self.repair_mean_h} is too small for {w:.0%} quick repairs of median "
                f"{self.repair_quick_median_h} h: raise repair_mean_h or lower repair_quick_share"
            )
        ln_m = math.log(self.repair_median_h)
        quick_below = _normal_cdf((ln_m - math.log(self.repair_quick_median_h)) / self.repair_quick_sigma)

        def excess(sigma: float) -> float:  # mixture CDF at the median minus 1/2; rises with sigma
            mu = math.log(slow_mean) - sigma**2 / 2
            return (1 - w) * _normal_cdf((ln_m - mu) / sigma) + w * quick_below - 0.5

        # A root exists: as sigma -> 0 the slow part sits at its mean, above the median (excess < 0 since w < 1/2);
        # as sigma grows its median falls towards 0 (excess -> 1/2 - w + w * quick_below > 0).
        lo, hi = 1e-3, 10.0
        for _ in range(100):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if excess(mid) < 0 else (lo, mid)
        sigma = (lo + hi) / 2
        return math.log(slow_mean) - sigma**2 / 2, sigma

    def draw_repairs_h(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """`n` repair times in hours: quick with probability `repair_quick_share`, else slow (`repair_lognormal`)."""
        mu, sigma = self.repair_lognormal
        slow = rng.lognormal(mu, sigma, n)
        quick = rng.lognormal(math.log(self.repair_quick_median_h), self.repair_quick_sigma, n)
        return np.where(rng.uniform(size=n) < self.repair_quick_share, quick, slow)

    @property
    def duration_h(self) -> float:
        return self.days * _HOURS_PER_DAY


@dataclass(frozen=True, slots=True)
class SpotPreemption:
    """A spot reclaim: the provider warns at `notice_h` and takes the node at `preempt_h`."""

    node_id: str
    notice_h: float
    preempt_h: float


@dataclass(frozen=True, slots=True)
class SignalWindow:
    """A stretch of a node's telemetry that looks like trouble: a true precursor or a false alarm.

    Intensity ramps linearly from 0 at `start_h` to 1 at `end_h` (a precursor ends when its fault starts).
    """

    node_id: str
    start_h: float
    end_h: float
    kind: Literal["precursor", "false_alarm"]
    channel: Literal["gpu", "nic", "nvlink"]
    """Which counters rise: GPU ECC/XID/temperature, NIC errors or NVLink errors."""


def _normal_cdf(z: float) -> float:
    return 0.5 * (1 + math.erf(z / math.sqrt(2)))


def _spot_band(per_node_day: float) -> SpotInterruptionBand | None:
    if per_node_day <= 0:
        return None
    monthly = 1 - math.exp(-30 * per_node_day)
    return SPOT_BANDS[min(int(monthly / 0.05), len(SPOT_BANDS) - 1)]


def _channel(cause: str) -> Literal["gpu", "nic", "nvlink"]:
    if "NIC" in cause:
        return "nic"
    if "Cable" in cause:
        return "nvlink"
    return "gpu"


@dataclass(frozen=True, slots=True)
class SyntheticFleet:
    """A generated fleet: its faults, spot preemptions, signal windows, and a telemetry source."""

    config: SyntheticFleetConfig
    node_ids: tuple[str, ...]
    trace: FaultTrace
    has_precursor: tuple[bool, ...]
    """Aligned with `trace.records`: whether that fault is preceded by a precursor window."""
    preemptions: tuple[SpotPreemption, ...]
    windows: tuple[SignalWindow, ...]
    node_age0_days: np.ndarray
    """Each node's age at hour 0."""

    def telemetry(
        self, chunk_h: float = 24.0, start_h: float = 0.0, end_h: float | None = None
    ) -> Iterator[dict[str, np.ndarray]]:
        """Yield the fleet's telemetry in time chunks, each a dict of equal-length arrays named as `COLUMNS`.

        Rows are ordered by time, then node; a node that is down (between a fault's start and end) sends no
        rows. Each chunk is drawn from its own seed, so any time range reproduces the same values.
        """
        return _telemetry(self, chunk_h, start_h, self.trace.duration_h if end_h is None else end_h)


def _faults(cfg: SyntheticFleetConfig, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Node index, start hour and end hour of every fault, from per-node alternating renewal processes.

    A node is up for a Weibull-distributed time, faults, is repaired (`draw_repairs_h`), and comes back up: a node
    under repair cannot fault again, as in the trace (2 of its 584 faults start on a node that is still down).
    """
    k = cfg.weibull_shape
    # Bursts carry `burst_share` of the rate; the per-node renewals the rest.
    rate_per_h = cfg.faults_per_1000_node_days / 1000 / _HOURS_PER_DAY * (1 - cfg.burst_share)
    frailty = np.maximum(rng.gamma(cfg.frailty_shape, 1 / cfg.frailty_shape, cfg.n_nodes), 1e-12)
    # A node's mean cycle (up time + repair) is 1 / (rate * frailty), so the fleet's mean rate is the target.
    # The most frail nodes would need a negative up time; they keep at least a tenth of their cycle up.
    cycle_h = 1 / (rate_per_h * frailty)
    scale = np.maximum(cycle_h - cfg.repair_mean_h, 0.1 * cycle_h) / math.gamma(1 + 1 / k)
    # Start each node in equilibrium: the up time straddling hour 0 is length-biased ((X/scale)^k ~
    # Gamma(1 + 1/k)), and hour 0 falls uniformly inside it. Without this, every node would "fault" at 0.
    straddle = scale * rng.gamma(1 + 1 / k, 1.0, cfg.n_nodes) ** (1 / k)
    t = straddle * rng.uniform(size=cfg.n_nodes)
    nodes_out, starts_out, ends_out = [], [], []
    active = np.arange(cfg.n_nodes)
    while active.size:
        inside = t < cfg.duration_h
        active, t = active[inside], t[inside]
        end = t + cfg.draw_repairs_h(rng, active.size)
        nodes_out.append(active)
        starts_out.append(t)
        ends_out.append(end)
        t = end + scale[active] * rng.weibull(k, active.size)
    nodes, starts, ends = np.concatenate(nodes_out), np.concatenate(starts_out), np.concatenate(ends_out)
    if cfg.burst_share > 0:  # drawn only then, so fleets without bursts are bit for bit what they were
        b_nodes, b_starts, b_ends = _burst_faults(cfg, rng)
        nodes, starts, ends = _drop_faults_while_down(
            np.concatenate([nodes, b_nodes]), np.concatenate([starts, b_starts]), np.concatenate([ends, b_ends])
        )
    if cfg.hazard_shifts:  # likewise: drawn only then
        nodes, starts, ends = _shift_hazards(cfg, rng, frailty, nodes, starts, ends)
    return nodes, starts, ends


def _shift_hazards(
    cfg: SyntheticFleetConfig,
    rng: np.random.Generator,
    frailty: np.ndarray,
    nodes: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Multiply the fault rate inside each `hazard_shifts` period by its factor.

    Above 1, the missing (factor - 1) x the fleet's rate arrives as extra Poisson faults in the period, each on a
    node drawn in proportion to its frailty (the repeat offenders get more of them) with a repair drawn as usual;
    below 1, each fault that starts in the period is kept with probability factor. A fault that would start on a
    node still down is dropped, as everywhere, so a long factor-3 period shows slightly less than 3x (the nodes
    spend a few percent of their time in repair).
    """
    rate_per_node_h = cfg.faults_per_1000_node_days / 1000 / _HOURS_PER_DAY
    weights = frailty / frailty.sum()
    for shift in cfg.hazard_shifts:
        a = min(shift.start_day * _HOURS_PER_DAY, cfg.duration_h)
        b = min((shift.start_day + shift.days) * _HOURS_PER_DAY, cfg.duration_h)
        if b <= a:
            continue
        if shift.factor < 1:
            inside = (starts >= a) & (starts < b)
            keep = ~inside | (rng.uniform(size=starts.size) < shift.factor)
            nodes, starts, ends = nodes[keep], starts[keep], ends[keep]
        elif shift.factor > 1:
            n_extra = rng.poisson((shift.factor - 1) * rate_per_node_h * cfg.n_nodes * (b - a))
            e_nodes = rng.choice(cfg.n_nodes, size=n_extra, p=weights)
            e_starts = rng.uniform(a, b, n_extra)
            e_ends = e_starts + cfg.draw_repairs_h(rng, n_extra)
            nodes, starts, ends = _drop_faults_while_down(
                np.concatenate([nodes, e_nodes]), np.concatenate([starts, e_starts]), np.concatenate([ends, e_ends])
            )
    return nodes, starts, ends


BURSTS_LIKE_INFINITEHBD: dict[str, float] = {"burst_share": 0.3, "burst_size_exponent": 3.3, "burst_spread_h": 0.25}
"""Config overrides whose bursts match the InfiniteHBD trace: 33% of its faults fall in clusters of two or more
within 0.5 h (some by chance), and P(>= 4 failures within 0.5 h) is about 8,000x the independent value."""


def _burst_sizes(cfg: SyntheticFleetConfig, rng: np.random.Generator, n: int) -> np.ndarray:
    sizes = np.arange(2, min(cfg.domain_size, cfg.n_nodes) + 1)
    if sizes.size == 0:
        return np.zeros(n, dtype=np.int64)
    weights = sizes.astype(np.float64) ** -cfg.burst_size_exponent
    return rng.choice(sizes, size=n, p=weights / weights.sum())


def _burst_faults(cfg: SyntheticFleetConfig, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Common-cause bursts: Poisson events, each taking m nodes of one failure domain within `burst_spread_h`."""
    sizes_all = np.arange(2, min(cfg.domain_size, cfg.n_nodes) + 1)
    if sizes_all.size == 0:  # a one-node fleet has no domain to share
        empty = np.empty(0)
        return empty.astype(np.int64), empty, empty
    w = sizes_all.astype(np.float64) ** -cfg.burst_size_exponent
    mean_size = float(np.dot(sizes_all, w) / w.sum())
    rate_per_h = cfg.faults_per_1000_node_days / 1000 / _HOURS_PER_DAY * cfg.n_nodes * cfg.burst_share / mean_size
    n_events = rng.poisson(rate_per_h * cfg.duration_h)
    at = rng.uniform(0, cfg.duration_h, n_events)
    sizes = _burst_sizes(cfg, rng, n_events)
    n_domains = math.ceil(cfg.n_nodes / cfg.domain_size)
    domain = rng.integers(0, n_domains, n_events)
    nodes_out, starts_out = [], []
    for t0, m, d in zip(at.tolist(), sizes.tolist(), domain.tolist(), strict=True):
        members = np.arange(d * cfg.domain_size, min((d + 1) * cfg.domain_size, cfg.n_nodes))
        hit = rng.choice(members, size=min(m, members.size), replace=False)
        nodes_out.append(hit)
        starts_out.append(t0 + rng.uniform(0, cfg.burst_spread_h, hit.size))
    if not nodes_out:
        empty = np.empty(0)
        return empty.astype(np.int64), empty, empty
    nodes, starts = np.concatenate(nodes_out), np.concatenate(starts_out)
    keep = starts < cfg.duration_h
    nodes, starts = nodes[keep], starts[keep]
    return nodes, starts, starts + cfg.draw_repairs_h(rng, starts.size)


def _drop_faults_while_down(
    nodes: np.ndarray, starts: np.ndarray, ends: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Drop every fault that starts while its node is still down from an earlier one (as in the trace)."""
    order = np.lexsort((starts, nodes))
    nodes, starts, ends = nodes[order], starts[order], ends[order]
    keep = np.ones(nodes.size, dtype=bool)
    down_until = -math.inf
    for i in range(nodes.size):
        if i and nodes[i] != nodes[i - 1]:
            down_until = -math.inf
        if starts[i] < down_until:
            keep[i] = False
            continue
        down_until = ends[i]
    return nodes[keep], starts[keep], ends[keep]


def generate_fleet(config: SyntheticFleetConfig) -> SyntheticFleet:
    """Draw a fleet from `config` (same config, same fleet)."""
    cfg = config
    rng = np.random.default_rng(cfg.seed)
    node_ids = tuple(f"node-{i:05d}" for i in range(cfg.n_nodes))
    duration_h = cfg.duration_h

    node_idx, start_h, end_h = _faults(cfg, rng)
    order = np.lexsort((node_idx, start_h))
    node_idx, start_h, end_h = node_idx[order], start_h[order], end_h[order]
    n = start_h.size
    causes = list(cfg.cause_mix)
    weights = np.array([cfg.cause_mix[c] for c in causes])
    cause_idx = rng.choice(len(causes), size=n, p=weights / weights.sum())
    records = tuple(
        FaultRecord(node_ids[i], float(s), float(e) if e <= duration_h else None, causes[c])
        for i, s, e, c in zip(node_idx.tolist(), start_h.tolist(), end_h.tolist(), cause_idx.tolist(), strict=True)
    )
    trace = FaultTrace(records, cfg.n_nodes, duration_h)

    has_pre = rng.uniform(size=n) < cfg.precursor_fraction
    lead_h = rng.uniform(cfg.precursor_lead_min_h, cfg.precursor_lead_max_h, n)
    windows = [
        SignalWindow(r.node_id, max(0.0, r.start_h - lead), r.start_h, "precursor", _channel(r.cause))
        for r, lead, pre in zip(records, lead_h.tolist(), has_pre.tolist(), strict=True)
        if pre
    ]
    n_alarms = rng.poisson(cfg.false_alarms_per_node_year * cfg.days / 365 * cfg.n_nodes)
    alarm_node = rng.integers(0, cfg.n_nodes, n_alarms)
    alarm_start = rng.uniform(0, duration_h, n_alarms)
    alarm_len = rng.uniform(cfg.precursor_lead_min_h, cfg.precursor_lead_max_h, n_alarms)
    alarm_channel = rng.choice(np.array(["gpu", "gpu", "nic", "nvlink"]), n_alarms)
    windows += [
        SignalWindow(node_ids[i], s, min(s + d, duration_h), "false_alarm", ch)
        for i, s, d, ch in zip(
            alarm_node.tolist(), alarm_start.tolist(), alarm_len.tolist(), alarm_channel.tolist(), strict=True
        )
    ]

    n_pre = rng.poisson(cfg.spot_preemptions_per_node_day * cfg.days * cfg.n_nodes)
    notice_h = SPOT_NOTICE_S[cfg.spot_provider] / 3600
    pre_node = rng.integers(0, cfg.n_nodes, n_pre)
    pre_at = np.sort(rng.uniform(notice_h, duration_h, n_pre))
    preemptions = tuple(
        SpotPreemption(node_ids[i], t - notice_h, t) for i, t in zip(pre_node.tolist(), pre_at.tolist(), strict=True)
    )
    age0 = rng.uniform(30, 1500, cfg.n_nodes)
    return SyntheticFleet(cfg, node_ids, trace, tuple(has_pre.tolist()), preemptions, tuple(windows), age0)


def _telemetry(fleet: SyntheticFleet, chunk_h: float, start_h: float, end_h: float) -> Iterator[dict[str, np.ndarray]]:
    cfg = fleet.config
    if chunk_h <= 0 or start_h < 0 or end_h < start_h:
        raise ValueError("telemetry needs chunk_h > 0 and 0 <= start_h <= end_h")
    step_h = cfg.telemetry_interval_s / 3600
    n_nodes = cfg.n_nodes
    node_arr = np.array(fleet.node_ids)
    band = _spot_band(cfg.spot_preemptions_per_node_day)
    on_spot = band is not None

    # Fault starts keyed node * span + hour, so one searchsorted counts each node's faults in the last 30 days.
    recs = fleet.trace.records
    idx_of = {n: i for i, n in enumerate(fleet.node_ids)}
    span = fleet.trace.duration_h + 1e4
    f_node = np.array([idx_of[r.node_id] for r in recs], dtype=np.int64)
    f_start = np.array([r.start_h for r in recs])
    f_end = np.array([fleet.trace.duration_h if r.end_h is None else r.end_h for r in recs])
    keys = np.sort(f_node * span + f_start)
    w_node = np.array([idx_of[w.node_id] for w in fleet.windows], dtype=np.int64)
    w_start = np.array([w.start_h for w in fleet.windows])
    w_end = np.array([w.end_h for w in fleet.windows])
    p_node = np.array([idx_of[p.node_id] for p in fleet.preemptions], dtype=np.int64)
    p_notice = np.array([p.notice_h for p in fleet.preemptions])

    first = math.ceil(start_h / step_h - 1e-9)
    last = math.floor(end_h / step_h + 1e-9)
    per_chunk = max(1, round(chunk_h / step_h))
    for c0 in range(first, last + 1, per_chunk):
        rng = np.random.default_rng([cfg.seed, c0, 7])
        t = np.arange(c0, min(c0 + per_chunk, last + 1)) * step_h
        shape = (t.size, n_nodes)
        tt = np.broadcast_to(t[:, None], shape)
        nn = np.broadcast_to(np.arange(n_nodes)[None, :], shape)

        u = rng.uniform(size=shape)
        gpu = np.interp(u, _Q_KNOTS, _GPU_TEMP_KNOTS) + rng.normal(0, 1.0, shape)
        hbm = np.interp(np.clip(u + rng.normal(0, 0.05, shape), 0, 1), _Q_KNOTS, _HBM_TEMP_KNOTS)
        power = np.interp(np.clip(u + rng.normal(0, 0.05, shape), 0, 1), _Q_KNOTS, _POWER_KNOTS)

        gpu_x = np.zeros(shape)
        nic_x = np.zeros(shape)
        nvl_x = np.zeros(shape)
        lo, hi = t[0], t[-1]
        for j in np.flatnonzero((w_start <= hi) & (w_end > lo)).tolist():
            w = fleet.windows[j]
            ramp = np.clip((t - w_start[j]) / max(w_end[j] - w_start[j], 1e-9), 0, 1)
            ramp = np.where((t >= w_start[j]) & (t < w_end[j]), ramp, 0.0)
            target = {"gpu": gpu_x, "nic": nic_x, "nvlink": nvl_x}[w.channel]
            col = target[:, w_node[j]]
            np.maximum(col, ramp, out=col)

        gpu = gpu + 10 * gpu_x
        hbm = hbm + 8 * gpu_x
        sbe = rng.poisson(0.02 + 30 * gpu_x**2)
        dbe = rng.poisson(0.5 * gpu_x**3)
        has_xid = rng.uniform(size=shape) < 0.4 * gpu_x
        xid_pick = np.array(PRECURSOR_XID_CODES)[rng.integers(0, len(PRECURSOR_XID_CODES), shape)]
        xid = np.where(has_xid, xid_pick, 0)
        remaps = np.where(has_xid & (xid >= 63), 1, 0) + rng.poisson(0.2 * gpu_x**2)
        nvlink = rng.poisson(0.01 + 20 * nvl_x**2)
        pcie = rng.poisson(0.005 + 0.5 * gpu_x**2)
        nic = rng.poisson(0.01 + 20 * nic_x**2)

        up = np.ones(shape, dtype=bool)
        for j in np.flatnonzero((f_start <= hi) & (f_end > lo)).tolist():
            up[(t >= f_start[j]) & (t < f_end[j]), f_node[j]] = False

        rebalance = np.zeros(shape, dtype=bool)
        if on_spot and cfg.spot_provider == "aws":
            for j in np.flatnonzero((p_notice - _REBALANCE_LEAD_H <= hi) & (p_notice > lo)).tolist():
                rebalance[(t >= p_notice[j] - _REBALANCE_LEAD_H) & (t < p_notice[j]), p_node[j]] = True

        q = nn * span + tt
        failures_30d = np.searchsorted(keys, q, side="right") - np.searchsorted(keys, q - 720.0, side="right")

        xid_flat = xid[up]
        xid_codes = np.empty(xid_flat.size, dtype=object)
        xid_codes[:] = [(int(x),) if x else () for x in xid_flat.tolist()]
        rows = int(up.sum())
        out: dict[str, np.ndarray] = {
            "node_id": np.broadcast_to(node_arr[None, :], shape)[up],
            "t_h": tt[up],
            "gpu_temp_c": gpu[up],
            "hbm_temp_c": hbm[up],
            "power_w": power[up],
            "ecc_sbe_count": sbe[up],
            "ecc_dbe_count": dbe[up],
            "row_remaps": remaps[up],
            "xid_codes": xid_codes,
            "nvlink_errors": nvlink[up],
            "pcie_errors": pcie[up],
            "nic_errors": nic[up],
            "node_age_days": (fleet.node_age0_days[None, :] + tt / _HOURS_PER_DAY)[up],
            "failures_last_30d": failures_30d[up],
            "spot_interruption_band": np.full(rows, band, dtype=object),
            "rebalance_recommended": rebalance[up],
            "spot_price_ratio": (
                np.clip(cfg.spot_price_ratio * np.exp(rng.normal(0, 0.05, shape)), 0.01, 10)[up]
                if on_spot
                else np.ones(rows)
            ),
        }
        assert tuple(out) == COLUMNS
        yield out
