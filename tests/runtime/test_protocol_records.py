"""The store records of runtime.wire.protocol: every one round-trips, anything else is refused with a clear error."""

from __future__ import annotations

import datetime
import subprocess
import sys

import pytest
import torch.distributed as dist

from runtime.wire import store as keys
from runtime.wire.auth import Sealer
from runtime.wire.protocol import (
    RECORD_VERSION,
    RECORDS,
    Assignment,
    ChaosDone,
    ControlCommand,
    CurrentGeneration,
    FailureReport,
    FatalError,
    FaultFired,
    FinalDigest,
    Finished,
    Generation,
    Heartbeat,
    HoldsState,
    HotClaim,
    HotHeld,
    JobConfig,
    JobOver,
    Joined,
    ModelSpec,
    MoveResult,
    ProcessHello,
    Progress,
    RecordError,
    RecoveryReport,
    StandbyReady,
    StepStatus,
    StopOrder,
    StoreRecord,
    TlsAddress,
)

TOKEN = "r" * 64

SAMPLES: list[StoreRecord] = [
    JobConfig(4, "job-1"),
    Generation(2, ("w0", "s0", "w2"), "w1 killed by SIGKILL", ((1, "w1", "s0"),)),
    CurrentGeneration(2),
    Assignment(-1),
    StopOrder("training completed"),
    JobOver(1),
    ChaosDone(7),
    ControlCommand(3, '{"seq": 3, "ranks": [1], "reason": "spot"}'),
    MoveResult(3, False, "no standby ready"),
    ProcessHello(4242, "standby"),
    Heartbeat(17),
    Progress(120),
    FatalError("Traceback ...\nValueError: bad"),
    FaultFired(12.5, "w1", "kill", 4242, 1, 10, "exchange"),
    ModelSpec([["weight", [4, 4], "float32"], ["optimizer.param_groups.0", [2], "params"]]),
    StandbyReady(0.25),
    Joined(),
    StepStatus(10, True),
    HoldsState(10),
    FailureReport("peer lost", 12.0, 10, "comm", 2),
    RecoveryReport(rank=1, role="receiver", group_ready_at=1.0, handoff_s=0.5, handoff_bytes=1024,
                   handoff_end_at=1.6, replay_step=11, proc="s0", replay_done_at=1.9, post_steps_s=[0.1, 0.2],
                   final=True),
    Finished(20),
    FinalDigest("ab" * 16),
    TlsAddress("10.0.0.2", 40123),
    HotClaim("s0", "10.0.0.3", 40124),
    HotHeld(41),
]


def test_every_record_has_a_sample_and_round_trips_through_json() -> None:
    assert {type(r) for r in SAMPLES} == set(RECORDS)
    for record in SAMPLES:
        raw = record.to_json()
        if not record.BARE:
            assert raw["v"] == RECORD_VERSION
        assert type(record).from_json(raw) == record, type(record).__name__


def test_a_record_without_a_version_is_read_as_version_1_with_the_same_fields() -> None:
    # What runtime/training/job.py, runtime/faults.py and the simulated hosts of bench/scale.py write by hand.
    assert ProcessHello.from_json({"pid": 7, "role": "worker"}) == ProcessHello(7, "worker")
    assert FatalError.from_json({"message": "x"}) == FatalError("x")
    assert StandbyReady.from_json({"warmup_s": 0}) == StandbyReady(0.0)
    fault = {"time": 1.5, "proc": "w1", "pid": 3, "rank": 1, "step": 4, "phase": "exchange", "action": "kill"}
    assert FaultFired.from_json(fault).step == 4
    assert RecoveryReport.from_json({"rank": 0, "role": "source", "group_ready_at": 1, "handoff_end_at": 2,
                                     "handoff_s": 0.0, "handoff_bytes": 0, "replay_step": 1, "replay_done_at": 2,
                                     "final": True}).final


@pytest.mark.parametrize(("kind", "raw", "why"), [
    (FailureReport, {"v": 3, "message": "x", "time": 1, "step": 1}, "record version 3, this side reads [1, 2]"),
    (FailureReport, {"v": 2, "message": "x", "step": 1}, "missing field 'time'"),
    (FailureReport, {"v": 2, "message": "x", "time": 1, "step": 1, "untrusted_rank": "1"}, "'untrusted_rank' must be"),
    (FailureReport, {"v": 2, "message": "x", "time": 1, "step": 1, "kind": "other"}, "'kind' must be"),
    (StepStatus, {"v": 2, "step": True, "has_state": True}, "'step' must be int"),
    (StepStatus, {"v": 2, "step": 1, "has_state": 1}, "'has_state' must be bool"),
    (Generation, {"v": 2, "gen": 1, "members": ["w0", 3]}, "'members' must be"),
    (Generation, {"v": 2, "gen": 1, "members": ["w0"], "replaced": [[0, "w0"]]}, "'replaced' must be"),
    (Finished, 20, "must be a JSON object, got int"),
    (Heartbeat, {"count": 3}, "must be a bare int, got dict"),
    (Heartbeat, True, "must be a bare int, got bool"),
    (RecoveryReport, {"v": 2, "rank": 0, "role": "source", "group_ready_at": 1, "handoff_end_at": 2,
                      "handoff_s": 0.0, "handoff_bytes": 0, "replay_step": 1, "post_steps_s": [0.1, "x"]},
     "'post_steps_s' must be"),
])
def test_a_value_that_is_not_the_record_is_refused_saying_why(kind: type[StoreRecord], raw: object, why: str) -> None:
    with pytest.raises(RecordError, match=kind.__name__) as info:
        kind.from_json(raw)
    assert why in str(info.value)


def test_records_refuse_unsealed_and_malformed_values_once_and_waits_name_the_key() -> None:
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=5), wait_for_workers=False)
    refusals: list[tuple[str, str]] = []
    reader = keys.Records(store, Sealer(TOKEN, "reader", lambda kind, key, why: refusals.append((key, why))))
    writer = keys.Records(store, Sealer(TOKEN, "writer"))
    key = keys.k_status(1, 0)
    writer.put(key, StepStatus(5, True))
    assert reader.get_record(key, StepStatus) == StepStatus(5, True)
    store.set(key, '{"v": 2, "step": 9, "has_state": true}')  # unsealed
    assert reader.get_record(key, StepStatus) is None
    writer.put(key, {"v": 2, "step": "9", "has_state": True})  # sealed, but not a StepStatus
    for _ in range(3):
        assert reader.get_record(key, StepStatus) is None
    assert [why.split(":")[0] for _, why in refusals] == ["not signed with the job's secret",
                                                          "a sealed value that is not a StepStatus record"]
    assert reader.sealer.refused["gen/#/status/#"] == 2, "each bad value counted once however often it is read"
    with pytest.raises(RecordError, match=r"gen/1/status/0: StepStatus: field 'step'"):
        reader.wait_records([key], StepStatus, 1.0)
    writer.put(keys.k_status(1, 1), StepStatus(5, False))
    present = reader.get_present_records([key, keys.k_status(1, 1)], StepStatus)
    assert present == {key: None, keys.k_status(1, 1): StepStatus(5, False)}


def test_the_protocol_module_loads_no_torch() -> None:
    """`trainmover agent` imports runtime.wire.protocol and must not load torch."""
    code = "import sys, runtime.wire.protocol; assert 'torch' not in sys.modules, 'torch loaded'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
