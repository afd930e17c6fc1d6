"""`trainmover bench exit-path`: how long a process's death takes to reach the coordinator on one machine.

`trainmover run` starts every process through one agent in the launcher (runtime.launcher.LocalHostPool). A death
can reach the coordinator two ways:

- **agent report**: the agent's thread wakes on the process's pidfd, reaps it, seals an `exited` frame, sends it
  over the link; the link thread reads and checks it, marks the process gone and wakes the coordinator's loop
  (the path every host of a multi-host job takes);
- **own pidfd** (what the local pool does): the coordinator's loop waits on the process's pidfd itself and reads
  the exit status at once; the agent's report that follows changes nothing.

Each trial starts an idle process through the real local agent, SIGKILLs it, and times, from the signal, the moment
the coordinator's thread knows the exit code, alternating the two paths. `--load N` runs N busy processes beside
it (the training workers that share the cores in a real job), since each hop is a thread wake-up that must find
a free core. No torch is imported by the measured processes.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import select
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from runtime.control.hosts import HostPool
from runtime.launcher import LaunchConfig, LocalProcess, start_local_pool
from runtime.wire.auth import new_token


def _spin(stop: Any) -> None:
    x = 0
    while not stop.is_set():
        for _ in range(10_000):
            x += 1


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def measure(trials: int, load: int) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    spinners = [ctx.Process(target=_spin, args=(stop,), daemon=True) for _ in range(load)]
    for sp in spinners:
        sp.start()
    times: dict[str, list[float]] = {"own_pidfd": [], "agent_report": []}
    with tempfile.TemporaryDirectory(prefix="tm-exitpath-") as tmp:
        script = Path(tmp) / "idle.py"
        script.write_text("import time\ntime.sleep(120)\n")
        pool = start_local_pool(LaunchConfig(script=str(script), nproc=1, standby=0, quiet=True), 1, new_token(),
                                None)
        try:
            for i in range(2 * trials):
                path = "own_pidfd" if i % 2 == 0 else "agent_report"
                h = pool.spawn(f"p{i}", "worker")
                assert isinstance(h, LocalProcess) and h.pid > 0, h.start_error
                fd = h.exit_fd()
                assert fd is not None
                # Kill it once it has started up and sleeps, as a training process runs when it dies.
                select.select([fd], [], [], 0.2)  # a pace between trials, not a synchronisation
                t0 = time.perf_counter()
                os.kill(h.pid, signal.SIGKILL)
                if path == "own_pidfd":
                    select.select([fd], [], [], 10.0)
                    code = h.poll()
                else:
                    code = HostPool.wait_exit(pool, h, 10.0)  # the link thread's answer only
                elapsed = time.perf_counter() - t0
                if code != -signal.SIGKILL:
                    raise RuntimeError(f"trial {i}: exit code {code}, expected {-signal.SIGKILL}")
                times[path].append(elapsed)
                HostPool.wait_exit(pool, h, 10.0)  # the agent has reported before the next trial
                h.close()
        finally:
            pool.close()
            stop.set()
            for sp in spinners:
                sp.join(5)
    out: dict[str, Any] = {"trials": trials, "load_processes": load, "cores": os.cpu_count()}
    for path, values in times.items():
        out[path] = {"p50_ms": 1000 * statistics.median(values), "p90_ms": 1000 * _pct(values, 0.9),
                     "max_ms": 1000 * max(values)}
    out["ratio_p50_agent_report_to_own_pidfd"] = out["agent_report"]["p50_ms"] / out["own_pidfd"]["p50_ms"]
    return out


def main(trials: int, loads: list[int], json_path: str | None) -> int:
    rows = [measure(trials, load) for load in loads]
    print(f"exit path on one machine ({os.cpu_count()} cores): SIGKILL -> the coordinator knows the exit code, "
          f"{trials} trials per path, alternated")
    print(f"  {'busy processes':>14}  {'own pidfd p50/p90/max ms':>26}  {'agent report p50/p90/max ms':>29}  ratio p50")
    for r in rows:
        a, b = r["own_pidfd"], r["agent_report"]
        print(f"  {r['load_processes']:>14}  {a['p50_ms']:>8.2f} {a['p90_ms']:>8.2f} {a['max_ms']:>8.2f}  "
              f"{b['p50_ms']:>10.2f} {b['p90_ms']:>8.2f} {b['max_ms']:>8.2f}  "
              f"{r['ratio_p50_agent_report_to_own_pidfd']:>9.2f}")
    if json_path:
        Path(json_path).write_text(json.dumps({"command": " ".join(["trainmover", "bench", "exit-path", *sys.argv[3:]]),
                                               "rows": rows}, indent=1))
    return 0
