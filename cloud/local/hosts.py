"""Hosts for the local provider: each launched "instance" really runs its job's agent, as a cloud instance does.

A `LocalProvider(hosts=...)` boots an instance launched with a bootstrap (`LaunchRequest.bootstrap`) into a host
of the job: it starts the `trainmover agent` that the instance's systemd unit would start (`agent_argv`), with the
bootstrap's coordinator, slots, job id and secret, named after the instance id. A stop (park) powers the host off,
every process on it killed at once; a start boots the agent again (a woken standby comes back and warms up); a
terminate, or a spot interruption reaching its deadline, powers it off for good.

Two kinds of host:

- `ProcessHosts`: the agent is a process group on this machine, on 127.0.0.1. No privileges needed; a host loss
  is its process group killed.
- `NamespaceHosts`: every instance is a host of its own: a Linux network namespace with its own address on a
  bridge (`Bridge`), running the agent. Needs root and `ip` (iproute2). A host loss kills every process in its
  namespace; the coordinator runs in the caller's namespace on the bridge's address (`coordinator_host`).
  Traffic stays on the bridge: the namespaces have no route anywhere else.

The secret reaches the agent as the bootstrap says: a `local-file` `SecretRef` (`cloud.secrets.LocalFileStore`)
is passed as `--secret-file`; it never appears in an argv or an environment.
"""

from __future__ import annotations

import abc
import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from cloud.base import InvalidRequestError, UnsupportedError
from cloud.bootstrap import AgentBootstrap

KILL_WAIT_S = 10.0
"""How long a powered-off host's processes get to be reaped after SIGKILL."""


def power_cut(listing: Callable[[], list[int]], *, within_s: float = KILL_WAIT_S) -> float:
    """Kill every process that `listing` names at once, as a host losing power; returns when the SIGKILLs went out.

    One listing then SIGKILL leaves behind a child forked between the two (the agent starting a standby, a
    zygote forking one): it outlives its killed parent. So the processes are stopped first (a stopped process
    cannot fork), listed again until no new one appears, and only then killed, all together.
    """
    stopped: set[int] = set()
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        new = [pid for pid in listing() if pid not in stopped]
        if not new:
            break
        for pid in new:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
            stopped.add(pid)
    at = time.time()
    for pid in stopped | set(listing()):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return at


def agent_argv(spec: AgentBootstrap, name: str, *, secret_file: str, address: str | None = None,
               python: str = sys.executable) -> list[str]:
    """`trainmover agent` as a host of `spec`'s job runs it (the systemd unit's command, as an argv)."""
    argv = [python, "-m", "trainmover", "agent", "--coordinator", spec.coordinator, "--slots", str(spec.slots),
            "--secret-file", secret_file, "--job-id", spec.job_id, "--name", name, "--quiet"]
    bind = spec.address if spec.address is not None else address
    if bind is not None:
        argv += ["--address", bind]
    return argv


def _secret_file(spec: AgentBootstrap) -> str:
    if spec.secret.kind != "local-file":
        raise UnsupportedError(
            f"local: the bootstrap's secret is in {spec.secret.kind}, which a local host cannot read: store it with "
            "cloud.secrets.LocalFileStore",
            provider="local",
            code="UnsupportedSecretStore",
        )
    return spec.secret.name


class LocalHosts(abc.ABC):
    """Where a local provider's instances run their agents. Thread-safe."""

    coordinator_host: str
    """The address the hosts reach the coordinator at (the coordinator binds to it)."""

    def __init__(self, logs: Path) -> None:
        self.logs = Path(logs)
        self.logs.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._agents: dict[str, subprocess.Popen[bytes]] = {}
        self._boots: dict[str, int] = {}

    @abc.abstractmethod
    def address(self, instance_id: str) -> str:
        """The instance's private address."""

    @abc.abstractmethod
    def pids(self, instance_id: str) -> list[int]:
        """Every process running on the instance now."""

    @abc.abstractmethod
    def _wrap(self, instance_id: str, argv: list[str]) -> list[str]:
        """`argv` as run on the instance."""

    def _made(self, instance_id: str) -> None:  # noqa: B027 - a hook: process hosts have nothing to make
        """Make the instance's host the first time it boots."""

    def _unmade(self, instance_id: str) -> None:  # noqa: B027 - a hook
        """Remove what `_made` made."""

    def boot(self, instance_id: str, spec: AgentBootstrap) -> None:
        """Power the instance on: start its agent (a no-op when it runs already)."""
        secret_file = _secret_file(spec)
        with self._lock:
            running = self._agents.get(instance_id)
            if running is not None and running.poll() is None:
                return
            self._made(instance_id)
            boot = self._boots[instance_id] = self._boots.get(instance_id, 0) + 1
            argv = self._wrap(instance_id, agent_argv(spec, instance_id, secret_file=secret_file,
                                                      address=self.address(instance_id)))
            log = self.logs / f"{instance_id}.boot{boot}.log"
            with open(log, "wb") as out:
                self._agents[instance_id] = subprocess.Popen(
                    argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                    env={k: v for k, v in os.environ.items() if not k.startswith("TRAINMOVER_JOB_SECRET")},
                )

    def power_off(self, instance_id: str) -> None:
        """Kill every process on the instance at once, as a host losing power would (a no-op when off)."""
        with self._lock:
            self._kill(instance_id)

    def remove(self, instance_id: str) -> None:
        """Power off for good and remove the host."""
        with self._lock:
            self._kill(instance_id)
            self._unmade(instance_id)
            self._agents.pop(instance_id, None)

    def is_on(self, instance_id: str) -> bool:
        with self._lock:
            agent = self._agents.get(instance_id)
            return agent is not None and agent.poll() is None

    def agent_pid(self, instance_id: str) -> int | None:
        with self._lock:
            agent = self._agents.get(instance_id)
            return agent.pid if agent is not None and agent.poll() is None else None

    def close(self) -> None:
        for instance_id in list(self._agents):
            self.remove(instance_id)

    def _kill(self, instance_id: str) -> None:
        power_cut(lambda: self.pids(instance_id))
        agent = self._agents.get(instance_id)
        if agent is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                agent.wait(timeout=KILL_WAIT_S)


class ProcessHosts(LocalHosts):
    """Every instance's agent is a process group on this machine, on 127.0.0.1 (see the module docstring)."""

    coordinator_host = "127.0.0.1"

    def address(self, instance_id: str) -> str:
        return "127.0.0.1"

    def _wrap(self, instance_id: str, argv: list[str]) -> list[str]:
        return argv

    def pids(self, instance_id: str) -> list[int]:
        agent = self._agents.get(instance_id)
        if agent is None or agent.poll() is not None:
            return []
        # The agent starts each process in a session of its own: the host's processes are the agent's descendants.
        children: dict[int, list[int]] = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError, ValueError, IndexError):
                    stat = (entry / "stat").read_text()
                    ppid = int(stat[stat.rindex(")") + 2:].split()[1])
                    children.setdefault(ppid, []).append(int(entry.name))
        found, todo = [], [agent.pid]
        while todo:
            pid = todo.pop()
            found.append(pid)
            todo += children.get(pid, [])
        return found


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=20)


def namespaces_unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None."""
    if sys.platform != "linux":
        return "network namespaces are a Linux feature"
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


class Bridge:
    """A Linux bridge with one network namespace per host, each with its own address on it; `close()` removes
    every process, namespace and link it made. Hosts are numbered from 0 in the order they are added."""

    def __init__(self) -> None:
        self.id = f"{os.getpid() % 1000:03d}{random.randrange(100):02d}"
        self.subnet = f"10.{random.randrange(200, 250)}.{random.randrange(1, 250)}"
        self.bridge = f"tmb{self.id}"
        self.coordinator_ip = f"{self.subnet}.1"
        self.hosts: list[str] = []
        _ip("link", "add", self.bridge, "type", "bridge")
        try:
            _ip("addr", "add", f"{self.coordinator_ip}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
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
        if 10 + i > 254:
            raise InvalidRequestError("local: a bridge holds at most 245 hosts", provider="local")
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

    def pids(self, i: int) -> list[int]:
        got = _ip("netns", "pids", self.ns(i), check=False)
        return [int(p) for p in got.stdout.split()]

    def kill_host(self, *hosts: int) -> float:
        """SIGKILL every process in the namespaces of `hosts`, all at once (`power_cut`); returns when."""
        return power_cut(lambda: [pid for i in hosts for pid in self.pids(i)])

    def cut(self, i: int) -> None:
        _ip("link", "set", self.veth(i), "down")

    def reconnect(self, i: int) -> None:
        _ip("link", "set", self.veth(i), "up")

    def remove_host(self, i: int) -> None:
        self.kill_host(i)
        _ip("link", "del", self.veth(i), check=False)  # its peer goes with it, at once
        _ip("netns", "del", self.ns(i), check=False)

    def close(self) -> None:
        for i in range(len(self.hosts)):
            self.remove_host(i)
        _ip("link", "del", self.bridge, check=False)

    def leftovers(self) -> list[str]:
        """What close() failed to remove (a test asserts this is empty)."""
        left = [ns for ns in _ip("netns", "list", check=False).stdout.split() if ns.startswith(f"tm{self.id}")]
        links = _ip("-o", "link", check=False).stdout
        left += [name for name in (self.bridge, *(self.veth(i) for i in range(len(self.hosts))))
                 if f" {name}:" in links or f" {name}@" in links]
        return left


class NamespaceHosts(LocalHosts):
    """Every instance is a host of its own: a network namespace on a `Bridge` (see the module docstring)."""

    def __init__(self, logs: Path) -> None:
        why = namespaces_unavailable()
        if why is not None:
            raise UnsupportedError(f"local: namespace hosts: {why}; use process hosts instead", provider="local")
        super().__init__(logs)
        self.bridge = Bridge()
        self.coordinator_host = self.bridge.coordinator_ip
        self._index: dict[str, int] = {}

    def _made(self, instance_id: str) -> None:
        if instance_id not in self._index:
            self._index[instance_id] = self.bridge.add_host()

    def _unmade(self, instance_id: str) -> None:
        i = self._index.get(instance_id)
        if i is not None:
            self.bridge.remove_host(i)

    def namespace(self, instance_id: str) -> str:
        return self.bridge.ns(self._index[instance_id])

    def address(self, instance_id: str) -> str:
        if instance_id not in self._index:
            self._made(instance_id)
        return self.bridge.address(self._index[instance_id])

    def _wrap(self, instance_id: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace(instance_id), *argv]

    def pids(self, instance_id: str) -> list[int]:
        i = self._index.get(instance_id)
        return self.bridge.pids(i) if i is not None else []

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.bridge.close()


__all__ = [
    "Bridge", "LocalHosts", "NamespaceHosts", "ProcessHosts", "agent_argv", "namespaces_unavailable", "power_cut",
]
