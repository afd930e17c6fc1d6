"""Peer: checkpoint-restart, as users run it today with torchrun.

This module owns the checkpoint-restart baseline of the recovery benchmark:

* ``measure_checkpoint_cost``: the time of one checkpoint write (``torch.save`` of model, optimizer,
  scheduler and step to local disk, atomically renamed) and of one training step, and from them the
  checkpoint interval K a user would pick: the most frequent whose writes cost at most 2% of throughput.
* ``run_checkpoint_restart``: one real ``torchrun`` job (``--standalone``, 2 workers, ``--max-restarts`` one
  per planned kill) whose workers save every K steps (rank 0 writes, rank 1 waits at a barrier) and resume from
  the latest checkpoint on start (``torch.load(..., weights_only=True)``). A fault is ``SIGKILL`` of one worker
  by itself at a given step; attempt ``a`` of a job with several kills strikes at the a-th kill step.
* ``lost_time_checkpoint_restart``: a clean run, then one torchrun job whose successive attempts are killed at
  points spread over the checkpoint interval; the time lost per kill, measured within that job, and its parts
  (detection by torchrun, restart, recomputation since the checkpoint).

Timing sources: the victim writes its kill time just before killing itself; torchrun's own log lines
(timestamped by its logger) give the moment it noticed; restarted workers report when they were spawned
and when their checkpoint was loaded; every worker appends ``step time`` to a per-attempt log after each
committed step (a line-buffered write to the page cache, microseconds; it survives SIGKILL).

The lost-time runs take their first checkpoint after step 1 (a full one: AdamW creates its state at the
first step, and a step-0 checkpoint would be a third of the size, so cheaper to load), so a kill a
fraction f of the interval after a checkpoint can strike at step 1 + f*K + 1 instead of K + f*K + 1:
the same detection, restart, load and redo, at a fraction of the steps.

Smoke check: ``python -m bench.peers.checkpoint_restart --quick`` prints the result as JSON.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import itertools
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist

from bench.peers.common import (
    PeerError,
    ProcessSet,
    attach_flat_grads,
    check_flat_grads,
    log_tail,
    process_start_time,
    read_json,
    read_step_log,
    rounded,
    run_dir,
    state_digest,
    steady_step_s,
    worker_env,
    write_json_atomic,
)
from bench.peers.script import end_worker, parse_peer_args, peer_parser, start_worker
from bench.workload import WorkloadSpec, batch, build, loss_fn

MODULE = "bench.peers.checkpoint_restart"

MONITOR_INTERVAL_S = 0.1
"""torchrun's ``--monitor-interval``: how often its agent polls the workers (default 0.1 s in torch 2.13)."""

def kill_fractions(kills: int) -> tuple[float, ...]:
    """Where ``kills`` kills strike in the checkpoint interval: the middles of ``kills`` equal slices of it, so that
    their median is a kill at its middle (a failure's expected position) and their spread is the range a failure at
    a random moment can cost (5 kills: 0.1, 0.3, 0.5, 0.7, 0.9)."""
    if kills < 1:
        raise ValueError(f"kills must be at least 1, got {kills}")
    return tuple(round((i + 0.5) / kills, 4) for i in range(kills))


DEFAULT_KILL_FRACTIONS = kill_fractions(5)

THROUGHPUT_BUDGET = 0.02
"""Checkpoint writes may cost at most this fraction of throughput (sets the interval K)."""

TORCHRUN_ENV = {
    # Workaround for torch 2.13: with the default shared rendezvous store, a restarted worker group
    # reuses the first attempt's store (same MASTER_PORT) without a per-attempt key prefix, so
    # init_process_group reads the dead attempt's Gloo addresses and hangs or fails ("Connection
    # refused"). Unshared, every attempt gets a fresh store hosted by its rank 0.
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
}


def torchrun_argv(nproc: int = 2, max_restarts: int = 1) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        str(max_restarts),
        "--monitor-interval",
        str(MONITOR_INTERVAL_S),
        "-m",
        MODULE,
        "--worker",
    ]


def torchrun_settings() -> dict[str, Any]:
    return {
        "command": " ".join(["python", *torchrun_argv()[1:]]),
        "rendezvous": "--standalone (c10d backend on a local TCPStore, free port)",
        "max_restarts": "one per planned kill (each kill restarts every worker once)",
        "monitor_interval_s": MONITOR_INTERVAL_S,
        "shutdown_timeout_s": "default (30; survivors exit on their own at the Gloo error)",
        "env": dict(TORCHRUN_ENV),
    }


# ----------------------------------------------------------------------------------------- runner


@dataclass
class _Run:
    """What one torchrun job left behind, in absolute wall-clock times."""

    t_launch: float
    steps: dict[int, list[list[float]]]
    """attempt -> rank 0's rows [step, time] in that attempt."""
    ready: dict[int, list[dict[str, Any]]]
    """attempt -> each rank's start-up record."""
    saves: list[list[float]]
    """[step, t_start, t_end] of every checkpoint write on rank 0, all attempts."""
    result: dict[str, Any]
    kills: dict[int, dict[str, Any]]
    """attempt -> the kill that ended it (its time and step)."""
    agent_lines: list[tuple[float, str]] = field(default_factory=list)
    """torchrun's log lines with their time (the logger's own timestamp, else arrival)."""

    def final_steps(self) -> list[list[float]]:
        return self.steps[max(self.steps)]

    def step_end(self, step: int) -> float:
        """When the run finally completed ``step`` (the last attempt that did it)."""
        for attempt in sorted(self.steps, reverse=True):
            for s, t in self.steps[attempt]:
                if int(s) == step:
                    return t
        raise PeerError(f"step {step} never completed")

    @property
    def t_start(self) -> float:
        """Training start of the first attempt: every rank rendezvoused, built its model, ready for step 1."""
        return max(float(r["t_ready"]) for r in self.ready[0])

    def wall_to(self, step: int) -> float:
        """From training start (not launch: cold-start time varies by a second here between identical
        launches and is not part of a recovery) to the end of ``step``; restarts are inside it."""
        return self.step_end(step) - self.t_start

    def step_s(self, save_steps: Sequence[int]) -> float:
        """Steady step time of the final attempt, over steps that did not follow a checkpoint write."""
        rows = self.final_steps()
        times = [t for _, t in rows]
        saved = set(save_steps)
        durations = [
            b - a
            for (s0, a), (_, b) in itertools.pairwise(rows)
            if int(s0) not in saved  # the step after a save includes the save
        ]
        if len(durations) > 3:
            return statistics.median(durations[3:])
        return steady_step_s(times)


_AGENT_LINE = re.compile(
    r"^[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d{6}) \d+ \S*torch/distributed/elastic/.*"
    r"(closing signal|failed \(exitcode)"
)


def _agent_time(line: str, arrival: float) -> float | None:
    """The logger timestamp of a torchrun line reporting a worker failure (None for other lines)."""
    m = _AGENT_LINE.match(line)
    if not m:
        return None
    month, day, hh, mm, ss, us = (int(x) for x in m.groups()[:6])
    year = dt.datetime.fromtimestamp(arrival).year
    with contextlib.suppress(ValueError):
        t = dt.datetime(year, month, day, hh, mm, ss, us).timestamp()  # local time, as the logger prints
        if abs(t - arrival) < 60:  # guards a date roll-over or an odd log format
            return t
    return arrival


def _pump(stream: IO[bytes], log: IO[bytes], out: list[tuple[float, str]]) -> None:
    """Copy torchrun's output to its log, keeping the failure reports with their times."""
    for raw in iter(stream.readline, b""):
        arrival = time.time()
        log.write(raw)
        line = raw.decode(errors="replace").rstrip("\n")
        t = _agent_time(line, arrival)
        if t is not None:
            out.append((t, line))
    log.flush()


def _run(
    spec: WorkloadSpec,
    total_steps: int,
    save_steps: Sequence[int],
    kill_steps: Sequence[int],
    kill_rank: int,
    timeout_s: float,
) -> _Run:
    """One torchrun job; attempt a (a < len(kill_steps)) is killed at the start of step ``kill_steps[a]``."""
    attempts = len(kill_steps) + 1
    with run_dir("ckpt") as d, ProcessSet(d) as ps:
        (d / "ckpt").mkdir()
        env = worker_env(
            spec,
            {
                **TORCHRUN_ENV,
                "TM_CR_DIR": str(d),
                "TM_CR_STEPS": str(total_steps),
                "TM_CR_SAVE_STEPS": ",".join(str(x) for x in save_steps),
                "TM_CR_KILL": f"{kill_rank}:{','.join(str(k) for k in kill_steps)}" if kill_steps else "",
            },
            ps.pid_dir,
        )
        agent_lines: list[tuple[float, str]] = []
        t_launch = time.time()
        proc = ps.start("torchrun", torchrun_argv(max_restarts=max(1, len(kill_steps))), env, stdout=subprocess.PIPE)
        assert proc.stdout is not None
        with open(d / "torchrun_out.log", "wb") as log:
            pump = threading.Thread(target=_pump, args=(proc.stdout, log, agent_lines), daemon=True)
            pump.start()
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired as e:
                raise PeerError(f"torchrun still running after {timeout_s:.0f} s") from e
            finally:
                # The pipe closes when torchrun and its workers are gone (or killed by the ProcessSet).
                pump.join(timeout=10)
        if rc != 0:
            raise PeerError(f"torchrun exited with {rc}\n{log_tail(d / 'torchrun_out.log', 40)}")
        steps: dict[int, list[list[float]]] = {}
        ready: dict[int, list[dict[str, Any]]] = {}
        kills: dict[int, dict[str, Any]] = {}
        for attempt in range(attempts):
            rows = read_step_log(d / f"steps_r0_a{attempt}.log")
            if rows:
                steps[attempt] = rows
            records = [read_json(p) for r in range(2) if (p := d / f"ready_r{r}_a{attempt}.json").exists()]
            if records:
                ready[attempt] = records
            if (kill_path := d / f"kill_a{attempt}.json").exists():
                kills[attempt] = read_json(kill_path)
        saves = [row for a in range(attempts) for row in read_step_log(d / f"saves_a{a}.log")]
        return _Run(
            t_launch=t_launch,
            steps=steps,
            ready=ready,
            saves=saves,
            result=read_json(d / "result.json"),
            kills=kills,
            agent_lines=agent_lines,
        )


def _timeout_for(spec: WorkloadSpec, steps: int, restarts: int = 1) -> float:
    # Generous upper bound: start-up and each restart (tens of seconds), ~1 s per full-size step plus saves.
    size = spec.width * spec.width * spec.depth
    per_step = 1.5 if size > 20_000_000 else 0.5
    return 120.0 + 60.0 * restarts + per_step * steps * 2


def run_checkpoint_restart(
    spec: WorkloadSpec,
    total_steps: int,
    interval_steps: int,
    kill_step: int | None,
    kill_rank: int = 1,
    timeout_s: float | None = None,
) -> dict[str, Any]:
    """One torchrun job of ``total_steps`` steps, checkpointing every ``interval_steps`` steps.

    With ``kill_step``, worker ``kill_rank`` SIGKILLs itself at the start of that step in the first
    attempt; torchrun restarts both workers, which resume from the latest checkpoint.
    """
    save_steps = list(range(interval_steps, total_steps + 1, interval_steps))
    kills = [] if kill_step is None else [kill_step]
    run = _run(spec, total_steps, save_steps, kills, kill_rank, timeout_s or _timeout_for(spec, total_steps))
    out: dict[str, Any] = {
        "wall_s": run.wall_to(total_steps),
        "wall_from_launch_s": run.step_end(total_steps) - run.t_launch,
        "digest": run.result["digest"],
        "restarts": max(run.ready) if run.ready else 0,
        "step_s": run.step_s(save_steps),
        "total_steps": total_steps,
        "interval_steps": interval_steps,
        "ckpt_writes": len(run.saves),
        "ckpt_write_s": statistics.median([t1 - t0 for _, t0, t1 in run.saves]) if run.saves else None,
    }
    if kill_step is not None:
        out.update(_components(run, 0, kill_step))
    return rounded(out)


def _components(run: _Run, attempt: int, kill_step: int) -> dict[str, Any]:
    """Split the time lost to the kill that ended ``attempt``: kill -> detected -> workers ready again -> back at
    the kill point (the next attempt completes again the last step done before the kill)."""
    nxt = attempt + 1
    kill = run.kills.get(attempt)
    if kill is None or int(kill["step"]) != kill_step or nxt not in run.ready or nxt not in run.steps:
        raise PeerError(f"attempt {attempt} was not killed at step {kill_step} and restarted as planned")
    t_kill = float(kill["t_kill"])
    # torchrun reports each failure with a few lines; this kill's are the first at or after its time (the
    # logger's timestamps have microseconds, the victim's clock is the same wall clock).
    detected = [t for t, _ in run.agent_lines if t >= t_kill - 0.01]
    if not detected:
        raise PeerError(f"no torchrun failure report found after the kill of attempt {attempt}")
    t_detect = min(detected)
    t_spawn = min(float(r["t_spawn"]) for r in run.ready[nxt])
    t_ready = max(float(r["t_ready"]) for r in run.ready[nxt])
    resumed_from = int(run.ready[nxt][0]["start_step"])
    last_done = kill_step - 1  # the kill struck at the start of kill_step
    redo_steps = last_done - resumed_from
    t_back = t_ready
    if redo_steps > 0:
        done = [t for s, t in run.steps[nxt] if int(s) == last_done]
        if not done:
            # A restarted attempt that failed again on its own before reaching the kill point (its planned kill
            # then never happens, and the plan's later attempts shift): not this kill's cost, so not measured.
            reached = max((int(s) for s, _ in run.steps[nxt]), default=resumed_from)
            said = " | ".join(line for t, line in run.agent_lines if t >= t_ready)[-600:]
            raise PeerError(f"attempt {nxt}, restarted after the kill at step {kill_step}, stopped at step {reached} "
                            f"before step {last_done}; torchrun: {said or 'nothing'}")
        t_back = done[0]
    return {
        "detect_s": t_detect - t_kill,
        "restart_s": t_ready - t_detect,
        "restart_spawn_s": t_spawn - t_detect,
        "restart_init_load_s": t_ready - t_spawn,
        "ckpt_load_s": max(float(r["load_s"]) for r in run.ready[nxt]),
        "redo_s": t_back - t_ready,
        "redo_steps": redo_steps,
        "resumed_from_step": resumed_from,
        "kill_to_back_s": t_back - t_kill,
    }


def _cost(run: _Run, save_steps: Sequence[int]) -> dict[str, Any]:
    """Checkpoint write time, step time and the interval K they imply, from a finished run."""
    writes = [t1 - t0 for _, t0, t1 in run.saves]
    write_s = statistics.median(writes)
    step_s = run.step_s(save_steps)
    interval = max(1, math.ceil(write_s / (THROUGHPUT_BUDGET * step_s)))
    return {
        "ckpt_write_s": write_s,
        "ckpt_write_s_each": writes,
        "step_s": step_s,
        "interval_steps": interval,
        "throughput_budget": THROUGHPUT_BUDGET,
        "ckpt_bytes": run.result["ckpt_bytes"],
    }


def measure_checkpoint_cost(spec: WorkloadSpec, steps: int = 12, every: int = 3) -> dict[str, Any]:
    """Checkpoint write time, step time and the interval K they imply.

    A torchrun job of ``steps`` steps saving every ``every`` steps. ``ckpt_write_s`` is
    the median duration of rank 0's ``torch.save`` + rename to local disk (what stalls training: rank 1
    waits at the barrier meanwhile); ``step_s`` the median step after warm-up that did not follow a save.
    K = ceil(ckpt_write_s / (0.02 * step_s)), at least 1.
    """
    saves = list(range(every, steps + 1, every))
    run = _run(spec, steps, saves, [], 1, _timeout_for(spec, steps))
    return rounded(_cost(run, saves))


def lost_time_checkpoint_restart(
    spec: WorkloadSpec,
    quick: bool,
    max_measured_offset: int | None = None,
    fractions: Sequence[float] = DEFAULT_KILL_FRACTIONS,
) -> dict[str, Any]:
    """Time lost per kill under checkpoint-restart, over kills spread across the checkpoint interval.

    Kills strike f*K steps after a checkpoint, one per f in ``fractions``. A kill whose offset exceeds
    ``max_measured_offset`` (M, default 40 steps full, 10 quick) is measured at offset M and the remaining
    steps are added as ``steps x step_s`` (``redo_s_method`` says which).

    Two torchrun jobs of T = M + 3 steps with checkpoints after steps 1, M + 2 and M + 3. The clean one measures
    the write cost (3 full writes), which sets K, the step time and the digest to compare with. The killed one
    is restarted once per kill: attempt a is killed m_a <= M steps after the checkpoint, at the start of step
    m_a + 2 <= M + 2, so its latest checkpoint is step 1, as with checkpoints every K steps (m_a < K); attempt
    a + 1 restarts from it. Each kill's ``lost_time_s`` is measured within that job: from the kill until the
    restarted attempt completed again the last step done before the kill (``kill_to_back_s``), plus the
    unmeasured steps. The job's whole extra wall time over the clean job (``lost_time_wall_diff_s``) checks the
    sum, but carries the run-to-run drift of this machine.
    """
    cap = max_measured_offset or (10 if quick else 40)
    anchor = 1  # the checkpoint every kill restarts from
    total = anchor + cap + 2
    save_steps = [anchor, anchor + cap + 1, anchor + cap + 2]
    clean = _run(spec, total, save_steps, [], 1, _timeout_for(spec, total))
    cost = _cost(clean, save_steps)
    k = int(cost["interval_steps"])
    step_s = float(cost["step_s"])
    plan: list[tuple[float, int, int]] = []  # (fraction, offset, measured offset)
    for f in fractions:
        offset = min(k - 1, round(f * k)) if k > 1 else 0  # steps done after the checkpoint at the kill
        plan.append((f, offset, min(offset, cap)))
    kill_steps = [anchor + measured + 1 for _, _, measured in plan]
    run = _run(spec, total, save_steps, kill_steps, 1,
               _timeout_for(spec, total * (len(plan) + 1), restarts=len(plan)))
    kills: list[dict[str, Any]] = []
    unmeasured: list[dict[str, Any]] = []
    for attempt, ((f, offset, measured), kill_step) in enumerate(zip(plan, kill_steps, strict=True)):
        try:
            comp = _components(run, attempt, kill_step)
        except PeerError as exc:  # that kill's restart did not go as planned: said, and left out of the medians
            unmeasured.append({"fraction_of_interval": f, "kill_step": kill_step, "error": str(exc)})
            continue
        extra = offset - measured
        kills.append(
            {
                "fraction_of_interval": f,
                "offset_steps": offset,
                "kill_step": kill_step,
                "lost_time_s": comp["kill_to_back_s"] + extra * step_s,
                **comp,
                "redo_s": comp["redo_s"] + extra * step_s,
                "redo_s_method": "measured" if extra == 0 else f"measured {measured} steps + {extra} x step_s",
            }
        )
    if not kills:
        raise PeerError("no checkpoint-restart kill could be measured: " + "; ".join(e["error"] for e in unmeasured))
    keys = ("lost_time_s", "detect_s", "restart_s", "redo_s")
    summary = {key: statistics.median(float(e[key]) for e in kills) for key in keys}
    measured_sum = sum(float(e["kill_to_back_s"]) for e in kills)
    return rounded(
        {
            **summary,
            "lost_time_s_each": [e["lost_time_s"] for e in kills],
            "lost_time_wall_diff_s": run.wall_to(total) - clean.wall_to(total),
            "lost_time_wall_diff_vs_measured_sum_s": run.wall_to(total) - clean.wall_to(total) - measured_sum,
            "bitwise_identical": run.result["digest"] == clean.result["digest"],
            "interval_steps": k,
            "ckpt_write_s": cost["ckpt_write_s"],
            "ckpt_write_s_each": cost["ckpt_write_s_each"],
            "ckpt_bytes": cost["ckpt_bytes"],
            "step_s": step_s,
            "kills": kills,
            "kills_unmeasured": unmeasured,
            "total_steps": total,
            "save_steps": save_steps,
            "clean_wall_s": clean.wall_to(total),
            "lost_time_method": "per kill, within one torchrun job restarted once per kill: kill -> the restarted "
            "attempt completes again the last step done before the kill, plus the offsets beyond the measured "
            "ones x step_s; summary values are medians over the kills",
            "torchrun": torchrun_settings(),
            "spec": json.loads(spec.to_env()),
        }
    )


# ----------------------------------------------------------------------------------------- worker


def _worker() -> None:
    start_worker()
    t_spawn = process_start_time()
    spec = WorkloadSpec.from_env()
    d = Path(os.environ["TM_CR_DIR"])
    steps = int(os.environ["TM_CR_STEPS"])
    save_steps = {int(x) for x in os.environ["TM_CR_SAVE_STEPS"].split(",") if x}
    kill = os.environ.get("TM_CR_KILL", "")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    kill_rank, kill_step = -1, -1
    if kill:
        rank_text, steps_text = kill.split(":")
        planned = [int(x) for x in steps_text.split(",")]
        if attempt < len(planned):  # attempt a dies at the a-th planned step; the last attempt runs to the end
            kill_rank, kill_step = int(rank_text), planned[attempt]
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    ckpt = d / "ckpt" / "latest.pt"
    # Decide before the rendezvous: rank 0 can only write a checkpoint after every rank joined it, so no
    # rank can mistake a checkpoint written by this attempt for one to resume from.
    resume = ckpt.exists()
    dist.init_process_group("gloo")
    model, optimizer, scheduler = build(spec)
    flats = attach_flat_grads(model)
    start_step = 0
    load_s = 0.0
    if resume:
        t0 = time.time()
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start_step = int(state["step"])
        del state
        load_s = time.time() - t0
    write_json_atomic(
        d / f"ready_r{rank}_a{attempt}.json",
        {"t_spawn": t_spawn, "t_ready": time.time(), "load_s": load_s, "start_step": start_step},
    )
    # Line-buffered appends: each line is in the page cache as soon as it is written, so the runner can
    # read the timeline of an attempt whose processes were killed.
    steplog = open(d / f"steps_r{rank}_a{attempt}.log", "a", buffering=1)  # noqa: SIM115
    savelog = open(d / f"saves_a{attempt}.log", "a", buffering=1) if rank == 0 else None  # noqa: SIM115

    def save(step: int) -> None:
        if rank == 0:
            assert savelog is not None
            t0 = time.time()
            tmp = ckpt.with_suffix(".tmp")
            state = {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "step": step,
            }
            torch.save(state, tmp)
            os.replace(tmp, ckpt)  # atomic: a restart sees the previous checkpoint or this one, whole
            savelog.write(f"{step} {t0} {time.time()}\n")
        dist.barrier()  # the other ranks wait for the write, as in the usual rank-0-saves recipe

    for step in range(start_step + 1, steps + 1):
        if rank == kill_rank and step == kill_step:
            write_json_atomic(d / f"kill_a{attempt}.json", {"t_kill": time.time(), "step": step, "rank": rank})
            os.kill(os.getpid(), signal.SIGKILL)
        for flat in flats:
            flat.zero_()
        loss_fn(model, batch(spec, step, rank)).backward()
        if step == start_step + 1:
            check_flat_grads(model, flats)
        for flat in flats:
            dist.all_reduce(flat)
            flat.div_(world)
        optimizer.step()
        scheduler.step()
        steplog.write(f"{step} {time.time()}\n")
        if step in save_steps:
            save(step)
    steplog.close()
    if rank == 0:
        assert savelog is not None
        savelog.close()
        write_json_atomic(
            d / "result.json",
            {
                "digest": state_digest(model, optimizer),
                "attempt": attempt,
                "ckpt_bytes": ckpt.stat().st_size,
            },
        )
    end_worker()


def main(argv: list[str] | None = None) -> None:
    parser = peer_parser(__doc__, "small model, one kill")
    parser.add_argument("--cost-only", action="store_true", help="only measure the checkpoint cost")
    args = parse_peer_args(parser, argv, _worker)
    if args is None:
        return
    spec = WorkloadSpec.quick() if args.quick else WorkloadSpec.full()
    result = measure_checkpoint_cost(spec) if args.cost_only else lost_time_checkpoint_restart(spec, args.quick)
    json.dump(result, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
