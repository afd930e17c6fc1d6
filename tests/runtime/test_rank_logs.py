"""`--rank-logs DIR`: each rank's output in one file that follows the rank across failovers."""

from __future__ import annotations

from pathlib import Path

from runtime.control.ranklogs import RankLogs
from tests.runtime.conftest import clean_digest, run_job


def test_a_ranks_file_follows_it_to_its_new_process_and_a_standby_writes_apart_until_promoted(
        tmp_path: Path) -> None:
    logs = RankLogs(tmp_path)
    logs.generation(0, ["w0", "w1"])
    logs.write("w1", "h0", "step 1\n")
    logs.write("s0", "h1", "warming up\n")
    logs.generation(1, ["w0", "s0"])
    logs.write("s0", "h1", "step 2\n")
    logs.write("w1", "h0", "Traceback: its last words\n")  # the replaced process, writing as it dies
    logs.close()
    assert (tmp_path / "standby-s0.log").read_text() == "--- s0 on host h1 ---\nwarming up\n"
    assert (tmp_path / "rank-1.log").read_text() == (
        "[trainmover] generation 0: rank 1 is w1 from here on\n--- w1 on host h0 ---\nstep 1\n"
        "[trainmover] generation 1: rank 1 is s0 from here on (was w1)\n--- s0 on host h1 ---\nstep 2\n"
        "--- w1 on host h0 ---\nTraceback: its last words\n")
    assert (tmp_path / "rank-0.log").read_text() == "[trainmover] generation 0: rank 0 is w0 from here on\n"


def test_a_killed_ranks_output_continues_in_its_file_from_the_forked_standby(tmp_path: Path) -> None:
    """A real job: rank 1 is SIGKILLed at step 8 and a standby forked by the zygote takes it; rank-1.log holds
    w1's steps, then s0's, stdout and stderr both; rank-0.log only w0's; the result is still bit-exact."""
    steps = 16
    result = run_job(nproc=2, standby=1, steps=steps, faults="kill:rank=1,step=8,phase=exchange",
                     script_args=("--say",), rank_logs=str(tmp_path / "logs"))
    assert result.exit_code == 0, result.message
    assert set(result.digests.values()) == {clean_digest(2, steps)}
    rank1 = (tmp_path / "logs" / "rank-1.log").read_text()
    assert "step 7 by w1" in rank1 and "rank 1 at step 7" in rank1, rank1
    assert "generation 1: rank 1 is s0 from here on (was w1)" in rank1
    after = rank1.split("generation 1: rank 1 is s0")[1]
    assert "--- s0 on host" in after and f"step {steps} by s0" in after and f"rank 1 at step {steps}" in after
    rank0 = (tmp_path / "logs" / "rank-0.log").read_text()
    assert f"step {steps} by w0" in rank0 and "by w1" not in rank0 and "by s0" not in rank0
