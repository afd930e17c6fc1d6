"""Synthetic fleets: calibrated to the InfiniteHBD trace, reproducible, with telemetry that validates."""

from __future__ import annotations

import ast
import collections
import itertools
import math
import time
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from policy.synthetic import (
    BURSTS_LIKE_INFINITEHBD,
    INFINITEHBD_CAUSE_COUNTS,
    PRECURSOR_XID_CODES,
    SyntheticFleet,
    SyntheticFleetConfig,
    generate_fleet,
)
from policy.telemetry import COLUMNS, TelemetryError, TelemetrySample, sample, validate_batch
from policy.traces import TraceStats, inter_fault_gaps_h, load_infinitehbd, trace_statistics

POLICY_DIR = Path(__file__).resolve().parents[2] / "policy"


def ks_statistic(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sample Kolmogorov-Smirnov statistic: the largest gap between the two empirical CDFs."""
    a, b = np.sort(a), np.sort(b)
    grid = np.concatenate([a, b])
    cdf_a = np.searchsorted(a, grid, side="right") / a.size
    cdf_b = np.searchsorted(b, grid, side="right") / b.size
    return float(np.max(np.abs(cdf_a - cdf_b)))


def ks_bound(n: int, m: int, alpha: float = 0.001) -> float:
    """Asymptotic critical value c(alpha) * sqrt((n + m) / (n m)), c(alpha) = sqrt(-ln(alpha / 2) / 2)."""
    return math.sqrt(-math.log(alpha / 2) / 2) * math.sqrt((n + m) / (n * m))


def test_ks_statistic_on_known_cases() -> None:
    x = np.arange(100.0)
    assert ks_statistic(x, x) == 0.0
    assert ks_statistic(x, x + 1000) == 1.0
    assert ks_statistic(x, x + 50) == pytest.approx(0.5)


@pytest.fixture(scope="module")
def real() -> TraceStats:
    return trace_statistics(load_infinitehbd())


@pytest.fixture(scope="module")
def fleet() -> SyntheticFleet:
    # The trace's fleet: 400 nodes over its 349 days.
    return generate_fleet(SyntheticFleetConfig(n_nodes=400, days=349, seed=1))


def test_generated_fleet_matches_the_real_trace(fleet: SyntheticFleet, real: TraceStats) -> None:
    gen = trace_statistics(fleet.trace)
    print(
        f"\nrate {gen.faults_per_1000_node_days:.2f} vs {real.faults_per_1000_node_days:.2f}; "
        f"weibull shape {gen.weibull_shape:.3f} vs {real.weibull_shape:.3f}; "
        f"repair median {gen.repair_median_h:.1f} vs {real.repair_median_h:.1f} h, "
        f"mean {gen.repair_mean_h:.1f} vs {real.repair_mean_h:.1f} h; "
        f"top-10% share {gen.top10_node_share:.3f} vs {real.top10_node_share:.3f}"
    )
    # One 400-node year holds ~580 faults from bursty, frailty-mixed nodes: seeds spread the rate by ~±10%.
    assert gen.faults_per_1000_node_days == pytest.approx(real.faults_per_1000_node_days, rel=0.2)
    assert gen.weibull_shape is not None and real.weibull_shape is not None
    assert abs(gen.weibull_shape - real.weibull_shape) < 0.15
    assert gen.weibull_shape < 1  # bursty
    assert gen.repair_median_h is not None and 12 < gen.repair_median_h < 32
    # The lognormal's sample mean is dominated by its tail (sd of the mean is ~36 h at n=580), hence the range.
    assert gen.repair_mean_h is not None and 60 < gen.repair_mean_h < 250
    assert gen.top10_node_share is not None and gen.top10_node_share > 0.2  # repeat offenders


def _ks_vs_trace(fleet: SyntheticFleet) -> tuple[float, float, float]:
    trace = load_infinitehbd()
    real_repair = np.array([r.repair_h for r in trace.records if r.repair_h is not None])
    gen_repair = np.array([r.repair_h for r in fleet.trace.records if r.repair_h is not None])
    real_gaps, gen_gaps = inter_fault_gaps_h(trace), inter_fault_gaps_h(fleet.trace)
    # The 0.1% critical values of the two-sample KS test ("indistinguishable from the trace at alpha=0.001").
    return (
        ks_statistic(gen_repair, real_repair),
        ks_bound(gen_repair.size, real_repair.size),
        ks_statistic(gen_gaps, real_gaps),
        ks_bound(gen_gaps.size, real_gaps.size),
    )


def test_repair_times_and_gaps_pass_a_two_sample_ks_check(fleet: SyntheticFleet) -> None:
    d_repair, repair_bound, d_gaps, gaps_bound = _ks_vs_trace(fleet)
    print(f"\nKS repair {d_repair:.3f} (bound {repair_bound:.3f}), KS gaps {d_gaps:.3f} (bound {gaps_bound:.3f})")
    assert d_repair < repair_bound
    assert d_gaps < gaps_bound


def test_sub_hour_repairs_are_as_common_as_in_the_trace(fleet: SyntheticFleet) -> None:
    def share(trace: object) -> float:
        repairs = np.array([r.repair_h for r in trace.records if r.repair_h is not None])  # type: ignore[attr-defined]
        return float(np.mean(repairs < 1.0))

    assert share(fleet.trace) == pytest.approx(share(load_infinitehbd()), abs=0.06)  # trace: 0.197


def test_a_node_under_repair_does_not_fault_again(fleet: SyntheticFleet) -> None:
    for node, faults in fleet.trace.by_node().items():
        ordered = sorted(faults, key=lambda r: r.start_h)
        for before, after in itertools.pairwise(ordered):
            assert before.end_h is not None and after.start_h >= before.end_h, f"{node}: {before} then {after}"


def test_ks_check_rejects_a_miscalibrated_fleet() -> None:
    # Memoryless, homogeneous nodes (Poisson faults) and a 60 h median repair: both checks must fail.
    cfg = SyntheticFleetConfig(
        n_nodes=400, days=349, seed=1, weibull_shape=1.0, frailty_shape=100, repair_median_h=60, repair_mean_h=200
    )
    d_repair, repair_bound, d_gaps, gaps_bound = _ks_vs_trace(generate_fleet(cfg))
    assert d_repair > repair_bound
    assert d_gaps > gaps_bound


def test_cause_mix_is_the_traces_level_class_mix(fleet: SyntheticFleet) -> None:
    real = collections.Counter("/".join(r.cause.split("/")[:2]) for r in load_infinitehbd().records)
    assert dict(real) == INFINITEHBD_CAUSE_COUNTS
    gen = collections.Counter(r.cause for r in fleet.trace.records)
    n = len(fleet.trace.records)
    assert gen["Hardware Failure/GPU"] / n == pytest.approx(158 / 584, abs=0.06)


def test_a_single_lognormal_is_derived_from_median_and_mean() -> None:
    mu, sigma = SyntheticFleetConfig(repair_quick_share=0).repair_lognormal
    assert math.exp(mu) == pytest.approx(20.4)
    assert math.exp(mu + sigma**2 / 2) == pytest.approx(132.8)


def test_the_repair_mixture_keeps_the_configured_median_and_mean() -> None:
    cfg = SyntheticFleetConfig()
    repairs = cfg.draw_repairs_h(np.random.default_rng(0), 2_000_000)
    assert np.median(repairs) == pytest.approx(20.4, rel=0.02)
    assert repairs.mean() == pytest.approx(132.8, rel=0.03)
    assert np.mean(repairs < 1.0) == pytest.approx(0.197, abs=0.03)  # the trace's sub-hour share


def test_same_seed_same_fleet_other_seed_other_fleet() -> None:
    cfg = SyntheticFleetConfig(n_nodes=64, days=60, seed=7, faults_per_1000_node_days=8)
    a, b = generate_fleet(cfg), generate_fleet(cfg)
    assert a.trace == b.trace and a.windows == b.windows and a.preemptions == b.preemptions
    for ca, cb in zip(a.telemetry(end_h=48), b.telemetry(end_h=48), strict=True):
        for col in COLUMNS:
            assert np.array_equal(ca[col], cb[col]), col
    other = generate_fleet(cfg.model_copy(update={"seed": 8}))
    assert other.trace != a.trace


def test_a_1024_node_year_generates_in_seconds() -> None:
    t0 = time.perf_counter()
    fleet = generate_fleet(SyntheticFleetConfig(n_nodes=1024, days=365))
    elapsed = time.perf_counter() - t0
    print(f"\n1024 nodes x 365 days: {len(fleet.trace.records)} faults in {elapsed:.3f} s")
    assert elapsed < 3.0
    assert len(fleet.trace.records) > 800


def _xids_before_faults(fleet: SyntheticFleet, lead_h: float) -> int:
    """XID-bearing samples of a failing node in the `lead_h` hours before each of its faults."""
    starts: dict[str, list[float]] = collections.defaultdict(list)
    for r in fleet.trace.records:
        starts[r.node_id].append(r.start_h)
    hits = 0
    for chunk in fleet.telemetry(chunk_h=24 * 30):
        has_xid = np.array([bool(x) for x in chunk["xid_codes"]])
        for node, t in zip(chunk["node_id"][has_xid], chunk["t_h"][has_xid], strict=True):
            hits += any(0 <= s - t <= lead_h for s in starts.get(str(node), []))
    return hits


def test_precursors_appear_before_faults_only_when_asked() -> None:
    base = {"n_nodes": 48, "days": 60, "faults_per_1000_node_days": 8, "seed": 3}
    quiet = generate_fleet(SyntheticFleetConfig(**base, precursor_fraction=0.0, false_alarms_per_node_year=0))
    assert not any(quiet.has_precursor) and not quiet.windows
    assert len(quiet.trace.records) > 5
    assert _xids_before_faults(quiet, 24.0) == 0
    loud = generate_fleet(SyntheticFleetConfig(**base, precursor_fraction=1.0, false_alarms_per_node_year=0))
    assert all(loud.has_precursor)
    assert _xids_before_faults(loud, 24.0) > 0
    codes = {c for chunk in loud.telemetry(chunk_h=24 * 30) for x in chunk["xid_codes"] for c in x}
    assert codes and codes <= set(PRECURSOR_XID_CODES)


def test_false_alarms_put_signals_where_no_fault_follows() -> None:
    fleet = generate_fleet(
        SyntheticFleetConfig(n_nodes=32, days=30, precursor_fraction=0.0, false_alarms_per_node_year=50, seed=2)
    )
    kinds = {w.kind for w in fleet.windows}
    assert kinds == {"false_alarm"}


def test_telemetry_rows_validate_and_follow_acmetrace_roughly() -> None:
    fleet = generate_fleet(SyntheticFleetConfig(n_nodes=64, days=30, seed=4))
    chunks = list(fleet.telemetry(chunk_h=24 * 7))
    for chunk in chunks:
        validate_batch(chunk, fleet.node_ids, check_rows=False)
    validate_batch({c: v[:2000] for c, v in chunks[0].items()}, fleet.node_ids)  # full per-row pydantic check
    gpu = np.concatenate([c["gpu_temp_c"] for c in chunks])
    power = np.concatenate([c["power_w"] for c in chunks])
    p50, p90 = np.percentile(gpu, [50, 90])
    assert 36 < p50 < 44 and 54 < p90 < 62  # AcmeTrace Kalos: 40 / 58 C
    w50, w90 = np.percentile(power, [50, 90])
    assert 80 < w50 < 130 and 350 < w90 < 430  # about 100 / 400 W
    assert chunks[0]["spot_interruption_band"][0] == "<5%"


def test_spot_preemptions_carry_the_providers_notice() -> None:
    for provider, notice_s in (("aws", 120.0), ("azure", 30.0)):
        fleet = generate_fleet(
            SyntheticFleetConfig(n_nodes=200, days=60, spot_preemptions_per_node_day=0.01, spot_provider=provider)
        )
        assert fleet.preemptions
        for p in fleet.preemptions:
            assert (p.preempt_h - p.notice_h) * 3600 == pytest.approx(notice_s)


@pytest.mark.parametrize(
    ("update", "field"),
    [
        ({"faults_per_1000_node_days": 1.0}, "faults_per_1000_node_days"),
        ({"faults_per_1000_node_days": 9.0}, "faults_per_1000_node_days"),
        ({"days": -5}, "days"),
        ({"repair_mean_h": 10.0}, "repair_mean_h"),
        ({"repair_quick_share": 0.45, "repair_quick_median_h": 100.0}, "repair_quick_share"),
    ],
)
def test_bad_config_names_the_field(update: dict[str, float], field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        SyntheticFleetConfig(**update)


def _good_sample() -> dict[str, object]:
    return {
        "node_id": "node-00000",
        "t_h": 1.0,
        "gpu_temp_c": 40.0,
        "hbm_temp_c": 50.0,
        "power_w": 100.0,
        "ecc_sbe_count": 0,
        "ecc_dbe_count": 0,
        "row_remaps": 0,
        "xid_codes": (),
        "nvlink_errors": 0,
        "pcie_errors": 0,
        "nic_errors": 0,
        "node_age_days": 100.0,
        "failures_last_30d": 0,
        "spot_interruption_band": None,
        "rebalance_recommended": False,
        "spot_price_ratio": 1.0,
    }


def test_bad_samples_say_what_is_wrong() -> None:
    assert isinstance(sample(**_good_sample()), TelemetrySample)
    with pytest.raises(TelemetryError, match="gpu_temp_c=nan"):
        sample(**{**_good_sample(), "gpu_temp_c": float("nan")})
    with pytest.raises(TelemetryError, match=r"ecc_sbe_count=-1.*greater than or equal to 0"):
        sample(**{**_good_sample(), "ecc_sbe_count": -1})
    with pytest.raises(TelemetryError, match="XID codes are positive"):
        sample(**{**_good_sample(), "xid_codes": (0,)})


def _batch(rows: list[dict[str, object]]) -> dict[str, np.ndarray]:
    out = {}
    for c in COLUMNS:
        arr = np.empty(len(rows), dtype=object)
        arr[:] = [r[c] for r in rows]
        out[c] = arr if c in ("xid_codes", "spot_interruption_band", "node_id") else np.array([r[c] for r in rows])
    return out


def test_bad_batches_give_one_clear_message() -> None:
    nodes = ["node-00000", "node-00001"]
    a, b = _good_sample(), {**_good_sample(), "node_id": "node-00001", "t_h": 0.5}
    assert validate_batch(_batch([a, b, {**a, "t_h": 2.0}]), nodes) == 3
    with pytest.raises(TelemetryError, match=r"row 2: node 'node-00000' has t_h=0.5 after row 0 with t_h=1.0"):
        validate_batch(_batch([a, b, {**a, "t_h": 0.5}]), nodes)
    with pytest.raises(TelemetryError, match="'node-99' is not in the fleet's node list"):
        validate_batch(_batch([a, {**b, "node_id": "node-99"}]), nodes)
    with pytest.raises(TelemetryError, match="row 1: power_w is nan"):
        validate_batch(_batch([a, {**b, "power_w": float("nan")}]), nodes)
    with pytest.raises(TelemetryError, match=r"row 1 .*nic_errors=-3"):
        validate_batch(_batch([a, {**b, "nic_errors": -3}]), nodes)


def test_policy_imports_only_numpy_pydantic_stdlib_and_policy() -> None:
    import sys

    allowed = {"numpy", "pydantic", "policy"} | set(sys.stdlib_module_names)
    for name in ("synthetic.py", "telemetry.py"):
        tree = ast.parse((POLICY_DIR / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                roots = {node.module.split(".")[0]}
            else:
                continue
            assert roots <= allowed, f"{name} imports {roots - allowed}"


@pytest.mark.parametrize("seed", [1, 2])
def test_a_bursty_fleet_matches_the_traces_burst_curve_rate_and_ks_checks(seed: int, real: TraceStats) -> None:
    fleet = generate_fleet(SyntheticFleetConfig(n_nodes=400, days=349, seed=seed, **BURSTS_LIKE_INFINITEHBD))
    stats = trace_statistics(fleet.trace)
    # Burst curve: P(>= k failures within 0.5 h) within a factor 2 of the trace's for k = 1..4 (independent
    # nodes are off by 6x at k = 2 and by 8,000x at k = 4).
    for k in range(1, 5):
        assert 0.5 < stats.burst_p_at_least[k] / real.burst_p_at_least[k] < 2.0, k
    assert stats.burst_excess[4] is not None and stats.burst_excess[4] > 1_000
    assert stats.faults_per_1000_node_days == pytest.approx(real.faults_per_1000_node_days, rel=0.2)
    d_repair, repair_bound, d_gaps, gaps_bound = _ks_vs_trace(fleet)
    assert d_repair < repair_bound and d_gaps < gaps_bound
    for faults in fleet.trace.by_node().values():  # a burst never strikes a node that is already down
        for before, after in itertools.pairwise(faults):
            assert before.end_h is not None and after.start_h >= before.end_h


def test_independent_fleets_have_no_bursts_and_stay_as_they_were(fleet: SyntheticFleet) -> None:
    stats = trace_statistics(fleet.trace)
    assert stats.burst_p_at_least[4] < 1e-4  # the trace: 4.9e-4
    # burst_share=0 draws nothing more, so a fleet is bit for bit the same as before bursts existed.
    assert generate_fleet(SyntheticFleetConfig(n_nodes=400, days=349, seed=1, burst_share=0.0)).trace == fleet.trace
