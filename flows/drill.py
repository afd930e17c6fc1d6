"""A failure drill for the local demo: scripted telemetry in which one node degrades, and real kills.

`DegradingFeed` is a `TelemetryFeed`: every node reports healthy telemetry once per (scaled) hour, except the node
holding `degrade_rank`, which from `degrade_from_h` on shows what precedes a GPU fault: climbing corrected ECC
counts and an XID 48 (double-bit ECC). Once that rank has moved to another node, the new node is healthy.

`FailureDrill` watches a `Supervisor`'s happenings and kills worker processes with SIGKILL, as a real fault would:

1. the predicted failure: once the policy has pre-warmed a standby for the degrading node and it is warm, the
   process holding `degrade_rank` is killed;
2. the unpredicted failure: once the first recovery is done and the policy has settled again, the process holding
   `surprise_rank` is killed with no warning in its telemetry.

Each stage has a deadline, so a drill never waits forever for a condition that does not come.
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from flows.supervisor import EVENT_PREFIX, Happening
from policy.telemetry import TelemetrySample


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

    def observe(self, happenings: list[Happening], events: list[dict[str, object]]) -> list[Happening]:
        now = self.clock()
        if self._stage_started is None:
            self._stage_started = now
        for ev in events:
            if ev.get("event") == "generation":
                members = ev.get("members")
                for m in members if isinstance(members, list) else []:
                    if isinstance(m, dict) and m.get("pid"):
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
