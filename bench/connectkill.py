"""`trainmover bench connect-kill`: a worker SIGKILLed the moment its generation is published, while its peers build
the generation's Gloo group.

Each trial runs `trainmover run --nproc 2 --standby 1 --wait-for-standbys` of the tiny job (300 steps, 5 ms of pace
per step), waits for the first `generation` event and SIGKILLs rank 1 at once, so the kill lands while the members
read each other's addresses or connect. The survivor must leave that building for the next generation: the
`recovered` event's `reconfigure_s` says how long that took (the group's rebuild included). Gloo alone would hold it
for the group's timeout (6 s with the default 30 s connect timeout) when the lost peer never published its address,
or five times that (30 s) when it published and died before connecting; the runtime abandons the building as soon as
the next generation forms (`runtime.training.comm.Connecting`). `--load N` runs N busy processes beside the job (the
two cores of this machine shared, as in CI), which widens the window the kill lands in.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "runtime" / "scripts" / "tiny_job.py"
SLOW_S = 1.0
"""A reconfiguration over this long waited on a Gloo timeout."""


def _spin(stop: Any) -> None:
    x = 0
    while not stop.is_set():
        for _ in range(10_000):
            x += 1


def _events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            break  # a line still being written
    return out


def trial(workdir: Path, timeout_s: float = 300.0) -> dict[str, Any]:
    """One job, one kill at generation 0's publication; what its recovery cost."""
    events = workdir / "events.jsonl"
    events.unlink(missing_ok=True)
    job = subprocess.Popen(
        [sys.executable, "-m", "trainmover", "run", "--nproc", "2", "--standby", "1", "--threads", "1",
         "--wait-for-standbys", "--events", str(events), str(SCRIPT), "--steps", "300", "--pace-ms", "5"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + timeout_s
        generation = None
        while generation is None:
            if time.monotonic() > deadline or job.poll() is not None:
                raise RuntimeError("the job published no generation")
            generation = next((e for e in _events(events) if e["event"] == "generation"), None)
            time.sleep(0.002)  # polling the events file, bounded by the deadline
        os.kill(generation["members"][1]["pid"], signal.SIGKILL)
        _, err = job.communicate(timeout=timeout_s)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    recovered = [e for e in _events(events) if e["event"] == "recovered"]
    finished = [e for e in _events(events) if e["event"] == "job_finished"]
    if job.returncode != 0 or not recovered or not finished:
        raise RuntimeError(f"the job did not recover and finish (exit {job.returncode}): {err[-500:]}")
    r = recovered[0]
    return {"reconfigure_s": r["reconfigure_s"], "recovery_s": r["recovery_s"], "detect_s": r["detect_s"],
            "handoff_s": r["handoff_s"], "generations": r.get("generations", 1)}


def main(trials: int, load: int, json_path: str | None) -> int:
    stop = multiprocessing.Event()
    spinners = [multiprocessing.Process(target=_spin, args=(stop,), daemon=True) for _ in range(load)]
    for p in spinners:
        p.start()
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="tm-connect-kill-") as tmp:
            for i in range(trials):
                row = trial(Path(tmp))
                rows.append(row)
                print(f"trial {i + 1}: reconfigure {row['reconfigure_s']:.3f} s, recovery {row['recovery_s']:.3f} s",
                      flush=True)
    finally:
        stop.set()
        for p in spinners:
            p.join(timeout=5)
    reconfigure = [r["reconfigure_s"] for r in rows]
    summary = {"trials": trials, "load": load, "median_reconfigure_s": statistics.median(reconfigure),
               "max_reconfigure_s": max(reconfigure), "over_1s": sum(1 for x in reconfigure if x > SLOW_S),
               "median_recovery_s": statistics.median(r["recovery_s"] for r in rows)}
    print(f"kill at the generation's publication, {trials} trials, {load} busy processes beside: reconfiguration "
          f"median {summary['median_reconfigure_s']:.3f} s, max {summary['max_reconfigure_s']:.3f} s, "
          f"{summary['over_1s']} over {SLOW_S:.0f} s; recovery median {summary['median_recovery_s']:.3f} s")
    if json_path:
        Path(json_path).write_text(json.dumps({"summary": summary, "trials": rows}, indent=2))
    return 0
