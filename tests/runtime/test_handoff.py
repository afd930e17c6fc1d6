"""Handoff between real processes over Gloo: exact copies, shares from several sources, refused strangers."""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from runtime.handoff import HandoffError, MemberStatus, checksum, chunk_layout, plan_handoff
from tests.runtime.conftest import SCRIPTS


def run_group(tmp_path: Path, world: int, receivers: str, token: str, chunk_bytes: int) -> list[dict[str, object]]:
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=30),
                           wait_for_workers=False)
    procs = [
        subprocess.Popen([sys.executable, str(SCRIPTS / "handoff_group.py"), str(r), str(world), str(server.port),
                          token, receivers, str(chunk_bytes), str(tmp_path / f"r{r}.json")])
        for r in range(world)
    ]
    try:
        for p in procs:
            p.wait(timeout=120)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(world)]


def test_two_sources_each_send_a_share_and_the_receiver_ends_identical(tmp_path: Path) -> None:
    results = run_group(tmp_path, world=3, receivers="2", token="the-secret", chunk_bytes=1000)

    src0, src1, recv = results
    assert src0["role"] == "source" and src1["role"] == "source" and recv["role"] == "receiver"
    assert recv["ok"] and recv["step"] == 3
    assert recv["before"] != src0["before"]
    assert recv["after"] == src0["after"] == src1["after"]
    assert recv["sched_epoch"] == 3
    assert 0 < src0["bytes"] < recv["bytes"], "each source sends only its share"


def test_a_receiver_without_the_job_secret_gets_nothing(tmp_path: Path) -> None:
    sender, receiver = run_group(tmp_path, world=2, receivers="1", token="a-guess", chunk_bytes=1 << 20)

    assert not sender["ok"] and "failed to prove it belongs to the job" in str(sender["error"])
    assert not receiver["ok"]
    assert receiver["after"] == receiver["before"], "no state may reach an unproven receiver"


def test_plan_takes_the_newest_committed_state_and_brings_everyone_to_it() -> None:
    plan = plan_handoff([MemberStatus(0, 12, True), MemberStatus(1, 11, True), MemberStatus(2, 0, False),
                         MemberStatus(3, 12, True)])
    assert plan.target_step == 12
    assert plan.sources == (0, 3)
    assert plan.receivers == (1, 2)


def test_plan_with_no_copy_of_the_state_left_says_to_use_the_backup() -> None:
    with pytest.raises(HandoffError, match="backup checkpoint"):
        plan_handoff([MemberStatus(0, 0, False), MemberStatus(1, 0, False)])


def test_chunks_cover_every_element_once() -> None:
    layout = chunk_layout([([10, 10], 4), ([], 4), ([3], 8)], chunk_bytes=64)
    covered: dict[int, list[tuple[int, int]]] = {}
    for c in layout:
        covered.setdefault(c.tensor, []).append((c.start, c.stop))
    assert covered[0] == [(i, min(100, i + 16)) for i in range(0, 100, 16)]
    assert covered[1] == [(0, 1)]
    assert covered[2] == [(0, 3)]


def test_checksum_sees_a_single_flipped_bit_whatever_the_dtype() -> None:
    for t in (torch.randn(1001), torch.randn(7).to(torch.bfloat16), torch.arange(5, dtype=torch.uint8)):
        damaged = t.clone()
        damaged.view(torch.uint8)[3] ^= 1
        assert checksum(t) == checksum(t.clone())
        assert checksum(damaged) != checksum(t)
