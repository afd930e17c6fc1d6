"""Node-fault traces: typed records, loaders with clear validation, and the statistics a standby policy needs.

This module owns the *observed failure process* of a fleet: when each node failed, when it came back, and why.
Two sources load into the same `FaultTrace`:

- `load_infinitehbd()`: the real 400-server trace of Shou et al. (SIGCOMM 2025) shipped in `policy/data/`.
- `load_csv()`: a cost owner's own fleet, in the CSV format documented on that function.

`trace_statistics()` reduces a trace to the figures that calibrate a standby policy: fault rate, MTBF, repair
times, burstiness (a Weibull shape below 1 means faults cluster in time) and repeat-offender nodes.
Only numpy and the standard library are used, so importing this module never pulls torch in.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
from collections import defaultdict, deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

INFINITEHBD_PATH = Path(__file__).parent / "data" / "infinitehbd" / "fault_trace.json"
"""The shipped copy of stepfun-ai/InfiniteHBD-Trace's fault_trace.json (Apache-2.0, see SOURCE.md beside it)."""

INFINITEHBD_N_NODES = 400
"""Servers in the InfiniteHBD trace's fleet, including the 169 that never failed."""

CSV_HEADER = ("node_id", "fault_start_h", "fault_end_h", "cause")
"""The exact header line `load_csv` expects and `write_csv` writes."""

_HOURS_PER_DAY = 24.0


class TraceFormatError(ValueError):
    """A trace file a user supplied is malformed; the message names the line and says what to fix."""


@dataclass(frozen=True, slots=True)
class FaultRecord:
    """One fault of one node, in hours from the trace start."""

    node_id: str
    start_h: float
    """When the node became unavailable."""
    end_h: float | None
    """When it was repaired and returned to service; None if it was still down when the trace ends."""
    cause: str
    """What failed, e.g. "Hardware Failure/GPU/GPU xid Error" (Level/Class/Desc in the InfiniteHBD trace)."""

    @property
    def repair_h(self) -> float | None:
        """Hours the node was down, or None for a fault still open at the trace end."""
        return None if self.end_h is None else self.end_h - self.start_h


@dataclass(frozen=True, slots=True)
class FaultTrace:
    """The faults of a fleet over an observation window that starts at hour 0."""

    records: tuple[FaultRecord, ...]
    """Faults sorted by start time (ties by node id)."""
    n_nodes: int
    """Nodes in the fleet, including those that never failed: the denominator of every rate."""
    duration_h: float
    """Length of the observation window in hours."""

    def __post_init__(self) -> None:
        keys = [(r.start_h, r.node_id) for r in self.records]
        if keys != sorted(keys):
            raise ValueError("FaultTrace.records must be sorted by (start_h, node_id)")
        if self.n_nodes < len(self.affected_nodes()):
            raise ValueError(f"n_nodes={self.n_nodes} is below the {len(self.affected_nodes())} nodes in the trace")
        if not self.duration_h >= 0:
            raise ValueError(f"duration_h must be >= 0, got {self.duration_h}")

    def affected_nodes(self) -> frozenset[str]:
        """Ids of the nodes with at least one fault."""
        return frozenset(r.node_id for r in self.records)

    def by_node(self) -> dict[str, list[FaultRecord]]:
        """Each affected node's faults, in start order."""
        out: dict[str, list[FaultRecord]] = defaultdict(list)
        for r in self.records:
            out[r.node_id].append(r)
        return dict(out)


def _make_trace(records: list[FaultRecord], n_nodes: int, duration_h: float) -> FaultTrace:
    return FaultTrace(tuple(sorted(records, key=lambda r: (r.start_h, r.node_id))), n_nodes, duration_h)


# --------------------------------------------------------------------------------------------------- loaders


def load_infinitehbd(path: str | Path | None = None, n_nodes: int = INFINITEHBD_N_NODES) -> FaultTrace:
    """Load the InfiniteHBD fault trace (default: the copy shipped in `policy/data/infinitehbd/`).

    Each `fault_start` is paired with the node's next `fault_end` *of the same fault_type*: the trace has a
    node whose "GPU Temperature High" fault stays open for 91 days while other faults start and end on it, so
    pairing on the node alone would mismatch them. A start without a matching end stays open (`end_h=None`).
    The window runs from hour 0 to the last event.
    """
    src = Path(path) if path is not None else INFINITEHBD_PATH
    events = json.loads(src.read_text(encoding="utf-8"))
    open_faults: dict[tuple[str, str], deque[tuple[float, str]]] = defaultdict(deque)
    records: list[FaultRecord] = []
    last_h = 0.0
    for i, ev in enumerate(events):
        try:
            node, t_h, kind = str(ev["node_id"]), float(ev["event_time"]) * _HOURS_PER_DAY, ev["event_type"]
            ft = ev["fault_type"]
            cause = f"{ft['Level']}/{ft['Class']}/{ft['Desc']}"
        except (KeyError, TypeError, ValueError) as exc:
            raise TraceFormatError(f"{src}: event {i} lacks node_id, event_time, event_type or fault_type") from exc
        last_h = max(last_h, t_h)
        if kind == "fault_start":
            open_faults[(node, cause)].append((t_h, cause))
        elif kind == "fault_end":
            pending = open_faults.get((node, cause))
            if not pending:
                raise TraceFormatError(f"{src}: event {i} ends a {cause!r} fault on node {node} that never started")
            start_h, _ = pending.popleft()
            records.append(FaultRecord(node, start_h, t_h, cause))
        else:
            raise TraceFormatError(f"{src}: event {i} has event_type {kind!r}; expected fault_start or fault_end")
    for (node, _), pending in open_faults.items():
        records.extend(FaultRecord(node, start_h, None, cause) for start_h, cause in pending)
    return _make_trace(records, n_nodes, last_h)


def _parse_hours(raw: str, column: str, where: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise TraceFormatError(
            f"{where}: {column} {raw!r} is not a number; write hours since the trace start, e.g. 12.5"
        ) from None
    if not math.isfinite(value):
        raise TraceFormatError(f"{where}: {column} is {raw!r}; write a finite number of hours")
    if value < 0:
        raise TraceFormatError(f"{where}: {column} {raw!r} is negative; times are hours since the trace start (>= 0)")
    return value


def load_csv(path: str | Path, n_nodes: int, duration_h: float | None = None) -> FaultTrace:
    """Load a fleet's own fault history from CSV.

    Format (UTF-8, comma-separated, one fault per line)::

        node_id,fault_start_h,fault_end_h,cause
        gpu-017,12.5,30.0,Hardware Failure/GPU/GPU xid Error
        gpu-203,100.25,,NIC lost

    - `node_id`: any non-empty name of the node.
    - `fault_start_h`, `fault_end_h`: hours since the start of the observation window (finite, >= 0, end >=
      start). Leave `fault_end_h` empty for a fault still open when the window closes.
    - `cause`: free text (may be empty); quote it if it contains a comma.
    - A node's faults must not overlap: each starts at or after the previous one's end.

    `n_nodes` is the fleet size, including nodes that never failed. `duration_h` is the window length; by
    default the latest time in the file. Any problem raises `TraceFormatError` naming the line and the fix.
    """
    src = Path(path)
    records: list[FaultRecord] = []
    lines: dict[int, int] = {}  # index in records -> line number, for overlap messages
    nodes: set[str] = set()
    with src.open(newline="", encoding="utf-8") as fh:
        reader = csv.reader(fh)
        header = next(reader, None)
        if header is None or tuple(h.strip() for h in header) != CSV_HEADER:
            raise TraceFormatError(
                f"{src} line 1: header is {header!r}; the first line must be exactly {','.join(CSV_HEADER)}"
            )
        for row in reader:
            where = f"{src} line {reader.line_num}"
            if not row:
                continue
            if len(row) != len(CSV_HEADER):
                raise TraceFormatError(
                    f"{where}: {len(row)} columns, expected {len(CSV_HEADER)} ({','.join(CSV_HEADER)}); "
                    "quote a cause that contains a comma"
                )
            node, raw_start, raw_end, cause = (c.strip() for c in row)
            if not node:
                raise TraceFormatError(f"{where}: node_id is empty; name the node that failed")
            start_h = _parse_hours(raw_start, "fault_start_h", where)
            end_h = None if raw_end == "" else _parse_hours(raw_end, "fault_end_h", where)
            if end_h is not None and end_h < start_h:
                raise TraceFormatError(
                    f"{where}: fault_end_h {raw_end} is before fault_start_h {raw_start}; swap them or fix the times"
                )
            if node not in nodes and len(nodes) == n_nodes:
                raise TraceFormatError(
                    f"{where}: node {node!r} is node number {n_nodes + 1} but the fleet has n_nodes={n_nodes}; "
                    "pass the real fleet size"
                )
            nodes.add(node)
            lines[len(records)] = reader.line_num
            records.append(FaultRecord(node, start_h, end_h, cause))

    order = sorted(range(len(records)), key=lambda i: (records[i].node_id, records[i].start_h))
    for prev_i, cur_i in itertools.pairwise(order):
        prev, cur = records[prev_i], records[cur_i]
        if prev.node_id == cur.node_id and (prev.end_h is None or cur.start_h < prev.end_h):
            first, second = sorted((lines[prev_i], lines[cur_i]))
            raise TraceFormatError(
                f"{src} line {second}: node {cur.node_id!r} has a fault overlapping the one on line {first}; "
                "a node's faults must not overlap (end the earlier one, or merge them into one line)"
            )

    last_h = max((max(r.start_h, r.end_h or 0.0) for r in records), default=0.0)
    if duration_h is None:
        duration_h = last_h
    elif duration_h < last_h:
        raise TraceFormatError(f"{src}: duration_h={duration_h} is before the latest time in the file ({last_h})")
    return _make_trace(records, n_nodes, duration_h)


def write_csv(trace: FaultTrace, path: str | Path) -> None:
    """Write `trace` in the format `load_csv` reads (times written exactly, so a round trip is lossless)."""
    with Path(path).open("w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(CSV_HEADER)
        for r in trace.records:
            writer.writerow([r.node_id, repr(r.start_h), "" if r.end_h is None else repr(r.end_h), r.cause])


# ------------------------------------------------------------------------------------------------ statistics


def fit_weibull(samples: np.ndarray) -> tuple[float, float]:
    """Maximum-likelihood Weibull (shape, scale) of positive samples.

    The shape k solves  sum(x^k ln x) / sum(x^k) - 1/k - mean(ln x) = 0,  whose left side increases in k;
    it is bracketed by doubling and solved by bisection. The scale is then mean(x^k)^(1/k).
    Raises ValueError for fewer than two distinct positive samples (the MLE does not exist).
    """
    x = np.asarray(samples, dtype=float)
    if x.ndim != 1 or np.any(~np.isfinite(x)) or np.any(x <= 0):
        raise ValueError("fit_weibull needs a 1-d array of finite, positive samples")
    if np.unique(x).size < 2:
        raise ValueError("fit_weibull needs at least two distinct samples")
    # The shape equation is scale-invariant; dividing by the max keeps x^k in [0, 1] for any k.
    log_x = np.log(x / x.max())
    mean_log = float(log_x.mean())

    def shape_eq(k: float) -> float:
        w = np.exp(k * log_x)
        return float((w * log_x).sum() / w.sum()) - 1.0 / k - mean_log

    lo, hi = 1.0, 1.0
    while shape_eq(lo) > 0:
        lo /= 2
    while shape_eq(hi) < 0:
        hi *= 2
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if shape_eq(mid) < 0:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    k = 0.5 * (lo + hi)
    scale = float(x.max() * np.mean(np.exp(k * log_x)) ** (1.0 / k))
    return k, scale


def inter_fault_gaps_h(trace: FaultTrace) -> np.ndarray:
    """Hours between consecutive fault starts on the same node, pooled over all nodes."""
    gaps = [np.diff([r.start_h for r in faults]) for faults in trace.by_node().values()]
    return np.concatenate(gaps) if gaps else np.empty(0)


@dataclass(frozen=True, slots=True)
class TraceStats:
    """What a fault trace says about the fleet's failure process. None marks a figure the trace cannot give."""

    n_faults: int
    n_affected_nodes: int
    """Nodes with at least one fault."""
    n_nodes: int
    faults_per_1000_node_days: float
    fleet_mtbf_h: float | None
    """Mean hours between faults anywhere in the fleet (window / faults)."""
    n_open_faults: int
    """Faults not repaired by the end of the window (excluded from repair times)."""
    repair_median_h: float | None
    repair_mean_h: float | None
    repair_p90_h: float | None
    n_gaps: int
    """Per-node gaps between consecutive fault starts."""
    gap_median_h: float | None
    weibull_shape: float | None
    """MLE Weibull shape of the positive gaps; below 1 means faults on a node cluster in time."""
    weibull_scale_h: float | None
    top10_node_share: float | None
    """Share of faults carried by the top 10% (rounded up) of affected nodes, ranked by fault count."""
    repeat_within_7d: float | None
    """P(a repaired node faults again within 7 days of its repair), over repaired faults."""


_REPEAT_WINDOW_H = 7 * _HOURS_PER_DAY


def trace_statistics(trace: FaultTrace) -> TraceStats:
    """Summarize `trace` into the figures that calibrate a standby policy."""
    n_faults = len(trace.records)
    node_days = trace.n_nodes * trace.duration_h / _HOURS_PER_DAY
    repairs = np.array([r.repair_h for r in trace.records if r.repair_h is not None], dtype=float)
    gaps = inter_fault_gaps_h(trace)
    positive_gaps = gaps[gaps > 0]
    shape: float | None = None
    scale: float | None = None
    if np.unique(positive_gaps).size >= 2:
        shape, scale = fit_weibull(positive_gaps)

    by_node = trace.by_node()
    counts = sorted((len(f) for f in by_node.values()), reverse=True)
    top_n = math.ceil(0.1 * len(counts))
    repeats = 0
    repaired = 0
    for faults in by_node.values():
        starts = np.array([f.start_h for f in faults])
        for f in faults:
            if f.end_h is None:
                continue
            repaired += 1
            # Another fault of this node starting in [end, end + 7 d]; a zero-length fault must not count itself.
            hit = (starts >= f.end_h) & (starts <= f.end_h + _REPEAT_WINDOW_H)
            hit &= np.array([g is not f for g in faults])
            repeats += bool(hit.any())

    return TraceStats(
        n_faults=n_faults,
        n_affected_nodes=len(by_node),
        n_nodes=trace.n_nodes,
        faults_per_1000_node_days=1000 * n_faults / node_days if node_days > 0 else 0.0,
        fleet_mtbf_h=trace.duration_h / n_faults if n_faults else None,
        n_open_faults=n_faults - repairs.size,
        repair_median_h=float(np.median(repairs)) if repairs.size else None,
        repair_mean_h=float(repairs.mean()) if repairs.size else None,
        repair_p90_h=float(np.percentile(repairs, 90)) if repairs.size else None,
        n_gaps=int(gaps.size),
        gap_median_h=float(np.median(gaps)) if gaps.size else None,
        weibull_shape=shape,
        weibull_scale_h=scale,
        top10_node_share=sum(counts[:top_n]) / n_faults if n_faults else None,
        repeat_within_7d=repeats / repaired if repaired else None,
    )
