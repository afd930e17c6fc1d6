"""Scenarios for `policy.tuning` (sweep, frontier, recommendation, plot) and the `trainmover policy` commands."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from policy.cli import main
from policy.costs import StandbyCosts
from policy.synthetic import SyntheticFleetConfig, generate_fleet
from policy.traces import FaultTrace
from policy.tuning import (
    FrontierPoint,
    NoSettingMeetsFloor,
    frontier_table,
    pareto_frontier,
    plot_frontier,
    recommend,
    sweep,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def small_trace() -> FaultTrace:
    return generate_fleet(SyntheticFleetConfig(n_nodes=64, days=60, seed=3)).trace


@pytest.fixture(scope="module")
def points(small_trace: FaultTrace) -> list[FrontierPoint]:
    return sweep(small_trace, StandbyCosts(), hazard_multipliers=(0.5, 2.0, 8.0, 64.0), static_fractions=(0.0, 0.05))


@pytest.fixture(scope="module")
def trace_csv(tmp_path_factory: pytest.TempPathFactory, small_trace: FaultTrace) -> Path:
    # Through `generate`, as a user would: the generator's overlapping faults must come out loadable.
    path = tmp_path_factory.mktemp("trace") / "fleet.csv"
    assert main(["generate", "--nodes", "64", "--days", "60", "--seed", "3", "--out", str(path)]) == 0
    return path


def _point(setting: str, ettr: float, cost: float) -> FrontierPoint:
    return FrontierPoint(setting, "hazard", 1.0, ettr, cost, 0.0, 0.0, 0, 0)


def test_sweep_returns_one_point_per_setting_in_grid_order(points: list[FrontierPoint]) -> None:
    assert [p.setting for p in points] == [
        "hazard x0.5",
        "hazard x2",
        "hazard x8",
        "hazard x64",
        "static 0% hot",
        "static 5% hot",
    ]
    assert all(0.0 <= p.ettr <= 1.0 for p in points)
    assert points[4].standby_usd == 0.0  # static 0% holds nothing
    assert points[5].ettr > points[4].ettr  # 5% standbys cover failures that none cannot


def test_frontier_is_monotone_more_ettr_costs_more(points: list[FrontierPoint]) -> None:
    frontier = pareto_frontier(points)
    assert len(frontier) >= 2
    for a, b in itertools.pairwise(frontier):
        assert b.ettr > a.ettr
        assert b.cost_per_useful_hour > a.cost_per_useful_hour
    for p in points:  # every point is matched or beaten by some frontier point
        assert any(f.ettr >= p.ettr and f.cost_per_useful_hour <= p.cost_per_useful_hour for f in frontier)


def test_dominated_point_leaves_the_frontier() -> None:
    cheap, dominated, best = _point("a", 0.99, 10.0), _point("b", 0.98, 20.0), _point("c", 0.999, 30.0)
    assert pareto_frontier([dominated, best, cheap]) == [cheap, best]


def test_recommend_is_cheapest_meeting_the_floor() -> None:
    pts = [_point("a", 0.99, 10.0), _point("b", 0.995, 20.0), _point("c", 0.999, 30.0)]
    assert recommend(pts).setting == "a"
    assert recommend(pts, min_ettr=0.993).setting == "b"
    assert recommend(pts, min_ettr=0.999).setting == "c"
    with pytest.raises(NoSettingMeetsFloor, match="best is c"):
        recommend(pts, min_ettr=0.9999)


def test_recommend_on_sweep_respects_floor(points: list[FrontierPoint]) -> None:
    floor = sorted(p.ettr for p in points)[-2]
    chosen = recommend(points, min_ettr=floor)
    assert chosen.ettr >= floor
    assert all(p.cost_per_useful_hour >= chosen.cost_per_useful_hour for p in points if p.ettr >= floor)


def test_plot_writes_a_png_and_table_marks_the_frontier(points: list[FrontierPoint], tmp_path: Path) -> None:
    out = tmp_path / "frontier.png"
    plot_frontier(points, out, recommended=recommend(points))
    assert out.read_bytes()[:8] == PNG_MAGIC
    table = frontier_table(points)
    assert table.count("*") == len(pareto_frontier(points))


def test_cli_simulate_infinitehbd_prints_the_comparison(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sim.json"
    assert main(["simulate", "--trace", "infinitehbd", "--json", str(out)]) == 0
    assert "oracle" in capsys.readouterr().out
    rows = json.loads(out.read_text())
    assert {r["policy"] for r in rows} >= {"no-standby", "oracle"}


def test_cli_tune_on_a_csv_writes_plot_json_and_meets_floor(
    trace_csv: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png, js = tmp_path / "f.png", tmp_path / "f.json"
    argv = ["tune", "--trace", str(trace_csv), "--nodes", "64", "--plot", str(png), "--json", str(js)]
    assert main([*argv, "--min-ettr", "0.99"]) == 0
    assert "recommended:" in capsys.readouterr().out
    assert png.read_bytes()[:8] == PNG_MAGIC
    report = json.loads(js.read_text())
    assert report["recommended"]["ettr"] >= 0.99
    assert report["frontier"]


def test_cli_generate_writes_a_loadable_csv(tmp_path: Path) -> None:
    out = tmp_path / "syn.csv"
    assert main(["generate", "--nodes", "32", "--days", "90", "--seed", "2", "--out", str(out)]) == 0
    assert main(["simulate", "--trace", str(out), "--nodes", "32"]) == 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["simulate", "--trace", "/nonexistent/trace.csv", "--nodes", "8"], "no such file"),
        (["simulate", "--trace", "infinitehbd", "--job-price-usd-per-h", "-5"], "--job-price-usd-per-h"),
        (["simulate", "--trace", "infinitehbd", "--lead-time-h", "-1"], "--lead-time-h"),
        (["simulate", "--trace", "infinitehbd", "--nodes", "-3"], "--nodes"),
        (["tune", "--trace", "infinitehbd", "--min-ettr", "1.5"], "--min-ettr"),
        (["generate", "--nodes", "-1", "--days", "1", "--out", "x.csv"], "--nodes"),
    ],
)
def test_bad_input_exits_2_with_one_clear_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) == 1
    assert "Traceback" not in err


def test_malformed_csv_and_missing_nodes_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("node_id,fault_start_h,fault_end_h,cause\nn1,soon,,GPU\n", encoding="utf-8")
    assert main(["simulate", "--trace", str(bad), "--nodes", "4"]) == 2
    assert "line 2" in capsys.readouterr().err
    assert main(["simulate", "--trace", str(bad)]) == 2
    assert "--nodes is required" in capsys.readouterr().err
