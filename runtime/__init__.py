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

A model sharded by torch (FSDP2, HSDP, tensor parallelism) uses `tm.ShardedTrainer(build, tm.MeshSpec(...), ...)`,
where `build(mesh)` parallelises the model on the mesh the runtime hands it (`runtime.training.sharded`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtime.training.data import ShardedLoader, StepData, derive_seed
    from runtime.training.job import Job, init
    from runtime.training.sharded import MeshSpec, ShardedTrainer
    from runtime.training.trainer import StepResult, Trainer

_WHERE = {"ShardedLoader": "runtime.training.data", "StepData": "runtime.training.data",
          "derive_seed": "runtime.training.data", "Job": "runtime.training.job", "init": "runtime.training.job",
          "StepResult": "runtime.training.trainer", "Trainer": "runtime.training.trainer",
          "MeshSpec": "runtime.training.sharded", "ShardedTrainer": "runtime.training.sharded"}


def __getattr__(name: str) -> Any:
    """The script API, imported on first use: `trainmover agent` loads this package without torch."""
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")


__all__ = ["Job", "MeshSpec", "ShardedLoader", "ShardedTrainer", "StepData", "StepResult", "Trainer", "derive_seed",
           "init"]
