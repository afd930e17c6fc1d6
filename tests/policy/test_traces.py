"""Fault traces: the shipped InfiniteHBD trace, the CSV format for a fleet's own history, and their statistics."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from policy.traces import (
    CSV_HEADER,
    INFINITEHBD_PATH,
    LANL_SYSTEM20_PATH,
    MAX_FLEET_NODES,
    FaultRecord,
    FaultTrace,
    TraceFormatError,
    fit_weibull,
    load_csv,
    load_infinitehbd,
    load_lanl_system20,
    read_csv,
    trace_statistics,
    with_window,
    write_csv,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def infinitehbd() -> FaultTrace:
    return load_infinitehbd()


def test_the_trace_ships_inside_the_package_with_its_license() -> None:
    package_data = REPO_ROOT / "policy" / "data" / "infinitehbd"
    assert package_data / "fault_trace.json" == INFINITEHBD_PATH
    assert INFINITEHBD_PATH.is_file()
    assert "Apache License" in (package_data / "LICENSE").read_text()
    assert "2502.03885" in (package_data / "SOURCE.md").read_text()


def test_infinitehbd_loads_every_fault_closed_and_sorted(infinitehbd: FaultTrace) -> None:
    assert len(infinitehbd.records) == 584
    assert infinitehbd.n_nodes == 400
    assert len(infinitehbd.affected_nodes()) == 231
    assert infinitehbd.duration_h == pytest.approx(348.9798 * 24)
    assert all(r.end_h is not None and r.end_h >= r.start_h for r in infinitehbd.records)
    starts = [r.start_h for r in infinitehbd.records]
    assert starts == sorted(starts)
    first = infinitehbd.records[0]
    assert first.start_h == pytest.approx(3.8955 * 24)
    assert first.cause == "Hardware Failure/GPU/GPU DBE(Double Bit ECC) > Threshold"


def test_infinitehbd_pairs_an_end_with_the_start_of_the_same_fault_type(infinitehbd: FaultTrace) -> None:
    # This node's GPU fault stays open from day 180.278 to day 271.9319 while a CPU fault starts and ends on it.
    node = infinitehbd.by_node()["d0aff1b6-1dea-433e-b483-5a86089fd8f9"]
    gpu = next(r for r in node if r.cause.endswith("GPU Temperature High"))
    cpu = next(r for r in node if r.cause.endswith("Configuration Error"))
    assert (gpu.start_h, gpu.end_h) == pytest.approx((180.278 * 24, 271.9319 * 24))
    assert (cpu.start_h, cpu.end_h) == pytest.approx((271.244 * 24, 271.9428 * 24))


def test_infinitehbd_statistics_match_the_published_figures(infinitehbd: FaultTrace) -> None:
    stats = trace_statistics(infinitehbd)
    assert stats.n_faults == 584
    assert stats.n_affected_nodes == 231
    assert stats.n_open_faults == 0
    assert stats.faults_per_1000_node_days == pytest.approx(4.1836, abs=5e-4)
    assert stats.fleet_mtbf_h == pytest.approx(14.342, abs=1e-3)
    assert stats.repair_median_h == pytest.approx(20.389, abs=1e-3)
    assert stats.repair_mean_h == pytest.approx(132.84, abs=0.01)
    assert stats.repair_p90_h == pytest.approx(311.34, abs=0.01)
    # Gaps between fault starts on a node (repair-to-next-start gaps would give a shape near 0.38).
    assert stats.n_gaps == 584 - 231
    assert stats.weibull_shape == pytest.approx(0.5199, abs=1e-3)
    # Top 24 of 231 affected nodes (10% rounded up) carry 166 faults; the top 23 would give 0.2757.
    assert stats.top10_node_share == pytest.approx(166 / 584)
    # 182 of 584 repairs are followed by another fault of the same node within 7 days.
    assert stats.repeat_within_7d == pytest.approx(182 / 584)


@pytest.mark.parametrize("shape", [0.5, 1.0, 2.5])
def test_weibull_mle_recovers_a_known_shape_and_scale(shape: float) -> None:
    rng = np.random.default_rng(20250)
    samples = 300.0 * rng.weibull(shape, size=20_000)
    fitted_shape, fitted_scale = fit_weibull(samples)
    assert fitted_shape == pytest.approx(shape, rel=0.03)
    assert fitted_scale == pytest.approx(300.0, rel=0.05)


def test_weibull_mle_refuses_samples_without_a_maximum() -> None:
    with pytest.raises(ValueError, match="distinct"):
        fit_weibull(np.array([5.0, 5.0, 5.0]))
    with pytest.raises(ValueError, match="positive"):
        fit_weibull(np.array([1.0, 0.0, 3.0]))


def test_csv_round_trip_keeps_every_fault_exactly(tmp_path: Path) -> None:
    trace = FaultTrace(
        records=(
            FaultRecord("gpu-1", 0.1, 2.0 / 3.0, "Hardware Failure/GPU/GPU xid Error"),
            FaultRecord("gpu-2", 5.0, 5.0, "reboot, then fine"),
            FaultRecord("gpu-1", 12.5, None, "NIC lost"),
        ),
        n_nodes=8,
        duration_h=48.0,
    )
    path = tmp_path / "fleet.csv"
    write_csv(trace, path)
    assert path.read_text().splitlines()[0] == ",".join(CSV_HEADER)
    assert load_csv(path, n_nodes=8, duration_h=48.0) == trace


def test_csv_loads_a_hand_written_fleet_and_summarizes_it(tmp_path: Path) -> None:
    path = tmp_path / "fleet.csv"
    path.write_text("node_id,fault_start_h,fault_end_h,cause\na,10,20,GPU\nb,30,,NIC\na,100,110,GPU\n")
    trace = load_csv(path, n_nodes=4)
    assert trace.duration_h == 110.0
    assert [r.node_id for r in trace.records] == ["a", "b", "a"]
    stats = trace_statistics(trace)
    assert stats.n_open_faults == 1
    assert stats.repair_median_h == 10.0
    assert stats.repeat_within_7d == 0.5  # a's repair at 20 h is followed by its fault at 100 h; the last is not
    assert stats.weibull_shape is None  # one gap: no MLE


GOOD = "a,1,2,GPU\n"


@pytest.mark.parametrize(
    ("body", "line", "fix"),
    [
        pytest.param("node_id,start,end,cause\n" + GOOD, 1, "must be exactly", id="wrong-header"),
        pytest.param(",".join(CSV_HEADER) + "\n" + GOOD + "b,1,2\n", 3, "3 columns, expected 4", id="missing-column"),
        pytest.param(",".join(CSV_HEADER) + "\nb,1,2,GPU,x\n", 2, "quote a cause", id="extra-column"),
        pytest.param(",".join(CSV_HEADER) + "\nb,soon,2,GPU\n", 2, "is not a number", id="non-numeric-start"),
        pytest.param(",".join(CSV_HEADER) + "\nb,1,later,GPU\n", 2, "fault_end_h 'later' is not a number", id="nn-end"),
        pytest.param(",".join(CSV_HEADER) + "\nb,-1,2,GPU\n", 2, "negative", id="negative-start"),
        pytest.param(",".join(CSV_HEADER) + "\nb,1,nan,GPU\n", 2, "finite number", id="nan-end"),
        pytest.param(",".join(CSV_HEADER) + "\nb,inf,,GPU\n", 2, "finite number", id="infinite-start"),
        pytest.param(",".join(CSV_HEADER) + "\nb,5,2,GPU\n", 2, "before fault_start_h", id="end-before-start"),
        pytest.param(",".join(CSV_HEADER) + "\n,1,2,GPU\n", 2, "node_id is empty", id="empty-node"),
        pytest.param(
            ",".join(CSV_HEADER) + "\n" + GOOD + "b,1,2,GPU\nc,1,2,GPU\n", 4, "n_nodes=2", id="too-many-nodes"
        ),
    ],
)
def test_each_bad_csv_gives_one_clear_error(tmp_path: Path, body: str, line: int, fix: str) -> None:
    path = tmp_path / "fleet.csv"
    path.write_text(body)
    with pytest.raises(TraceFormatError) as excinfo:
        load_csv(path, n_nodes=2)
    message = str(excinfo.value)
    assert f"line {line}" in message
    assert fix in message


# Overlaps are merged by default now (a raw export has them: issue 13); refusing them is the opt-in, and then
# every overlap is listed at once. These two cases moved here from the table above, with `overlaps="refuse"`.
@pytest.mark.parametrize(
    ("body", "line", "fix"),
    [
        pytest.param(GOOD + "b,0,1,GPU\na,1.5,3,NIC\n", 4, "overlapping the one on line 2", id="overlap"),
        pytest.param("a,1,,GPU\na,7,8,NIC\n", 3, "overlapping the one on line 2", id="after-open"),
    ],
)
def test_refusing_overlaps_names_the_lines(tmp_path: Path, body: str, line: int, fix: str) -> None:
    path = tmp_path / "fleet.csv"
    path.write_text(",".join(CSV_HEADER) + "\n" + body)
    with pytest.raises(TraceFormatError) as excinfo:
        load_csv(path, n_nodes=2, overlaps="refuse")
    assert f"line {line}: node 'a' has a fault {fix}" in str(excinfo.value)


def test_refusing_overlaps_reports_every_one_at_once(tmp_path: Path) -> None:
    path = tmp_path / "fleet.csv"
    path.write_text(",".join(CSV_HEADER) + "\na,1,5,GPU\nb,1,5,GPU\na,2,3,NIC\nb,4,6,NIC\na,4,9,PSU\n")
    with pytest.raises(TraceFormatError) as excinfo:
        load_csv(path, n_nodes=2, overlaps="refuse")
    message = str(excinfo.value)
    assert "3 overlapping fault(s)" in message
    for clash in ("line 4: node 'a'", "line 6: node 'a'", "line 5: node 'b'"):
        assert clash in message


def test_a_raw_export_loads_with_duplicates_and_overlaps_merged_and_says_so(tmp_path: Path) -> None:
    path = tmp_path / "export.csv"
    path.write_bytes(
        b"\xef\xbb\xbf"  # a spreadsheet's UTF-8 byte-order mark
        + (",".join(CSV_HEADER) + "\r\n").encode()
        + b"a,1,5,GPU\r\nb,2,3,NIC\r\na,1,5,GPU\r\na,4,9,PSU\r\na,8,12,Fan\r\na,20,,GPU\r\nb,2,3,NIC\r\n"
    )
    trace, report = read_csv(path, n_nodes=2)
    assert report.byte_order_mark
    assert report.duplicate_lines == (4, 8)  # exact repeats of lines 2 and 3: duplicates, not "overlaps"
    assert report.merged_lines == ((2, 5, 6),)  # 1-5 overlaps 4-9, which overlaps 8-12
    assert (report.rows, report.faults) == (7, 3)
    assert [(r.node_id, r.start_h, r.end_h, r.cause) for r in trace.records] == [
        ("a", 1.0, 12.0, "GPU + PSU + Fan"),
        ("b", 2.0, 3.0, "NIC"),
        ("a", 20.0, None, "GPU"),
    ]
    summary = report.summary()
    assert "7 rows -> 3 faults" in summary and "byte-order mark" in summary
    assert "2 exact duplicate row(s) dropped (lines 4, 8)" in summary and "(lines 2+5+6)" in summary
    assert load_csv(path, n_nodes=2) == trace


def test_a_utf16_file_is_refused_with_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "export.csv"
    path.write_text(",".join(CSV_HEADER) + "\n" + GOOD, encoding="utf-16")
    with pytest.raises(TraceFormatError, match=r"UTF-16.*save it as UTF-8"):
        load_csv(path, n_nodes=2)
    path.write_bytes((",".join(CSV_HEADER) + "\n").encode() + b"a,1,2,caf\xe9\n")  # Latin-1
    with pytest.raises(TraceFormatError, match="line 2: byte 0xe9 is not UTF-8"):
        load_csv(path, n_nodes=2)


def test_the_shipped_lanl_trace_loads_raw_and_reports_its_repairs() -> None:
    trace, report = load_lanl_system20()
    assert "Los Alamos" in (LANL_SYSTEM20_PATH.parent / "SOURCE.md").read_text()
    assert (report.rows, len(report.duplicate_lines), len(report.merged_lines)) == (2478, 2, 10)
    assert len(trace.records) == report.faults == 2464
    assert trace.n_nodes == 512 and len(trace.affected_nodes()) == 400
    assert trace.duration_h / 24 == pytest.approx(1378.3, abs=0.1)
    by_node = trace.by_node()
    for faults in by_node.values():  # merged: no node is down twice at once any more
        for a, b in itertools.pairwise(faults):
            assert a.end_h is not None and b.start_h >= a.end_h


def test_the_observation_window_can_be_set_but_must_hold_every_fault(tmp_path: Path) -> None:
    path = tmp_path / "fleet.csv"
    path.write_text(",".join(CSV_HEADER) + "\n" + GOOD)
    assert load_csv(path, n_nodes=2, duration_h=100.0).duration_h == 100.0
    assert with_window(load_csv(path, n_nodes=2), 50.0).duration_h == 50.0
    with pytest.raises(ValueError, match="latest time"):
        with_window(load_csv(path, n_nodes=2), 1.0)


def test_a_fleet_above_the_supported_size_is_refused_with_the_limit() -> None:
    FaultTrace((), MAX_FLEET_NODES, 1.0)
    with pytest.raises(ValueError, match="1,000,000"):
        FaultTrace((), MAX_FLEET_NODES + 1, 1.0)


def test_the_readme_shows_the_header_the_reader_requires() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme[readme.index("## Standby policy, for cost owners") :]
    section = section[: section.index("\n## ", 5)]
    assert ",".join(CSV_HEADER) in section
    assert "start_h,end_h" not in section.replace("fault_start_h,fault_end_h", "")


def test_duration_shorter_than_the_faults_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "fleet.csv"
    path.write_text(",".join(CSV_HEADER) + "\n" + GOOD)
    with pytest.raises(TraceFormatError, match="duration_h"):
        load_csv(path, n_nodes=2, duration_h=1.5)


def test_importing_policy_traces_does_not_import_torch() -> None:
    code = (
        "import sys, policy.traces\n"
        "bad = {'torch', 'prefect', 'boto3', 'azure', 'runtime', 'cloud', 'flows'} & set(sys.modules)\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True, timeout=60)
