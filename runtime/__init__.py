"""runtime/: runs inside the PyTorch job and its launcher.

A worker that crashes or hangs is replaced by a pre-warmed standby that takes its exact logical rank; healthy
replicas hand over the training state from memory; only the process groups are rebuilt, in-process; the
interrupted step is replayed, so training continues bit for bit as if nothing had happened.

The training-script API::

    import runtime as tm
    job = tm.init()
    trainer = tm.Trainer(model, optimizer, loss_fn, tm.ShardedLoader(dataset, batch_size=32), scheduler=sched)
    for result in trainer.fit(steps=1000):
        ...
"""

from runtime.data import ShardedLoader, StepData, derive_seed
from runtime.job import Job, init
from runtime.trainer import StepResult, Trainer

__all__ = ["Job", "ShardedLoader", "StepData", "StepResult", "Trainer", "derive_seed", "init"]
