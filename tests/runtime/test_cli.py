"""The `trainmover` command as a user runs it: a real signal from outside, bad input, the import boundaries."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.runtime.conftest import TINY_JOB
from tests.runtime.fresh import loaded_by
from tests.runtime.test_control import STEPS
from tests.stack_dumps import assert_no_stack_dump

ROOT = Path(__file__).resolve().parents[2]


def trainmover(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainmover", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def wait_for_event(path: Path, kind: str, proc: subprocess.Popen[str], timeout_s: float) -> dict[str, object]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the job ended before the event"
        if path.exists():
            for line in path.read_text().splitlines():
                event = json.loads(line)
                if event["event"] == kind:
                    return event
        time.sleep(0.05)
    raise AssertionError(f"no {kind} event within {timeout_s} s")


@contextlib.contextmanager
def launched(events: Path, *script_args: str) -> Iterator[subprocess.Popen[str]]:
    """`trainmover run` of the tiny job with two workers and a warm standby, its events in `events`; killed on
    the way out if it still runs."""
    job = subprocess.Popen(
        [sys.executable, "-m", "trainmover", "run", "--nproc", "2", "--standby", "1", "--threads", "1",
         "--wait-for-standbys", "--events", str(events), str(TINY_JOB), *script_args],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        yield job
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()


@pytest.mark.slow
@pytest.mark.untimed
def test_a_worker_killed_from_outside_at_a_random_moment_is_replaced_bit_exactly(
    tmp_path: Path, reference_digest: Callable[[int, int], str]
) -> None:
    steps = STEPS  # test_control's: one clean reference run serves both
    events = tmp_path / "events.jsonl"
    # --wait-for-standbys: generation 0 is published once the standby is warm, and the kill follows at once,
    # so it lands while the workers connect, broadcast the initial model or run their first steps. A 5 ms pace
    # (a sleep; numbers unchanged) keeps the job running past the kill on a fast machine too.
    with launched(events, "--steps", str(steps), "--pace-ms", "5") as job:
        generation = wait_for_event(events, "generation", job, 120)
        victim = generation["members"][1]["pid"]  # type: ignore[index]
        os.kill(victim, signal.SIGKILL)
        _, err = job.communicate(timeout=180)
    assert job.returncode == 0, err
    records = [json.loads(line) for line in events.read_text().splitlines()]
    finished = next(e for e in records if e["event"] == "job_finished")
    assert set(finished["digests"].values()) == {reference_digest(2, steps)}
    assert set(finished["digests"]) == {"w0", "s0"}
    assert f"worker w1 (pid {victim}) died at step" in err
    assert "standby s0 took rank 1 in" in err
    assert_no_stack_dump(err)


def test_a_job_stopped_with_sigterm_ends_every_process_without_a_stack_dump(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    with launched(events, "--steps", "100000") as job:
        generation = wait_for_event(events, "generation", job, 120)
        job.send_signal(signal.SIGTERM)
        _, err = job.communicate(timeout=60)
    assert job.returncode == 130, err
    assert "interrupted; every process was stopped" in err
    assert_no_stack_dump(err)
    for member in generation["members"]:  # type: ignore[attr-defined]
        # It left at the stop order (a step boundary, or its peer's closed group), not killed after the grace.
        assert f"{member['proc']}: the coordinator stopped the job" in err, err
        with pytest.raises(ProcessLookupError):
            os.kill(member["pid"], 0)


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie waiting for init to reap it is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def test_a_launcher_killed_outright_takes_every_process_of_its_machine_with_it(tmp_path: Path) -> None:
    """One machine runs the multi-host path with one agent inside the launcher: the job's processes (workers, a
    standby forked from the zygote, the zygote) watch that agent and end when it is SIGKILLed, leaving nothing
    that could write into a store nobody serves."""
    events = tmp_path / "events.jsonl"
    with launched(events, "--steps", "100000") as job:
        wait_for_event(events, "generation", job, 120)
        records = [json.loads(line) for line in events.read_text().splitlines()]
        started = next(e for e in records if e["event"] == "job_started")
        placed = [e for e in records if e["event"] == "placed"]
        pids = [e["pid"] for e in placed] + list(started["helpers"].values())
        job.kill()
        deadline = time.monotonic() + 30  # one heartbeat (0.5 s) each, with room for a loaded machine
        while (left := [p for p in pids if _running(p)]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not left, f"processes outlived their launcher: {[_describe(p) for p in left]}"
        try:  # the launcher's output pipe: held open by whatever it started that still runs
            job.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            holders = _holders(job.stderr.fileno()) if job.stderr is not None else []
            raise AssertionError(f"the launcher's output is still held open by {[_describe(p) for p in holders]}") \
                from None
    assert [h["slots"] for h in started["hosts"]] == [1024], started  # one host: this machine's agent
    assert {e["role"] for e in placed} == {"worker", "standby"} and all(e["pid"] > 0 for e in placed), placed
    assert len(pids) == 4, started  # two workers, the standby, the zygote


def _describe(pid: int) -> str:
    """A process as a failure message names it: pid, state, what it waits in, its command line."""
    proc = Path(f"/proc/{pid}")
    try:
        state = next(line for line in (proc / "status").read_text().splitlines() if line.startswith("State:"))
        wchan = (proc / "wchan").read_text()
        argv = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except (OSError, StopIteration):
        return f"{pid} (gone)"
    return f"{pid} {state.split(':', 1)[1].strip()} in {wchan or '?'}: {argv[:160]}"


def _holders(fd: int) -> list[int]:
    """The other processes that hold the pipe this process reads at `fd`."""
    pipe = os.readlink(f"/proc/self/fd/{fd}")
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if any(os.readlink(f) == pipe for f in (proc / "fd").iterdir()):
                out.append(int(proc.name))
    return out


def test_a_missing_script_is_one_clear_line_without_a_traceback() -> None:
    result = trainmover("run", "--nproc", "2", "no_such_train.py")
    assert result.returncode == 2
    assert "training script 'no_such_train.py' does not exist" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_coordinator_whose_agents_never_join_says_so_in_one_line_and_a_bad_job_id_is_refused() -> None:
    result = trainmover("coordinator", "--agents", "2", "--agents-wait", "1", "--job-id", "job-7", str(TINY_JOB))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "0 of 2 agents joined within 1 s: start `trainmover agent --coordinator 127.0.0.1:" in result.stderr
    result = trainmover("coordinator", "--agents", "1", "--job-id", "job 7; rm", str(TINY_JOB))
    assert result.returncode == 2 and "--job-id must be 1-64 letters" in result.stderr, result.stderr


def test_a_bad_fault_plan_is_refused_before_anything_starts() -> None:
    result = trainmover("run", "--faults", "kill:rank=1,phase=lunch", str(TINY_JOB))
    assert result.returncode == 2 and "phase must be one of" in result.stderr


def test_a_script_started_without_the_launcher_says_how_to_start_it() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TM_")}
    result = subprocess.run([sys.executable, str(TINY_JOB)], capture_output=True, text=True, timeout=60, env=env,
                            cwd=ROOT)
    assert result.returncode == 2
    assert "trainmover run --nproc N --standby K SCRIPT" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_training_image_path_loads_no_orchestration_or_cloud_library() -> None:
    imports = "import runtime, runtime.launcher, runtime.training.trainer, runtime.cli, trainmover.cli"
    assert loaded_by(imports, ["prefect", "sklearn", "boto3", "azure", "policy", "cloud", "flows"]) == []


@pytest.mark.slow
@pytest.mark.untimed
def test_the_demo_recovers_a_killed_worker_bit_exactly_and_says_what_it_cost(tmp_path: Path) -> None:
    events = tmp_path / "demo.jsonl"
    result = trainmover("demo", "--runtime", "--steps", "24", "--events", str(events), timeout=240)

    assert result.returncode == 0, result.stderr
    assert "bit-for-bit identical to the uninterrupted run: yes" in result.stdout
    assert "the job was down for " in result.stdout
    assert "standby" in result.stdout and "recovered in" in result.stdout
    assert_no_stack_dump(result.stderr)
    kinds = [json.loads(line)["event"] for line in events.read_text().splitlines()]
    assert "member_failed" in kinds and "recovered" in kinds and kinds[-1] == "job_finished"
