"""The benchmark workload as a TrainMover training script (launched by `bench.recovery` and `bench.chaos`).

This module owns what a benchmark reads from inside the training processes. Rank 0 writes, at the end, to the
file named by TM_BENCH_OUT: the wall-clock time of every committed step (`step_times`), one row per commit
(`commits`: step number, generation, commit time, the step's own duration) and the final state digest.
Every member that finishes training writes its own digest next to it (`<TM_BENCH_OUT>.<proc>.digest`), so a
benchmark can check every rank's final state, not only rank 0's; and every member, killed ones included, appends
each of its commits to `<TM_BENCH_OUT>.<proc>.commits` as it happens ("step generation time step_s" lines).

Rows carry the step number and the generation because a commit time alone cannot say which step a recovery
replayed: the recovery benchmark anchors each kill's lost time on the survivor's last commit before the failure.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

import runtime as tm
from bench.peers.common import state_digest
from bench.workload import WorkloadSpec, batch, build, loss_fn


def _write_atomic(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def main() -> None:
    steps = int(sys.argv[1])
    job = tm.init()
    spec = WorkloadSpec.from_env()
    model, optimizer, scheduler = build(spec)
    def loss(m: torch.nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if spec.device_ms:
            time.sleep(spec.device_ms / 1000)  # the accelerator's share of the step: the CPU is free meanwhile
        return loss_fn(m, data)

    trainer = tm.Trainer(model, optimizer, loss, lambda step, rank, world: batch(spec, step, rank),
                         scheduler=scheduler, seed=spec.seed, job=job)
    out = os.environ["TM_BENCH_OUT"]
    start = time.time()
    times: list[float] = []
    commits: list[tuple[int, int, float, float]] = []
    # Every member appends each commit to its own log as it happens (line-buffered: in the page cache at once,
    # so it survives a SIGKILL): a soak whose rank 0 is killed still knows every step's commit time.
    log = open(f"{out}.{job.proc}.commits", "a", buffering=1)  # noqa: SIM115
    for result in trainer.fit(steps):
        now = time.time()
        times.append(now)
        commits.append((result.step, result.generation, now, result.step_s))
        log.write(f"{result.step} {result.generation} {now!r} {result.step_s!r}\n")
    log.close()
    if trainer.rank is None:
        # A standby the job never needed (a runtime that returns from fit() for it): it holds no training state.
        job.close()
        os._exit(0)
    digest = state_digest(model, optimizer)
    # Every finishing member (the original workers and any promoted standby) reports its own final state.
    _write_atomic(f"{out}.{job.proc}.digest", digest)
    if trainer.rank == 0:
        _write_atomic(out, json.dumps({"start": start, "step_times": times, "commits": commits, "digest": digest,
                                       "state_bytes": trainer.state.state_bytes(),
                                       "model_bytes": sum(t.numel() * t.element_size() for k, t in
                                                          trainer.state.tensors() if not k.startswith("optim."))}))
    # Every figure is written; skip the interpreter's slow teardown of torch (not part of any measurement).
    job.close()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
