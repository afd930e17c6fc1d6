"""Hosts for multi-host tests and benchmarks: each a Linux network namespace with its own address on a bridge,
made and removed by the test itself. Traffic stays on that bridge: the namespaces have no route anywhere else.

The coordinator runs in the test's own namespace on the bridge's address; each host runs `trainmover agent`
inside its namespace. A host can be killed whole (every process in its namespace, at once), cut off (its link
down, its processes alive) and reconnected.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from cloud.local.hosts import Bridge, namespaces_unavailable

ROOT = Path(__file__).resolve().parents[2]


def unavailable() -> str | None:
    """Why namespaces cannot be made here (a skip reason), or None."""
    return namespaces_unavailable()


class Cluster(Bridge):
    """A bridge with `count` host namespaces (cloud.local.hosts.Bridge) and the agents a test starts in them;
    `close()` removes every process, namespace and link it made."""

    def __init__(self, count: int, tmp: Path) -> None:
        super().__init__()
        self.tmp = tmp
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, Path] = {}
        try:
            for _ in range(count):
                self.add_host()
        except BaseException:
            self.close()
            raise

    def start_agent(self, i: int, port: int, secret: str, slots: int = 1, *extra: str,
                    env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """`trainmover agent` in host i's namespace; the secret travels in its environment, not its argv."""
        log = self.tmp / f"agent-h{i}-{len(self.logs)}.log"
        self.logs[f"h{i}"] = log
        env = {**os.environ, **(env or {}), "TRAINMOVER_JOB_SECRET": secret}
        cmd = ["ip", "netns", "exec", self.ns(i), sys.executable, "-m", "trainmover", "agent",
               "--coordinator", f"{self.coordinator_ip}:{port}", "--slots", str(slots), "--name", f"h{i}",
               "--connect-timeout", "30", *extra]
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        self.agents[f"h{i}"] = proc
        return proc

    def close(self) -> None:
        for i in range(len(self.hosts)):
            self.kill_host(i)
        for proc in self.agents.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        super().close()


@contextlib.contextmanager
def cluster(count: int, tmp: Path) -> Iterator[Cluster]:
    c = Cluster(count, tmp)
    try:
        yield c
    finally:
        c.close()
        assert not c.leftovers(), f"left behind: {c.leftovers()}"


class Events:
    """A job's events file, read as it grows."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.events: list[dict[str, Any]] = []
        self._offset = 0

    def read(self) -> list[dict[str, Any]]:
        if self.path.exists():
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
            complete = data[:data.rfind(b"\n") + 1]
            self._offset += len(complete)
            self.events += [json.loads(line) for line in complete.splitlines() if line.strip()]
        return self.events

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.read() if e["event"] == kind]

    def wait_for(self, what: str, found: Callable[[list[dict[str, Any]]], Any], timeout_s: float,
                 alive: subprocess.Popen[bytes] | None = None) -> Any:
        """Poll the events until `found(events)` is truthy; fail after the timeout or when `alive` exits."""
        deadline = time.monotonic() + timeout_s
        while True:
            hit = found(self.read())
            if hit:
                return hit
            if alive is not None and alive.poll() is not None:
                raise AssertionError(f"the coordinator exited ({alive.returncode}) before {what}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} within {timeout_s:.0f} s; events: "
                                     f"{[e['event'] for e in self.events]}")
            time.sleep(0.05)  # a polling pace for a file another process appends to
