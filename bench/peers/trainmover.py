"""TrainMover as the benchmarks measure it: one job of the benchmark workload, and the lost time of each kill.

This module owns:

* ``run_job``: one TrainMover job (``runtime.launcher.launch``) of ``bench/tm_worker.py``; it returns rank 0's
  commits (step, generation, wall time), every member's final digest and the job's events;
* ``kill_losses``: the time each kill cost, measured inside the killed run from rank 0's commits, one kill at a
  time, with the decomposition that ties it to the coordinator's ``recovered`` event (pure; unit-tested).

* ``recovery_losses``: the same identity for a job where any rank may die (the chaos soak), from the commit logs
  every member keeps and the coordinator's events.

Why the lost time is anchored where it is. Rank 0 (a survivor) commits step ``r - 1`` at ``T[r-1]``, where ``r``
is the step the recovery replays (the ``recovered`` event's ``step``); a worker dies at ``t_fail`` during step
``r``; the replayed step commits at ``T[r]``. Had nothing failed, step ``r + m`` would have committed at
``T[r-1] + (m + 1) * s``, so the kill cost ``T[r+m] - T[r-1] - (m + 1) * s``. Split at ``t_fail`` this is

    (t_fail - T[r-1])          d, the part of step r done before the failure: lost, the replay redoes it
  + (T[r] - t_fail) - s        detection, reconfiguration, handoff, and the replay's excess over a step
  + (T[r+m] - T[r] - m * s)    the warm-up penalty of the m steps after it

The coordinator's ``recovery_s`` is ``T[r] - t_fail`` (to the slowest member's commit; members commit within
milliseconds of each other). So, exactly,

    lost_time_s = recovery_s - (s - d) + warm-up penalty

``recovery_s`` counts the whole replayed step, but the part of step r that was still to run when the worker died,
``s - d``, would have been spent on step r anyway; only ``d`` is lost. The lower bound the report checks for every
kill is therefore ``recovery_s - (s - d)`` (``recovery_bound_s``). The warm-up penalty is measured on rank 0 and
counted only when positive: steps after a recovery cannot be faster than steady ones, and a negative value is the
noise of subtracting ``m`` estimated steady steps on a shared machine (this is what made the old single-kill
figure fall below recovery_s's share). ``d`` may be slightly negative: the victim can start step r before rank 0
commits step r - 1; the identity holds with that value.

The physical floor of one kill is the work it must redo plus the part of the handoff nothing can hide,
``max(d, 0) + max(model_bytes / bandwidth, state_bytes / bandwidth - s)``: the new member cannot start the replayed
step before the model has arrived (the handoff's first phase), nor take its optimizer step before the whole state
has (the optimizer's state streams beside the step's passes: `runtime.training.handoff`, overlap), and the redone
work is redone at full speed at best. Without the overlap (before 2026-12-05) the floor was the sum,
``state_bytes / bandwidth + max(d, 0)`` (``floor_sequential_s``). ``floor_s`` of the report (a whole step) is the
floor for a failure at the very end of a step, the worst case; a kill early in its step can legitimately cost less.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import statistics
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.peers.common import WARMUP_STEPS, PeerError
from bench.workload import SPEC_ENV, WorkloadSpec
from runtime.launcher import LaunchConfig, launch

NPROC = 2
TM_SCRIPT = Path(__file__).resolve().parents[1] / "tm_worker.py"
OUT_ENV = "TM_BENCH_OUT"
"""Where bench/tm_worker.py writes rank 0's commits (and, beside it, every member's digest)."""

AFTER_STEPS = 3
"""Steps after the replayed one inside each kill's window: the warm-up penalty (the coordinator's
``warmup_penalty_s`` also covers 3 steps)."""

NEIGHBOUR_STEPS = 4
"""Undisturbed step durations taken on each side of a kill's window to estimate its steady step."""


@dataclass(frozen=True, slots=True)
class Commit:
    """One step committed by rank 0."""

    step: int
    generation: int
    time: float
    """Wall clock (``time.time()``) just after the commit."""
    step_s: float = 0.0
    """The step's own duration, measured inside it (``StepResult.step_s``)."""


@dataclass(frozen=True, slots=True)
class JobRun:
    """What one TrainMover job left behind."""

    commits: tuple[Commit, ...]
    digest: str
    """Rank 0's final state digest (bench.peers.common.state_digest)."""
    member_digests: dict[str, str]
    """Final bench digest of every member that finished training, by process name."""
    runtime_digests: dict[str, str]
    """The runtime's own final digest of every member (``JobResult.digests``)."""
    state_bytes: int
    events: list[dict[str, Any]]
    exit_code: int
    message: str
    proc_commits: dict[str, tuple[Commit, ...]] = dataclasses.field(default_factory=dict)
    """Every member's commits as it logged them, killed members included, by process name."""
    model_bytes: int = 0
    """Of `state_bytes`, what is not the optimizer's: the handoff's first phase (0: not reported)."""

    @property
    def step_times(self) -> list[float]:
        return [c.time for c in self.commits]

    @property
    def loop_wall_s(self) -> float:
        return self.commits[-1].time - self.commits[0].time

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == kind]

    def training_start(self) -> float:
        """When generation 0 was published: every process (and, when waited for, every standby) was ready."""
        (gen0,) = [e for e in self.of_kind("generation") if e["generation"] == 0]
        return float(gen0["time"])


def run_job(
    spec: WorkloadSpec,
    steps: int,
    *,
    faults: str = "",
    standby: int = 1,
    replenish: bool = False,
    wait_for_standbys: bool = True,
    extra: Mapping[str, Any] | None = None,
    check: bool = True,
) -> JobRun:
    """One job of ``steps`` steps with ``NPROC`` workers and ``standby`` warm standbys, one torch thread each.

    ``extra`` passes further ``LaunchConfig`` fields (the chaos benchmark's ``chaos``). With ``check`` a job
    that did not complete raises; without it the caller judges the result (a soak reports what it lost).
    """
    with tempfile.TemporaryDirectory(prefix="tm-bench-") as tmp:
        out = Path(tmp) / "rank0.json"
        saved = {k: os.environ.get(k) for k in (SPEC_ENV, OUT_ENV)}
        os.environ[SPEC_ENV] = spec.to_env()
        os.environ[OUT_ENV] = str(out)
        try:
            cfg = LaunchConfig(script=str(TM_SCRIPT), args=(str(steps),), nproc=NPROC, standby=standby,
                               faults=faults, num_threads=1, quiet=True, replenish=replenish,
                               wait_for_standbys=wait_for_standbys)
            if extra:
                cfg = dataclasses.replace(cfg, **extra)
            result = launch(cfg)
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        events = [e.to_dict() for e in result.events]
        return collect(out, events, result.exit_code, result.message, dict(result.digests), check)


def collect(out: Path, events: list[dict[str, Any]], exit_code: int, message: str, digests: dict[str, str],
            check: bool = True) -> JobRun:
    """A finished job's run, from the files its members wrote next to `out` and its events."""
    if check and exit_code != 0:
        raise PeerError(f"TrainMover benchmark job failed: {message}")
    record = json.loads(out.read_text()) if out.exists() else {}
    member_digests = {p.name[len(out.name) + 1 : -len(".digest")]: p.read_text()
                      for p in out.parent.glob(f"{out.name}.*.digest")}
    proc_commits = {p.name[len(out.name) + 1 : -len(".commits")]: parse_commit_log(p.read_text())
                    for p in out.parent.glob(f"{out.name}.*.commits")}
    commits = tuple(Commit(int(s), int(g), float(t), float(rest[0]) if rest else 0.0)
                    for s, g, t, *rest in record.get("commits", []))
    if check and not commits:
        raise PeerError("the TrainMover job finished without rank 0's step record")
    return JobRun(
        commits=commits,
        digest=str(record.get("digest", "")),
        member_digests=member_digests,
        runtime_digests=digests,
        proc_commits=proc_commits,
        state_bytes=int(record.get("state_bytes", 0)),
        model_bytes=int(record.get("model_bytes", 0)),
        events=events,
        exit_code=exit_code,
        message=message,
    )


def parse_commit_log(text: str) -> tuple[Commit, ...]:
    """Rows "step generation time step_s" of a member's commit log; a torn last line (a kill mid-write) is skipped."""
    rows = []
    for line in text.split("\n")[:-1]:  # only whole lines: the last, unterminated one may be torn
        parts = line.split()
        if len(parts) < 3:
            continue
        try:
            rows.append(Commit(int(parts[0]), int(parts[1]), float(parts[2]),
                               float(parts[3]) if len(parts) > 3 else 0.0))
        except ValueError:
            continue
    return tuple(rows)


def kill_plan(kill_steps: Sequence[int], rank: int = 1, phase: str = "exchange") -> str:
    """A fault plan (runtime.faults) that SIGKILLs whoever holds ``rank`` at each of ``kill_steps``.

    Each fault fires once per job, so the standby promoted into the rank after one kill is the next victim.
    """
    return ";".join(f"kill:rank={rank},step={k},phase={phase}" for k in kill_steps)


def kill_schedule(kills: int, first: int = 8, spacing: int = 8) -> tuple[list[int], int]:
    """Kill steps and the job's total steps: every window (step before the replay .. AFTER_STEPS after it) keeps
    ``NEIGHBOUR_STEPS`` undisturbed steps on each side for its steady-step estimate."""
    if spacing < AFTER_STEPS + 1 + NEIGHBOUR_STEPS:
        raise ValueError(f"kills {spacing} steps apart leave no undisturbed steps between their windows")
    if first < WARMUP_STEPS + NEIGHBOUR_STEPS + 1:
        raise ValueError(f"the first kill (step {first}) leaves no steady steps before it")
    steps = [first + i * spacing for i in range(kills)]
    return steps, steps[-1] + AFTER_STEPS + NEIGHBOUR_STEPS


# ----------------------------------------------------------------------------------------- accounting


@dataclass(frozen=True, slots=True)
class KillLoss:
    """The cost of one kill, measured in the killed run (see the module docstring for the identity)."""

    kill_step: int | None
    """The step the fault plan named (None when the failure was not injected by a plan)."""
    replay_step: int
    failure_at: float
    lost_time_s: float
    """(T[r] - T[r-1] - step_s) + max(0, warmup_penalty_in_run_s) on rank 0: = recovery_bound_s + the penalty."""
    step_s: float
    """Steady step around this kill: median of up to NEIGHBOUR_STEPS undisturbed durations on each side."""
    redone_s: float
    """d: failure time minus rank 0's commit of the step before the replayed one (the work the failure destroyed)."""
    replay_commit_s: float
    """Failure to rank 0's commit of the replayed step."""
    warmup_penalty_in_run_s: float
    """The AFTER_STEPS steps after the replay, minus as many steady steps (rank 0); raw, may be negative (noise)."""
    recovery_s: float
    """The coordinator's: failure to the slowest member's commit of the replayed step."""
    recovery_bound_s: float
    """recovery_s - (step_s - redone_s): the lost time without the warm-up penalty, from the coordinator's clock."""
    components: dict[str, float]
    """detect_s, reconfigure_s, handoff_s, replay_s, warmup_penalty_s of the coordinator's recovered event."""
    handoff_bytes: int
    floor_s: float | None = None
    """This kill's floor: max(redone_s, 0) + max(model_bytes, state_bytes - step_s x bandwidth) / bandwidth (set once
    the bandwidth is known; see the module docstring)."""
    invalid: bool = False
    """lost_time_s below floor_s: impossible on this machine, so a measurement disturbed (by load); excluded."""

    @property
    def reconciled(self) -> bool:
        """lost_time_s is at least recovery_s - (step_s - redone_s), give or take the members' commit skew."""
        return self.lost_time_s >= self.recovery_bound_s - COMMIT_SKEW_S

    def with_floor(self, handoff_floor_s: float, first_phase_floor_s: float | None = None) -> KillLoss:
        """`handoff_floor_s`: the whole state over the bandwidth; `first_phase_floor_s`: the model's part of it (None:
        the handoff does not overlap the step)."""
        hidden = handoff_floor_s if first_phase_floor_s is None else \
            max(first_phase_floor_s, handoff_floor_s - self.step_s)
        floor = hidden + max(self.redone_s, 0.0)
        return dataclasses.replace(self, floor_s=floor, invalid=self.lost_time_s < floor)

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "reconciled": self.reconciled}


COMMIT_SKEW_S = 0.02
"""How far apart members may commit the same step (rank 0's commit vs the coordinator's slowest member)."""


def lost_time(t_anchor: float, t_replay: float, end_time: float, step_s: float, steps_after: int) -> float:
    """The identity of the module docstring: (T[r] - T[r-1] - s) + max(0, T[r+m] - T[r] - m s)."""
    return (t_replay - t_anchor - step_s) + max(0.0, end_time - t_replay - steps_after * step_s)


def _commit_times(commits: Sequence[Commit]) -> dict[int, float]:
    """Step -> its commit time on rank 0 (the last commit of a step, should one ever be committed twice)."""
    return {c.step: c.time for c in commits}


def kill_windows(replay_steps: Iterable[int]) -> list[tuple[int, int]]:
    """(anchor, end) steps of every kill's window: the commit before the replayed step to AFTER_STEPS after it."""
    return [(r - 1, r + AFTER_STEPS) for r in replay_steps]


def steady_step_near(
    times: Mapping[int, float], window: tuple[int, int], windows: Sequence[tuple[int, int]]
) -> float:
    """Median of up to NEIGHBOUR_STEPS step durations on each side of ``window`` that no kill disturbed.

    Local rather than run-wide: on a shared machine the step time drifts by tens of percent within a minute, and
    the lost time subtracts steady steps.
    """

    def clean(step: int) -> bool:
        # The duration ending at `step` (commit step-1 -> commit step): inside some window, or in the warm-up,
        # it is not a steady step.
        if step - 1 < WARMUP_STEPS + 1 or step - 1 not in times or step not in times:
            return False
        return not any(a < step <= e for a, e in windows)

    anchor, end = window
    before = [s for s in range(anchor, 0, -1) if clean(s)][:NEIGHBOUR_STEPS]
    after = [s for s in range(end + 1, max(times) + 1) if clean(s)][:NEIGHBOUR_STEPS]
    durations = [times[s] - times[s - 1] for s in before + after]
    if len(durations) < 2:
        durations = [times[s] - times[s - 1] for s in times if clean(s)]
    if not durations:
        raise PeerError(f"no undisturbed steps around the kill window {window}")
    return statistics.median(durations)


def _death_of(rec: Mapping[str, Any], failed: Mapping[str, Mapping[str, Any]]) -> Mapping[str, Any]:
    """The earliest member_failed of a recovery (what recovery_s counts from)."""
    deaths = [failed[r["old"]] for r in rec["ranks"] if r["old"] in failed]
    if not deaths:
        raise PeerError(f"no member_failed event for the recovery of step {rec['step']}")
    return min(deaths, key=lambda d: float(d["failure_at"]))


def kill_losses(commits: Sequence[Commit], events: Sequence[Mapping[str, Any]]) -> list[KillLoss]:
    """The cost of every recovery of a job, from rank 0's commits and the job's events, in order.

    A ``recovered`` event is matched to its ``member_failed`` events through the processes it replaced; the
    earliest failure of a recovery is its failure time (what ``recovery_s`` counts from).
    """
    times = _commit_times(commits)
    failed = {e["proc"]: e for e in events if e["event"] == "member_failed"}
    recovered = [e for e in events if e["event"] == "recovered"]
    windows = kill_windows(int(e["step"]) for e in recovered)
    out: list[KillLoss] = []
    for rec, window in zip(recovered, windows, strict=True):
        anchor, end = window
        replay = anchor + 1
        if anchor not in times or end not in times or replay not in times:
            raise PeerError(f"rank 0 has no commits of steps {anchor}..{end} around the recovery of step {replay}")
        death = _death_of(rec, failed)
        failure_at = float(death["failure_at"])
        s = steady_step_near(times, window, windows)
        redone = failure_at - times[anchor]
        recovery_s = float(rec["recovery_s"])
        out.append(KillLoss(
            kill_step=None if death.get("step") is None else int(death["step"]),
            replay_step=replay,
            failure_at=failure_at,
            lost_time_s=lost_time(times[anchor], times[replay], times[end], s, AFTER_STEPS),
            step_s=s,
            redone_s=redone,
            replay_commit_s=times[replay] - failure_at,
            warmup_penalty_in_run_s=times[end] - times[replay] - AFTER_STEPS * s,
            recovery_s=recovery_s,
            recovery_bound_s=recovery_s - (s - redone),
            components={**{k: float(rec[k]) for k in
                           ("detect_s", "reconfigure_s", "handoff_s", "replay_s", "warmup_penalty_s")},
                        "handoff_overlapped_s": float(rec.get("handoff_overlapped_s", 0.0))},
            handoff_bytes=int(rec.get("handoff_bytes", 0)),
        ))
    return out


def steady_step_of(proc_commits: Mapping[str, Sequence[Commit]]) -> float:
    """Median duration between consecutive commits of one member within one generation, over every member."""
    durations = [b.time - a.time for cs in proc_commits.values() for a, b in itertools.pairwise(cs)
                 if b.step == a.step + 1 and b.generation == a.generation and a.step > WARMUP_STEPS]
    if not durations:
        raise PeerError("no member logged two consecutive commits")
    return statistics.median(durations)


@dataclass(frozen=True, slots=True)
class Interruption:
    """One stall of a job where any rank may die (the chaos soak): from the last commit before it to the first
    commit of the generation that resumed training, read from the commit logs every member keeps.

    The coordinator merges into one ``recovered`` event the deaths of generations whose reports never came (a
    generation that trained fewer than the reported steps after its replay before the next death); the commit
    logs still show each stall, so each is counted here, and the deaths that caused it are attributed to it.
    """

    generation: int
    """The generation that resumed training (its first commit ends the stall)."""
    replay_step: int
    anchor_at: float
    """The last member's commit of replay_step - 1, before this generation."""
    resumed_at: float
    """The last member's commit of replay_step in this generation."""
    deaths: tuple[str, ...]
    """Processes that died in the generations before this one and after the previous stall."""
    failure_at: float | None
    """Earliest true failure time (the chaos signal, the exit, or the last heartbeat of a hang) of those deaths."""
    lost_time_s: float
    """(resumed_at - anchor_at - step_s) + max(0, warm-up penalty of up to AFTER_STEPS steps after it)."""
    penalty_s: float
    step_s: float
    """Steady step here: median of up to NEIGHBOUR_STEPS undisturbed durations on each side (the job's otherwise)."""
    redone_s: float | None
    """failure_at - anchor_at: the part of the interrupted step done before the failure (may be slightly negative)."""
    since_failure_s: float | None
    """resumed_at - failure_at: the coordinator's recovery_s, read from the commit logs."""
    recovery_s: float | None
    """The coordinator's, when its recovered event names this generation, this step and exactly these deaths."""
    waited_for_standby_s: float
    """How long after the last declaration of death the promoted standby became warm (0: one was ready)."""

    @property
    def reconciled(self) -> bool:
        """lost_time_s >= recovery_s - (step_s - redone_s), give or take the members' commit skew.

        lost_time_s - (recovery_s - (step_s - redone_s)) = since_failure_s - recovery_s + penalty_s: the commit logs
        and the coordinator must agree on when the replayed step committed. True when there is nothing to compare.
        """
        if self.recovery_s is None or self.since_failure_s is None:
            return True
        return self.since_failure_s - self.recovery_s + self.penalty_s >= -COMMIT_SKEW_S

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "reconciled": self.reconciled}


def _local_step(before: Sequence[float], after: Sequence[float], fallback: float) -> float:
    """Median of the NEIGHBOUR_STEPS nearest durations on each side (``before`` nearest first), else ``fallback``."""
    near = [*before[:NEIGHBOUR_STEPS], *after[:NEIGHBOUR_STEPS]]
    return statistics.median(near) if len(near) >= 2 else fallback


def interruptions(
    proc_commits: Mapping[str, Sequence[Commit]], events: Sequence[Mapping[str, Any]], step_s: float
) -> list[Interruption]:
    """Every stall of the job, in order, with its lost time by the identity of the module docstring.

    The steady step of each is local (the load changes along a soak: replacements start up on the same cores);
    ``step_s``, the job's median step, stands in where a stall has fewer than 2 undisturbed steps around it.
    """
    last: dict[tuple[int, int], float] = {}  # (generation, step) -> the last member's commit
    for cs in proc_commits.values():
        for c in cs:
            key = (c.generation, c.step)
            last[key] = max(last.get(key, c.time), c.time)
    generations = sorted({g for g, _ in last if g > 0})
    first_step = {g: min(st for gg, st in last if gg == g) for g in generations}
    disturbed = {first_step[g] + i for g in generations for i in range(AFTER_STEPS + 1)}
    # Undisturbed step durations (step, generation, duration): consecutive commits of one generation, outside
    # every stall's replay and warm-up, past the job's own warm-up.
    steady = sorted((st, g, t - last[(g, st - 1)]) for (g, st), t in last.items()
                    if (g, st - 1) in last and st not in disturbed and st - 1 > WARMUP_STEPS)
    deaths = sorted((e for e in events if e["event"] == "member_failed"), key=lambda e: float(e["failure_at"]))
    recovered = {(int(e["generation"]), int(e["step"])): e for e in events if e["event"] == "recovered"}
    ready = {e["proc"]: float(e["time"]) for e in events if e["event"] == "standby_ready"}
    replaced = {int(e["generation"]): [r["new"] for r in e.get("replaced") or []]
                for e in events if e["event"] == "generation"}
    out: list[Interruption] = []
    previous = 0
    for g in generations:
        replay = min(s for gg, s in last if gg == g)
        anchors = [t for (gg, s), t in last.items() if s == replay - 1 and gg < g]
        if not anchors:
            continue  # nothing committed before it (a stall before the first step): no schedule to measure against
        anchor, resumed = max(anchors), last[(g, replay)]
        s_local = _local_step([d for st, gg, d in reversed(steady) if gg < g and st < replay],
                              [d for st, gg, d in steady if gg == g and st > replay], step_s)
        mine = [d for d in deaths if previous <= int(d.get("generation", 0)) < g]
        after = [(s - replay, last[(g, s)]) for s in range(replay + 1, replay + AFTER_STEPS + 1) if (g, s) in last]
        penalty = max(0.0, after[-1][1] - resumed - after[-1][0] * s_local) if after else 0.0
        failure = min((float(d["failure_at"]) for d in mine), default=None)
        rec = recovered.get((g, replay))
        if rec is not None and {r["old"] for r in rec["ranks"]} != {d["proc"] for d in mine}:
            rec = None  # the coordinator merged deaths of an earlier stall into it: not comparable
        declared = max((float(d["declared_at"]) for d in mine if d.get("declared_at") is not None), default=None)
        new_ready = [ready[p] for gg in range(previous + 1, g + 1) for p in replaced.get(gg, []) if p in ready]
        waited = max(0.0, max(new_ready) - declared) if new_ready and declared is not None else 0.0
        previous = g
        out.append(Interruption(
            generation=g,
            replay_step=replay,
            anchor_at=anchor,
            resumed_at=resumed,
            deaths=tuple(d["proc"] for d in mine),
            failure_at=failure,
            lost_time_s=resumed - anchor - s_local + penalty,
            step_s=s_local,
            penalty_s=penalty,
            redone_s=None if failure is None else failure - anchor,
            since_failure_s=None if failure is None else resumed - failure,
            recovery_s=None if rec is None else float(rec["recovery_s"]),
            waited_for_standby_s=waited,
        ))
    return out
