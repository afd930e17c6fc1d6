"""A failure drill for the local demo: scripted telemetry in which one node degrades, and real kills.

`DegradingFeed` is a `TelemetryFeed`: every node reports healthy telemetry once per (scaled) hour, except the node
holding `degrade_rank`, which from `degrade_from_h` on shows what precedes a GPU fault: climbing corrected ECC
counts and an XID 48 (double-bit ECC). Once that rank has moved to another node, the new node is healthy.

`FailureDrill` watches a `Supervisor`'s happenings and kills worker processes with SIGKILL, as a real fault would:

1. the predicted failure: once the policy has pre-warmed a standby for the degrading node and it is warm, the
   process holding `degrade_rank` is killed;
2. the unpredicted failure: once the first recovery is done and the policy has settled again, the process holding
   `surprise_rank` is killed with no warning in its telemetry.

Each stage has a deadline, so a drill never waits forever for a condition that does not come. A run whose settings
would let every stage time out (a cloud provider, one worker, a standby held from the start, a real-time clock) is
refused by `drill_refusal` before anything launches, with what to change.
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from flows.models import TrainingRun
from flows.supervisor import EVENT_PREFIX, Happening
from policy.telemetry import TelemetrySample
from runtime.wire.event_records import Event, GenerationStarted


@dataclass
class DegradingFeed:
    degrade_rank: int = 1
    degrade_from_h: float = 6.0
    _last_h: dict[str, int] = field(default_factory=dict)
    _degrading_node: str | None = None

    def read(self, now_h: float, nodes: dict[int, str]) -> list[TelemetrySample]:
        if self._degrading_node is None and now_h >= self.degrade_from_h:
            self._degrading_node = nodes.get(self.degrade_rank)
        out = []
        for rank, node in sorted(nodes.items()):
            first = self._last_h.get(node, -1) + 1
            last = math.floor(now_h)
            for h in range(first, last + 1):
                sick = node == self._degrading_node and h >= self.degrade_from_h
                severity = min(1.0, (h - self.degrade_from_h + 1) / 4.0) if sick else 0.0
                out.append(
                    TelemetrySample(
                        node_id=node,
                        t_h=float(h),
                        gpu_temp_c=45.0 + 15 * severity,
                        hbm_temp_c=55.0 + 10 * severity,
                        power_w=380.0,
                        ecc_sbe_count=int(40 * severity),
                        ecc_dbe_count=0,
                        row_remaps=1 if severity > 0.5 else 0,
                        xid_codes=(48,) if severity >= 0.5 else (),
                        nvlink_errors=0,
                        pcie_errors=0,
                        nic_errors=0,
                        node_age_days=400.0 + rank,
                        failures_last_30d=0,
                    )
                )
            self._last_h[node] = max(last, first - 1)
        return out


@dataclass
class FailureDrill:
    """Kills workers at the scripted moments (see the module docstring); `observe` is called every tick."""

    degrade_rank: int = 1
    surprise_rank: int = 0
    stage_timeout_s: float = 60.0
    settle_s: float = 3.0
    clock: Callable[[], float] = time.monotonic
    stage: int = 0
    log: list[str] = field(default_factory=list)
    _prewarmed: bool = False
    _ready_after_prewarm: bool = False
    _recovered_at: float | None = None
    _stage_started: float | None = None
    _pids: dict[int, int] = field(default_factory=dict)

    def observe(self, happenings: list[Happening], events: Sequence[Event]) -> list[Happening]:
        now = self.clock()
        if self._stage_started is None:
            self._stage_started = now
        for ev in events:
            if isinstance(ev, GenerationStarted):
                for m in ev.members:
                    if m.get("pid"):
                        self._pids[int(m["rank"])] = int(m["pid"])
        for h in happenings:
            if h.event == f"{EVENT_PREFIX}.standby.prewarmed":
                self._prewarmed = True
            elif h.event == f"{EVENT_PREFIX}.standby.ready" and self._prewarmed:
                self._ready_after_prewarm = True
            elif h.event == f"{EVENT_PREFIX}.standby.promoted" and self.stage == 1:
                self._recovered_at = now
        out: list[Happening] = []
        if self.stage == 0 and self._ready_after_prewarm:
            out += self._kill(self.degrade_rank, "predicted: its telemetry degraded first")
        elif self.stage == 1 and self._recovered_at is not None and now - self._recovered_at >= self.settle_s:
            out += self._kill(self.surprise_rank, "unpredicted: no warning in its telemetry")
        elif self.stage < 2 and now - self._stage_started > self.stage_timeout_s:
            self.log.append(f"stage {self.stage} timed out after {self.stage_timeout_s:.0f} s")
            self.stage = 2
        return out

    def _kill(self, rank: int, why: str) -> list[Happening]:
        pid = self._pids.get(rank)
        self.stage += 1
        self._stage_started = self.clock()
        if pid is None:
            self.log.append(f"no pid known for rank {rank}")
            return []
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            self.log.append(f"rank {rank} (pid {pid}) was already gone")
            return []
        self.log.append(f"SIGKILLed rank {rank} (pid {pid}): {why}")
        return [
            Happening(
                f"{EVENT_PREFIX}.drill.killed",
                f"{EVENT_PREFIX}.rank.{rank}",
                f"drill: SIGKILL to rank {rank} (pid {pid}), {why}",
                {"rank": rank, "pid": pid},
            )
        ]


def drill_refusal(run: TrainingRun, time_scale: float, policy_every_s: float) -> str | None:
    """Why the drill could not do what it says with these settings (what to change), or None when it can."""
    feed, drill = DegradingFeed(), FailureDrill()
    victims = sorted({drill.degrade_rank, drill.surprise_rank})
    # The node shows XID 48 two telemetry hours after it starts degrading; leave half a stage for the pre-warm.
    min_scale = (feed.degrade_from_h + 2.0) * 3600.0 / (drill.stage_timeout_s / 2)
    max_every_s = drill.stage_timeout_s / 10
    if run.provider != "local":
        return (
            f"the drill SIGKILLs worker processes by pid on this machine, so it runs with run.provider 'local' only "
            f"(this run: {run.provider!r}); set drill to false, or use `faults` to inject failures in the job itself"
        )
    if run.workers <= victims[-1]:
        return (
            f"the drill degrades rank {drill.degrade_rank}'s node and kills ranks {victims}: "
            f"set run.workers to at least {victims[-1] + 1}"
        )
    if run.standby.min_warm > 0:
        return (
            f"the drill shows the policy pre-warming a standby for a degrading node, but run.standby.min_warm="
            f"{run.standby.min_warm} holds one from the start, so nothing would be pre-warmed and the drill would "
            "kill nobody: set run.standby.min_warm to 0 (and max_warm to 1 or more), or drill to false"
        )
    if run.standby.max_warm < 1:
        return "the drill needs room for the standby the policy pre-warms: set run.standby.max_warm to 1 or more"
    if time_scale < min_scale:
        return (
            f"the drill's node degrades {feed.degrade_from_h:g} telemetry hours in and each stage waits "
            f"{drill.stage_timeout_s:.0f} s, so with time_scale={time_scale:g} nothing would happen in time: set "
            f"time_scale to at least {min_scale:.0f} (the demo uses 3600: one wall second stands for an hour)"
        )
    if policy_every_s > max_every_s:
        return (
            f"the drill's stages wait {drill.stage_timeout_s:.0f} s for the policy to react, so policy_every_s="
            f"{policy_every_s:g} is too slow: set it to {max_every_s:g} s or less (the demo uses 0.5)"
        )
    return None
