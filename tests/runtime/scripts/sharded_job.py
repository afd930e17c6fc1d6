"""The sharded Llama-style decoder of examples/train_llama.py, under the runtime tests' scenario options."""

from __future__ import annotations

import scenario  # this directory's shared scenario options

import runtime as tm
from examples.train_llama import make_trainer, parser


def main() -> None:
    args = scenario.add_options(parser()).parse_args()
    job = tm.init()
    trainer = make_trainer(args)
    for result in trainer.fit(args.steps):
        scenario.after_step(args, job, result)


if __name__ == "__main__":
    main()
