"""The benchmark workload as a TrainMover training script (launched by `bench.recovery` under the runtime).

Rank 0 writes, at the end, the wall-clock time of every committed step and the final state digest to the
file named by TM_BENCH_OUT.
"""

from __future__ import annotations

import json
import os
import sys
import time

import runtime as tm
from bench.peers.common import state_digest
from bench.workload import WorkloadSpec, batch, build, loss_fn


def main() -> None:
    steps = int(sys.argv[1])
    job = tm.init()
    spec = WorkloadSpec.from_env()
    model, optimizer, scheduler = build(spec)
    trainer = tm.Trainer(model, optimizer, loss_fn, lambda step, rank, world: batch(spec, step, rank),
                         scheduler=scheduler, seed=spec.seed, job=job)
    start = time.time()
    times: list[float] = []
    for _ in trainer.fit(steps):
        times.append(time.time())
    if trainer.rank == 0:
        out = os.environ["TM_BENCH_OUT"]
        with open(out + ".tmp", "w") as f:
            json.dump({"start": start, "step_times": times, "digest": state_digest(model, optimizer),
                       "state_bytes": trainer.state.state_bytes()}, f)
        os.replace(out + ".tmp", out)
    # Every figure is written; skip the interpreter's slow teardown of torch (not part of any measurement).
    job.close()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
