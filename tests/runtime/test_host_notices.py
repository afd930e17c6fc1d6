"""A host's cloud notices reach the job through its own agent: `trainmover agent --notices aws` watches the host's
instance metadata (here a fake IMDSv2 per host), tells the coordinator, and the coordinator moves the host's ranks
to standbys before the cloud acts, bit for bit; nothing new is placed on a host that is going.

The in-process test drives HostPool with a real Agent; the scenario runs `trainmover coordinator` and three
`trainmover agent` processes on this machine, each with its own metadata service.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import pytest

from bench.netns import Events
from cloud.aws.notices import ImdsNoticeSource
from runtime.control.hosts import HostPool, NoSlot
from runtime.host.agent import Agent, AgentConfig, NoticeWatch
from runtime.wire.event_records import HostNoticed
from runtime.wire.events import of_type
from runtime.wire.protocol import HostNotice, ProtocolError, decode, to_json
from tests.cloud.aws_servers import ImdsServer, imds_server
from tests.runtime.conftest import TINY_JOB, clean_digest

ROOT = Path(__file__).resolve().parents[2]
SOON = "2026-12-03T12:00:00Z"


def _wait(what: str, found: object, timeout_s: float = 15.0) -> object:
    deadline = time.monotonic() + timeout_s
    while not (hit := found()):  # type: ignore[operator]
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f} s"
        time.sleep(0.02)  # polling another thread's or process's state
    return hit


def test_a_notice_kind_the_protocol_does_not_know_is_refused() -> None:
    assert decode(to_json(HostNotice("spot_interruption", 1.0, "x"))) == HostNotice("spot_interruption", 1.0, "x")
    with pytest.raises(ProtocolError, match="kind must be one of"):
        decode({**to_json(HostNotice("spot_interruption")), "kind": "reboot-everything"})


def test_an_agent_forwards_its_hosts_spot_notice_once_and_the_host_gets_nothing_new(
    pool: tuple[HostPool, str], tmp_path: Path
) -> None:
    p, token = pool
    script = tmp_path / "idle.py"
    script.write_text("import time\ntime.sleep(60)\n")
    p.argv = [str(script)]
    with imds_server() as imds:
        watch = NoticeWatch(ImdsNoticeSource("host-a", endpoint=imds.url), every_s=0.05)
        agent = Agent(AgentConfig(coordinator=f"127.0.0.1:{p.port}", slots=2, secret=token, name="host-a",
                                  connect_timeout_s=5.0, rejoin=False, fork_server=False,
                                  notices=watch))
        thread = threading.Thread(target=agent.run, daemon=True)
        thread.start()
        try:
            p.wait_for_hosts(1, 10)
            worker = p.spawn("w0", "worker")
            imds.post_spot_action("terminate", SOON)
            ((host, incarnation, kind),) = _wait("the notice at the coordinator", p.take_notices)  # type: ignore[misc]
            assert (host, kind) == ("host-a", "spot_interruption")
            assert p.procs_on(host, incarnation) == ["w0"]
            events = of_type(p.take_events(), HostNoticed)
            assert events and events[0].procs == ["w0"] and events[0].deadline_at > 0
            # The host still has a free slot, but it is going: a new standby must go elsewhere.
            with pytest.raises(NoSlot):
                p.spawn("s0", "standby")
            assert imds.wait_for_gets("/latest/meta-data/spot/instance-action", 3, 10.0)
            assert p.take_notices() == [], "a notice still posted is forwarded once"
            worker.kill()
        finally:
            p.close()
            thread.join(timeout=15)
            agent.close()
    assert not thread.is_alive()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_a_spot_notice_from_a_hosts_metadata_moves_its_rank_to_a_standby_host_bit_exact(tmp_path: Path) -> None:
    """Three one-slot hosts (two workers, one standby), each with its own metadata service. Once training runs,
    the host of rank 1 is told it will be reclaimed: its rank moves to the standby's host as a planned move, no
    standby is placed on the doomed host, and the job ends where an uninterrupted run ends."""
    steps, args = 80, ("--step-ms", "40")
    secret = secrets.token_hex(32)
    port = _free_port()
    events = Events(tmp_path / "events.jsonl")
    env = {**os.environ, "TRAINMOVER_JOB_SECRET": secret}
    with ExitStack() as stack:
        imds: dict[str, ImdsServer] = {f"h{i}": stack.enter_context(imds_server()) for i in range(3)}
        log = stack.enter_context(open(tmp_path / "coordinator.log", "wb"))
        coordinator = subprocess.Popen(
            [sys.executable, "-m", "trainmover", "coordinator", "--agents", "3", "--agent-port", str(port),
             "--nproc", "2", "--standby", "1", "--threads", "1", "--events", str(events.path), "--hang-timeout", "6",
             "--wait-for-standbys", "--agents-wait", "60", "--no-replenish", str(TINY_JOB), "--steps", str(steps),
             *args],
            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        stack.callback(lambda: coordinator.poll() is None and coordinator.kill())
        for name, server in imds.items():
            agent_log = stack.enter_context(open(tmp_path / f"{name}.log", "wb"))
            agent = subprocess.Popen(
                [sys.executable, "-m", "trainmover", "agent", "--coordinator", f"127.0.0.1:{port}", "--slots", "1",
                 "--name", name, "--notices", "aws", "--metadata-url", server.url, "--no-rejoin"],
                env=env, stdout=agent_log, stderr=subprocess.STDOUT, cwd=ROOT)
            stack.callback(lambda a=agent: a.poll() is None and a.kill())
        placed = events.wait_for("rank 1's placement", lambda evs: next(
            (e for e in evs if e["event"] == "placed" and e["proc"] == "w1"), None), 90.0, alive=coordinator)
        events.wait_for("training to run", lambda evs: any(e["event"] == "generation" for e in evs), 90.0,
                        alive=coordinator)
        doomed = placed["host"]
        imds[doomed].post_spot_action("terminate", SOON)
        assert coordinator.wait(timeout=120) == 0, (tmp_path / "coordinator.log").read_text()
    evs = events.read()
    (notice,) = [e for e in evs if e["event"] == "host_notice"]
    assert notice["host"] == doomed and notice["notice"] == "spot_interruption" and notice["procs"] == ["w1"]
    (moved,) = [e for e in evs if e["event"] == "move_accepted"]
    assert moved["ranks"] == [1] and moved["reason"] == "spot_interruption" and moved["host"] == doomed
    # A planned move of a data-parallel job: at a step boundary, nothing replayed, no failure.
    (done,) = [e for e in evs if e["event"] == "moved"]
    assert done["ranks"][0]["rank"] == 1 and done["ranks"][0]["old"] == "w1" and done["reason"] == "spot_interruption"
    assert not [e for e in evs if e["event"] in ("member_failed", "recovered")], evs
    placed_after = [e["host"] for e in evs if e["event"] == "placed" and e["time"] > moved["time"]]
    assert doomed not in placed_after, "nothing new goes to a host that is going"
    (finished,) = [e for e in evs if e["event"] == "job_finished"]
    assert set(finished["digests"].values()) == {clean_digest(2, steps, TINY_JOB, args)}
