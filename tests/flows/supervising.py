"""Drive a Supervisor the way the flow does (a tick every 0.1 s) until its job ends, bounded, explaining a stall."""

from __future__ import annotations

import time
from pathlib import Path

from flows.drill import FailureDrill
from flows.supervisor import Happening, Supervisor
from tests.diagnostics import explained


def supervise(sup: Supervisor, script: Path, timeout_s: float, drill: FailureDrill | None = None
              ) -> list[Happening]:
    """Start `script` under `sup` and tick until the job is done; every happening, the drill's among them."""
    seen: list[Happening] = []
    deadline = time.monotonic() + timeout_s
    sup.start(script)
    with explained(sup.events_path, sup.workdir / "job.log"):
        while not sup.done():
            assert time.monotonic() < deadline, f"job still running after {timeout_s} s: {[h.event for h in seen]}"
            n = len(sup.events)
            hs = sup.tick()
            if drill is not None:
                hs += drill.observe(hs, sup.events[n:])
            seen += hs
            time.sleep(0.1)  # the flow's tick pace
    return seen
