"""Scenarios for `policy.tuning` (sweep, frontier, recommendation, plot) and the `trainmover policy` commands."""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import pytest

from policy.cli import main
from policy.costs import StandbyCosts
from policy.simulator import static_pools
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
    # Mixed-tier pools (issue 13) follow the hazard and static settings, one point each.
    assert [p.setting for p in points[:6]] == [
        "hazard x0.5",
        "hazard x2",
        "hazard x8",
        "hazard x64",
        "static 0% hot",
        "static 5% hot",
    ]
    pools = points[6:]
    assert len(pools) == len(static_pools()) and all(p.kind == "pool" for p in pools)
    assert pools[0].setting == "pool 1 stopped" and pools[0].pool == (0, 0, 1)
    assert next(p for p in pools if p.setting == "pool 1 hot + 2 stopped").pool == (1, 0, 2)
    assert all(0.0 <= p.ettr <= 1.0 for p in points)
    assert points[4].standby_usd == 0.0  # static 0% holds nothing
    assert points[5].ettr > points[4].ettr  # 5% standbys cover failures that none cannot


def test_the_frontier_offers_mixed_tier_pools_and_the_table_shows_them(points: list[FrontierPoint]) -> None:
    frontier = pareto_frontier(points)
    mixed = [p for p in frontier if sum(1 for n in p.pool if n) >= 2]
    assert mixed, "no mixed-tier pool on the frontier"
    table = frontier_table(points)
    assert "hot/warm/stopped" in table.splitlines()[0]
    line = next(row for row in table.splitlines() if row.startswith("pool 1 hot + 2 stopped "))
    assert " 1/0/2 " in line


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


def test_cli_generates_a_bursty_fleet(tmp_path: Path) -> None:
    from policy.traces import load_csv, trace_statistics

    out = tmp_path / "bursty.csv"
    assert (
        main(["generate", "--nodes", "400", "--days", "349", "--seed", "1", "--burst-share", "0.3", "--out", str(out)])
        == 0
    )
    assert trace_statistics(load_csv(out, n_nodes=400)).burst_p_at_least[4] > 1e-4  # independent nodes: ~0
    assert main(["generate", "--burst-share", "1.5", "--out", str(out)]) == 2


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
        (["simulate", "--trace", "infinitehbd", "--nodes", "100000000"], "must lie in [1, 1,000,000]"),
        (["simulate", "--trace", "infinitehbd", "--duration-h", "100"], "--duration-h"),
        (["simulate", "--trace", "infinitehbd", "--duration-h", "-1"], "--duration-h"),
        (["simulate", "--trace", "infinitehbd", "--tiers", "hot,cold"], "--tiers"),
        (["simulate", "--trace", "infinitehbd", "--stopped-takeover-s", "-4"], "--stopped-takeover-s"),
        (["simulate", "--trace", "infinitehbd", "--warm-price-usd-per-h", "-1"], "--warm-price-usd-per-h"),
        (["simulate", "--trace", "infinitehbd", "--stopped-wake-failure-prob", "2"], "--stopped-wake-failure-prob"),
        (["tune", "--trace", "infinitehbd", "--replacement-h", "-1"], "--replacement-h"),
        (["simulate", "--trace", "infinitehbd", "--node-price-usd-per-h", "-1"], "--node-price-usd-per-h"),
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


def test_cli_simulate_a_million_nodes_finishes_quickly(capsys: pytest.CaptureFixture[str]) -> None:
    started = time.perf_counter()
    assert main(["simulate", "--trace", "infinitehbd", "--nodes", "1000000"]) == 0
    assert time.perf_counter() - started < 20.0  # about 1 s here; it used to run for hours (O(nodes^2))
    assert "binomial-p99-warm" in capsys.readouterr().out


def test_cli_reads_a_raw_export_says_what_it_did_and_takes_a_window(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    raw = tmp_path / "raw.csv"
    raw.write_bytes(
        b"\xef\xbb\xbfnode_id,fault_start_h,fault_end_h,cause\na,1,5,GPU\na,1,5,GPU\na,3,9,NIC\nb,20,21,x\n"
    )
    js = tmp_path / "sim.json"
    assert main(["simulate", "--trace", str(raw), "--nodes", "4", "--json", str(js)]) == 0
    out = capsys.readouterr().out
    assert "4 rows -> 2 faults" in out and "duplicate" in out and "(lines 2+4)" in out
    short = {r["policy"]: r for r in json.loads(js.read_text())}
    assert main(["simulate", "--trace", str(raw), "--nodes", "4", "--duration-h", "2100", "--json", str(js)]) == 0
    long = {r["policy"]: r for r in json.loads(js.read_text())}
    # The same two failures over a window 100x as long: the restarts weigh 100x less.
    assert 1 - long["no-standby"]["ettr"] == pytest.approx((1 - short["no-standby"]["ettr"]) / 100)


def test_cli_simulates_the_shipped_lanl_trace(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--trace", "lanl-system20"]) == 0
    out = capsys.readouterr().out
    assert "2478 rows -> 2464 faults" in out and "oracle" in out


def _sim_json(tmp_path: Path, *argv: str) -> dict[str, dict[str, object]]:
    out = tmp_path / "sim.json"
    assert main(["simulate", "--trace", "infinitehbd", "--json", str(out), *argv]) == 0
    return {r["policy"]: r for r in json.loads(out.read_text())}


def test_the_job_is_priced_by_its_node_count(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fleet = _sim_json(tmp_path)
    assert "job 22016.00 USD/h (400 nodes x 55.04)" in capsys.readouterr().out
    half = _sim_json(tmp_path, "--job-nodes", "200", "--node-price-usd-per-h", "10")
    assert "job 2000.00 USD/h (200 nodes x 10)" in capsys.readouterr().out
    assert half["no-standby"]["downtime_cost_usd"] < fleet["no-standby"]["downtime_cost_usd"]  # type: ignore[operator]
    fixed = _sim_json(tmp_path, "--job-price-usd-per-h", "1000")
    assert "job 1000.00 USD/h (given)" in capsys.readouterr().out
    # No-standby: every failure costs (restart + replacement) x the job price, 2,700 s by default.
    r = fixed["no-standby"]
    assert r["downtime_cost_usd"] == pytest.approx(r["uncovered_failures"] * 2700.0 / 3600.0 * 1000.0)  # type: ignore[operator]
    quick = _sim_json(tmp_path, "--job-price-usd-per-h", "1000", "--replacement-h", "0", "--restart-downtime-s", "1200")
    assert quick["no-standby"]["downtime_cost_usd"] == pytest.approx(r["uncovered_failures"] * 1200.0 / 3600.0 * 1000.0)  # type: ignore[operator]


def test_tier_prices_takeovers_and_stopped_capacity_are_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _sim_json(tmp_path, "--tiers", "hot,stopped", "--stopped-capacity", "reserved", "--hot-takeover-s", "2")
    out = capsys.readouterr().out
    assert "hot 56.04 USD/h, 2 s" in out and "stopped 55.54 USD/h, 600 s" in out and "wakes" not in out
    assert "-warm" not in out and "static-5%-stopped" in out  # the baselines use the tiers offered
    _sim_json(
        tmp_path, "--stopped-price-usd-per-h", "2", "--stopped-wake-failure-prob", "0.3", "--warm-takeover-s", "9"
    )
    out = capsys.readouterr().out
    assert "stopped 2 USD/h, 600 s, wakes 70%" in out and "warm 55.04 USD/h, 9 s" in out


def test_malformed_csv_and_missing_nodes_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("node_id,fault_start_h,fault_end_h,cause\nn1,soon,,GPU\n", encoding="utf-8")
    assert main(["simulate", "--trace", str(bad), "--nodes", "4"]) == 2
    assert "line 2" in capsys.readouterr().err
    assert main(["simulate", "--trace", str(bad)]) == 2
    assert "--nodes is required" in capsys.readouterr().err
