"""Scenarios: an orchestrator in another process steers a running job through `runtime.wire.control.JobControl`.

Each job is the real `trainmover run` command with real worker and standby processes; the test plays the
orchestrator. Nothing waits on a sleep: every wait polls the events file (or the store) against a deadline.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from runtime.wire.auth import ENV_SECRET
from runtime.wire.control import JobControl, JobNotFound
from tests.runtime.conftest import TINY_JOB
from tests.stack_dumps import assert_no_stack_dump

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STEPS = 300  # one clean reference run of this length serves test_cli's, test_outsider's and these scenarios
PACE_MS = 25  # with it, a job of STEPS lasts 7.5 s or more on any machine (a sleep: no CPU, numbers unchanged)
SHORT = 100  # for scenarios that steer the job as soon as its generation 0 is published
SECRET = "0123456789abcdef" * 4  # the job's and the orchestrator's: JobControl signs commands with it
Event = dict[str, Any]


class Job:
    """A `trainmover run` subprocess and its events file."""

    def __init__(self, tmp_path: Path, *args: str, steps: int = STEPS, pace_ms: float = 0.0) -> None:
        self.events_path = tmp_path / "events.jsonl"
        self.fast = tmp_path / "full-speed"
        """Created by `full_speed`: no process paces its steps from then on."""
        pace = ("--pace-ms", str(pace_ms), "--full-speed-file", str(self.fast)) if pace_ms else ()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trainmover", "run", "--nproc", "2", "--threads", "1", "--quiet",
             "--events", str(self.events_path), *args, str(TINY_JOB), "--steps", str(steps), *pace],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, ENV_SECRET: SECRET},
        )
        self.stderr = ""

    def events(self, kind: str | None = None) -> list[Event]:
        if not self.events_path.exists():
            return []
        records = [json.loads(line) for line in self.events_path.read_text().splitlines() if line.strip()]
        return [e for e in records if kind is None or e["event"] == kind]

    def wait_for(self, kind: str, count: int = 1, timeout_s: float = 120.0,
                 where: Callable[[Event], bool] = lambda e: True) -> list[Event]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = [e for e in self.events(kind) if where(e)]
            if len(found) >= count:
                return found
            assert self.proc.poll() is None, f"the job ended before {count} {kind} event(s): {self.events()}"
            time.sleep(0.05)
        raise AssertionError(f"fewer than {count} {kind} event(s) within {timeout_s} s: {self.events()}")

    def full_speed(self) -> None:
        """The scenario's outside actions are done: the rest of the run without `--pace-ms`."""
        self.fast.touch()

    def control(self) -> JobControl:
        (started,) = self.wait_for("job_started")
        return JobControl("127.0.0.1", started["port"], timeout_s=10, secret=SECRET)

    def finish(self, timeout_s: float = 240) -> Event:
        """Let the job run to its end; returns its job_finished event."""
        _, self.stderr = self.proc.communicate(timeout=timeout_s)
        assert self.proc.returncode == 0, self.stderr
        assert_no_stack_dump(self.stderr)
        (finished,) = self.events("job_finished")
        return finished


@contextmanager
def running(tmp_path: Path, *args: str, steps: int = STEPS, pace_ms: float = 0.0) -> Iterator[Job]:
    """The job; `pace_ms` adds that much wall time after each step (without CPU; the numbers are unchanged, so
    the unpaced reference run of the same steps still applies), for a scenario that needs the job to last."""
    job = Job(tmp_path, *args, steps=steps, pace_ms=pace_ms)
    try:
        yield job
    finally:
        if job.proc.poll() is None:  # a failed scenario: SIGTERM makes the launcher stop what it started
            job.proc.send_signal(signal.SIGTERM)
            try:
                job.proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                job.proc.kill()
                job.proc.communicate()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_raised_standby_target_starts_a_standby_that_then_covers_a_failure(
    tmp_path: Path, reference_digest: Callable[[int, int], str]
) -> None:
    port = free_port()
    # Rank 1 is SIGKILLed at step 200, long after the new standby is warm (5 s or more in, paced; a forked standby
    # warms in well under a second). On a slower machine the coordinator would wait for the standby still warming:
    # covered either way.
    kill = f"kill:rank=1,step={STEPS - 100},phase=exchange"
    with running(tmp_path, "--standby", "0", "--port", str(port), "--standby-wait", "120", "--faults", kill,
                 pace_ms=PACE_MS) as job:
        job.wait_for("job_started")
        with JobControl("127.0.0.1", port, timeout_s=10, secret=SECRET) as control:
            control.set_standby_target(1)
        (changed,) = job.wait_for("standby_target_changed")
        assert (changed["old"], changed["new"]) == (0, 1)
        job.wait_for("recovered")
        job.full_speed()
        finished = job.finish()

    assert set(finished["digests"].values()) == {reference_digest(2, STEPS)}
    assert set(finished["digests"]) == {"w0", "s0"}
    assert [e["proc"] for e in job.events("standby_ready")][:1] == ["s0"]
    (failed,) = job.events("member_failed")
    assert (failed["proc"], failed["cause"]) == ("w1", "killed by SIGKILL")
    (recovered,) = job.events("recovered")
    assert recovered["ranks"] == [{"rank": 1, "old": "w1", "new": "s0"}] and recovered["tier"] == "warm"
    # Replenishment aims at the new target: the promoted standby is replaced.
    assert [e["reason"] for e in job.events("standby_spawned")] == ["standby target raised to 1",
                                                                   "replace a promoted standby"]


def test_a_planned_move_hands_the_rank_to_the_standby_at_a_step_boundary_bit_exactly(
    tmp_path: Path, reference_digest: Callable[[int, int], str]
) -> None:
    # Generation 0 is published once the standby is warm; the move follows at once, while the workers connect,
    # broadcast the initial model or run their first step: it waits for the first committed step (before it a
    # data-parallel job is not told apart from a sharded one), then the members switch after a step they agree on:
    # nobody fails, nothing is replayed, and the process that left exits on its own.
    with running(tmp_path, "--standby", "1", "--wait-for-standbys", pace_ms=PACE_MS) as job:
        job.wait_for("generation")
        with job.control() as control:
            outcome = control.wait_move(control.move([1], "spot_interruption"), timeout_s=60)
        assert outcome.accepted, outcome.reason
        job.wait_for("moved")
        job.full_speed()
        finished = job.finish()

    assert set(finished["digests"].values()) == {reference_digest(2, STEPS)}
    assert set(finished["digests"]) == {"w0", "s0"}
    (accepted,) = job.events("move_accepted")
    assert accepted["ranks"] == [1] and accepted["procs"] == ["w1"] and accepted["reason"] == "spot_interruption"
    (moved,) = job.events("moved")
    assert moved["ranks"] == [{"rank": 1, "old": "w1", "new": "s0"}] and moved["reason"] == "spot_interruption"
    assert moved["stall_s"] > 0 and moved["handoff_bytes"] > 0
    assert not job.events("member_failed") and not job.events("recovered") and not job.events("standby_lost")


def test_a_lowered_standby_target_releases_the_standbys(tmp_path: Path) -> None:
    # Generation 0 waits for both standbys to be warm, so both are ready when the target drops.
    with running(tmp_path, "--standby", "2", "--wait-for-standbys", steps=SHORT) as job:
        with job.control() as control:
            job.wait_for("generation")
            control.set_standby_target(0)
            released = job.wait_for("standby_released", count=2)
        finished = job.finish()

    assert sorted(e["proc"] for e in released) == ["s0", "s1"]
    assert {(e["reason"], e["was_ready"]) for e in released} == {("standby target lowered to 0", True)}
    (changed,) = job.events("standby_target_changed")
    assert (changed["old"], changed["new"]) == (2, 0)
    assert not job.events("standby_lost") and not job.events("standby_spawned"), "a released standby stays gone"
    assert set(finished["digests"]) == {"w0", "w1"}, "releasing standbys leaves the workers alone"
    for e in released:
        with pytest.raises(ProcessLookupError):
            os.kill(e["pid"], 0)  # killed and reaped


def test_garbage_in_the_control_keys_and_a_move_with_no_standby_are_rejected_and_training_goes_on(
    tmp_path: Path, reference_digest: Callable[[int, int], str]
) -> None:
    # One job without standbys: every bad value is answered once, then a well-formed move is refused because no
    # standby is ready; none of it touches the workers, which end exactly as an uninterrupted run.
    bad_targets = ["many", "-1", "65"]
    bad_moves = ["not json", '{"ranks": [1]}', '{"seq": 1, "ranks": "1"}', '{"seq": 2, "ranks": [7]}',
                 '{"seq": 3, "ranks": [0, 1]}']
    with running(tmp_path, "--standby", "0", pace_ms=PACE_MS) as job:
        with job.control() as control:
            job.wait_for("generation")
            for i, value in enumerate(bad_targets):
                control._command("control/standby_target", lambda _, v=value: v)
                job.wait_for("control_rejected", count=i + 1)
            for i, value in enumerate(bad_moves):
                control._command("control/move", lambda _, v=value: v)
                job.wait_for("control_rejected", count=len(bad_targets) + i + 1)
            with pytest.raises(ValueError):
                control.set_standby_target(-1)  # the client refuses before anything is written
            outcome = control.wait_move(control.move([1], "maintenance"), timeout_s=10)
        assert not outcome.accepted and outcome.reason == "no standby ready"
        job.full_speed()
        finished = job.finish()

    rejected = job.events("control_rejected")
    reasons = [(e["control"], e["reason"]) for e in rejected]
    assert len(reasons) == len(bad_targets) + len(bad_moves) + 1, "each bad value is answered once"
    assert reasons[0] == ("standby_target", "standby target 'many' is not an integer")
    assert reasons[2] == ("standby_target", "standby target 65 is outside 0..64")
    assert reasons[3] == ("move", "move request is not JSON")
    assert reasons[6][1] == "ranks [7] are not all worker ranks (0..1)"
    assert reasons[7][1].startswith("moving every rank at once would lose the training state")
    assert (rejected[-1]["control"], rejected[-1]["reason"], rejected[-1]["ranks"]) == ("move", "no standby ready", [1])
    assert not job.events("standby_target_changed") and not job.events("member_failed")
    assert not job.events("move_accepted")
    assert set(finished["digests"]) == {"w0", "w1"}
    assert set(finished["digests"].values()) == {reference_digest(2, STEPS)}


def test_a_client_of_a_job_that_is_not_there_gets_one_clear_error() -> None:
    with pytest.raises(JobNotFound, match=r"no trainmover job answers at 127\.0\.0\.1:\d+"):
        JobControl("127.0.0.1", free_port(), timeout_s=0.5, secret=SECRET)
