"""The sharded benchmark's training script: examples/train_llama.py, timed (launched by `bench.sharded`).

Every member appends each commit to `<TM_BENCH_OUT>.<proc>.commits` as it happens ("step generation time step_s"
lines, line-buffered so that a SIGKILL loses none); rank 0 writes, at the end, to TM_BENCH_OUT: its local state's
bytes, the buddy copies' host memory, their refreshes, and how long its optimizer waited for a copy's clone.
"""

from __future__ import annotations

import json
import os
import sys
import time

import runtime as tm
from examples.train_llama import make_trainer, parser


def main() -> None:
    args = parser().parse_args()
    job = tm.init()
    trainer = make_trainer(args)
    out = os.environ["TM_BENCH_OUT"]
    log = open(f"{out}.{job.proc}.commits", "a", buffering=1)  # noqa: SIM115
    for result in trainer.fit(args.steps):
        log.write(f"{result.step} {result.generation} {time.time()!r} {result.step_s!r}\n")
    log.close()
    if trainer.rank == 0 and trainer.state is not None:
        buddies = trainer.buddies
        summary = {"state_bytes": trainer.state.state_bytes(),
                   "buddy_memory_bytes": buddies.memory_bytes() if buddies else 0,
                   "buddy_refreshes": buddies.refreshes if buddies else 0,
                   "buddy_waited_s": buddies.waited_s if buddies else 0.0}
        with open(out + ".tmp", "w") as f:
            f.write(json.dumps(summary))
        os.replace(out + ".tmp", out)
    job.close()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
