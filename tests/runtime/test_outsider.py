"""An outsider on the same machine attacks a live job: a process that can reach every port but lacks the secret.

It reads every key it can name, forges every record that changes membership, state sources or the job's fate,
and replays genuine sealed records to other keys and after newer ones. Each forgery must be refused (counted,
warned about once, never obeyed, never a crash), and the job, with a real failure and recovery in the middle,
must finish bit for bit as an uninterrupted run does.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch.distributed as dist

from runtime.wire import store as keys
from runtime.wire.control import JobControl, JobNotFound
from tests.runtime.test_control import PACE_MS, SECRET, STEPS, running

pytestmark = pytest.mark.slow


def listening_addresses(pids: list[int]) -> set[tuple[str, int]]:
    """The TCP (v4) addresses the given processes listen on, from /proc (no `ss` needed)."""
    inodes: set[str] = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue  # exited meanwhile
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            host_hex, port_hex = fields[1].split(":")
            if len(host_hex) == 8:
                host = socket.inet_ntoa(bytes.fromhex(host_hex)[::-1])
            else:
                host = "::" if set(host_hex) == {"0"} else host_hex
            out.add((host, int(port_hex, 16)))
    return out


def test_an_outsider_without_the_secret_steers_nothing_and_the_job_ends_bit_exact(
    tmp_path: Path, reference_digest: Callable[[int, int], str]
) -> None:
    """Also: the store and Gloo listen only on the job's address (checked first, while every process is up)."""
    kill = f"kill:rank=1,step={STEPS // 2},phase=exchange"
    # Paced so that the kill (5 s or more in) comes after the forgeries below, and the job outlasts the waits.
    with running(tmp_path, "--standby", "1", "--wait-for-standbys", "--faults", kill, pace_ms=1.4 * PACE_MS) as job:
        (started,) = job.wait_for("job_started")
        port = started["port"]
        (gen,) = job.wait_for("generation")  # published once the standby is warm (--wait-for-standbys)
        (ready,) = job.wait_for("standby_ready")

        # 0. Where the job listens: the launcher's store, every member's and the standby's sockets.
        addresses = listening_addresses([job.proc.pid, ready["pid"]] + [m["pid"] for m in gen["members"]])
        assert ("127.0.0.1", port) in addresses
        assert all(host == "127.0.0.1" for host, _ in addresses), addresses
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.2", port), timeout=2).close()

        outsider = dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=10))

        # 1. It reads what it can name: nothing there is the secret, or a proof it could use elsewhere.
        names = [keys.k_job_config(), keys.k_gen(0), keys.k_current_gen(), keys.k_hello("w0"), keys.k_hello("s0"),
                 keys.k_heartbeat("w1"), keys.k_spec("w0"), keys.k_job_spec(), keys.k_status(0, 0),
                 keys.k_ready("s0")]
        # The members write their spec, status and heartbeat once they train: waited for (bounded), not raced.
        outsider.wait(names, datetime.timedelta(seconds=60))
        seen = {k: outsider.get(k) for k in names}
        assert not any(SECRET.encode() in v for v in seen.values())

        # 2. Forgeries of everything that steers the job (unsealed, or genuine values moved to other keys).
        fake_gen = {"gen": 1, "members": ["w0", "outsider"], "reason": "forged", "replaced": [[1, "w1", "outsider"]]}
        forged = {
            keys.k_control_move(): json.dumps({"seq": 99, "request": json.dumps({"seq": 99, "ranks": [0]})}),
            keys.k_control_standby_target(): "0",
            keys.k_fatal("w1"): json.dumps({"message": "forged fatal error"}),
            keys.k_failed(0, "w0"): json.dumps({"message": "forged", "untrusted_rank": 7, "kind": "comm"}),
            keys.k_gen(1): json.dumps(fake_gen),
            keys.k_current_gen(): "1",
            keys.k_stop(): "1",
            keys.k_assign("s0"): "1",
            keys.k_done(0, 0): "1",
            keys.k_done(0, 1): "1",
            keys.k_hello("s1"): seen[keys.k_hello("s0")].decode(),  # a genuine hello, replayed for another name
            keys.k_hello("s2"): json.dumps({"pid": 1, "proof": "0" * 64}),
            keys.k_heartbeat("w1"): seen[keys.k_heartbeat("w1")].decode()[:64] + "999999999",
            keys.k_report(1, 0): "not even json",
        }
        for key, value in forged.items():
            outsider.set(key, value)
        outsider.add(keys.k_failed_count(0), 1)
        # A genuine generation record moved to another generation is refused too (the key is signed with it).
        outsider.set(keys.k_gen(2), seen[keys.k_gen(0)].decode())

        # What the coordinator reads is refused there (events); what members read, in their logs (below).
        coordinator_reads = {"control/move", "control/standby_target", "gen/#/failed/w#", "gen/#/done/#"}
        job.wait_for("untrusted_value", count=len(coordinator_reads),
                     where=lambda e: e["key_kind"] in coordinator_reads)

        # 3. A genuine sealed command, replayed after a newer one, is stale.
        with job.control() as control:
            control.set_standby_target(2)
            job.wait_for("standby_target_changed")
            old = outsider.get(keys.k_control_standby_target())
            control.set_standby_target(1)
            job.wait_for("standby_target_changed", count=2)
            outsider.set(keys.k_control_standby_target(), old)
            job.wait_for("untrusted_value", where=lambda e: "stale" in e["reason"])

        # 4. Without the secret there is no client at all; with a wrong one, one clear error.
        with pytest.raises(JobNotFound, match="another secret"):
            JobControl("127.0.0.1", port, timeout_s=5, secret="f" * 64)
        del outsider

        job.wait_for("recovered")  # the planned kill, after every forgery
        job.full_speed()
        finished = job.finish()

    assert not job.events("job_failed")
    assert set(finished["digests"].values()) == {reference_digest(2, STEPS)}, "the job ends bit-exact"
    (recovered,) = job.events("recovered")
    assert recovered["generations"] == 1 and recovered["ranks"][0]["rank"] == 1
    changes = [(e["old"], e["new"]) for e in job.events("standby_target_changed")]
    assert changes == [(1, 2), (2, 1)], "only the sealed commands were obeyed, each once"
    assert not job.events("move_accepted")
    assert finished["refused_values"]["control/standby_target"] >= 2
    for kind in ("gen/current", "job/stop", "proc/s0/assign"):
        assert f"ignored a value of {kind}" in job.stderr, f"a member refused the forged {kind}"
    assert [e for e in job.events("untrusted_value") if e["key_kind"] == "proc/w#/fatal"], "read when w1 died"
    assert "Traceback" not in job.stderr and "Exception raised from" not in job.stderr


def test_heartbeats_deleted_and_overwritten_in_the_store_get_no_healthy_process_killed(
    tmp_path: Path, reference_digest: Callable[[int, int], str]
) -> None:
    """The store's heartbeat keys deleted and overwritten with junk, over and over, for 2.5 hang timeouts (the
    attack of issue 26, here on one machine where the store is on loopback): each process's agent still sees it beat
    through its own socket (runtime.host.agent's beat socket), so no one is declared hung; the silences are counted
    as refused heartbeats; the job ends bit-exact."""
    with running(tmp_path, "--standby", "1", "--wait-for-standbys", "--hang-timeout", "1.5",
                 pace_ms=1.4 * PACE_MS) as job:
        (started,) = job.wait_for("job_started")
        job.wait_for("generation")
        outsider = dist.TCPStore("127.0.0.1", started["port"], None, False, timeout=datetime.timedelta(seconds=10))
        targets = [keys.k_heartbeat(p) for p in ("w0", "w1", "s0")]
        deadline = time.monotonic() + 2.5 * 1.5
        attacks = 0
        while time.monotonic() < deadline:
            for key in targets:
                outsider.delete_key(key)
                attacks += 1
            if attacks % 30 == 0:
                for key in targets:
                    outsider.set(key, "0" * 64 + "999999")  # and junk in its place now and then
            time.sleep(0.002)  # the attacker's own pace, not a synchronisation
        del outsider
        job.full_speed()
        finished = job.finish()
    assert not job.events("member_failed") and not job.events("recovered"), "a healthy process was declared hung"
    assert set(finished["digests"].values()) == {reference_digest(2, STEPS)}
    assert finished["refused_values"].get("proc/w#/heartbeat", 0) + finished["refused_values"].get(
        "proc/s#/heartbeat", 0) > 0, finished["refused_values"]
