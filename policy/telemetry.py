"""Node telemetry: the typed per-node, per-time sample a failure predictor reads, and batch validation.

This module owns the *schema* of fleet telemetry. `TelemetrySample` is one node at one time (GPU health
counters, link errors, node history and spot-market signals); `validate_batch` checks a column-oriented batch
(numpy arrays named like the sample's fields, as `policy.synthetic` yields them) against a fleet's node list:
every row must be a valid sample, every node known, and each node's timestamps strictly increasing.
Counters are *per sampling interval* (events seen since the node's previous sample), never cumulative.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

SpotInterruptionBand = Literal["<5%", "5-10%", "10-15%", "15-20%", ">20%"]
"""AWS Spot Instance Advisor's monthly interruption-frequency bands."""

SPOT_BANDS: tuple[SpotInterruptionBand, ...] = ("<5%", "5-10%", "10-15%", "15-20%", ">20%")


class TelemetryError(ValueError):
    """A telemetry batch is malformed; the message names the row and node and says what is wrong."""


class TelemetrySample(BaseModel):
    """One node's health and market signals at one time."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    node_id: str = Field(min_length=1, description="Id of the node, as in the fleet's node list.")
    t_h: float = Field(ge=0, description="Sample time in hours since the start of the observation window.")
    gpu_temp_c: float = Field(ge=-20, le=130, description="Hottest GPU core temperature on the node (C).")
    hbm_temp_c: float = Field(ge=-20, le=130, description="Hottest HBM stack temperature on the node (C).")
    power_w: float = Field(ge=0, le=2000, description="Highest per-GPU board power on the node (W).")
    ecc_sbe_count: int = Field(ge=0, description="Single-bit (corrected) ECC errors in the sampling interval.")
    ecc_dbe_count: int = Field(ge=0, description="Double-bit (uncorrected) ECC errors in the sampling interval.")
    row_remaps: int = Field(ge=0, description="HBM rows remapped in the sampling interval.")
    xid_codes: tuple[int, ...] = Field(
        default=(), description="NVIDIA XID error codes logged in the sampling interval (e.g. 48, 63, 64, 79)."
    )
    nvlink_errors: int = Field(ge=0, description="NVLink CRC/replay errors in the sampling interval.")
    pcie_errors: int = Field(ge=0, description="PCIe AER errors in the sampling interval.")
    nic_errors: int = Field(ge=0, description="NIC link flaps and RDMA errors in the sampling interval.")
    node_age_days: float = Field(ge=0, description="Days since the node entered service.")
    failures_last_30d: int = Field(ge=0, description="Faults of this node that started in the last 30 days.")
    spot_interruption_band: SpotInterruptionBand | None = Field(
        default=None, description="Monthly spot interruption band of the node's pool; None for on-demand nodes."
    )
    rebalance_recommended: bool = Field(
        default=False, description="The provider has sent a rebalance recommendation (elevated spot risk)."
    )
    spot_price_ratio: float = Field(
        default=1.0, gt=0, le=10, description="Current price over the on-demand price (1.0 for on-demand)."
    )

    @field_validator("xid_codes")
    @classmethod
    def _xid_codes_positive(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if any(c <= 0 for c in v):
            raise ValueError(f"XID codes are positive integers, got {v}")
        return v


COLUMNS: tuple[str, ...] = tuple(TelemetrySample.model_fields)
"""Column names of a telemetry batch: exactly the fields of `TelemetrySample`, in order."""


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        parts.append(f"{loc}={err.get('input')!r}: {err['msg']}")
    return "; ".join(parts)


def sample(**fields: Any) -> TelemetrySample:
    """Build a `TelemetrySample`, raising `TelemetryError` with one line per bad field."""
    try:
        return TelemetrySample(**fields)
    except ValidationError as exc:
        raise TelemetryError(f"invalid telemetry sample: {_describe(exc)}") from None


def _python_value(v: Any) -> Any:
    if isinstance(v, np.generic):
        return v.item()
    return v


def validate_batch(batch: Mapping[str, np.ndarray], fleet_nodes: Iterable[str], *, check_rows: bool = True) -> int:
    """Check a column-oriented batch; return its row count or raise `TelemetryError` with one clear message.

    Checks, in this order: the columns are exactly `COLUMNS` with equal lengths; every node id is in
    `fleet_nodes`; no float column holds NaN or infinity; each node's `t_h` strictly increases in row order;
    and (with `check_rows`) every row is a valid `TelemetrySample` (ranges, non-negative counts).
    """
    missing = [c for c in COLUMNS if c not in batch]
    extra = [c for c in batch if c not in COLUMNS]
    if missing or extra:
        raise TelemetryError(f"telemetry batch columns: missing {missing}, unexpected {extra}")
    lengths = {c: len(batch[c]) for c in COLUMNS}
    n = lengths["node_id"]
    if any(v != n for v in lengths.values()):
        raise TelemetryError(f"telemetry batch columns differ in length: {lengths}")

    nodes = np.asarray(batch["node_id"]).astype(str)
    known = np.array(sorted(set(fleet_nodes)), dtype=str)
    unknown = ~np.isin(nodes, known)
    if unknown.any():
        i = int(np.argmax(unknown))
        raise TelemetryError(
            f"row {i}: node_id {str(nodes[i])!r} is not in the fleet's node list ({known.size} nodes); "
            "send telemetry only for registered nodes"
        )

    for col in COLUMNS:
        arr = np.asarray(batch[col])
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            i = int(np.argmax(~np.isfinite(arr)))
            raise TelemetryError(f"row {i}: {col} is {arr[i]} for node {str(nodes[i])!r}; it must be a finite number")

    t = np.asarray(batch["t_h"], dtype=float)
    order = np.argsort(nodes, kind="stable")
    same_node = nodes[order][1:] == nodes[order][:-1]
    not_increasing = same_node & (np.diff(t[order]) <= 0)
    if not_increasing.any():
        j = int(np.argmax(not_increasing))
        prev, cur = int(order[j]), int(order[j + 1])
        raise TelemetryError(
            f"row {cur}: node {str(nodes[cur])!r} has t_h={t[cur]} after row {prev} with t_h={t[prev]}; "
            "a node's samples must be in strictly increasing time order"
        )

    if check_rows:
        for i in range(n):
            row = {c: _python_value(batch[c][i]) for c in COLUMNS}
            try:
                TelemetrySample(**row)
            except ValidationError as exc:
                raise TelemetryError(f"row {i} (node {str(nodes[i])!r}): {_describe(exc)}") from None
    return n
