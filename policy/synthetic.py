"""Synthetic fleets calibrated to the real InfiniteHBD fault trace, with telemetry that carries precursors.

This module owns *making up a fleet that behaves like the real one*: `SyntheticFleetConfig` holds the
calibration (defaults fitted to `trace_statistics(load_infinitehbd())`), and `generate_fleet` draws

- a `FaultTrace` of bursty, repeat-offender faults (per-node Weibull renewal gaps with shape below 1, and a
  gamma-distributed per-node rate multiplier), scaled to a target rate, with lognormal repair times and
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


class SyntheticFleetConfig(BaseModel):
    """Calibration of a synthetic fleet. Defaults reproduce the InfiniteHBD trace's statistics."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    n_nodes: int = Field(default=1024, ge=1, le=100_000, description="Nodes in the fleet.")
    days: float = Field(default=365.0, gt=0, le=3650, description="Length of the observation window in days.")
    faults_per_1000_node_days: float = Field(
        default=4.2, ge=2, le=8, description="Target fleet fault rate (the trace has 4.18 per 1,000 node-days)."
    )
    weibull_shape: float = Field(
        default=0.45,
        gt=0.2,
        le=1.5,
        description=(
            "Shape of each node's Weibull gaps between fault starts; below 1 makes faults bursty. The per-node "
            "frailty lowers and the finite window raises the *pooled* fitted shape; 0.45 here gives about "
            "the trace's 0.52 when the generated gaps are fitted the way trace_statistics fits them."
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
    seed: int = Field(default=0, ge=0, description="Seed of every random draw; equal configs give equal fleets.")

    @model_validator(mode="after")
    def _check(self) -> SyntheticFleetConfig:
        if self.repair_mean_h <= self.repair_median_h:
            raise ValueError(
                f"repair_mean_h={self.repair_mean_h} must exceed repair_median_h={self.repair_median_h} "
                "(a lognormal's mean is above its median)"
            )
        if self.precursor_lead_max_h < self.precursor_lead_min_h:
            raise ValueError("precursor_lead_max_h must be >= precursor_lead_min_h")
        if not self.cause_mix or any(not (w > 0 and math.isfinite(w)) for w in self.cause_mix.values()):
            raise ValueError("cause_mix must name at least one cause, each with a positive finite weight")
        return self

    @property
    def repair_lognormal(self) -> tuple[float, float]:
        """(mu, sigma) of ln(repair hours), derived from the median and mean.

        A lognormal has median exp(mu) and mean exp(mu + sigma^2 / 2), so mu = ln(median) and
        sigma = sqrt(2 ln(mean / median)); for 20.4 h and 132.8 h that is mu = 3.02, sigma = 1.94.
        """
        return math.log(self.repair_median_h), math.sqrt(2 * math.log(self.repair_mean_h / self.repair_median_h))

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


def _fault_starts(cfg: SyntheticFleetConfig, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Node index and start hour of every fault, from stationary per-node Weibull renewal processes."""
    k = cfg.weibull_shape
    rate_per_h = cfg.faults_per_1000_node_days / 1000 / _HOURS_PER_DAY
    frailty = rng.gamma(cfg.frailty_shape, 1 / cfg.frailty_shape, cfg.n_nodes)
    # Mean gap of a node = scale * Gamma(1 + 1/k) = 1 / (rate * frailty), so the fleet mean rate is the target.
    scale = 1 / (rate_per_h * math.gamma(1 + 1 / k) * np.maximum(frailty, 1e-12))
    # Start each process in equilibrium: the gap straddling hour 0 is length-biased, ((X/scale)^k ~
    # Gamma(1 + 1/k)), and hour 0 falls uniformly inside it. Without this, every node would "fault" at 0.
    straddle = scale * rng.gamma(1 + 1 / k, 1.0, cfg.n_nodes) ** (1 / k)
    t = straddle * rng.uniform(size=cfg.n_nodes)
    nodes_out, starts_out = [], []
    active = np.arange(cfg.n_nodes)
    t = t.copy()
    while active.size:
        inside = t < cfg.duration_h
        nodes_out.append(active[inside])
        starts_out.append(t[inside])
        active, t = active[inside], t[inside]
        t = t + scale[active] * rng.weibull(k, active.size)
    return np.concatenate(nodes_out), np.concatenate(starts_out)


def generate_fleet(config: SyntheticFleetConfig) -> SyntheticFleet:
    """Draw a fleet from `config` (same config, same fleet)."""
    cfg = config
    rng = np.random.default_rng(cfg.seed)
    node_ids = tuple(f"node-{i:05d}" for i in range(cfg.n_nodes))
    duration_h = cfg.duration_h

    node_idx, start_h = _fault_starts(cfg, rng)
    order = np.lexsort((node_idx, start_h))
    node_idx, start_h = node_idx[order], start_h[order]
    n = start_h.size
    mu, sigma = cfg.repair_lognormal
    end_h = start_h + rng.lognormal(mu, sigma, n)
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
