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
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=20)


def unavailable() -> str | None:
    """Why namespaces cannot be made here (a skip reason), or None."""
    if shutil.which("ip") is None:
        return "needs the `ip` command (iproute2) to make network namespaces"
    if os.geteuid() != 0:
        return "needs root to make network namespaces"
    probe = f"tmprobe{os.getpid() % 100000}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class Cluster:
    """A bridge with `count` host namespaces; `close()` removes every process, namespace and link it made."""

    def __init__(self, count: int, tmp: Path) -> None:
        self.id = f"{os.getpid() % 1000:03d}{random.randrange(100):02d}"
        self.subnet = f"10.{random.randrange(200, 250)}.{random.randrange(1, 250)}"
        self.bridge = f"tmb{self.id}"
        self.coordinator_ip = f"{self.subnet}.1"
        self.tmp = tmp
        self.hosts: list[str] = []
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, Path] = {}
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.coordinator_ip}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for _ in range(count):
                self.add_host()
        except BaseException:
            self.close()
            raise

    def ns(self, i: int) -> str:
        return f"tm{self.id}h{i}"

    def veth(self, i: int) -> str:
        return f"tmv{self.id}{i}"

    def address(self, i: int) -> str:
        return f"{self.subnet}.{10 + i}"

    def add_host(self) -> int:
        i = len(self.hosts)
        ns, veth, peer = self.ns(i), self.veth(i), f"tmp{self.id}{i}"
        _ip("netns", "add", ns)
        self.hosts.append(ns)
        _ip("link", "add", veth, "type", "veth", "peer", "name", peer)
        _ip("link", "set", peer, "netns", ns)
        _ip("link", "set", veth, "master", self.bridge)
        _ip("link", "set", veth, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "link", "set", peer, "name", "eth0")
        _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        return i

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

    def pids(self, i: int) -> list[int]:
        got = _ip("netns", "pids", self.ns(i), check=False)
        return [int(p) for p in got.stdout.split()]

    def kill_host(self, *hosts: int) -> float:
        """SIGKILL every process in the namespaces of `hosts`, all at once (listed first); returns when."""
        pids = [pid for i in hosts for pid in self.pids(i)]
        at = time.time()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return at

    def cut(self, i: int) -> None:
        _ip("link", "set", self.veth(i), "down")

    def reconnect(self, i: int) -> None:
        _ip("link", "set", self.veth(i), "up")

    def close(self) -> None:
        for i in range(len(self.hosts)):
            self.kill_host(i)
        for proc in self.agents.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        for i, ns in enumerate(self.hosts):
            _ip("link", "del", self.veth(i), check=False)  # its peer goes with it, at once
            _ip("netns", "del", ns, check=False)
        _ip("link", "del", self.bridge, check=False)

    def leftovers(self) -> list[str]:
        """What close() failed to remove (a test asserts this is empty)."""
        left = [ns for ns in _ip("netns", "list", check=False).stdout.split() if ns.startswith(f"tm{self.id}")]
        links = _ip("-o", "link", check=False).stdout
        left += [name for name in (self.bridge, *(self.veth(i) for i in range(len(self.hosts)))) if f" {name}:" in links
                 or f" {name}@" in links]
        return left


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
