"""The fork server: forked processes are the launcher's own children, as fresh as new interpreters; a zygote that
dies or hangs never costs the job more than falling back to ordinary starts."""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.host.zygote import ForkedProcess, ForkRequest, ZygoteClient, forks_adopted_by
from runtime.launcher import LaunchConfig, launch
from runtime.wire.event_records import Recovered
from tests.runtime.conftest import TINY_JOB, clean_digest, events_of

PROBE = """
import json, os, random, sys
import numpy as np
open(os.environ["PROBE_OUT"], "w").write(json.dumps({
    "argv": sys.argv[1:], "env": os.environ.get("PROBE_VALUE"), "random": random.random(),
    "numpy": float(np.random.random()), "path0": sys.path[0]}))
mode = sys.argv[1]
if mode == "raise":
    raise ValueError("probe failed")
sys.exit(int(mode))
"""


@pytest.fixture
def zygote() -> Iterator[ZygoteClient]:
    client = ZygoteClient(dict(os.environ))
    deadline = time.monotonic() + 60
    while not client.ready():
        assert time.monotonic() < deadline, "the zygote did not finish its imports within 60 s"
        time.sleep(0.01)
    yield client
    client.close()


def test_forked_processes_are_our_children_with_their_own_argv_env_and_random_state(zygote: ZygoteClient,
                                                                                   tmp_path: Path) -> None:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    results = {}
    for mode in ("0", "3", "raise"):
        out = tmp_path / f"out-{mode}.json"
        env = {**os.environ, "PROBE_VALUE": f"value-{mode}", "PROBE_OUT": str(out)}
        pid = zygote.spawn(env, [str(script), mode])
        assert pid is not None
        p = ForkedProcess("probe", "standby", pid)
        results[mode] = (p.wait(30), json.loads(out.read_text()))
        p.close()
    # Their exit codes came from waitpid() here, which only a parent can call: the launcher adopted them.
    assert [results[m][0] for m in ("0", "3", "raise")] == [0, 3, 1]
    for mode, (_, seen) in results.items():
        assert seen["argv"] == [mode] and seen["env"] == f"value-{mode}"
        assert seen["path0"] == str(tmp_path)
    assert len({r[1]["random"] for r in results.values()}) == 3, "each child seeds Python's random afresh"
    assert len({r[1]["numpy"] for r in results.values()}) == 3, "and NumPy's"


def test_a_forked_process_writes_its_stdout_and_stderr_to_the_descriptor_sent_with_its_request(
        zygote: ZygoteClient, tmp_path: Path) -> None:
    """`--rank-logs`: the agent sends a pipe's write end with the request (SCM_RIGHTS); the forked process's
    stdout and stderr both land there, and the pipe ends when the process does (the zygote keeps no copy)."""
    script = tmp_path / "talker.py"
    script.write_text("import sys\nprint('to stdout')\nprint('to stderr', file=sys.stderr)\n")
    r, w = os.pipe()
    try:
        pid = zygote.spawn(dict(os.environ), [str(script)], w)
    finally:
        os.close(w)
    assert pid is not None
    p = ForkedProcess("talker", "standby", pid)
    assert p.wait(30) == 0
    p.close()
    data, deadline = b"", time.monotonic() + 10
    try:
        while chunk := (os.read(r, 4096) if select.select([r], [], [], max(0.0, deadline - time.monotonic()))[0]
                        else None):
            data += chunk
        assert chunk == b"", "the pipe must end with the process: nobody else may hold its write end"
    finally:
        os.close(r)
    assert data.decode().splitlines() == ["to stdout", "to stderr"]


def test_a_forked_process_can_be_killed_and_reaped(zygote: ZygoteClient, tmp_path: Path) -> None:
    script = tmp_path / "sleeper.py"
    script.write_text("import time\ntime.sleep(60)\n")
    pid = zygote.spawn(dict(os.environ), [str(script)])
    assert pid is not None
    p = ForkedProcess("sleeper", "standby", pid)
    assert p.poll() is None
    p.kill()
    assert p.wait(10) == -signal.SIGKILL
    p.close()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
def test_a_dead_or_hung_zygote_is_abandoned_and_the_caller_falls_back(zygote: ZygoteClient, sig: int) -> None:
    assert zygote.pid is not None
    os.kill(zygote.pid, sig)
    t0 = time.monotonic()
    assert zygote.spawn(dict(os.environ), [sys.executable]) is None
    assert time.monotonic() - t0 < 10, "a hung zygote is given up on after a bounded wait"
    assert zygote.pid is None and not zygote.ready()


def test_a_zygote_still_importing_is_waited_for_once_and_used_once_it_is_ready(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A zygote slow to import costs the first process one bounded wait; the next ones are started at once instead
    of each waiting again (a job's recovery would wait with them). Once it is ready after all, it serves."""
    client = ZygoteClient(dict(os.environ))
    try:
        assert not client.wait_ready(0.05), "its imports take longer than that"
        monkeypatch.setattr("runtime.host.zygote.select.select", _no_wait_allowed)
        assert not client.wait_ready(60.0), "the second wait only looks"
        monkeypatch.undo()
        deadline = time.monotonic() + 60
        while not client.ready() and time.monotonic() < deadline:
            select.select([client.sock], [], [], 0.5)
        assert client.wait_ready(0.0) and client.pid is not None, "a zygote that finished its imports is used"
    finally:
        client.close()


def test_a_stopped_zygote_is_not_waited_for_and_serves_again_once_continued(monkeypatch: pytest.MonkeyPatch) -> None:
    client = ZygoteClient(dict(os.environ))
    try:
        assert client.pid is not None
        os.kill(client.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10  # the signal is delivered when the kernel next schedules it
        while Path(f"/proc/{client.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
            assert time.monotonic() < deadline, "the zygote never showed as stopped"
            time.sleep(0.001)
        with monkeypatch.context() as m:
            m.setattr("runtime.host.zygote.select.select", _no_wait_allowed)
            assert not client.wait_ready(60.0), "a stopped zygote is not waited for"
        os.kill(client.pid, signal.SIGCONT)
        deadline = time.monotonic() + 60
        while not client.ready() and time.monotonic() < deadline:
            select.select([client.sock], [], [], 0.5)
        assert client.ready(), "continued, it finishes its imports and serves"
    finally:
        client.close()


def _no_wait_allowed(r: object, w: object, x: object, timeout: float = 0.0) -> tuple[list, list, list]:
    assert timeout == 0, f"waited {timeout} s for a zygote already waited for once"
    return [], [], []


def test_a_zygote_that_answers_too_late_leaves_no_process_of_that_request(
    zygote: ZygoteClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a loaded machine a fork may outlast the wait for its pid. The caller then starts the process itself, so
    nothing the zygote forked for that request may live on: two processes under one name would both take its
    role in the job (both answer its promotion, both join its generation)."""
    script = tmp_path / "sleeper.py"
    script.write_text("import os, sys, time\nopen(sys.argv[1], 'w').write(str(os.getpid()))\ntime.sleep(60)\n")
    answered = zygote.spawn(dict(os.environ), [str(script), str(tmp_path / "answered.pid")])
    assert answered is not None
    monkeypatch.setattr("runtime.host.zygote.REQUEST_TIMEOUT_S", 0.0)  # no zygote answers within no time at all
    assert zygote.spawn(dict(os.environ), [str(script), str(tmp_path / "late.pid")]) is None
    assert zygote.pid is None, "a zygote that did not answer in time is given up on"
    late = tmp_path / "late.pid"
    if late.exists():  # it got as far as the script: it was killed and reaped
        assert not Path(f"/proc/{late.read_text()}").exists()
    assert forks_adopted_by(os.getpid()) == {answered}, "the answered fork lives on; no other fork is left"
    p = ForkedProcess("answered", "standby", answered)
    p.kill()
    assert p.wait(10) == -signal.SIGKILL
    p.close()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
def test_a_job_whose_zygote_is_killed_or_stopped_still_replaces_workers_exactly(tmp_path: Path, sig: int) -> None:
    events_path = tmp_path / "events.jsonl"
    # 20 steps: the reference run is the one test_recovery's scenarios use (one clean run for both).
    cfg = LaunchConfig(script=str(TINY_JOB), args=("--steps", "20", "--pace-ms", "30"), nproc=2, standby=1,
                       faults="kill:rank=1,step=8,phase=exchange;kill:rank=0,step=14,phase=exchange",
                       num_threads=1, quiet=True, events_path=str(events_path), wait_for_standbys=True,
                       recovery_timeout_s=60.0)
    killed: list[int] = []

    def kill_the_zygote() -> None:  # bounded: gives up after 60 s, and the job then fails the test below
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if events_path.exists():
                for line in events_path.read_text().splitlines():
                    event = json.loads(line)
                    if event["event"] == "job_started" and event["helpers"].get("zygote"):
                        os.kill(event["helpers"]["zygote"], sig)
                        killed.append(event["helpers"]["zygote"])
                        return
            time.sleep(0.005)

    watcher = threading.Thread(target=kill_the_zygote, daemon=True)
    watcher.start()
    result = launch(cfg)
    watcher.join(60)
    assert killed, "the job named no zygote"
    assert result.exit_code == 0, result.message
    assert len(events_of(result, Recovered)) == 2
    reference = clean_digest(2, 20, TINY_JOB)
    assert set(result.digests.values()) == {reference}


def test_a_fork_request_is_one_json_line_read_back_whole_or_refused() -> None:
    request = ForkRequest({"TM_PROC": "s3", "PATH": "/bin"}, ["train.py", "--steps", "5"])
    line = request.to_json()
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert json.loads(line) == {"env": {"TM_PROC": "s3", "PATH": "/bin"}, "argv": ["train.py", "--steps", "5"],
                                "output": False}
    assert ForkRequest.from_json(line) == request
    for bad in (b"[]", b'{"env": {"A": 1}, "argv": ["x"]}', b'{"env": {}, "argv": []}', b"not json"):
        with pytest.raises(ValueError):
            ForkRequest.from_json(bad)
