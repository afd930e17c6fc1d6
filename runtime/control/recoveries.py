"""Recoveries in flight: from the deaths a new generation answers to the `recovered` event.

A recovery opens when the coordinator publishes a generation that gives lost ranks to standbys. Its members
report (runtime.wire.protocol's `RecoveryReport`) once the replayed step committed and again, final, after the steps
that follow it; `Recoveries.flush` then turns the reports into one `recovered` event (the figures are
runtime.control.decisions' `recovery_metrics`). A generation superseded before its replay committed is a failed attempt
of the same recovery, which goes on in the next generation.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from runtime.control.decisions import recovery_metrics
from runtime.wire import store as keys
from runtime.wire.event_records import Recovered, Shrunk
from runtime.wire.events import EventLog
from runtime.wire.protocol import Generation, RecoveryReport

log = logging.getLogger("trainmover.coordinator")


@dataclass
class Death:
    """A member declared dead: its rank, its process, why, when it failed and when it was declared (wall)."""

    rank: int
    proc: str
    pid: int
    cause: str
    failure_at: float
    declared_at: float


@dataclass
class PendingRecovery:
    gen: Generation
    deaths: list[Death]
    declared_at: float
    reports: dict[int, RecoveryReport] = field(default_factory=dict)
    attempts: list[dict[str, Any]] = field(default_factory=list)
    """Earlier generations of this recovery that failed before its replayed step committed, and why."""
    left_out: dict[str, int] = field(default_factory=dict)
    """Lost processes no standby replaced (the job shrank): process -> the width before."""
    mode: str = ""
    """How the shrunk job trains (`--shrink`)."""

    def replayed(self) -> bool:
        return any(r.replay_done_at is not None for r in self.reports.values())


class Recoveries:
    """The recoveries not reported yet, and their members' reports."""

    def __init__(self, records: keys.Records, events: EventLog) -> None:
        self.records = records
        self.events = events
        self.pending: list[PendingRecovery] = []

    def __bool__(self) -> bool:
        return bool(self.pending)

    def open(self, gen: Generation, deaths: list[Death], declared_at: float, left_out: Sequence[str] = (),
             width_before: int = 0, mode: str = "") -> None:
        """`gen` gives the ranks of `deaths` to standbys, or leaves them out (`left_out`: their processes; the job
        shrank from `width_before` members). A recovery it supersedes before its replayed step committed goes on in
        this one: its failure, its deaths and its failed generations are this recovery's, and its time runs from
        there."""
        earlier = self.supersede(gen)
        merged = [d for r in earlier for d in r.deaths] + deaths
        attempts = [a for r in earlier for a in r.attempts]
        shrunk = {p: w for r in earlier for p, w in r.left_out.items()} | {p: width_before for p in left_out}
        self.pending.append(PendingRecovery(gen, merged, declared_at, attempts=attempts, left_out=shrunk,
                                            mode=mode or next((r.mode for r in earlier if r.mode), "")))

    def carry_over(self, gen: Generation) -> None:
        """`gen` rebuilds the groups with the same members: unfinished recoveries go on in it."""
        for rec in self.supersede(gen):
            rec.gen, rec.reports = gen, {}
            self.pending.append(rec)

    def supersede(self, new: Generation) -> list[PendingRecovery]:
        """Take out the pending recoveries that `new` supersedes before their replay committed; each records
        its generation as a failed attempt."""
        self.read_reports()
        out = [r for r in self.pending if r.gen.gen < new.gen and not r.replayed()]
        for r in out:
            self.pending.remove(r)
            r.attempts.append({"generation": r.gen.gen, "failed": new.reason})
        return out

    def read_reports(self) -> None:
        """Read the members' recovery reports: a first one when the replayed step committed, the final one after
        the steps that follow it."""
        for rec in self.pending:
            g = rec.gen.gen
            for r in range(rec.gen.world_size):
                seen = rec.reports.get(r)
                if (seen is None or not seen.final) and (
                    report := self.records.get_record(keys.k_report(g, r), RecoveryReport)
                ) is not None:
                    rec.reports[r] = report

    def flush(self, current_gen: int, final: bool = False) -> None:
        """Emit `recovered` for each recovery whose reports are all final, or that a newer generation superseded
        after its replay, or (`final`: the job is ending) that has any report at all."""
        self.read_reports()
        for rec in list(self.pending):
            complete = len(rec.reports) == rec.gen.world_size and all(r.final for r in rec.reports.values())
            superseded = current_gen > rec.gen.gen
            if complete or final or (superseded and rec.reports):
                self.pending.remove(rec)
                if rec.reports:
                    self._emit(rec)

    @staticmethod
    def _tier(rec: PendingRecovery) -> str:
        """"hot" when every standby that took a rank already held that rank's state (a hot standby, runtime.training.
        hot: its report is not a receiver's, nothing was sent to it); else "warm"."""
        taken = [d.rank for d in rec.deaths if d.proc not in rec.left_out]
        hot = bool(taken) and all((r := rec.reports.get(rank)) is not None and r.role != "receiver" for rank in taken)
        return "hot" if hot else "warm"

    def _emit(self, rec: PendingRecovery) -> None:
        m = recovery_metrics([(d.failure_at, d.declared_at) for d in rec.deaths], list(rec.reports.values()))
        def new_of(d: Death) -> str | None:
            return None if d.proc in rec.left_out else rec.gen.members[d.rank]

        self.events.emit(Recovered(
            generation=rec.gen.gen, step=m["step"],
            ranks=[{"rank": d.rank, "old": d.proc, "new": new_of(d)} for d in rec.deaths],
            causes=[d.cause for d in rec.deaths], recovery_s=m["recovery_s"],
            handoff_bytes=m["handoff_bytes"], sources=m["sources"],
            detect_s=m["detect_s"], reconfigure_s=m["reconfigure_s"], handoff_s=m["handoff_s"],
            replay_s=m["replay_s"], warmup_penalty_s=m["warmup_penalty_s"],
            reconfigure_split=m["reconfigure_split"], tier=self._tier(rec), generations=len(rec.attempts) + 1,
            failed_attempts=rec.attempts, refetched_chunks=m["refetched_chunks"],
            handoff_overlapped_s=m["handoff_overlapped_s"],
        ))
        if rec.left_out:
            out = [d for d in rec.deaths if d.proc in rec.left_out]
            self.events.emit(Shrunk(
                generation=rec.gen.gen, width_from=max(rec.left_out.values()), width_to=rec.gen.world_size,
                logical_width=rec.gen.logical_width, ranks=[{"rank": d.rank, "proc": d.proc} for d in out],
                cause="; ".join(f"{d.proc} {d.cause}" for d in out) + ": no standby ready within the standby wait",
                planned=False, mode=rec.mode, lost_s=m["recovery_s"], first_step_s=m["replay_s"] or None,
                steady_step_s=None))
            log.warning("the job shrank to %d of %d members after losing %s (%s); it grows back when a standby is "
                        "ready", rec.gen.world_size, rec.gen.logical_width, ", ".join(d.proc for d in out), rec.mode)
        for d in rec.deaths:
            new = new_of(d)
            if new is None:
                continue
            log.warning("worker %s (pid %d) died at step %d (%s); standby %s took rank %d in %.2f s "
                        "(detect %.3f, reconfigure %.3f, handoff %.3f, replay %.3f)", d.proc, d.pid, m["step"],
                        d.cause, new, d.rank, m["recovery_s"], m["detect_s"], m["reconfigure_s"], m["handoff_s"],
                        m["replay_s"])
