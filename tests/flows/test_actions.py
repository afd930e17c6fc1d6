"""`flows.actions`: a standby plan turned into cloud actions, case by case (a pure function: no cloud, no job)."""

from __future__ import annotations

import time

import pytest

from cloud.base import Notice
from flows.actions import Pool, PoolChange, notice_moves, pool_change, targets
from flows.models import StandbyLimits
from policy.decision import StandbyPlan


def _plan(warm: int = 0, hot: int = 0, stopped: int = 0) -> StandbyPlan:
    return StandbyPlan(stopped=stopped, warm=warm, hot=hot, cost_usd_per_h=0.0, expected_covered_failures=0.0,
                       reasons=("because",))


LIMITS = StandbyLimits(min_warm=1, max_warm=3, max_hot=1, max_stopped=2)

# (plan warm, hot, stopped), pool (warm, parked, warm target) -> the change expected
CASES = [
    pytest.param((1, 0, 0), ((), (), 1), PoolChange(1, 0), id="held-as-asked-nothing-to-do"),
    pytest.param((0, 0, 0), ((), (), 0), PoolChange(1, 0, launch_warm=1, retarget=True), id="min-warm-enforced"),
    pytest.param((2, 0, 0), (("w1",), (), 1), PoolChange(2, 0, launch_warm=1, retarget=True), id="prewarm-one-more"),
    pytest.param((1, 1, 0), (("w1",), (), 1), PoolChange(2, 0, launch_warm=1, retarget=True), id="hot-runs-warm"),
    pytest.param((9, 0, 0), (("w1",), (), 1), PoolChange(3, 0, launch_warm=2, retarget=True), id="capped-at-max-warm"),
    pytest.param((2, 0, 0), (("w1", "w2"), (), 1), PoolChange(2, 0, retarget=True),
                 id="instance-there-already-only-the-target-rises"),
    pytest.param((0, 0, 0), (("w1", "w2", "w3"), (), 3), PoolChange(1, 0, release_warm=("w3", "w2"), retarget=True),
                 id="release-to-min-warm-newest-first"),
    pytest.param((1, 0, 0), (("w1",), (), 2), PoolChange(1, 0, retarget=True),
                 id="target-lowered-no-instance-to-release"),
    pytest.param((1, 0, 2), (("w1",), ("p1",), 1), PoolChange(1, 2, park=1), id="park-one-more"),
    pytest.param((1, 0, 7), (("w1",), (), 1), PoolChange(1, 2, park=2), id="parked-capped-at-max-stopped"),
    pytest.param((1, 0, 0), (("w1",), ("p1", "p2"), 1), PoolChange(1, 0, release_parked=("p2", "p1")),
                 id="unpark-when-the-risk-no-longer-pays"),
    pytest.param((3, 0, 1), ((), ("p1", "p2"), 0),
                 PoolChange(3, 1, launch_warm=3, release_parked=("p2",), retarget=True), id="both-tiers-at-once"),
]


@pytest.mark.parametrize(("plan", "pool", "expected"), CASES)
def test_pool_change(plan: tuple[int, int, int], pool: tuple[tuple[str, ...], tuple[str, ...], int],
                     expected: PoolChange) -> None:
    assert pool_change(_plan(*plan), LIMITS, Pool(*pool)) == expected


def test_targets_and_empty() -> None:
    assert targets(_plan(warm=0, stopped=5), StandbyLimits(min_warm=0, max_warm=0, max_stopped=4)) == (0, 4)
    assert pool_change(_plan(warm=1), LIMITS, Pool(("w1",), (), 1)).empty
    assert not pool_change(_plan(warm=2), LIMITS, Pool(("w1",), (), 1)).empty


def test_notices_move_only_the_ranks_their_instance_holds() -> None:
    now = time.time()
    notices = [
        Notice("spot_interruption", "i-b", now, "local", now + 120),
        Notice("scheduled_maintenance", "i-standby", now, "local"),
        Notice("rebalance_recommendation", "i-a", now, "local"),
    ]
    moves = notice_moves(notices, {0: "i-a", 1: "i-b"})
    assert [(ranks, n.kind) for ranks, n in moves] == [([1], "spot_interruption"), ([0], "rebalance_recommendation")]
    assert notice_moves(notices, {}) == []
    # A host of several slots moves whole, in one request.
    eight = {r: "i-a" if r < 8 else "i-b" for r in range(16)}
    assert [(ranks, n.instance_id) for ranks, n in notice_moves(notices[:1], eight)] == [(list(range(8, 16)), "i-b")]
