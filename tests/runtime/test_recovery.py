"""Scenarios: real worker processes lose a peer to a real signal; a standby takes the rank; the final state
equals, bit for bit, that of an uninterrupted run with the same seed and world size."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from runtime.wire.event_records import GenerationStarted, JobFailed, MemberFailed, Recovered
from tests.runtime.conftest import events_of, run_job

pytestmark = pytest.mark.slow

Reference = Callable[[int, int], str]


def assert_recovered_exactly(result, reference: str, nproc: int) -> None:  # type: ignore[no-untyped-def]
    assert result.exit_code == 0, result.message
    assert len(result.digests) == nproc
    assert set(result.digests.values()) == {reference}, "final state differs from the uninterrupted run"


# One kill at each point of a step, in one job: each lands on whichever process holds the rank by then (a worker
# or a standby promoted by an earlier kill), and each must be recovered on its own, bit-exactly in the end.
PHASE_KILLS = [(1, "before_exchange"), (1, "exchange"), (0, "exchange"), (1, "after_exchange"), (0, "optimizer")]
PHASE_KILL_STEPS = [3, 6, 9, 12, 15]


@pytest.mark.untimed
def test_a_worker_killed_at_each_point_of_a_step_is_replaced_bit_exactly(reference_digest: Reference) -> None:
    faults = ";".join(f"kill:rank={rank},step={step},phase={phase}"
                      for (rank, phase), step in zip(PHASE_KILLS, PHASE_KILL_STEPS, strict=True))
    result = run_job(nproc=2, standby=2, steps=20, faults=faults)

    assert_recovered_exactly(result, reference_digest(2, 20), nproc=2)
    failed = events_of(result, MemberFailed)
    assert [(e.rank, e.cause) for e in failed] == [(rank, "killed by SIGKILL") for rank, _ in PHASE_KILLS]
    recovered = events_of(result, Recovered)
    assert len(recovered) == len(PHASE_KILLS), "each kill is a recovery of its own"
    holder = {0: "w0", 1: "w1"}
    for (rank, phase), e, rec in zip(PHASE_KILLS, failed, recovered, strict=True):
        assert e.proc == holder[rank], f"the kill at {phase} hit the process holding rank {rank}"
        (moved,) = rec.ranks
        assert moved["rank"] == rank and moved["old"] == holder[rank] and moved["new"].startswith("s"), (phase, rec)
        # Bounds, not timings: each part lies within the recovery, and the recovery within its timeout.
        assert 0.0 < rec.recovery_s < 60.0, (phase, rec.recovery_s)
        for key in ("detect_s", "reconfigure_s", "handoff_s", "replay_s"):
            assert 0.0 <= getattr(rec, key) <= rec.recovery_s, (phase, key, getattr(rec, key), rec.recovery_s)
        assert 0.0 <= rec.warmup_penalty_s < 60.0, (phase, rec.warmup_penalty_s)  # measured after the recovery
        assert rec.handoff_bytes > 0, phase
        assert rec.generations == 1, phase
        holder[rank] = moved["new"]
    assert set(result.digests) == set(holder.values()), "the standbys that took the ranks hold them at the end"


@pytest.mark.untimed
def test_sender_killed_mid_handoff_another_replica_serves(reference_digest: Reference) -> None:
    result = run_job(nproc=3, standby=2, steps=20,
                     faults="kill:rank=1,step=8,phase=exchange;kill:role=sender,phase=handoff_send,chunk=2")

    assert_recovered_exactly(result, reference_digest(3, 20), nproc=3)
    dead = {e.proc for e in events_of(result, MemberFailed)}
    assert dead == {"w1", "w0"} or dead == {"w1", "w2"}, dead
    assert len(events_of(result, GenerationStarted)) == 3
    # One recovery that took two generations: timed from the first kill to the step that committed.
    (recovered,) = events_of(result, Recovered)
    assert recovered.generations == 2 and recovered.generation == 2
    assert [a["generation"] for a in recovered.failed_attempts] == [1]
    assert "killed by SIGKILL" in recovered.failed_attempts[0]["failed"]
    first_kill = min(e.failure_at for e in events_of(result, MemberFailed))
    assert recovered.recovery_s >= max(e.declared_at for e in events_of(result, MemberFailed)) - first_kill
    lost = sorted(e.rank for e in events_of(result, MemberFailed))
    assert sorted(r["rank"] for r in recovered.ranks) == lost


@pytest.mark.untimed
@pytest.mark.parametrize("overlap", [True, False])
def test_a_source_killed_while_the_optimizer_state_streams_beside_the_replay(reference_digest: Reference,
                                                                            overlap: bool) -> None:
    """The tiny model is 4 tensors and AdamW's state 12, one chunk each, shared by two sources: a source's third
    chunk is Adam's, sent (with the overlap) while the new member already runs the replayed step on the model it
    received. The source dies there; the new member's optimizer step never runs on half a state: the recovery goes
    on in a new generation, bit-exact. Without the overlap the same chunk is sent before the replay starts."""
    result = run_job(nproc=3, standby=2, steps=20, handoff_overlap=overlap,
                     faults="kill:rank=1,step=8,phase=exchange;kill:role=sender,phase=handoff_send,chunk=3")

    assert_recovered_exactly(result, reference_digest(3, 20), nproc=3)
    (recovered,) = events_of(result, Recovered)
    assert recovered.generations == 2 and len(events_of(result, MemberFailed)) == 2
    assert (recovered.handoff_overlapped_s > 0) == overlap


@pytest.mark.untimed
def test_a_chunk_corrupted_on_the_way_is_refused_and_fetched_again_from_the_other_source(
    reference_digest: Reference,
) -> None:
    result = run_job(nproc=3, standby=1, steps=20, chunk_bytes=4096,
                     faults="kill:rank=1,step=8,phase=exchange;corrupt:role=sender,phase=handoff_send,chunk=2")

    assert_recovered_exactly(result, reference_digest(3, 20), nproc=3)
    (recovered,) = events_of(result, Recovered)
    assert recovered.refetched_chunks == 1 and recovered.generations == 1
    assert len(events_of(result, GenerationStarted)) == 2, "repaired within the handoff, no new generation"


@pytest.mark.untimed
def test_the_state_travels_over_mutual_tls_when_asked_and_the_run_stays_bit_exact(reference_digest: Reference) -> None:
    result = run_job(nproc=3, standby=1, steps=20, handoff_transport="tls", chunk_bytes=4096,
                     faults="kill:rank=2,step=8,phase=exchange;corrupt:role=sender,phase=handoff_send,chunk=3")

    assert_recovered_exactly(result, reference_digest(3, 20), nproc=3)
    (recovered,) = events_of(result, Recovered)
    # Sources are the survivors at the newest committed step. Rank 2 dies inside step 8's all-reduce, which one
    # survivor may have finished and the other not (seen under load): then only that one serves, the other
    # receives with the standby, and the corrupted chunk is fetched again from the same source.
    assert recovered.handoff_bytes > 0 and recovered.sources in ([0, 1], [0], [1])
    assert recovered.refetched_chunks == 1, "the MAC and the refetch work over TLS too"


@pytest.mark.untimed
def test_standby_killed_while_taking_over_the_next_standby_serves(reference_digest: Reference) -> None:
    result = run_job(nproc=2, standby=2, steps=20,
                     faults="kill:rank=1,step=8,phase=exchange;kill:role=receiver,phase=handoff_recv")

    assert_recovered_exactly(result, reference_digest(2, 20), nproc=2)
    first, second = (e.proc for e in events_of(result, MemberFailed))
    assert first == "w1" and second in {"s0", "s1"}, "the promoted standby is the one killed while receiving"
    assert set(result.digests) == {"w0", ({"s0", "s1"} - {second}).pop()}


@pytest.mark.untimed
def test_two_workers_killed_at_once_two_standbys_take_both_ranks(reference_digest: Reference) -> None:
    result = run_job(nproc=3, standby=2, steps=20,
                     faults="kill:rank=1,step=8,phase=exchange;kill:rank=2,step=8,phase=exchange")

    assert_recovered_exactly(result, reference_digest(3, 20), nproc=3)
    assert sorted(e.rank for e in events_of(result, MemberFailed)) == [1, 2]
    assert set(result.digests) == {"w0", "s0", "s1"}
    recovered = events_of(result, Recovered)
    assert sorted(r["rank"] for e in recovered for r in e.ranks) == [1, 2]


def test_hung_worker_is_detected_by_heartbeat_fenced_and_replaced(reference_digest: Reference) -> None:
    result = run_job(nproc=2, standby=1, steps=20, faults="stop:rank=1,step=9,phase=before_exchange",
                     hang_timeout_s=1.5)

    assert_recovered_exactly(result, reference_digest(2, 20), nproc=2)
    (failed,) = events_of(result, MemberFailed)
    assert failed.proc == "w1" and failed.cause.startswith("hung")
    # Declared hung 1.5 s after its last heartbeat, which may precede the stop by up to one heartbeat (0.25 s).
    assert 1.5 - 0.25 <= failed.detect_s < 10.0


def test_without_a_standby_the_job_waits_then_stops_with_a_clear_message() -> None:
    result = run_job(nproc=2, standby=0, steps=20, faults="kill:rank=1,step=5,phase=exchange", standby_wait_s=1.0,
                     replenish=False, shrink="off")

    assert result.exit_code == 1
    assert "no standby became ready within 1 s" in result.message
    assert "--standby" in result.message and "--shrink accumulate" in result.message
    assert events_of(result, JobFailed)


def test_a_bug_in_the_training_script_stops_the_job_instead_of_burning_standbys() -> None:
    result = run_job(nproc=2, standby=1, steps=20, script_args=("--raise-at", "6"))

    assert result.exit_code == 1
    assert "a bug in the training script at step 6" in result.message
    assert not events_of(result, Recovered)
