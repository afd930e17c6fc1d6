"""Handoff between real processes over Gloo: exact copies, shares from several sources, refused strangers."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from runtime.host.zygote import ForkedProcess, ZygoteClient
from runtime.training.handoff import HandoffError, MemberStatus, chunk_layout, chunk_mac, plan_handoff
from tests.runtime.conftest import SCRIPTS


@pytest.fixture(scope="module")
def zygote() -> Iterator[ZygoteClient]:
    """The project's fork server (runtime.host.zygote), shared by this module's groups: each rank is forked from one
    process that imported torch once, instead of a new interpreter importing it again (1.4 s of CPU a rank)."""
    client = ZygoteClient(dict(os.environ))
    try:
        yield client
    finally:
        client.close()


def run_group(zygote: ZygoteClient, tmp_path: Path, world: int, receivers: str, token: str, chunk_bytes: int,
              **options: object) -> list[dict[str, object]]:
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=30),
                           wait_for_workers=False)
    return run_ranks(zygote, world, lambda r: [
        "handoff_group.py", str(r), str(world), str(server.port), token, receivers, str(chunk_bytes),
        str(tmp_path / f"r{r}.json"), json.dumps(options)], lambda r: tmp_path / f"r{r}.json")


def run_ranks(zygote: ZygoteClient, world: int, argv: Callable[[int], list[str]], result: Callable[[int], Path],
              timeout_s: float = 120) -> list[Any]:
    """Run one test script per rank (`argv(rank)`: script name and arguments; it writes JSON to `result(rank)`),
    forked by `zygote` (started the ordinary way where it cannot serve), each bounded; returns the results in rank
    order."""
    procs: list[ForkedProcess | subprocess.Popen[bytes]] = []
    try:
        for r in range(world):
            args = [str(SCRIPTS / argv(r)[0]), *argv(r)[1:]]
            pid = zygote.spawn(dict(os.environ), args) if zygote.wait_ready(60.0) else None
            procs.append(ForkedProcess(f"r{r}", "rank", pid) if pid is not None
                         else subprocess.Popen([sys.executable, *args]))
        for p in procs:
            code = p.wait(timeout_s) if isinstance(p, ForkedProcess) else p.wait(timeout=timeout_s)
            assert code is not None, f"a rank did not finish within {timeout_s:.0f} s"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10) if isinstance(p, ForkedProcess) else p.wait()
            if isinstance(p, ForkedProcess):
                p.close()
    return [json.loads(result(r).read_text()) for r in range(world)]


@pytest.mark.untimed
def test_two_sources_each_send_a_share_and_the_receiver_ends_identical(zygote: ZygoteClient, tmp_path: Path) -> None:
    results = run_group(zygote, tmp_path, world=3, receivers="2", token="the-secret", chunk_bytes=1000)

    src0, src1, recv = results
    assert src0["role"] == "source" and src1["role"] == "source" and recv["role"] == "receiver"
    assert recv["ok"] and recv["step"] == 3
    assert recv["before"] != src0["before"]
    assert recv["after"] == src0["after"] == src1["after"]
    assert recv["sched_epoch"] == 3
    assert 0 < src0["bytes"] < recv["bytes"], "each source sends only its share"


@pytest.mark.untimed
def test_a_receiver_without_the_job_secret_gets_nothing(zygote: ZygoteClient, tmp_path: Path) -> None:
    sender, receiver = run_group(zygote, tmp_path, world=2, receivers="1", token="a-guess", chunk_bytes=1 << 20)

    assert not sender["ok"] and "failed to prove it belongs to the job" in str(sender["error"])
    assert not receiver["ok"]
    assert receiver["after"] == receiver["before"], "no state may reach an unproven receiver"


@pytest.mark.untimed
def test_a_source_without_the_job_secret_gives_nothing(zygote: ZygoteClient, tmp_path: Path) -> None:
    sender, receiver = run_group(zygote, tmp_path, world=2, receivers="1", token="the-secret", chunk_bytes=1 << 20,
                                 source_token="an-outsider")

    assert not receiver["ok"] and "sending rank 0 failed to prove it belongs to the job" in str(receiver["error"])
    assert receiver["after"] == receiver["before"], "no state from an unproven source may be applied"
    assert not sender["ok"]


@pytest.mark.untimed
def test_a_corrupted_chunk_is_fetched_again_from_the_other_source(zygote: ZygoteClient, tmp_path: Path) -> None:
    src0, src1, recv = run_group(zygote, tmp_path, world=3, receivers="2", token="the-secret", chunk_bytes=1000,
                                 corrupt=[0, 2])

    assert recv["ok"] and recv["refetched"] == 1
    assert recv["after"] == src0["after"] == src1["after"]
    assert src1["bytes"] > 0 and src0["ok"] and src1["ok"]


@pytest.mark.untimed
@pytest.mark.parametrize("keep_own", [True, False])
def test_a_receiver_behind_keeps_its_own_state_when_its_only_source_dies_mid_handoff(
    zygote: ZygoteClient, tmp_path: Path, keep_own: bool
) -> None:
    """A survivor one step behind when a peer died receives the newest step from the only rank that holds it. A
    chunk arrives corrupted, and the source dies when asked to send it again (every other chunk has landed). Kept
    (`keep_own`, what the trainer does for a survivor that holds a state), its own older state is whole and the
    job can replay from it; received in place, most of it is the dead source's."""
    source, receiver = run_group(zygote, tmp_path, world=2, receivers="1", token="the-secret", chunk_bytes=1000,
                                 corrupt=[0, 5], die_on_repair=0, keep_own=keep_own)
    assert source.get("died") and not receiver["ok"], receiver
    if keep_own:
        assert receiver["after"] == receiver["before"] and not receiver.get("own_lost")
    else:
        assert receiver["after"] != receiver["before"]


@pytest.mark.untimed
def test_a_chunk_corrupted_by_the_only_source_is_sent_again(zygote: ZygoteClient, tmp_path: Path) -> None:
    src, recv = run_group(zygote, tmp_path, world=2, receivers="1", token="the-secret", chunk_bytes=1000,
                          corrupt=[0, 1])

    assert recv["ok"] and recv["refetched"] == 1
    assert recv["after"] == src["after"]


@pytest.mark.untimed
def test_overlapped_the_model_arrives_first_and_the_optimizer_state_after(zygote: ZygoteClient, tmp_path: Path) -> None:
    """`start_handoff(overlap=True)` returns once the model (what a forward pass reads) is in place; the optimizer's
    state follows on a thread; both sources' shares end in the same bits as without the overlap."""
    src0, src1, recv = run_group(zygote, tmp_path, world=3, receivers="2", token="the-secret", chunk_bytes=1000,
                                 overlap=True)

    assert recv["ok"] and recv["step"] == 3 and recv["refetched"] == 0
    assert recv["model_early"] == src0["model_after"] != recv["before"]
    assert recv["after"] == src0["after"] == src1["after"]
    assert recv["sched_epoch"] == 3 and recv["lr"] == src0["lr"]


@pytest.mark.untimed
def test_overlapped_a_chunk_of_the_optimizer_state_corrupted_is_sent_again(
    zygote: ZygoteClient, tmp_path: Path
) -> None:
    # The model is 36 chunks of 1000 bytes: the source's 40th chunk is Adam's, in the second phase.
    src, recv = run_group(zygote, tmp_path, world=2, receivers="1", token="the-secret", chunk_bytes=1000,
                          corrupt=[0, 40], overlap=True)

    assert recv["ok"] and recv["refetched"] == 1
    assert recv["after"] == src["after"]


@pytest.mark.untimed
def test_overlapped_a_source_lost_while_the_optimizer_state_streams_fails_the_wait(
    zygote: ZygoteClient, tmp_path: Path
) -> None:
    """The source dies in the second phase (asked to resend a corrupted chunk of Adam's state): the receiver already
    has the model, but its wait fails, so the trainer never counts it as holding the state."""
    src, recv = run_group(zygote, tmp_path, world=2, receivers="1", token="the-secret", chunk_bytes=1000,
                          corrupt=[0, 40], die_on_repair=0, die_on_repair_phase=1, overlap=True)

    assert src.get("died") and not recv["ok"], recv
    assert "handoff interrupted" in str(recv["error"])
    assert recv["model_early"] != recv["before"]


def test_plan_takes_the_newest_committed_state_and_brings_everyone_to_it() -> None:
    plan = plan_handoff([MemberStatus(0, 12, True), MemberStatus(1, 11, True), MemberStatus(2, 0, False),
                         MemberStatus(3, 12, True)])
    assert plan.target_step == 12
    assert plan.sources == (0, 3)
    assert plan.receivers == (1, 2)


def test_plan_with_no_copy_of_the_state_left_says_to_use_the_backup() -> None:
    with pytest.raises(HandoffError, match=r"last backup \(trainmover run --resume-from DIR\)"):
        plan_handoff([MemberStatus(0, 0, False), MemberStatus(1, 0, False)])


def test_chunks_cover_every_element_once() -> None:
    layout = chunk_layout([([10, 10], 4), ([], 4), ([3], 8)], chunk_bytes=64)
    covered: dict[int, list[tuple[int, int]]] = {}
    for c in layout:
        covered.setdefault(c.tensor, []).append((c.start, c.stop))
    assert covered[0] == [(i, min(100, i + 16)) for i in range(0, 100, 16)]
    assert covered[1] == [(0, 1)]
    assert covered[2] == [(0, 3)]


def test_chunk_mac_sees_a_single_flipped_bit_whatever_the_dtype_and_binds_receiver_step_and_index() -> None:
    from runtime.training.handoff import TAG_BYTES, tensor_bytes

    key = b"k" * 32
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8):
        t = (torch.arange(1000) % 7).to(dtype)
        damaged = t.clone()
        damaged.view(torch.uint8)[13] ^= 4
        tag = chunk_mac(key, 1, 5, 0, tensor_bytes(t))
        assert len(tag) == TAG_BYTES
        assert chunk_mac(key, 1, 5, 0, tensor_bytes(t.clone())) == tag
        assert chunk_mac(key, 1, 5, 0, tensor_bytes(damaged)) != tag
        assert chunk_mac(key, 1, 5, 1, tensor_bytes(t)) != tag, "index is bound"
        assert chunk_mac(key, 1, 6, 0, tensor_bytes(t)) != tag, "step is bound"
        assert chunk_mac(key, 2, 5, 0, tensor_bytes(t)) != tag, "receiver is bound (a one-time key per message)"
        assert chunk_mac(b"x" * 32, 1, 5, 0, tensor_bytes(t)) != tag, "keyed"


@pytest.mark.untimed
def test_a_group_with_a_peer_that_cannot_prove_its_rank_is_refused_by_every_member(
    zygote: ZygoteClient, tmp_path: Path
) -> None:
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=30),
                           wait_for_workers=False)
    tokens = ["the-secret", "an-impostor", "the-secret"]
    results = run_ranks(zygote, 3, lambda r: [
        "group_proof.py", str(r), "3", str(server.port), tokens[r], str(tmp_path / f"g{r}.json")],
        lambda r: tmp_path / f"g{r}.json", timeout_s=60)
    assert not results[0]["ok"] and not results[2]["ok"]
    assert "rank 1 in the group of generation 3 failed to prove it belongs to the job" in str(results[0]["error"])



def test_a_peer_that_never_sends_fails_the_receive_within_its_bound(zygote: ZygoteClient, tmp_path: Path) -> None:
    """Every blocking receive of a transfer is bounded (GlooLinks' timeout), not held for the group's 600 s."""
    init, out = tmp_path / "init", tmp_path / "result"
    first, _ = run_ranks(zygote, 2, lambda r: ["silent_peer.py", str(r), str(init), str(out)],
                         lambda r: Path(f"{out}.{r}"), timeout_s=90)
    assert first["error"] is not None, "the receive from a silent peer must fail"
    assert first["waited_s"] < 30, first
