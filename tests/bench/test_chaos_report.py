"""Scenarios for the chaos soak's report, on made-up jobs: what it counts, and that a lost state fails it."""

from __future__ import annotations

from typing import Any

import pytest

from bench.chaos import chaos_plan, format_report, ok, percentile, summarize, unaccounted
from bench.peers.trainmover import Commit, JobRun, interruptions, parse_commit_log, steady_step_of

STEPS = 60
STEP_S = 0.2
PLAN = chaos_plan(3, 1.5, 1)
# (replay step, part of it done before the failure, recovery_s, warm-up penalty) of each recovery.
KILLS = [(10, 0.05, 0.30, 0.02), (25, 0.15, 0.40, 0.0), (40, 0.0, 0.25, 0.10)]


def job(digests: dict[str, str], members: list[str], kills: list[tuple[int, float, float, float]],
        exit_code: int = 0, extra_events: list[dict[str, Any]] | None = None, merge_first: bool = False,
        standby_late_s: float | None = None) -> JobRun:
    """A finished job whose rank 1 dies at each of ``kills`` and is recovered; every member logs its commits.

    Rank 0 (w0) commits every step, ``STEP_S`` apart except for the recoveries; the killed rank 1 processes log
    the steps they committed before they died. ``merge_first``: the coordinator reports the first two deaths as
    one recovery (as it does when the first recovery's reports never came). ``standby_late_s``: every promoted
    standby became warm that long after the death was declared.
    """
    events: list[dict[str, Any]] = [{"event": "generation", "generation": 0, "time": 1000.0,
                                     "members": [{"rank": 0, "proc": "w0"}, {"rank": 1, "proc": "w1"}]}]
    w0: list[Commit] = []
    others: dict[str, list[Commit]] = {"w1": []}
    t, gen, holder = 1000.0, 0, "w1"
    by_step = {k[0]: k for k in kills}
    for step in range(1, STEPS + 1):
        if step in by_step:
            _, done, recovery, penalty = by_step[step]
            failure = t + done
            gen += 1
            new = f"s{gen - 1}"
            if standby_late_s is not None:
                events.append({"event": "standby_ready", "proc": new, "time": failure + 0.02 + standby_late_s})
            events += [
                {"event": "chaos_injected", "proc": holder, "pid": 10 + gen, "role": "worker", "state": "training",
                 "signal": "kill", "time": failure},
                {"event": "member_failed", "proc": holder, "failure_at": failure, "step": None, "generation": gen - 1,
                 "declared_at": failure + 0.02},
                {"event": "generation", "generation": gen, "replaced": [{"rank": 1, "old": holder, "new": new}],
                 "members": [{"rank": 0, "proc": "w0"}, {"rank": 1, "proc": new}]},
                {"event": "recovered", "generation": gen, "step": step,
                 "ranks": [{"rank": 1, "old": holder, "new": new}], "causes": ["killed by SIGKILL"],
                 "recovery_s": recovery, "warmup_penalty_s": penalty, "detect_s": 0.02, "reconfigure_s": 0.02,
                 "handoff_s": 0.03, "replay_s": recovery - 0.07},
            ]
            holder = new
            others[holder] = []
            t = failure + recovery
        else:
            t += STEP_S + (by_step[step - 1][3] if step - 1 in by_step else 0.0)
        w0.append(Commit(step, gen, t))
        others[holder].append(Commit(step, gen, t + 0.001))
    events.append({"event": "generation", "generation": gen + 1, "time": t,
                   "members": [{"rank": r, "proc": p} for r, p in enumerate(members)]})
    if merge_first:
        first, second = [e for e in events if e["event"] == "recovered"][:2]
        events.remove(first)
        second["ranks"] = first["ranks"] + second["ranks"]
        second["recovery_s"] = second["recovery_s"] + 3.0  # counted from the first death
    events += extra_events or []
    return JobRun(commits=tuple(w0), digest=digests[members[0]], member_digests=dict(digests),
                  runtime_digests=dict(digests), state_bytes=1, events=events, exit_code=exit_code, message="boom",
                  proc_commits={"w0": tuple(w0), **{p: tuple(cs) for p, cs in others.items()}})


CLEAN = job({"w0": "a", "w1": "a"}, ["w0", "w1"], [])
DONE = {"calibration_step_s": STEP_S, "benchmark_wall_s": 30.0}


def test_each_stall_costs_its_recovery_minus_the_rest_of_the_step_plus_its_penalty() -> None:
    chaos = job({"w0": "a", "s2": "a"}, ["w0", "s2"], KILLS)

    assert steady_step_of(chaos.proc_commits) == pytest.approx(STEP_S)
    stalls = interruptions(chaos.proc_commits, chaos.events, STEP_S)

    # Anchor and resumption are the last member's commits (rank 1 logs 1 ms after rank 0).
    assert [k.replay_step for k in stalls] == [10, 25, 40]
    assert [k.deaths for k in stalls] == [("w1",), ("s0",), ("s1",)]
    assert [k.redone_s for k in stalls] == pytest.approx([0.049, 0.149, -0.001])
    assert [k.lost_time_s for k in stalls] == pytest.approx([0.05 + 0.30 - 0.2 + 0.02, 0.15 + 0.40 - 0.2,
                                                             0.25 - 0.2 + 0.10])
    assert [k.recovery_s for k in stalls] == [0.30, 0.40, 0.25]
    assert all(k.reconciled and k.waited_for_standby_s == 0 for k in stalls)


def test_deaths_the_coordinator_merged_are_still_two_stalls_in_the_commit_logs() -> None:
    chaos = job({"w0": "a", "s2": "a"}, ["w0", "s2"], KILLS, merge_first=True)

    stalls = interruptions(chaos.proc_commits, chaos.events, STEP_S)

    assert [k.deaths for k in stalls] == [("w1",), ("s0",), ("s1",)]
    assert [k.lost_time_s for k in stalls] == pytest.approx([0.17, 0.35, 0.15])
    # The merged event's recovery_s spans both stalls: it is not compared with either.
    assert [k.recovery_s for k in stalls] == [None, None, 0.25]
    r = summarize(CLEAN, chaos, STEPS, PLAN, 3)
    assert r["recoveries"] == 2 and r["stalls"] == 3 and ok(r)


def test_a_stall_that_waited_for_a_standby_to_warm_is_counted_apart() -> None:
    chaos = job({"w0": "a", "s2": "a"}, ["w0", "s2"], KILLS, standby_late_s=1.5)

    r = summarize(CLEAN, chaos, STEPS, PLAN, 3)

    assert r["stalls_waiting_for_a_standby"] == 3
    assert [k["waited_for_standby_s"] for k in r["stalls_detail"]] == pytest.approx([1.5] * 3)
    assert r["lost_time_s_p50_standby_ready"] is None


def test_a_soak_that_kept_every_state_passes_and_reports_its_figures() -> None:
    chaos = job({"w0": "a", "s2": "a"}, ["w0", "s2"], KILLS)

    r = summarize(CLEAN, chaos, STEPS, PLAN, 3)

    assert ok(r)
    assert r["interruptions_injected"] == 3 and r["recoveries"] == 3 and r["interruptions_survived"] == 3
    assert r["injected_by_signal"] == {"kill": 3} and r["injected_by_target"] == {"worker/training": 3}
    assert r["stalls"] == 3 and r["reconciled"]
    assert r["lost_time_s_p50"] == pytest.approx(0.17)
    assert r["lost_time_s_p99"] == pytest.approx(0.17 + 0.98 * (0.35 - 0.17))
    assert r["recovery_s_p50"] == pytest.approx(0.30)
    assert r["recovery_plus_penalty_s_p50"] == pytest.approx(0.35)
    assert r["lost_time_whole_run_per_interruption_s"] == pytest.approx(
        (training(chaos) - training(CLEAN)) / 3)
    text = format_report({**r, **DONE})
    assert "identical" in text and "MISMATCH" not in text and "p99" in text


def training(run: JobRun) -> float:
    return run.commits[-1].time - 1000.0


def test_a_rank_whose_final_state_differs_is_a_mismatch() -> None:
    chaos = job({"w0": "a", "s2": "b"}, ["w0", "s2"], KILLS)

    r = summarize(CLEAN, chaos, STEPS, PLAN, 3)

    assert not ok(r)
    assert "MISMATCH" in format_report({**r, **DONE})
    assert any("rank 1 (s2)" in p for p in r["state_problems"])


def test_a_failed_job_or_too_few_injections_fails_the_soak() -> None:
    failed = job({"w0": "a", "s2": "a"}, ["w0", "s2"], KILLS, exit_code=1)
    r = summarize(CLEAN, failed, STEPS, PLAN, 3)
    assert not ok(r) and "FAILED" in format_report({**r, **DONE})
    short = job({"w0": "a", "s2": "a"}, ["w0", "s2"], KILLS)
    r = summarize(CLEAN, short, STEPS, chaos_plan(100, 1.5, 1), 100)
    assert not ok(r) and "SHORT" in format_report({**r, **DONE})


def test_an_injection_the_events_do_not_answer_fails_the_soak() -> None:
    ghost = {"event": "chaos_injected", "proc": "s9", "pid": 99, "role": "standby", "state": "standby_warm",
             "signal": "stop", "time": 1003.0}
    chaos = job({"w0": "a", "s2": "a"}, ["w0", "s2"], KILLS, extra_events=[ghost])

    r = summarize(CLEAN, chaos, STEPS, PLAN, 3)

    assert r["unaccounted_injections"] == unaccounted(chaos.events) and len(r["unaccounted_injections"]) == 1
    assert not ok(r) and "UNACCOUNTED" in format_report({**r, **DONE})
    lost = {**ghost, "event": "standby_lost"}
    assert unaccounted([ghost, lost]) == []


def test_percentiles_the_plan_and_commit_logs() -> None:
    assert percentile([], 50) is None
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert percentile(list(map(float, range(101))), 99) == pytest.approx(99.0)
    assert chaos_plan(100, 1.5, 1) == "seed=1,every_s=1.5,max=100,signals=kill,targets=worker,covered=1"
    assert chaos_plan(5, 2.0, 3, ("kill", "stop"), ("worker", "standby")).endswith(
        "signals=kill|stop,targets=worker|standby,covered=1")
    # A member killed mid-write leaves a torn last line, which is skipped.
    assert parse_commit_log("1 0 100.5 0.2\n2 0 100.7 0.2\n3 0 10") == (
        Commit(1, 0, 100.5, 0.2), Commit(2, 0, 100.7, 0.2))
    assert parse_commit_log("1 0 100.5\n") == (Commit(1, 0, 100.5),), "a log without step durations (older writers)"


def test_a_stall_is_measured_against_the_steps_around_it_not_the_whole_soak() -> None:
    # Steps of 0.1 s around the stall, 0.3 s later on (replacements starting up on the same cores): the job's
    # median step is 0.3 s, but the stall cost 0.5 - 0.1 s.
    times, t = [], 100.0
    for step in range(1, 61):
        t += 0.5 if step == 10 else (0.1 if step <= 20 else 0.3)
        times.append(Commit(step, 0 if step < 10 else 1, t))
    events = [{"event": "member_failed", "proc": "w1", "generation": 0, "failure_at": times[8].time + 0.05,
               "declared_at": times[8].time + 0.06}]

    (stall,) = interruptions({"w0": tuple(times)}, events, steady_step_of({"w0": tuple(times)}))

    assert steady_step_of({"w0": tuple(times)}) == pytest.approx(0.3)
    assert stall.step_s == pytest.approx(0.1)
    assert stall.lost_time_s == pytest.approx(0.4)
    assert stall.redone_s == pytest.approx(0.05) and stall.deaths == ("w1",)
