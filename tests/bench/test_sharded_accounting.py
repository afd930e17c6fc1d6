"""The sharded benchmark's accounting on made-up timelines of rank 0's commits: no process is started."""

from __future__ import annotations

from typing import Any

import pytest

from bench.sharded import AFTER, Run, kill_losses, kill_plan, own_steady_step_s

STEP_S = 1.0


def _recovered(gen: int, step: int, moved: int) -> dict[str, Any]:
    return {"event": "recovered", "generation": gen, "step": step, "handoff_bytes": moved, "sources": [3],
            "detect_s": 0.1, "reconfigure_s": 0.1, "handoff_s": 0.2, "replay_s": 1.0, "recovery_s": 1.5}


def test_kills_spare_rank_0_whose_commits_are_the_timeline() -> None:
    plan, steps = kill_plan(5, spacing=10)
    assert [r for r, _ in plan] == [1, 2, 3, 1, 2] and [s for _, s in plan] == [10, 20, 30, 40, 50]
    assert steps == 60


def test_a_kill_replayed_from_its_replica_costs_the_pause_beyond_the_steps_it_would_have_taken() -> None:
    # Steps 1-4 commit every second; the victim dies in step 5; step 5 commits 2.5 s after step 4, then steady.
    commits = [(s, 0, float(s), STEP_S) for s in range(1, 5)]
    commits += [(5, 1, 6.5, 1.2)] + [(s, 1, 6.5 + s - 5, STEP_S) for s in range(6, 10)]
    run = Run(20.0, [_recovered(1, 5, 2_000_000)], commits, {}, "d")
    (kill,) = kill_losses(run, [(1, 5)], STEP_S, bandwidth=1e9)
    assert kill["lost_time_s"] == pytest.approx((6.5 + AFTER) - 4.0 - (AFTER + 1) * STEP_S)
    assert kill["replayed_steps"] == 0
    assert kill["floor_s"] == pytest.approx(0.002 + STEP_S) and not kill["invalid"]


def test_a_restore_from_an_older_buddy_copy_counts_the_steps_replayed_in_its_floor() -> None:
    # Copy at step 10; the kill hits step 14: rank 0 commits 11-13 again in generation 1 before step 14.
    commits = [(s, 0, float(s), STEP_S) for s in range(1, 14)]
    commits += [(s, 1, 14.0 + (s - 10), STEP_S) for s in range(11, 20)]
    run = Run(30.0, [_recovered(1, 14, 1_000_000)], commits, {}, "d")
    (kill,) = kill_losses(run, [(2, 14)], STEP_S, bandwidth=1e9)
    assert kill["replayed_steps"] == 3
    assert kill["floor_s"] == pytest.approx(0.001 + 4 * STEP_S)
    assert kill["lost_time_s"] == pytest.approx((14.0 + 7) - 13.0 - (AFTER + 1) * STEP_S)
    assert kill["invalid"] == (kill["lost_time_s"] < kill["floor_s"])


def test_a_kill_the_commits_do_not_bracket_is_an_error() -> None:
    run = Run(10.0, [_recovered(1, 5, 0)], [(s, 0, float(s), STEP_S) for s in range(1, 5)], {}, "d")
    with pytest.raises(RuntimeError, match="do not bracket the kill at step 5"):
        kill_losses(run, [(1, 5)], STEP_S, bandwidth=1e9)


def test_the_steady_step_is_the_killed_runs_own_away_from_its_kills() -> None:
    # 0.8 s steps, except the recovery around the kill at step 10 (slow, and step 10 committed twice).
    commits = [(s, 0, float(s), 0.8) for s in range(1, 10)]
    commits += [(10, 0, 10.0, 0.9), (10, 1, 12.0, 1.5)] + [(s, 1, 12.0 + s - 10, 1.1 if s < 14 else 0.8)
                                                           for s in range(11, 20)]
    run = Run(30.0, [_recovered(1, 10, 0)], commits, {}, "d")
    assert own_steady_step_s(run, [(1, 10)]) == pytest.approx(0.8)
