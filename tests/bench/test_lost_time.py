"""Scenarios for the recovery benchmark's accounting, on made-up timelines: no process is started.

A timeline is rank 0's commits with a steady step of 1 s, a failure part-way through a step, the coordinator's
events for it, and slower steps after it; each test states what a kill there must cost.
"""

from __future__ import annotations

from typing import Any

import pytest

from bench.peers.common import spread
from bench.peers.trainmover import AFTER_STEPS, Commit, JobRun, kill_losses, kill_schedule
from bench.recovery import format_report, summarize_trainmover

STEP_S = 1.0


def timeline(
    steps: int, kills: dict[int, tuple[float, float, float]], replay_offset: int = 0
) -> tuple[list[Commit], list[dict[str, Any]]]:
    """Commits and events of a run where, for each kill step k: (done, recovery, penalty).

    The worker dies ``done`` seconds after rank 0's commit of step k-1 (+ replay_offset); the replayed step
    commits ``recovery`` seconds after the failure; the next step is ``penalty`` slower than a steady one.
    """
    commits: list[Commit] = []
    events: list[dict[str, Any]] = []
    t, gen = 100.0, 0
    replay_of = {k + replay_offset: k for k in kills}
    for step in range(1, steps + 1):
        if step in replay_of:
            done, recovery, penalty = kills[replay_of[step]]
            failure = t + done
            gen += 1
            events.append({"event": "member_failed", "proc": f"p{gen}", "failure_at": failure,
                           "step": replay_of[step], "generation": gen - 1})
            events.append({"event": "recovered", "step": step, "generation": gen,
                           "ranks": [{"rank": 1, "old": f"p{gen}", "new": f"s{gen}"}], "recovery_s": recovery,
                           "detect_s": 0.01, "reconfigure_s": 0.02, "handoff_s": 0.3, "replay_s": recovery - 0.33,
                           "warmup_penalty_s": penalty, "handoff_bytes": 1000})
            t = failure + recovery
            commits.append(Commit(step, gen, t))
            t += STEP_S + penalty
            commits.append(Commit(step + 1, gen, t))
            continue
        if commits and commits[-1].step >= step:
            continue
        t += STEP_S
        commits.append(Commit(step, gen, t))
    return commits, events


def test_a_kill_costs_the_redone_part_of_its_step_plus_recovery_beyond_a_step_plus_the_penalty() -> None:
    commits, events = timeline(20, {10: (0.3, 1.5, 0.2)})

    (kill,) = kill_losses(commits, events)

    # Redone 0.3 s of step 10, then 1.5 s from failure to the replayed commit where 0.7 s of step 10 would have
    # run anyway, then 0.2 s of warm-up: 0.3 + 1.5 - 1.0 + 0.2.
    assert kill.lost_time_s == pytest.approx(1.0)
    assert kill.redone_s == pytest.approx(0.3)
    assert kill.step_s == pytest.approx(STEP_S)
    assert kill.replay_step == 10 and kill.kill_step == 10
    assert kill.warmup_penalty_in_run_s == pytest.approx(0.2)
    # recovery_s overstates the loss by the part of the step still to run at the failure (0.7 s), no more.
    assert kill.recovery_bound_s == pytest.approx(0.8)
    assert kill.lost_time_s >= kill.recovery_bound_s


def test_the_recovery_bound_holds_whatever_part_of_the_step_was_done() -> None:
    for done in (0.0, 0.25, 0.5, 0.99):
        commits, events = timeline(20, {10: (done, 0.9, 0.0)})
        (kill,) = kill_losses(commits, events)
        assert kill.lost_time_s == pytest.approx(done + 0.9 - STEP_S)
        assert kill.lost_time_s == pytest.approx(kill.recovery_bound_s)


def test_each_of_several_kills_in_one_run_is_measured_alone() -> None:
    commits, events = timeline(47, {8: (0.2, 1.2, 0.1), 16: (0.5, 1.4, 0.0), 24: (0.1, 2.0, 0.6)})

    kills = kill_losses(commits, events)

    assert [k.replay_step for k in kills] == [8, 16, 24]
    assert [k.lost_time_s for k in kills] == pytest.approx([0.5, 0.9, 1.7])
    # The slow steps inside the other windows never enter a kill's steady step.
    assert all(k.step_s == pytest.approx(STEP_S) for k in kills)


def test_the_window_follows_the_replayed_step_when_the_survivor_committed_the_killed_one() -> None:
    commits, events = timeline(20, {10: (0.4, 1.5, 0.0)}, replay_offset=1)

    (kill,) = kill_losses(commits, events)

    assert kill.kill_step == 10 and kill.replay_step == 11
    assert kill.lost_time_s == pytest.approx(0.4 + 1.5 - STEP_S)


def test_a_kill_below_its_floor_is_invalid() -> None:
    commits, events = timeline(20, {10: (0.3, 1.5, 0.2)})
    (kill,) = kill_losses(commits, events)

    assert not kill.with_floor(0.6).invalid  # floor 0.6 + 0.3 redone = 0.9 < 1.0
    below = kill.with_floor(0.8)  # floor 0.8 + 0.3 = 1.1 > 1.0: impossible, so a disturbed measurement
    assert below.invalid and below.floor_s == pytest.approx(1.1)


def test_with_the_overlap_the_floor_counts_the_model_and_what_the_step_cannot_hide() -> None:
    """The replay waits for the model (the handoff's first phase); the optimizer's state streams beside the step, so
    only what a whole step cannot cover of it counts."""
    commits, events = timeline(20, {10: (0.3, 1.5, 0.2)})
    (kill,) = kill_losses(commits, events)

    assert kill.with_floor(0.8).invalid  # sequential: 0.8 + 0.3 redone = 1.1 > 1.0
    overlapped = kill.with_floor(0.8, first_phase_floor_s=0.2)
    assert overlapped.floor_s == pytest.approx(0.3 + max(0.2, 0.8 - kill.step_s))
    assert not overlapped.invalid
    slow_link = kill.with_floor(0.8 + kill.step_s, first_phase_floor_s=0.2)  # the rest outlasts the step
    assert slow_link.floor_s == pytest.approx(0.3 + 0.8)


def test_the_schedule_leaves_undisturbed_steps_between_kills() -> None:
    steps, total = kill_schedule(5)
    assert len(steps) == 5 and total == steps[-1] + AFTER_STEPS + 4
    with pytest.raises(ValueError, match="undisturbed"):
        kill_schedule(5, spacing=5)


def test_spread_of_nothing_is_none() -> None:
    assert spread([]) == {"median": None, "min": None, "max": None, "n": 0}
    assert spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}


def _run(commits: list[Commit], events: list[dict[str, Any]]) -> JobRun:
    return JobRun(commits=tuple(commits), digest="d", member_digests={"w0": "d", "s1": "d"},
                  runtime_digests={}, state_bytes=10**6, events=events, exit_code=0, message="")


def test_the_report_excludes_invalid_kills_from_the_median_and_counts_them() -> None:
    kill_steps = [8, 16, 24]
    commits, events = timeline(47, {8: (0.2, 1.2, 0.1), 16: (0.5, 1.4, 0.0), 24: (0.1, 0.95, 0.0)})
    clean_commits, _ = timeline(47, {})
    # A handoff floor of 0.1 s: the third kill (0.05 s lost) is below 0.1 + its 0.1 s redone.
    tm = summarize_trainmover([_run(clean_commits, [])], _run(commits, events), kill_steps, 0.1, 1.5)

    assert tm["kills_invalid"] == 1 and tm["kills_valid"] == 2
    assert tm["lost_time_s"] == pytest.approx((0.5 + 0.9) / 2)
    assert tm["bitwise_identical"] and tm["every_member_identical"]

    report = {
        "mode": "quick", "workload": {"parameters": 4_200_000, "workers": 2, "kills_per_system": 3},
        "state_bytes": 10**6, "trainmover": tm, "floor_s": 1.5, "p2p_bandwidth_bytes_per_s": 2e9,
        "checkpoint_restart": {"lost_time_s": 6.0, "lost_time_s_each": [5.0, 6.0, 7.0], "interval_steps": 60,
                               "bitwise_identical": True},
        "torchft": {"available": False}, "overhead": 1.0, "benchmark_wall_s": 100.0,
        "ratios": {"lost_time_vs_checkpoint_restart": 0.1, "lost_time_vs_torchft": None, "lost_time_vs_floor": 0.5},
        "section_wall_s": {"plain": 1.0},
    }
    text = format_report(report)
    assert "1 invalid" in text
    assert "checkpoint-restart" in text and "n/a" in text


def test_steps_after_the_replay_that_look_faster_than_steady_add_no_credit() -> None:
    # A negative warm-up penalty (-0.3 s) is the noise of subtracting estimated steady steps: it is not counted, so
    # the lost time never falls below recovery_s - (step - redone), the coordinator's share.
    commits, events = timeline(20, {10: (0.3, 1.5, -0.3)})

    (kill,) = kill_losses(commits, events)

    assert kill.warmup_penalty_in_run_s == pytest.approx(-0.3)
    assert kill.lost_time_s == pytest.approx(kill.recovery_bound_s) == pytest.approx(0.8)
    assert kill.reconciled and kill.to_json()["reconciled"]


def test_a_victim_that_started_its_step_before_rank_0_committed_the_last_one() -> None:
    # The failure comes 0.05 s before rank 0's commit of step 9: redone is negative, the identity still holds and
    # the floor counts no redone work.
    commits, events = timeline(20, {10: (-0.05, 0.6, 0.0)})

    (kill,) = kill_losses(commits, events)

    assert kill.redone_s == pytest.approx(-0.05)
    assert kill.lost_time_s == pytest.approx(0.6 - (STEP_S + 0.05))
    assert kill.with_floor(0.5).floor_s == pytest.approx(0.5)
    assert kill.with_floor(0.5).invalid == (kill.lost_time_s < 0.5)


def test_the_report_lists_every_kill_with_its_verdict() -> None:
    commits, events = timeline(47, {8: (0.2, 1.2, 0.1), 16: (0.5, 1.4, 0.0), 24: (0.1, 0.95, 0.0)})
    clean_commits, _ = timeline(47, {})
    tm = summarize_trainmover([_run(clean_commits, [])], _run(commits, events), [8, 16, 24], 0.1, 1.5)

    assert tm["reconciled"] and tm["kills_reconciled"] == 3
    report = {
        "mode": "quick", "workload": {"parameters": 4_200_000, "workers": 2, "kills_per_system": 3},
        "state_bytes": 10**6, "trainmover": tm, "floor_s": 1.5, "p2p_bandwidth_bytes_per_s": 2e9,
        "checkpoint_restart": {}, "torchft": {}, "overhead": 1.0, "benchmark_wall_s": 100.0,
        "ratios": {"lost_time_vs_floor": 0.5}, "section_wall_s": {},
    }
    lines = format_report(report).splitlines()
    assert sum("INVALID" in line for line in lines) == 1
    assert sum(line.rstrip().endswith("valid") and "INVALID" not in line for line in lines) == 2
