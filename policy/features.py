"""Failure-prediction features: rolling-window summaries of node telemetry, with fault-horizon labels.

This module owns *turning telemetry into a supervised data set*. `build_features` reads column-oriented
telemetry chunks (as `SyntheticFleet.telemetry` yields them), bins each node's samples into fixed slots
(`bin_h`, an hour by default), and emits one row per node and slot end `t` while the node is up:

- counter sums over the last 6 h and 24 h (ECC SBE/DBE, row remaps, NVLink/PCIe/NIC errors),
- XID presence counts (48/79 and 63/64) over the last 6 h and 24 h,
- max GPU/HBM temperature over the last 6 h and a temperature slope (mean of the last 6 h minus the mean of
  the 18 h before, 0 when that earlier stretch has no samples),
- node age and faults in the last 30 days (from the last sample in the slot),
- from the fleet's own fault history: hours since the node's last repair ended (capped at `REPAIR_CAP_H`) and
  its faults that started in the last 7 days: faults are bursty (Weibull shape about 0.5), so a node that just
  came back from repair is at far higher risk than its 30-day count says,
- short windows that say *when*, not only *whether*: corrected ECC, NVLink and NIC errors in the last hour,
  corrected ECC in the last 3 h, a trend per counter (the last 3 h minus the 3 h before: a precursor's error
  rate keeps climbing until the fault, so level and slope together estimate the time left), and XIDs of any
  precursor kind in the last 3 h. Pre-warming needs that timing: a standby ordered now is ready one lead time
  later, and held hours cost full price.

Every feature at time `t` uses only samples with `t_h < t`. The label is 1 when the node's next fault starts
in `[t, t + horizon_h)`; rows whose horizon runs past the trace end are dropped (their label is censored), as
are rows where the node is inside a fault at `t`. Everything is vectorized numpy.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from policy.traces import FaultTrace

FEATURE_NAMES: tuple[str, ...] = (
    "ecc_sbe_6h",
    "ecc_sbe_24h",
    "ecc_dbe_6h",
    "ecc_dbe_24h",
    "row_remaps_24h",
    "xid_48_79_6h",
    "xid_48_79_24h",
    "xid_63_64_6h",
    "xid_63_64_24h",
    "gpu_temp_max_6h",
    "hbm_temp_max_6h",
    "gpu_temp_slope_c",
    "nvlink_errors_6h",
    "nvlink_errors_24h",
    "pcie_errors_24h",
    "nic_errors_6h",
    "nic_errors_24h",
    "node_age_days",
    "failures_last_30d",
    "hours_since_last_repair",
    "faults_last_7d",
    "ecc_sbe_1h",
    "ecc_sbe_3h",
    "ecc_sbe_trend_3h",
    "nvlink_errors_1h",
    "nvlink_errors_trend_3h",
    "nic_errors_1h",
    "nic_errors_trend_3h",
    "xid_any_3h",
)
"""Column names of `FeatureSet.X`, in order."""

RULE_FEATURE = "xid_48_79_24h"
"""The feature the rule baseline reads: any XID 48/79 in the last 24 h means the node will fail."""

DEFAULT_HORIZON_H = 3.0
"""Label horizon of the learned policy's predictor: a fault within the next 3 h. Chosen on development seeds 103
and 104 among 1, 1.5, 2, 3, 4 and 6 h (docs/benchmarks.md): a short horizon says *when* a node will fail, which is
what pre-warming needs; P(fault within 24 h) = 0.8 is only 0.033 per half hour, too little to pay for a warm
standby."""

REPAIR_CAP_H = 2000.0
"""`hours_since_last_repair` of a node with no fault yet (or a long time ago)."""

_SUMMED = ("ecc_sbe_count", "ecc_dbe_count", "row_remaps", "nvlink_errors", "pcie_errors", "nic_errors")


@dataclass(frozen=True, slots=True)
class FeatureSet:
    """A supervised data set: one row per node and time, with the node (group) and time kept for splitting."""

    X: np.ndarray
    """(n_rows, len(FEATURE_NAMES)) float features."""
    y: np.ndarray
    """(n_rows,) int labels: 1 when the node's next fault starts within `horizon_h` of `times`."""
    groups: np.ndarray
    """(n_rows,) node index into `node_ids`."""
    times: np.ndarray
    """(n_rows,) hour at which the row's features are known (the end of its slot)."""
    node_ids: tuple[str, ...]
    horizon_h: float
    feature_names: tuple[str, ...] = FEATURE_NAMES


def _window_sum(a: np.ndarray, w: int) -> np.ndarray:
    """Sum over the last `w` slots (including the current one) along axis 0."""
    c = np.concatenate([np.zeros((1, *a.shape[1:])), np.cumsum(a, axis=0)])
    hi = np.arange(1, a.shape[0] + 1)
    lo = np.maximum(hi - w, 0)
    return c[hi] - c[lo]


def _window_max(a: np.ndarray, w: int) -> np.ndarray:
    """Max over the last `w` slots along axis 0 (-inf where every slot is -inf)."""
    padded = np.concatenate([np.full((w - 1, *a.shape[1:]), -np.inf), a])
    return np.lib.stride_tricks.sliding_window_view(padded, w, axis=0).max(axis=-1)


def build_features(
    chunks: Iterable[Mapping[str, np.ndarray]],
    trace: FaultTrace,
    node_ids: tuple[str, ...],
    *,
    horizon_h: float = 24.0,
    bin_h: float = 1.0,
    drop_censored: bool = True,
) -> FeatureSet:
    """Build rolling-window features and horizon labels from telemetry chunks and the fleet's fault trace.

    With `drop_censored=False` the rows of the last horizon are kept (for scoring, not training): their labels
    only say whether a fault starts before the window ends.
    """
    if horizon_h <= 0 or bin_h <= 0:
        raise ValueError(f"horizon_h and bin_h must be positive, got {horizon_h} and {bin_h}")
    n_nodes = len(node_ids)
    n_bins = math.ceil(trace.duration_h / bin_h) + 1
    shape = (n_bins, n_nodes)
    node_arr = np.array(node_ids)
    sort_idx = np.argsort(node_arr)
    sorted_ids = node_arr[sort_idx]

    sums = {c: np.zeros(n_bins * n_nodes) for c in _SUMMED}
    xid_a = np.zeros(n_bins * n_nodes)
    xid_b = np.zeros(n_bins * n_nodes)
    count = np.zeros(n_bins * n_nodes)
    gpu_sum = np.zeros(n_bins * n_nodes)
    gpu_max = np.full(n_bins * n_nodes, -np.inf)
    hbm_max = np.full(n_bins * n_nodes, -np.inf)
    age = np.full(n_bins * n_nodes, np.nan)
    fails = np.full(n_bins * n_nodes, np.nan)
    size = n_bins * n_nodes

    for chunk in chunks:
        node = sort_idx[np.searchsorted(sorted_ids, np.asarray(chunk["node_id"]).astype(str))]
        t = np.asarray(chunk["t_h"], dtype=float)
        b = np.minimum((t // bin_h).astype(np.int64), n_bins - 1)
        flat = b * n_nodes + node
        for c in _SUMMED:
            sums[c] += np.bincount(flat, weights=np.asarray(chunk[c], dtype=float), minlength=size)
        codes = chunk["xid_codes"]
        a = np.fromiter((48 in x or 79 in x for x in codes), dtype=float, count=len(codes))
        bb = np.fromiter((63 in x or 64 in x for x in codes), dtype=float, count=len(codes))
        xid_a += np.bincount(flat, weights=a, minlength=size)
        xid_b += np.bincount(flat, weights=bb, minlength=size)
        count += np.bincount(flat, minlength=size)
        gpu = np.asarray(chunk["gpu_temp_c"], dtype=float)
        gpu_sum += np.bincount(flat, weights=gpu, minlength=size)
        np.maximum.at(gpu_max, flat, gpu)
        np.maximum.at(hbm_max, flat, np.asarray(chunk["hbm_temp_c"], dtype=float))
        # Rows are time-ordered, so plain assignment keeps each slot's last sample.
        age[flat] = np.asarray(chunk["node_age_days"], dtype=float)
        fails[flat] = np.asarray(chunk["failures_last_30d"], dtype=float)

    def grid(a: np.ndarray) -> np.ndarray:
        return a.reshape(shape)

    w6, w24 = max(1, round(6 / bin_h)), max(1, round(24 / bin_h))
    cnt = grid(count)
    g_sum = grid(gpu_sum)
    n6, n24 = _window_sum(cnt, w6), _window_sum(cnt, w24)
    s6, s24 = _window_sum(g_sum, w6), _window_sum(g_sum, w24)
    with np.errstate(invalid="ignore", divide="ignore"):
        recent = s6 / n6
        earlier = (s24 - s6) / (n24 - n6)
    slope = np.where((n6 > 0) & (n24 - n6 > 0), recent - earlier, 0.0)
    gmax6 = _window_max(grid(gpu_max), w6)
    hmax6 = _window_max(grid(hbm_max), w6)
    s = {c: grid(v) for c, v in sums.items()}
    cols = [
        _window_sum(s["ecc_sbe_count"], w6),
        _window_sum(s["ecc_sbe_count"], w24),
        _window_sum(s["ecc_dbe_count"], w6),
        _window_sum(s["ecc_dbe_count"], w24),
        _window_sum(s["row_remaps"], w24),
        _window_sum(grid(xid_a), w6),
        _window_sum(grid(xid_a), w24),
        _window_sum(grid(xid_b), w6),
        _window_sum(grid(xid_b), w24),
        gmax6,
        hmax6,
        slope,
        _window_sum(s["nvlink_errors"], w6),
        _window_sum(s["nvlink_errors"], w24),
        _window_sum(s["pcie_errors"], w24),
        _window_sum(s["nic_errors"], w6),
        _window_sum(s["nic_errors"], w24),
        grid(age),
        grid(fails),
    ]

    w1, w3 = max(1, round(1 / bin_h)), max(1, round(3 / bin_h))

    def trend(a: np.ndarray) -> np.ndarray:
        last3 = _window_sum(a, w3)
        return last3 - (_window_sum(a, 2 * w3) - last3)

    xid_any = grid(xid_a) + grid(xid_b)
    short = [
        _window_sum(s["ecc_sbe_count"], w1),
        _window_sum(s["ecc_sbe_count"], w3),
        trend(s["ecc_sbe_count"]),
        _window_sum(s["nvlink_errors"], w1),
        trend(s["nvlink_errors"]),
        _window_sum(s["nic_errors"], w1),
        trend(s["nic_errors"]),
        _window_sum(xid_any, w3),
    ]

    # A row exists where the node sent samples in the slot; it is known at the slot's end.
    bins, nodes = np.nonzero(cnt > 0)
    times = (bins + 1) * bin_h
    X = np.stack([c[bins, nodes] for c in cols], axis=1)

    # Faults keyed node * span + start hour: one searchsorted finds each row's previous and next fault.
    idx_of = {n: i for i, n in enumerate(node_ids)}
    span = trace.duration_h + 10 * horizon_h + 1e4
    f_node = np.array([idx_of[r.node_id] for r in trace.records], dtype=np.int64)
    f_start = np.array([r.start_h for r in trace.records], dtype=float)
    f_end = np.array([trace.duration_h + span if r.end_h is None else r.end_h for r in trace.records], dtype=float)
    order = np.argsort(f_node * span + f_start)
    keys = (f_node * span + f_start)[order]
    f_node, f_start, f_end = f_node[order], f_start[order], f_end[order]
    q = nodes * span + times
    nxt = np.searchsorted(keys, q, side="left")
    has_next = nxt < keys.size
    nxt_c = np.minimum(nxt, max(keys.size - 1, 0))
    same = has_next & (f_node[nxt_c] == nodes) if keys.size else np.zeros(q.size, dtype=bool)
    lead = np.where(same, (f_start[nxt_c] if keys.size else 0.0) - times, np.inf)
    y = (lead < horizon_h).astype(np.int64)
    prev = nxt - 1
    prev_c = np.maximum(prev, 0)
    down = (
        (prev >= 0) & (f_node[prev_c] == nodes) & (f_end[prev_c] > times) if keys.size else np.zeros(q.size, dtype=bool)
    )
    if keys.size:
        had = (prev >= 0) & (f_node[prev_c] == nodes)
        since = np.where(had, times - f_end[prev_c], REPAIR_CAP_H)
        recent = np.searchsorted(keys, q, side="left") - np.searchsorted(keys, q - 168.0, side="left")
    else:
        since = np.full(q.size, REPAIR_CAP_H)
        recent = np.zeros(q.size)
    X = np.column_stack([X, np.clip(since, 0.0, REPAIR_CAP_H), recent.astype(float), *[c[bins, nodes] for c in short]])
    keep = ~down & ((times + horizon_h <= trace.duration_h) | (not drop_censored))
    order_rows = np.lexsort((nodes[keep], times[keep]))
    return FeatureSet(
        X=X[keep][order_rows],
        y=y[keep][order_rows],
        groups=nodes[keep][order_rows].astype(np.int64),
        times=times[keep][order_rows].astype(float),
        node_ids=tuple(node_ids),
        horizon_h=horizon_h,
    )
