"""The reactive-hold candidate (policy/reactive.py): its schedule, that it never looks ahead, its fit on the training
part only, and `policy evaluate --trace ... --candidates reactive-hold` on the shipped traces."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from policy.cli import main
from policy.costs import TIER_NAMES, StandbyCosts
from policy.reactive import HOLDS_H, ReactiveHold, fit_reactive_hold
from policy.simulator import StaticPool, fleet_node_ids, job_view
from policy.traces import FaultRecord, FaultTrace, split_trace

WARM = TIER_NAMES.index("warm")


def _trace(starts: list[float], duration_h: float = 100.0) -> FaultTrace:
    records = tuple(FaultRecord(f"n{i}", t, t + 1.0, "test") for i, t in enumerate(starts))
    return FaultTrace(records, n_nodes=16, duration_h=duration_h)


def test_one_more_warm_standby_from_each_failure_until_the_hold_after_the_latest() -> None:
    policy = ReactiveHold(StaticPool(hot=1, stopped=2), hold_h=5.0)
    sched = policy.schedule(job_view(_trace([10.0, 12.0, 30.0]), StandbyCosts()))

    assert sched.times_h.tolist() == [0.0, 10.0, 17.0, 30.0, 35.0]  # 12 falls inside 10's hold: it moves its end
    assert sched.counts[:, WARM].tolist() == [0, 1, 0, 1, 0]
    assert (sched.counts[:, TIER_NAMES.index("hot")] == 1).all()
    assert (sched.counts[:, TIER_NAMES.index("stopped")] == 2).all()


def test_the_target_at_any_hour_depends_only_on_the_failures_before_it() -> None:
    starts = [3.0, 4.5, 20.0, 21.0, 22.5, 60.0, 90.0]
    policy = ReactiveHold(StaticPool(stopped=1), hold_h=6.0)
    full = policy.schedule(job_view(_trace(starts), StandbyCosts()))

    def target(sched: object, t: float) -> int:
        i = int(np.searchsorted(sched.times_h, t, side="right")) - 1  # type: ignore[attr-defined]
        return int(sched.counts[i, WARM])  # type: ignore[attr-defined]

    for cut in (4.0, 21.5, 25.0, 61.0, 95.0):
        seen = policy.schedule(job_view(_trace([s for s in starts if s <= cut]), StandbyCosts()))
        for t in np.linspace(0.0, cut, 200):
            assert target(full, t) == target(seen, t), (cut, t)


def test_the_fit_reads_the_training_part_alone() -> None:
    trace = _trace([5.0, 6.0, 7.0, 40.0, 41.0, 70.0, 71.0, 72.0, 73.0], duration_h=100.0)
    head, _ = split_trace(trace, 50.0)
    nodes = fleet_node_ids(trace)

    fitted = fit_reactive_hold(head, StandbyCosts(), nodes)
    again = fit_reactive_hold(split_trace(_trace([5.0, 6.0, 7.0, 40.0, 41.0], 100.0), 50.0)[0], StandbyCosts(), nodes)

    assert fitted.hold_h in HOLDS_H and fitted == again, "the failures after the cut change nothing"
    assert fitted.name == "reactive-hold" and fitted.tier == "warm"


def test_evaluate_judges_it_on_the_held_out_half_and_keeps_it_only_with_an_edge(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "lanl.json"
    assert main(["evaluate", "--trace", "lanl-system20", "--candidates", "reactive-hold", "--json", str(out)]) == 0
    lanl = json.loads(out.read_text())
    assert lanl["chosen"] == "reactive-hold" and not lanl["fell_back"]
    assert lanl["cost_ratio"] < 0.8 and lanl["verdicts"]["reactive-hold"]["dominated_by"] == []

    out = tmp_path / "ihbd.json"
    assert main(["evaluate", "--trace", "infinitehbd", "--candidates", "reactive-hold", "--json", str(out)]) == 0
    ihbd = json.loads(out.read_text())
    # Cheaper on the held-out half, but dominated on stretches of the training part: no edge, the static runs.
    assert ihbd["fell_back"] and ihbd["cost_ratio"] == 1.0
    assert ihbd["verdicts"]["reactive-hold"]["cost_ratio"] < 0.9
    assert "reactive-hold" in capsys.readouterr().out

    assert main(["evaluate", "--trace", "infinitehbd", "--candidates", "reactive"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "--candidates 'reactive': name one or more of" in captured.err
