"""Hazard shifts in the synthetic generator: a rollout or ageing period in which the fleet fails more often."""

from __future__ import annotations

from pathlib import Path

import pytest

from policy.cli import main as policy_main
from policy.synthetic import HazardShift, SyntheticFleetConfig, generate_fleet
from policy.traces import read_csv


def _rates(config: SyntheticFleetConfig, start_h: float, end_h: float) -> tuple[float, float]:
    """Faults per 1,000 node-days inside [start_h, end_h) and outside it."""
    trace = generate_fleet(config).trace
    inside = sum(1 for r in trace.records if start_h <= r.start_h < end_h)
    outside = len(trace.records) - inside
    node_days_in = config.n_nodes * (end_h - start_h) / 24
    node_days_out = config.n_nodes * (trace.duration_h - (end_h - start_h)) / 24
    return inside / node_days_in * 1000, outside / node_days_out * 1000


@pytest.mark.parametrize("factor", [3.0, 0.4])
def test_a_shift_shows_in_the_rate_of_its_period(factor: float) -> None:
    shift = HazardShift(start_day=100, days=40, factor=factor)
    ratios = []
    for seed in (1, 2, 3):
        config = SyntheticFleetConfig(n_nodes=2048, days=240, seed=seed, hazard_shifts=(shift,))
        inside, outside = _rates(config, 2400.0, 3360.0)
        base_in, _ = _rates(SyntheticFleetConfig(n_nodes=2048, days=240, seed=seed), 2400.0, 3360.0)
        assert 3.0 < outside < 5.5  # the rest of the window keeps the calibrated rate (4.2)
        ratios.append(inside / outside)
        assert (inside > 1.5 * base_in) if factor > 1 else (inside < 0.7 * base_in)
    mean = sum(ratios) / len(ratios)
    assert factor * 0.8 < mean < factor * 1.2, ratios


def test_no_shift_leaves_the_fleet_bit_for_bit_unchanged() -> None:
    plain = generate_fleet(SyntheticFleetConfig(n_nodes=128, days=60, seed=5))
    empty = generate_fleet(SyntheticFleetConfig(n_nodes=128, days=60, seed=5, hazard_shifts=()))
    assert plain.trace.records == empty.trace.records
    shifted = generate_fleet(
        SyntheticFleetConfig(n_nodes=128, days=60, seed=5, hazard_shifts=(HazardShift(start_day=10, days=5, factor=4),))
    )
    assert shifted.trace.records != plain.trace.records

    # Faults before the shift are the same faults (their causes are drawn later, from a moved stream).
    def when(records: tuple) -> set[tuple[str, float, float | None]]:
        return {(r.node_id, r.start_h, r.end_h) for r in records if r.start_h < 240}

    assert when(plain.trace.records) == when(shifted.trace.records)


def test_generate_takes_hazard_shifts_and_refuses_a_bad_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "shifted.csv"
    args = ["generate", "--nodes", "256", "--days", "60", "--seed", "3", "--out", str(out)]
    assert policy_main([*args, "--hazard-shift", "20:10:5"]) == 0
    trace, _ = read_csv(out, n_nodes=256)
    inside = sum(1 for r in trace.records if 480 <= r.start_h < 720)
    assert inside > 2 * (len(trace.records) - inside) * 10 / 50
    for bad, says in (("20:10", "START_DAY:DAYS:FACTOR"), ("a:b:c", "must be numbers"), ("20:10:0", "factor")):
        assert policy_main([*args, "--hazard-shift", bad]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--hazard-shift" in err and says in err, err


def test_train_on_bursty_fleets_records_the_burst_share(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, report = tmp_path / "m.skops", tmp_path / "r.json"
    args = ["train", "--seeds", "1", "--nodes", "64", "--days", "30", "--max-iter", "3", "--out", str(out)]
    assert policy_main([*args, "--burst-share", "0.3", "--json", str(report)]) == 0
    assert '"burst_share": 0.3' in report.read_text()
    assert policy_main([*args, "--burst-share", "1.5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--burst-share" in err, err
