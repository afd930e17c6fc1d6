"""What every test script shares: the scenario's command line, and what happens after each committed step."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Any

from runtime.training.job import Job
from runtime.training.trainer import StepResult
from runtime.wire.protocol import HotClaim, HotHeld, ProcessHello
from runtime.wire.store import k_chaos_done, k_hello, k_hot_held, k_hot_slot


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    return add_options(p)


def add_options(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The scenario's options, added to a script's own parser (which has `--steps`)."""
    p.add_argument("--raise-at", type=int, default=0, help="raise a script error at this step (a bug)")
    p.add_argument("--pace-ms", type=float, default=0.0,
                   help="wall time added after each step while a chaos monkey is at work (a slower model, without "
                        "its CPU); numbers unchanged")
    p.add_argument("--pace-end-factor", type=float, default=1.0,
                   help="in the last quarter of the steps, a monkey still at work meets a model this many times "
                        "slower (so that a short run outlasts the faults on a slow machine too); numbers unchanged")
    p.add_argument("--step-ms", type=float, default=0.0,
                   help="wall time added after every step (a slower model, without its CPU), so that a test's outside "
                        "action (a cut link, a killed agent) lands mid-training; numbers unchanged")
    p.add_argument("--step-ms-until-gen", type=int, default=0,
                   help="--step-ms only until the job reaches this generation (each recovery starts one), then full "
                        "speed: a test's window for its outside action stays wide on a loaded machine, the run short")
    p.add_argument("--full-speed-file", default="",
                   help="neither --step-ms nor --pace-ms once this file exists: a test creates it after its last "
                        "outside action, and the rest of the run goes at full speed")
    p.add_argument("--await-backup", type=lambda text: [int(x) for x in text.split(",")], default=[],
                   help="comma-separated steps: once the step after each is committed, wait (bounded) until its backup "
                        "is complete in the job's --backup-dir (so that the next one is not skipped, and a fault "
                        "planned after it finds it, whatever the machine's pace)")
    p.add_argument("--hot-wait", type=lambda text: [int(x) for x in text.split(",")], default=[],
                   help="comma-separated steps S: in generation 0, each member waits (bounded) after step S - 2 "
                        "until the hot standby of slot 0 is linked, and before fetching the batch of S until it holds "
                        "step S - 1, so that a fault planned in step S finds the mirror current (its last message "
                        "cannot race the fault)")
    p.add_argument("--hot-kill", type=int, default=0,
                   help="in generation 0, the hot standby of slot 0 that this step's --hot-wait waited on is SIGKILLed "
                        "by rank 0 as it fetches the next step's batch (a standby lost while it mirrors; every rank "
                        "has passed the wait, so all of them know which one, and later waits ignore it)")
    p.set_defaults(hot_killed=None)
    p.add_argument("--say", action="store_true",
                   help="print each committed step with this process's name to stdout, and its rank to stderr")
    return p


def _hot_holder(job: Job) -> str | None:
    """The standby that holds hot slot 0 (runtime.training.hot), if one does."""
    _, claim = job.records.get_slot(k_hot_slot(0), HotClaim)
    return None if claim is None else claim.proc


def _await_hot(job: Job, step: int, killed: str | None, timeout_s: float = 60.0) -> str:
    """The standby that holds hot slot 0 once it holds `step` (-1: linked), ignoring `killed`, which the hooks
    SIGKILLed: its claim stays until the coordinator frees the slot."""
    deadline = time.monotonic() + timeout_s
    while True:
        proc = _hot_holder(job)
        proc = None if proc == killed else proc
        held = job.records.get_record(k_hot_held(proc), HotHeld) if proc else None
        if proc is not None and held is not None and held.step >= step:
            return proc
        if time.monotonic() > deadline:
            raise TimeoutError(f"no hot standby held step {step} within {timeout_s:.0f} s ({proc} holds {held})")
        time.sleep(0.01)


class HotHooks:
    """The batches of a script, with --hot-wait and --hot-kill applied where each step's batch is fetched."""

    def __init__(self, args: argparse.Namespace, job: Job, data: Any, accumulation: int) -> None:
        self.args, self.job, self.data, self.accumulation = args, job, data, accumulation
        self.done: set[int] = set()

    def batch_at(self, step: int, rank: int, world_size: int) -> Any:
        self._hooks(step, rank)
        return self.data.batch_at(step, rank, world_size)

    def micro_batch_at(self, step: int, micro: int, rank: int, world_size: int) -> Any:
        """With accumulation: micro-batch `micro` of training step `step` (the data's own numbering below)."""
        if micro == 0:
            self._hooks(step, rank)
        return self.data.batch_at((step - 1) * self.accumulation + micro + 1, rank, world_size)

    def _hooks(self, step: int, rank: int) -> None:
        job = self.job
        if job.is_standby or job.heartbeat.latest_gen > 0 or step in self.done:
            return
        self.done.add(step)
        if step in self.args.hot_wait:
            proc = _await_hot(job, step - 1, self.args.hot_killed)
            if step == self.args.hot_kill:
                self.args.hot_killed = proc  # every rank waited on this holder: none dies before the next step
        if step == self.args.hot_kill + 1 and rank == 0 and self.args.hot_killed:
            hello = job.records.get_record(k_hello(self.args.hot_killed), ProcessHello)
            assert hello is not None
            os.kill(hello.pid, signal.SIGKILL)


def hot_hooks(args: argparse.Namespace, job: Job, data: Any, accumulation: int = 1) -> Any:
    """`data` with the scenario's hot-standby hooks, when any is asked for (`accumulation`: the trainer's)."""
    return HotHooks(args, job, data, accumulation) if args.hot_wait else data


def _await_backup(job: Job, step: int, timeout_s: float = 120.0) -> None:
    from runtime.training.backup import backup_steps

    deadline = time.monotonic() + timeout_s
    while step not in backup_steps(job.cfg.backup_dir):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the backup of step {step} was not complete within {timeout_s:.0f} s")
        time.sleep(0.02)


def after_step(args: argparse.Namespace, job: Job, result: StepResult) -> None:
    if args.say:
        print(f"step {result.step} by {job.proc}", flush=True)
        print(f"rank {result.rank} at step {result.step}", file=sys.stderr, flush=True)
    full_speed = bool(args.full_speed_file) and os.path.exists(args.full_speed_file)
    if args.pace_ms and not full_speed and not job.store.check([k_chaos_done()]):
        factor = args.pace_end_factor if result.step > args.steps * 3 // 4 else 1.0
        time.sleep(args.pace_ms * factor / 1000)
    if args.step_ms and not full_speed and (
            not args.step_ms_until_gen or job.heartbeat.latest_gen < args.step_ms_until_gen):
        time.sleep(args.step_ms / 1000)
    if result.step - 1 in args.await_backup:
        _await_backup(job, result.step - 1)
    if result.step + 2 in args.hot_wait and not job.is_standby and job.heartbeat.latest_gen <= 0:
        _await_hot(job, -1, args.hot_killed)  # linked: the next boundary sends the state, the next a step (HotHooks)
    if result.step == args.raise_at:
        raise ValueError(f"a bug in the training script at step {result.step}")
