"""The coordinator's pure decisions, in-process: move refusals and a recovery's figures."""

from __future__ import annotations

import dataclasses

import pytest

from runtime.control.decisions import MoveContext, move_refusal, recovery_metrics
from runtime.wire.control import MoveRequest
from runtime.wire.protocol import RecoveryReport

OK = MoveContext(last_seq=3, started=True, finished=False, world=4, recovering=False, ready=2)


@pytest.mark.parametrize(("request_", "change", "why"), [
    (MoveRequest(3, (1,), "spot"), {}, "not newer than 3"),
    (MoveRequest(4, (1,), "spot"), {"started": False}, "not started"),
    (MoveRequest(4, (1,), "spot"), {"finished": True}, "finished"),
    (MoveRequest(4, (4,), "spot"), {}, "not all worker ranks (0..3)"),
    (MoveRequest(4, (0, 1, 2, 3), "spot"), {"ready": 4}, "every rank at once"),
    (MoveRequest(4, (1,), "spot"), {"recovering": True}, "recovery is in progress"),
    (MoveRequest(4, (1,), "spot"), {"ready": 0}, "no standby ready"),
    (MoveRequest(4, (1, 2, 3), "spot"), {}, "only 2 standbys ready for 3 ranks"),
])
def test_a_move_is_refused_with_the_reason(request_: MoveRequest, change: dict[str, object], why: str) -> None:
    refusal = move_refusal(request_, dataclasses.replace(OK, **change))  # type: ignore[arg-type]
    assert refusal is not None and why in refusal


def test_a_move_that_costs_no_restart_is_accepted() -> None:
    assert move_refusal(MoveRequest(4, (1, 2), "maintenance"), OK) is None


def _report(rank: int, role: str, **over: object) -> RecoveryReport:
    base = {"rank": rank, "role": role, "group_ready_at": 10.5, "handoff_end_at": 11.0, "replay_done_at": 11.4,
            "handoff_s": 0.4, "handoff_bytes": 100 if role == "receiver" else 0, "replay_step": 8,
            "post_steps_s": [0.2, 0.2, 0.3], "steady_step_s": 0.2, "teardown_s": 0.1, "joined_at": 10.2,
            "group_init_s": 0.05}
    return RecoveryReport.from_json({**base, **over})


def test_recovery_metrics_run_from_the_earliest_failure_to_the_replayed_commit() -> None:
    # Two deaths (a host with two ranks): failed at 9.9 and 10.0, declared at 10.1 and 10.15.
    m = recovery_metrics([(9.9, 10.1), (10.0, 10.15)],
                         [_report(0, "source"), _report(1, "receiver", replay_done_at=11.6, refetched_chunks=1),
                          _report(2, "receiver", group_ready_at=10.7)])
    assert m["step"] == 8
    assert m["recovery_s"] == pytest.approx(11.6 - 9.9)
    assert m["detect_s"] == pytest.approx(10.1 - 9.9), "from the earliest failure to the first declaration"
    assert m["reconfigure_s"] == pytest.approx(10.7 - 10.15), "from the last declaration to the last group ready"
    assert m["replay_s"] == pytest.approx(11.6 - 11.0)
    assert m["warmup_penalty_s"] == pytest.approx(0.1)
    assert m["handoff_bytes"] == 200 and m["sources"] == [0] and m["refetched_chunks"] == 1
    assert m["reconfigure_split"]["last_joined_after_s"] == pytest.approx(10.2 - 10.15)


def test_a_report_without_a_replay_counts_the_handoff_end() -> None:
    m = recovery_metrics([(1.0, 1.2)], [_report(0, "source", replay_done_at=None, post_steps_s=[])])
    assert m["replay_s"] == 0.0 and m["warmup_penalty_s"] == 0.0
