"""`runtime.client`, the supervisor's side of a job, in-process: the command lines, the events tail, a launcher
watched by pid, and stopping a launcher's whole process group (a real child process; no training)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime.client import AttachedLauncher, EventTail, JobSpec, Placement, RuntimeJob, coordinator_argv, run_argv
from runtime.wire.event_records import StandbyLost, StandbySpawned


def test_the_runtime_writes_its_own_command_lines(tmp_path: Path) -> None:
    spec = JobSpec(script=Path("examples/train_mlp.py"), workers=3, standby=1, script_args=("--lr", "0.1"),
                   faults="kill:1@40", steps=100)
    local = run_argv(spec, tmp_path / "ev.jsonl", 29500)
    assert local[1:4] == ["-m", "trainmover.cli", "run"]
    tail = local[local.index("--nproc"):]
    assert tail[:2] == ["--nproc", "3"] and "--standby" in tail and tail[tail.index("--faults") + 1] == "kill:1@40"
    script = str(Path("examples/train_mlp.py").resolve())
    assert local[-5:] == [script, "--lr", "0.1", "--steps", "100"], "script args, then the step count, last"
    remote = coordinator_argv(spec, tmp_path / "ev.jsonl", Placement("job-a", 3, "10.0.0.1", 7000, 7001, 30.0))
    assert remote[3] == "coordinator" and remote[remote.index("--agents") + 1] == "3"
    assert remote[remote.index("--agents-wait") + 1] == "30" and remote[remote.index("--host") + 1] == "10.0.0.1"
    assert remote[-5:] == local[-5:]


def test_the_tail_reads_whole_lines_once_as_records_and_skips_garbage(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    tail = EventTail(path)
    assert tail.read() == [], "no file yet: nothing"
    spawned = StandbySpawned(proc="s1", reason="keep the standby target", time=5.0)
    lost = json.dumps(StandbyLost(proc="s0", pid=7, cause="killed by SIGKILL", was_ready=True, failure_at=1.0,
                                  declared_at=1.1, detect_s=0.1, time=6.0).to_dict())
    with path.open("w") as f:
        f.write(json.dumps(spawned.to_dict()) + "\n" + "not json\n" + "[1, 2]\n"
                + json.dumps({"event": "standby_ready", "proc": "s1"}) + "\n" + lost[:20])
    assert tail.read() == [spawned], "garbage and an event without its fields skipped, the half-written line left"
    with path.open("a") as f:
        f.write(lost[20:] + "\n")
    (read,) = tail.read()
    assert isinstance(read, StandbyLost) and read.cause == "killed by SIGKILL" and read.to_dict() == json.loads(lost)
    assert tail.read() == []


def test_an_attached_launcher_ends_with_what_its_events_say(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        watched = AttachedLauncher(child.pid, events)
        assert watched.poll() is None
        events.write_text(json.dumps({"event": "job_finished", "step": 5}) + "\n")
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=30)  # reaped by its parent: gone from /proc
        assert watched.wait(timeout=30) == 0
    finally:
        child.kill()
    ghost = AttachedLauncher(child.pid, tmp_path / "none.jsonl")
    assert ghost.poll() == 1, "a launcher gone without a job_finished event failed"


def _alive(pid: int) -> bool:
    """Running, not a zombie (a reparented child's zombie may wait for a reaper that never comes)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def test_stop_ends_the_launchers_whole_group_and_a_job_without_control_is_not_steered(tmp_path: Path) -> None:
    # A launcher that starts a grandchild, then waits for it: stop must end both.
    pid_file = tmp_path / "grandchild"
    code = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']);"
            f" open({str(pid_file)!r}, 'w').write(str(p.pid)); p.wait()")
    launcher = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    job = RuntimeJob(launcher, tmp_path / "events.jsonl", "127.0.0.1", 1, "secret")
    try:
        assert not job.set_standby_target(2), "nothing to steer before a connection"
        assert not job.move([1], "maintenance")
        with pytest.warns(DeprecationWarning):
            assert not job.steer("set_standby_target", 2), "the deprecated form calls the same"
        assert job.committed_step() is None
        assert job.wait(0.01) is None and job.running()
        for _ in range(300):
            if pid_file.exists() and pid_file.read_text():
                break
            job.wait(0.1)
        grandchild = int(pid_file.read_text())
        job.stop(grace_s=10)
        assert job.returncode == -signal.SIGTERM
        deadline = time.monotonic() + 30
        while _alive(grandchild):  # SIGTERM reached the whole group: the grandchild goes too
            assert time.monotonic() < deadline, "the launcher's grandchild outlived stop()"
            time.sleep(0.05)  # a poll pace: an unrelated process's exit has no fd to wait on
        job.stop()  # twice: nothing to do
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
