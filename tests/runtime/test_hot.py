"""Hot standbys (runtime.training.hot): a standby that mirrors the state every step takes a lost rank with nothing
sent to it, and the run stays bit for bit the uninterrupted one; a hot standby lost while it mirrors is replaced by
one that mirrors in its turn."""

from __future__ import annotations

import pytest

from runtime.wire.event_records import MemberFailed, Recovered, StandbyLost
from tests.runtime.conftest import SCRIPTS, clean_digest, events_of, run_job

pytestmark = pytest.mark.slow

EMA = SCRIPTS / "ema_job.py"
BN_AUG = SCRIPTS / "bn_aug_job.py"


@pytest.mark.untimed
@pytest.mark.parametrize(("script", "args", "victim"), [
    # EMA weights registered and updated after each commit, AdamW over two groups, ReduceLROnPlateau on the global
    # loss, two micro-batches per step, dropout. The victim is rank 0: the hot standby's own source.
    (EMA, (), 0),
    # BatchNorm statistics, random augmentation from three generators, SGD with Nesterov over two groups, OneCycleLR,
    # gradient-norm clipping, fp16 autocast with its GradScaler.
    (BN_AUG, ("--amp", "fp16"), 1),
], ids=["ema-adamw-plateau-source-killed", "batchnorm-fp16-clipping"])
def test_a_hot_standby_takes_a_killed_rank_with_nothing_sent_and_the_run_stays_bit_exact(
        script, args: tuple[str, ...], victim: int) -> None:  # type: ignore[no-untyped-def]
    """Killed before its exchange, the victim leaves every survivor at step 9, which the hot standby holds (the
    scenario's --hot-wait). Killed inside the exchange, a survivor may finish step 10 alone: the hot standby, one step
    behind, then receives the state as a survivor behind would (tested in test_recovery.py for warm standbys)."""
    steps = 20
    result = run_job(nproc=2, standby=2, hot_standbys=1, steps=steps, script=script,
                     script_args=(*args, "--hot-wait", "10"),
                     faults=f"kill:rank={victim},step=10,phase=before_exchange")

    assert result.exit_code == 0, result.message
    assert set(result.digests.values()) == {clean_digest(2, steps, script, args)}
    (recovered,) = events_of(result, Recovered)
    assert recovered.handoff_bytes == 0, "the hot standby held the survivors' step: nothing to send"
    assert recovered.tier == "hot"
    (moved,) = recovered.ranks
    assert moved["rank"] == victim and moved["old"] == f"w{victim}"
    assert recovered.generations == 1


@pytest.mark.untimed
def test_a_hot_standby_killed_while_it_mirrors_is_replaced_by_one_that_mirrors_in_its_turn() -> None:
    """Rank 0 SIGKILLs the mirroring standby as step 6 starts; the coordinator frees its slot, another standby (the
    warm one, or the replacement) claims it and is synced; at step 12 a worker dies and that standby takes it with
    nothing sent."""
    steps = 20
    result = run_job(nproc=2, standby=2, hot_standbys=1, steps=steps, script=EMA,
                     script_args=("--hot-wait", "5,12", "--hot-kill", "5"),
                     faults="kill:rank=1,step=12,phase=before_exchange")

    assert result.exit_code == 0, result.message
    assert set(result.digests.values()) == {clean_digest(2, steps, EMA)}
    (lost,) = events_of(result, StandbyLost)
    assert lost.cause == "killed by SIGKILL"
    (failed,) = events_of(result, MemberFailed)
    assert failed.rank == 1
    (recovered,) = events_of(result, Recovered)
    assert recovered.handoff_bytes == 0 and recovered.tier == "hot"
    (moved,) = recovered.ranks
    assert moved["new"] not in (lost.proc, "w0", "w1")
