"""Node-fault traces: typed records, loaders with clear validation, and the statistics a standby policy needs.

This module owns the *observed failure process* of a fleet: when each node failed, when it came back, and why.
Two sources load into the same `FaultTrace`:

- `load_infinitehbd()`: the real 400-server trace of Shou et al. (SIGCOMM 2025) shipped in `policy/data/`.
- `load_lanl_system20()`: LANL system 20's raw failure records (512 nodes, 1996-2005), also shipped.
- `load_csv()` / `read_csv()`: a cost owner's own fleet, in the CSV format documented on `read_csv`, as a raw
  export comes (byte-order mark, exact duplicates, overlapping records), with a `CsvLoadReport` of what was done.

`trace_statistics()` reduces a trace to the figures that calibrate a standby policy: fault rate, MTBF, repair
times, burstiness (a Weibull shape below 1 means a node's faults cluster in time; `burst_curve` measures how the
fleet's failures cluster across nodes, against independence) and repeat-offender nodes.
Only numpy and the standard library are used, so importing this module never pulls torch in.
"""

from __future__ import annotations

import codecs
import csv
import io
import json
import math
from collections import defaultdict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import numpy.typing as npt

from policy.decision import binomial_tail

INFINITEHBD_PATH = Path(__file__).parent / "data" / "infinitehbd" / "fault_trace.json"
"""The shipped copy of stepfun-ai/InfiniteHBD-Trace's fault_trace.json (Apache-2.0, see SOURCE.md beside it)."""

INFINITEHBD_N_NODES = 400
"""Servers in the InfiniteHBD trace's fleet, including the 169 that never failed."""

LANL_SYSTEM20_PATH = Path(__file__).parent / "data" / "lanl-system20" / "faults.csv"
"""The shipped copy of LANL system 20's failure records, 1996-2005 (credit Los Alamos, see SOURCE.md beside it)."""

LANL_SYSTEM20_N_NODES = 512
"""Compute nodes of LANL system 20, including the 112 that never failed."""

SHIPPED_TRACES = ("infinitehbd", "lanl-system20")
"""Names that `load_shipped` accepts: the real fleets shipped in `policy/data/`."""

MAX_FLEET_NODES = 1_000_000
"""Largest fleet a trace may describe: the simulator names every node of a job, so memory grows with it."""

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
        _check_fleet_size(self.n_nodes)
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


def load_lanl_system20(n_nodes: int = LANL_SYSTEM20_N_NODES) -> tuple[FaultTrace, CsvLoadReport]:
    """Load LANL system 20's raw records shipped in `policy/data/lanl-system20/` (duplicates dropped, overlaps
    merged, as the report says)."""
    return read_csv(LANL_SYSTEM20_PATH, n_nodes)


def load_shipped(name: str, n_nodes: int | None = None) -> tuple[FaultTrace, CsvLoadReport | None]:
    """One of `SHIPPED_TRACES` by name, on its own fleet size unless `n_nodes` says otherwise."""
    if name == "infinitehbd":
        return load_infinitehbd(n_nodes=n_nodes or INFINITEHBD_N_NODES), None
    if name == "lanl-system20":
        return load_lanl_system20(n_nodes or LANL_SYSTEM20_N_NODES)
    raise ValueError(f"no shipped trace {name!r}; pick one of {', '.join(SHIPPED_TRACES)} or pass a CSV file")


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


@dataclass(frozen=True, slots=True)
class CsvLoadReport:
    """What `read_csv` did to a fleet's raw export on its way into a `FaultTrace`: nothing is dropped silently."""

    path: str
    rows: int
    """Data rows read (blank lines not counted)."""
    byte_order_mark: bool
    """The file started with a UTF-8 byte-order mark (as spreadsheet exports often do); it was skipped."""
    duplicate_lines: tuple[int, ...]
    """Lines that repeat an earlier line exactly (same node, times and cause); each was dropped."""
    merged_lines: tuple[tuple[int, ...], ...]
    """Groups of lines whose faults of one node overlap in time; each group became one fault spanning them all."""

    @property
    def faults(self) -> int:
        """Faults in the resulting trace."""
        return self.rows - len(self.duplicate_lines) - sum(len(g) - 1 for g in self.merged_lines)

    def summary(self) -> str:
        """One line for a person: rows read, faults kept, and each change made with its line numbers."""
        parts = [f"{self.path}: {self.rows} rows -> {self.faults} faults"]
        if self.byte_order_mark:
            parts.append("UTF-8 byte-order mark skipped")
        if self.duplicate_lines:
            parts.append(
                f"{len(self.duplicate_lines)} exact duplicate row(s) dropped (lines {_lines(self.duplicate_lines)})"
            )
        if self.merged_lines:
            groups = ", ".join("+".join(str(n) for n in g) for g in self.merged_lines[:_MAX_LISTED])
            more = f" and {len(self.merged_lines) - _MAX_LISTED} more" if len(self.merged_lines) > _MAX_LISTED else ""
            parts.append(
                f"{len(self.merged_lines)} group(s) of overlapping faults of one node merged (lines {groups}{more})"
            )
        return "; ".join(parts)


_MAX_LISTED = 10


def _lines(numbers: tuple[int, ...]) -> str:
    head = ", ".join(str(n) for n in numbers[:_MAX_LISTED])
    return head + (f" and {len(numbers) - _MAX_LISTED} more" if len(numbers) > _MAX_LISTED else "")


OverlapHandling = Literal["merge", "refuse"]


def _open_text(src: Path) -> tuple[str, bool]:
    """The file's text and whether it began with a UTF-8 byte-order mark; UTF-16 and other encodings are refused
    with the fix, not with a decoding traceback."""
    raw = src.read_bytes()
    if raw.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        raise TraceFormatError(
            f"{src}: the file is UTF-16 (it starts with a UTF-16 byte-order mark); save it as UTF-8 CSV"
        )
    bom = raw.startswith(codecs.BOM_UTF8)
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise TraceFormatError(
            f"{src} line {line}: byte {raw[exc.start]:#04x} is not UTF-8; save the file as UTF-8 CSV"
        ) from None
    return text, bom


def load_csv(
    path: str | Path, n_nodes: int, duration_h: float | None = None, *, overlaps: OverlapHandling = "merge"
) -> FaultTrace:
    """Load a fleet's own fault history from CSV; `read_csv` says what it did on the way (duplicates, overlaps)."""
    return read_csv(path, n_nodes, duration_h, overlaps=overlaps)[0]


def read_csv(
    path: str | Path, n_nodes: int, duration_h: float | None = None, *, overlaps: OverlapHandling = "merge"
) -> tuple[FaultTrace, CsvLoadReport]:
    """Load a fleet's own fault history from CSV, as a raw export comes, and report what was changed.

    Format (UTF-8, a byte-order mark allowed, comma-separated, one fault per line)::

        node_id,fault_start_h,fault_end_h,cause
        gpu-017,12.5,30.0,Hardware Failure/GPU/GPU xid Error
        gpu-203,100.25,,NIC lost

    - `node_id`: any non-empty name of the node.
    - `fault_start_h`, `fault_end_h`: hours since the start of the observation window (finite, >= 0, end >=
      start). Leave `fault_end_h` empty for a fault still open when the window closes.
    - `cause`: free text (may be empty); quote it if it contains a comma.

    Raw exports repeat rows and log one outage of a node several times. A row that repeats an earlier one exactly
    is dropped; faults of one node that overlap in time (one starts before the previous one ended) are merged into
    one fault from the earliest start to the latest end, causes joined with " + " (a node already down cannot
    fail the job again, so the simulator counts them once either way). With `overlaps="refuse"` every overlap is
    reported at once, with its line numbers, instead. `CsvLoadReport` lists the lines of each change.

    `n_nodes` is the fleet size, including nodes that never failed. `duration_h` is the window length; by
    default the latest time in the file. Any problem raises `TraceFormatError` naming the line and the fix.
    """
    src = Path(path)
    _check_fleet_size(n_nodes)
    text, bom = _open_text(src)
    rows: list[tuple[int, FaultRecord]] = []
    seen: dict[FaultRecord, int] = {}
    duplicates: list[int] = []
    nodes: set[str] = set()
    reader = csv.reader(io.StringIO(text, newline=""))
    header = next(reader, None)
    if header is None or tuple(h.strip() for h in header) != CSV_HEADER:
        raise TraceFormatError(
            f"{src} line 1: header is {header!r}; the first line must be exactly {','.join(CSV_HEADER)}"
        )
    n_rows = 0
    for row in reader:
        where = f"{src} line {reader.line_num}"
        if not row:
            continue
        n_rows += 1
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
        record = FaultRecord(node, start_h, end_h, cause)
        if record in seen:
            duplicates.append(reader.line_num)
            continue
        seen[record] = reader.line_num
        rows.append((reader.line_num, record))

    records, groups = _merge_overlaps(rows)
    if groups and overlaps == "refuse":
        clashes = [
            f"line {g[i]}: node {n!r} has a fault overlapping the one on line {g[0]}"
            for n, g in groups
            for i in range(1, len(g))
        ]
        raise TraceFormatError(
            f"{src}: {len(clashes)} overlapping fault(s): " + "; ".join(clashes) + ". A node's faults must not "
            "overlap: end the earlier one, merge them into one line, or load with overlaps merged"
        )

    last_h = max((max(r.start_h, r.end_h or 0.0) for r in records), default=0.0)
    if duration_h is None:
        duration_h = last_h
    elif duration_h < last_h:
        raise TraceFormatError(
            f"{src}: duration_h={duration_h:g} is before the latest time in the file ({last_h:g}); the window must "
            "hold every fault"
        )
    report = CsvLoadReport(str(src), n_rows, bom, tuple(duplicates), tuple(g for _, g in groups))
    return _make_trace(records, n_nodes, duration_h), report


def _merge_overlaps(
    rows: list[tuple[int, FaultRecord]],
) -> tuple[list[FaultRecord], list[tuple[str, tuple[int, ...]]]]:
    """Merge each node's overlapping faults (transitively); return the records and the line groups merged."""
    by_node: dict[str, list[tuple[int, FaultRecord]]] = defaultdict(list)
    for line, r in rows:
        by_node[r.node_id].append((line, r))
    records: list[FaultRecord] = []
    groups: list[tuple[str, tuple[int, ...]]] = []
    for node, faults in by_node.items():
        faults.sort(key=lambda lr: (lr[1].start_h, lr[0]))
        chains: list[list[tuple[int, FaultRecord]]] = []
        for line, r in faults:
            if chains and _overlaps(chains[-1], r):
                chains[-1].append((line, r))
            else:
                chains.append([(line, r)])
        for chain in chains:
            if len(chain) == 1:
                records.append(chain[0][1])
                continue
            causes = list(dict.fromkeys(r.cause for _, r in chain if r.cause))
            records.append(FaultRecord(node, chain[0][1].start_h, _chain_end(chain), " + ".join(causes)))
            groups.append((node, tuple(sorted(line for line, _ in chain))))
    groups.sort(key=lambda g: g[1])
    return records, groups


def _chain_end(chain: list[tuple[int, FaultRecord]]) -> float | None:
    ends = [r.end_h for _, r in chain]
    return None if any(e is None for e in ends) else max(e for e in ends if e is not None)


def _overlaps(chain: list[tuple[int, FaultRecord]], r: FaultRecord) -> bool:
    """A fault overlaps a chain of one node's faults when it starts before all of them have ended."""
    end = _chain_end(chain)
    return end is None or r.start_h < end


def _check_fleet_size(n_nodes: int) -> None:
    if not 1 <= n_nodes <= MAX_FLEET_NODES:
        raise ValueError(
            f"n_nodes={n_nodes} is outside [1, {MAX_FLEET_NODES:,}]: the simulator names and places every node, so "
            f"fleets above {MAX_FLEET_NODES:,} nodes are not supported; simulate a representative part of the fleet"
        )


def with_window(trace: FaultTrace, duration_h: float) -> FaultTrace:
    """`trace` observed over `duration_h` hours instead (e.g. a fleet watched for longer than its last fault)."""
    last_h = max((max(r.start_h, r.end_h or 0.0) for r in trace.records), default=0.0)
    if not (math.isfinite(duration_h) and duration_h >= last_h):
        raise ValueError(
            f"duration_h={duration_h:g} must be finite and at least the latest time in the trace ({last_h:g})"
        )
    return FaultTrace(trace.records, trace.n_nodes, duration_h)


def split_trace(trace: FaultTrace, at_h: float) -> tuple[FaultTrace, FaultTrace]:
    """The trace before `at_h` and the trace from `at_h` on (its clock restarted at 0), for a temporal split:
    choose on the first part, judge on the second. A fault belongs to the part in which it starts; the second
    part does not see faults still open at `at_h` (their nodes come back healthy at its hour 0)."""
    if not 0.0 < at_h < trace.duration_h:
        raise ValueError(f"split at {at_h:g} h must fall inside the trace's window (0, {trace.duration_h:g}) h")
    head = [r for r in trace.records if r.start_h < at_h]
    tail = [
        FaultRecord(r.node_id, r.start_h - at_h, None if r.end_h is None else r.end_h - at_h, r.cause)
        for r in trace.records
        if r.start_h >= at_h
    ]
    return _make_trace(head, trace.n_nodes, at_h), _make_trace(tail, trace.n_nodes, trace.duration_h - at_h)


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


def job_failure_times(trace: FaultTrace) -> npt.NDArray[np.float64]:
    """Sorted start times of the faults that would fail a job spanning the fleet: a fault that starts while its node
    is still down from an earlier one is not a new failure (the simulator's rule)."""
    down_until: dict[str, float] = {}
    times: list[float] = []
    for r in trace.records:
        if r.start_h >= down_until.get(r.node_id, -math.inf):
            times.append(r.start_h)
        end = math.inf if r.end_h is None else r.end_h
        down_until[r.node_id] = max(down_until.get(r.node_id, -math.inf), end)
    return np.asarray(times, dtype=np.float64)


def burst_curve(times_h: npt.ArrayLike, duration_h: float, window_h: float, k_max: int = 8) -> npt.NDArray[np.float64]:
    """t[k] = share of windows [t, t + window_h), t uniform in [0, duration_h - window_h], holding >= k failures.

    A sweep over the instants where a failure enters (t = s - window_h) or leaves (t = s) the window: exact, and
    O(n log n) in the number of failures.
    """
    s = np.sort(np.asarray(times_h, dtype=np.float64))
    span = duration_h - window_h
    if not window_h > 0 or not span > 0:
        raise ValueError(f"window_h={window_h} must be > 0 and shorter than the trace ({duration_h} h)")
    events = np.concatenate([s - window_h, s])
    deltas = np.concatenate([np.ones(s.size, dtype=np.int64), -np.ones(s.size, dtype=np.int64)])
    # At equal instants the leaving failure goes first: windows are half-open.
    order = np.lexsort((deltas, events))
    events, deltas = np.clip(events[order], 0.0, span), deltas[order]
    counts = np.cumsum(deltas)
    lengths = np.diff(np.append(events, span))
    measure = np.zeros(k_max + 1)
    np.add.at(measure, np.minimum(counts, k_max), lengths)
    measure[0] += max(0.0, float(events[0]) if events.size else span)  # before the first event: no failure
    tail = np.cumsum(measure[::-1])[::-1] / span
    tail[0] = 1.0
    return np.clip(tail, 0.0, 1.0)


def independent_curve(n_nodes: int, failures: int, duration_h: float, window_h: float, k_max: int = 8) -> np.ndarray:
    """P(>= k failures within `window_h`) if each of `n_nodes` nodes failed independently at the fleet's mean rate."""
    rate = failures / (n_nodes * duration_h) if n_nodes and duration_h > 0 else 0.0
    tail = binomial_tail(n_nodes, -math.expm1(-rate * window_h), floor=0.0)
    out = np.zeros(k_max + 1)
    out[: min(tail.size, k_max + 1)] = tail[: k_max + 1]
    return out


BURST_WINDOW_H = 0.5
"""The window of the burst statistic: the default replenishment lead time L, the span a pool must bridge."""
BURST_K_MAX = 6


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
    burst_p_at_least: tuple[float, ...]
    """Empirical P(>= k job failures within `BURST_WINDOW_H`), k = 0..`BURST_K_MAX`, over every window."""
    independent_p_at_least: tuple[float, ...]
    """The same if nodes failed independently at the fleet's mean rate (binomial)."""

    @property
    def burst_excess(self) -> tuple[float | None, ...]:
        """Empirical / independent P(>= k failures within the window), k = 0..: how far bursts break independence
        (about 8,000 at k = 4 on InfiniteHBD, 1,000 on LANL system 20). None where independence gives 0."""
        return tuple(
            e / i if i > 0 else None for e, i in zip(self.burst_p_at_least, self.independent_p_at_least, strict=True)
        )


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

    failures = job_failure_times(trace)
    if trace.duration_h > BURST_WINDOW_H:
        burst = burst_curve(failures, trace.duration_h, BURST_WINDOW_H, BURST_K_MAX)
        independent = independent_curve(trace.n_nodes, failures.size, trace.duration_h, BURST_WINDOW_H, BURST_K_MAX)
    else:
        burst = independent = np.full(BURST_K_MAX + 1, np.nan)
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
        burst_p_at_least=tuple(float(x) for x in burst),
        independent_p_at_least=tuple(float(x) for x in independent),
    )
