"""Failure injection, inside the library, so that tests and demos read like scenarios.

A plan is a `;`-separated list of faults, each `ACTION:key=value,...`, for example::

    kill:rank=1,step=5,phase=exchange      # SIGKILL rank 1 while its step-5 gradients are in flight
    stop:rank=2,step=9,phase=before_exchange  # SIGSTOP (a hang) rank 2 just before its step-9 exchange
    kill:role=sender,phase=handoff_send,chunk=3  # the replica streaming state dies after 3 chunks
    corrupt:role=sender,phase=handoff_send,chunk=2  # chunk 2 leaves the sender with one bit flipped

Actions are real signals sent by the process to itself: kill (SIGKILL), stop (SIGSTOP), term (SIGTERM),
exit (os._exit(1)); host (SIGKILL the host's agent, then itself: every process of the host follows the
agent within a heartbeat, so the host is lost as a whole); and corrupt, which flips a bit of the handoff
chunk being sent (after its MAC was taken:
what a bad link or a forger does), for the handoff's MAC and refetch. Each fault fires once per job: the first
process to claim it in the store fires it.
Before it fires, the process records the wall-clock time, so benchmarks can measure detection from the
moment of failure.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from typing import Literal

from runtime.fault_grammar import ACTION_NAMES, PHASES
from runtime.wire.protocol import FaultFired
from runtime.wire.store import Records, k_fault

Phase = Literal[
    "before_exchange", "exchange", "after_exchange", "optimizer", "handoff_send", "handoff_recv", "warmup",
    "standby_wait", "switch",
]
ACTIONS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "term": signal.SIGTERM, "exit": None, "corrupt": None,
           "host": None}
assert tuple(ACTIONS) == ACTION_NAMES, "runtime/fault_grammar.py lists the same actions"


class FaultPlanError(ValueError):
    """A fault plan that cannot be parsed; the message shows the expected form."""


@dataclass(frozen=True, slots=True)
class Fault:
    """One failure to inject."""

    action: str
    phase: str
    step: int | None = None
    rank: int | None = None
    proc: str | None = None
    role: str | None = None  # "sender" / "receiver" during a handoff
    chunk: int | None = None
    gen: int | None = None


def parse_plan(spec: str) -> list[Fault]:
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(";"))):
        action, _, rest = item.partition(":")
        if action not in ACTIONS:
            raise FaultPlanError(
                f"fault {item!r}: action must be one of {', '.join(ACTIONS)}, e.g. kill:rank=1,step=5,phase=exchange"
            )
        fields: dict[str, str] = {}
        for pair in filter(None, rest.split(",")):
            key, sep, value = pair.partition("=")
            if not sep:
                raise FaultPlanError(f"fault {item!r}: expected key=value, got {pair!r}")
            if key.strip() in fields:
                raise FaultPlanError(f"fault {item!r}: {key.strip()} is given twice; keep one")
            fields[key.strip()] = value.strip()
        phase = fields.pop("phase", "before_exchange")
        if phase not in PHASES:
            raise FaultPlanError(f"fault {item!r}: phase must be one of {', '.join(PHASES)}")
        try:
            fault = Fault(
                action=action,
                phase=phase,
                step=int(fields.pop("step")) if "step" in fields else None,
                rank=int(fields.pop("rank")) if "rank" in fields else None,
                proc=fields.pop("proc", None),
                role=fields.pop("role", None),
                chunk=int(fields.pop("chunk")) if "chunk" in fields else None,
                gen=int(fields.pop("gen")) if "gen" in fields else None,
            )
        except ValueError as exc:
            raise FaultPlanError(f"fault {item!r}: {exc}") from None
        if fields:
            raise FaultPlanError(f"fault {item!r}: unknown keys {sorted(fields)}")
        if action == "corrupt" and phase != "handoff_send":
            raise FaultPlanError(f"fault {item!r}: corrupt applies to phase=handoff_send only")
        faults.append(fault)
    return faults


class FaultInjector:
    """Fires the planned faults that match the point a process has reached."""

    def __init__(self, spec: str, records: Records | None, proc: str) -> None:
        self.faults = parse_plan(spec)
        self.records = records
        self.proc = proc

    def __bool__(self) -> bool:
        return bool(self.faults)

    def at(
        self,
        phase: str,
        *,
        step: int | None = None,
        rank: int | None = None,
        gen: int | None = None,
        role: str | None = None,
        chunk: int | None = None,
    ) -> bool:
        """Fire what matches; True when a `corrupt` fault fired (the caller corrupts what it is sending)."""
        corrupt = False
        if not self.faults:
            return False
        for index, f in enumerate(self.faults):
            if f.phase != phase:
                continue
            if any(
                want is not None and want != have
                for want, have in (
                    (f.step, step), (f.rank, rank), (f.gen, gen), (f.role, role), (f.chunk, chunk), (f.proc, self.proc)
                )
            ):
                continue
            if self.records is not None and self.records.store.add(k_fault(index) + "/claims", 1) != 1:
                continue  # fired already, by this process's predecessor in the same rank
            corrupt |= self._fire(index, f, step, rank)
        return corrupt

    def _fire(self, index: int, fault: Fault, step: int | None, rank: int | None) -> bool:
        record = FaultFired(time=time.time(), proc=self.proc, action=fault.action, pid=os.getpid(), rank=rank,
                            step=step, phase=fault.phase)
        if self.records is not None:
            self.records.put(k_fault(index), record)
        if fault.action == "corrupt":
            return True
        if fault.action == "host":
            # The whole host dies: its agent first (every other process of the host follows it within a
            # heartbeat, runtime.training.job), then this process. Without an agent (one machine) only this process.
            agent = os.environ.get("TM_AGENT_PID", "")
            if agent.isdigit():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(agent), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        sig = ACTIONS[fault.action]
        if sig is None:
            os._exit(1)
        os.kill(os.getpid(), sig)
        return False
