"""The job's events as typed, versioned records (`runtime.wire.event_records`): what the event log writes, and what a
reader makes of lines of this version, of the version before, of a kind it does not know and of a broken one."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from runtime.wire.event_records import (
    EVENT_TYPES,
    EVENT_VERSION,
    AgentRefused,
    BackupWritten,
    ChaosInjected,
    ChaosUnresolved,
    ControlRejected,
    CoordinatorTookOver,
    Coverage,
    Event,
    EventError,
    GenerationStarted,
    Grew,
    HostJoined,
    HostLost,
    HostNoticed,
    JobFailed,
    JobFinished,
    JobStarted,
    MemberFailed,
    MoveAccepted,
    Moved,
    Placed,
    Recovered,
    RestoringFromBackup,
    Shrunk,
    StandbyLost,
    StandbyReleased,
    StandbySpawned,
    StandbyTargetChanged,
    StandbyWarm,
    UnknownEvent,
    UntrustedValue,
    WidthTargetChanged,
    parse_event,
)
from runtime.wire.events import EventLog, read_events, read_records

ONE_OF_EACH: list[Event] = [
    JobStarted(job_id="j", nproc=2, standby=1, port=29500, helpers={"zygote": 42}, agent_port=29600,
               hosts=[{"host": "h", "incarnation": "i", "slots": 4, "address": "127.0.0.1"}]),
    GenerationStarted(generation=1, reason="w1 killed by SIGKILL", world_size=2,
                      members=[{"rank": 0, "proc": "w0", "pid": 10}, {"rank": 1, "proc": "s0", "pid": 12}],
                      replaced=[{"rank": 1, "old": "w1", "new": "s0"}]),
    JobFinished(wall_s=3.5, generation=1, digests={"w0": "ab"}, step=20, final_digest="ab",
                refused_values={"proc/w#/hello": 1}),
    JobFailed(wall_s=1.0, reason="no standby", exit_code=1),
    MemberFailed(generation=0, rank=1, proc="w1", pid=11, cause="killed by SIGKILL", step=None, failure_at=1.0,
                 declared_at=1.01, detect_s=0.01),
    Recovered(generation=1, step=8, ranks=[{"rank": 1, "old": "w1", "new": "s0"}], causes=["killed by SIGKILL"],
              recovery_s=0.4, handoff_bytes=1000, sources=[0], detect_s=0.01, reconfigure_s=0.1, handoff_s=0.2,
              replay_s=0.05, warmup_penalty_s=0.01, reconfigure_split={"teardown_s": 0.01}, generations=2,
              failed_attempts=[{"generation": 1, "failed": "s1 killed"}], refetched_chunks=1),
    StandbySpawned(proc="s1", reason="replace a promoted standby"),
    StandbyWarm(proc="s0", pid=12, warmup_s=0.5, ready_after_s=None),
    StandbyLost(proc="s1", pid=13, cause="killed by SIGKILL", was_ready=False, failure_at=2.0, declared_at=2.1,
                detect_s=0.1),
    StandbyReleased(proc="s2", pid=14, was_ready=True, reason="the standby target is 1"),
    Coverage(covered=False, warm=0, warming=1, target=1),
    StandbyTargetChanged(old=1, new=3),
    MoveAccepted(seq=3, ranks=[1], procs=["w1"], reason="maintenance"),
    ControlRejected(control="move", reason="no standby ready", seq=4, ranks=[1]),
    UntrustedValue(key="proc/w0/hello", key_kind="proc/w#/hello", reason="not signed with the job's secret"),
    ChaosInjected(proc="w1", pid=11, signal="kill", role="worker", state="training", rank=1, generation=0, n=1),
    ChaosUnresolved(proc="s1", pid=13, reason="the job ended before the fault was detected"),
    Placed(proc="w0", role="worker", host="h", incarnation="i", slot=0, pid=10),
    HostJoined(host="h", incarnation="i", slots=4, address="127.0.0.1"),
    HostLost(host="h", incarnation="i", cause="no heartbeat for 3.0 s", procs=["w1"], failure_at=4.0),
    HostNoticed(host="h", incarnation="i", notice="spot_interruption", deadline_at=10.0, detail="", procs=["w1"]),
    AgentRefused(peer="10.0.0.9:4242", reason="its frames are not sealed with the job's secret"),
    CoordinatorTookOver(epoch=2, previous="vm/41/a1b2c3", generation=1, stale_s=2.04, adopted=["s0", "w0"],
                        missing=["w1"], adopt_s=0.09),
    BackupWritten(step=8, path="/backups/step-000000008", bytes=1 << 20, stage_s=0.004, write_s=0.05),
    RestoringFromBackup(generation=1, backup_step=8, path="/backups/step-000000008", committed_step=9,
                        steps_redone=1),
    Shrunk(generation=2, width_from=4, width_to=3, logical_width=4, ranks=[{"rank": 1, "proc": "w1"}],
           cause="w1 killed by SIGKILL: no standby ready within the standby wait", planned=False,
           mode="accumulate", lost_s=0.4),
    Grew(generation=3, width_from=3, width_to=4, logical_width=4, procs=["s1"], cause="a standby is ready",
         stall_s=0.05, handoff_bytes=1 << 20, first_step_s=0.09, steady_step_s=0.08),
    WidthTargetChanged(old=4, new=2, reason="free capacity", seq=3),
    Moved(generation=4, ranks=[{"rank": 1, "old": "w1", "new": "s2"}], reason="spot_interruption", stall_s=0.09,
          handoff_bytes=1 << 20, group_s=0.04, handoff_s=0.04),
]


def test_every_kind_has_one_record_and_reads_back_from_its_json_line(tmp_path: Path) -> None:
    assert {type(e) for e in ONE_OF_EACH} == set(EVENT_TYPES.values()), "one sample of every kind"
    log = EventLog(tmp_path / "events.jsonl")
    for event in ONE_OF_EACH:
        assert log.emit(event) is event
    log.close()
    lines = read_events(tmp_path / "events.jsonl")
    assert [line["event"] for line in lines] == [e.kind for e in ONE_OF_EACH]
    assert all(line["version"] == EVENT_VERSION == 2 and isinstance(line["time"], float) for line in lines)
    assert read_records(tmp_path / "events.jsonl") == ONE_OF_EACH
    assert log.of_type(MemberFailed) == [ONE_OF_EACH[4]]


def test_fields_only_some_writers_fill_in_are_absent_when_unset_and_every_other_is_written() -> None:
    moved = MoveAccepted(seq=None, ranks=[0], procs=["w0"], reason="spot_interruption", host="h")
    assert moved.to_dict()["host"] == "h" and moved.to_dict()["seq"] is None
    line = ControlRejected(control="standby_target", reason="standby target 65 is outside 0..64", value="65")
    assert {k for k in line.to_dict() if k not in ("event", "version", "time")} == {"control", "reason", "value"}
    failed = ONE_OF_EACH[4].to_dict()
    assert failed["step"] is None, "a declared field is written even when it is None"


def test_a_line_of_the_version_before_reads_as_version_1() -> None:
    old = {"event": "standby_target_changed", "time": 12.5, "old": 1, "new": 2}  # written before lines had one
    assert parse_event(old) == StandbyTargetChanged(old=1, new=2, time=12.5, version=1)
    recovered = {k: v for k, v in ONE_OF_EACH[5].to_dict().items()
                 if k not in ("version", "tier", "generations", "failed_attempts", "refetched_chunks")}
    read = parse_event(recovered)
    assert isinstance(read, Recovered) and read.version == 1 and read.generations == 1 and read.tier == "warm"


def test_an_unknown_kind_and_unknown_fields_read_tolerantly() -> None:
    line = {"event": "checkpoint_written", "version": 3, "time": 1.0, "step": 40, "path": "/ckpt/40"}
    read = parse_event(line)
    assert isinstance(read, UnknownEvent) and read.kind == "checkpoint_written" and read.version == 3
    assert read.to_dict() == line, "kept as written"
    newer = {**StandbyTargetChanged(old=1, new=2, time=3.0).to_dict(), "version": 3, "by": "policy"}
    assert parse_event(newer) == StandbyTargetChanged(old=1, new=2, time=3.0, version=3), "extra fields ignored"


@pytest.mark.parametrize(("line", "says"), [
    ({"event": "member_failed", "time": 1.0, "rank": 1}, "member_failed: missing field 'generation'"),
    ({"event": "standby_target_changed", "old": "1", "new": 2}, "field 'old' must be int"),
    ({"event": "standby_target_changed", "old": True, "new": 2}, "field 'old' must be int"),
    ({"event": "recovered", **{k: v for k, v in ONE_OF_EACH[5].to_dict().items() if k != "event"},
      "sources": ["0"]}, r"field 'sources' must be list\[int\]"),
    ({"time": 1.0}, "needs its kind"),
    (["generation"], "must be a JSON object"),
    ({"event": "job_failed", "time": "late"}, "time must be a number"),
])
def test_a_broken_line_is_one_clear_error(line: object, says: str) -> None:
    with pytest.raises(EventError, match=says):
        parse_event(line)


def test_reading_a_broken_file_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text(json.dumps(ONE_OF_EACH[0].to_dict()) + "\n\n" + '{"event": "standby_target_changed"}\n')
    with pytest.raises(EventError, match=r"events.jsonl, line 3: standby_target_changed: missing field 'old'"):
        read_records(path)


def test_records_are_frozen_and_matched_by_type() -> None:
    event = ONE_OF_EACH[5]
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.step = 9  # type: ignore[misc]
    match event:
        case Recovered(step=step, ranks=[{"rank": rank}]):
            assert (step, rank) == (8, 1)
        case _:
            pytest.fail("a Recovered record matches its class pattern")
