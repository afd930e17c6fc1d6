"""A fork server for a host's training processes: a process that imported torch once, and forks a new training process
in milliseconds instead of starting Python and importing torch again (2.3 s of CPU here with the runtime, 3-4 s on a
busy machine).

That start-up is what a job waits for when its warm standbys are used up: replacing a promoted or lost standby
quickly keeps the next failure covered. A job's first processes, workers and standbys, are forked too once the
zygote is ready (they wait up to `READY_WAIT_S` for its imports): one import per host instead of one per process.

The launcher starts one zygote per job (`ZygoteClient`); each request, a
`ForkRequest` sent as one JSON line, carries the new process's environment and argv, and the zygote answers with
the new process's pid on a line of its own. The zygote forks twice, so that the training process is orphaned
at once and adopted by the launcher, which marks itself a child subreaper: the launcher then owns it exactly like a
subprocess it started itself (it reaps it, reads its exit status, watches its pidfd).

The zygote is a helper, never a single point of failure: when it is gone, hung or refuses a request, the launcher
kills it and starts processes the ordinary way for the rest of the job.

Only the zygote's own imports are shared (torch, numpy, the runtime): it runs no torch operation and starts no
thread before forking, so a forked process is as fresh as a new interpreter for everything the script does.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import json
import os
import random
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

PR_SET_CHILD_SUBREAPER = 36
REQUEST_TIMEOUT_S = 5.0
READY_WAIT_S = 5.0
"""How long a process to start waits for a zygote still importing (`ZygoteClient.wait_ready`) before it is started the
ordinary way: well within the coordinator's wait for the answer (`runtime.control.hosts.SPAWN_ANSWER_S`). Waited once:
a zygote not ready by then (hung, stopped, or slow on a loaded machine) delays no later process."""
KEEPALIVE_S = 0.1
"""How often a caller waiting for the zygote's answer is given the hand (`ZygoteClient.spawn`'s `while_waiting`)."""


@dataclass(frozen=True, slots=True)
class ForkRequest:
    """What the zygote forks: a process running `argv` (the script first) with exactly `env` as its environment."""

    env: dict[str, str]
    argv: list[str]
    output: bool = False
    """The request came with a descriptor (SCM_RIGHTS) that becomes the process's stdout and stderr."""

    def to_json(self) -> bytes:
        """The request as the line the zygote reads."""
        return json.dumps({"env": self.env, "argv": self.argv, "output": self.output}).encode() + b"\n"

    @classmethod
    def from_json(cls, line: bytes | str) -> ForkRequest:
        """The request in one line; ValueError when it is not one."""
        raw = json.loads(line)
        env, argv = (raw.get("env"), raw.get("argv")) if isinstance(raw, dict) else (None, None)
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise ValueError("a fork request needs its environment as an object of strings")
        if not isinstance(argv, list) or not argv:
            raise ValueError("a fork request needs a non-empty argv")
        return cls(env, [str(a) for a in argv], raw.get("output") is True)


def become_subreaper(on: bool = True) -> bool:
    """Adopt orphaned descendants (the zygote's grandchildren), as Linux allows since 3.4; or stop adopting."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def wait_exit(poll: Callable[[], int | None], pidfd: int | None, timeout_s: float) -> int | None:
    """Wait up to `timeout_s` for a child to exit: its exit code (from `poll`), or None if it still runs. Sleeps
    on its pidfd when it has one, else polls every 5 ms."""
    deadline = time.monotonic() + timeout_s
    while (code := poll()) is None:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        if pidfd is not None:
            select.select([pidfd], [], [], left)
        else:
            time.sleep(min(left, 0.005))
    return code


class ChildProcess:
    """A child of this process, watched through a pidfd that turns readable when it exits."""

    def __init__(self, name: str, role: str, pid: int) -> None:
        self.name = name
        self.role = role
        self.pid = pid
        self._pidfd: int | None = None
        with contextlib.suppress(OSError, AttributeError):  # pidfds need Linux >= 5.3
            self._pidfd = os.pidfd_open(pid)

    def exit_fd(self) -> int | None:
        return self._pidfd

    def close(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


class ForkedProcess(ChildProcess):
    """A training process the zygote forked and this process adopted: poll, wait and kill it as a child."""

    def __init__(self, name: str, role: str, pid: int) -> None:
        super().__init__(name, role, pid)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: it is gone, how is unknown
                self.returncode = -int(signal.SIGKILL)
                return self.returncode
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout_s: float) -> int | None:
        return wait_exit(self.poll, self._pidfd, timeout_s)


class ZygoteClient:
    """The launcher's end: start the zygote, ask it for processes, fall back to None when it cannot serve."""

    def __init__(self, env: dict[str, str]) -> None:
        self.sock: socket.socket | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self._ready = False
        self._waited_out = False
        """Whether a `wait_ready` already timed out: later ones only look (a stuck zygote costs one wait, not one per
        process; one that finishes its imports later is still used)."""
        self._buffer = b""
        self.forked: set[int] = set()
        """Pids of the processes it forked for us, as it answered them."""
        if not become_subreaper():
            return
        ours, theirs = socket.socketpair()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "runtime.host.zygote", str(theirs.fileno())], env=env,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
            )
        except OSError:
            ours.close()
            return
        finally:
            theirs.close()
        self.sock = ours

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def ready(self) -> bool:
        """Whether the zygote finished its imports (never blocks)."""
        if self._ready or self.sock is None:
            return self._ready
        if select.select([self.sock], [], [], 0)[0]:
            try:
                self._ready = self._read_line(0.0) == "ready"
            except (OSError, TimeoutError):  # it died while importing
                self._ready = False
            if not self._ready:
                self.stop()
        return self._ready

    def wait_ready(self, timeout_s: float, while_waiting: Callable[[], None] | None = None) -> bool:
        """Whether the zygote is ready, waiting up to `timeout_s` for it to finish its imports (a job's first
        processes are asked for while it still imports); after one wait that timed out, and for a zygote that is
        stopped or dead, it does not wait at all. `while_waiting` as in `spawn`."""
        deadline = time.monotonic() + (0.0 if self._waited_out else timeout_s)
        while not self.ready():
            left = deadline - time.monotonic()
            if self.sock is None or left <= 0 or self._stopped():
                self._waited_out = self.sock is not None
                return False
            select.select([self.sock], [], [], min(left, KEEPALIVE_S))
            if while_waiting is not None:
                while_waiting()
        return True

    def _stopped(self) -> bool:
        """Whether the zygote is stopped (SIGSTOP, a debugger) or already dead: waiting for it would gain nothing."""
        if self.proc is None:
            return True
        try:
            with open(f"/proc/{self.proc.pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t", "Z", "X")
        except (OSError, IndexError):
            return True

    def spawn(self, env: dict[str, str], argv: list[str], output_fd: int | None = None,
              while_waiting: Callable[[], None] | None = None) -> int | None:
        """The pid of a new process running `argv` with `env`, or None (the caller starts it another way).

        None is only ever returned with no process left from the request: a zygote that answers late (a fork of a
        big process on a loaded machine) may already have forked it, and a second process under the same name,
        started by the caller, would take the same role in the job. So a zygote given up on is stopped with every
        process it forked that this process was not told about (`stop`). `output_fd` (passed over the socket)
        becomes the process's stdout and stderr. `while_waiting` is called every `KEEPALIVE_S` until the answer comes
        (an agent keeps its link beating meanwhile)."""
        if not self.ready() or self.sock is None:
            return None
        try:
            line = ForkRequest(env, argv, output_fd is not None).to_json()
            if output_fd is None:
                self.sock.sendall(line)
            else:
                socket.send_fds(self.sock, [line], [output_fd])
            pid = int(self._read_line(REQUEST_TIMEOUT_S, while_waiting))
        except (OSError, ValueError, TimeoutError):
            self.stop()  # dead, hung or confused: never ask it again (and no stray fork of it is left)
            return None
        self.forked.add(pid)
        return pid

    def _read_line(self, timeout_s: float, while_waiting: Callable[[], None] | None = None) -> str:
        assert self.sock is not None
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            left = max(0.0, deadline - time.monotonic())
            if not select.select([self.sock], [], [], min(left, KEEPALIVE_S))[0]:
                if time.monotonic() >= deadline:
                    raise TimeoutError("the zygote did not answer")
                if self._stopped():
                    raise TimeoutError("the zygote is stopped")
                if while_waiting is not None:
                    while_waiting()
                continue
            chunk = self.sock.recv(4096)
            if not chunk:
                raise OSError("the zygote closed its socket")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode()

    def close(self) -> None:
        """Stop the zygote and stop adopting orphans (processes adopted so far stay this process's children)."""
        self.stop()
        become_subreaper(False)

    def stop(self) -> None:
        """Kill the zygote, its forks in progress, and any process it forked whose pid it never answered."""
        self._ready = False
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.proc is not None:
            group = self.proc.pid  # a session (and group) of its own: its middle processes are in it
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5.0)
            self.proc = None
            # A middle process that dies hands its training process to us (the subreaper): wait for the group to
            # be gone, then kill every adopted fork of the zygote that was never answered (an unanswered request).
            deadline = time.monotonic() + 5.0
            while _group_members(group) and time.monotonic() < deadline:
                time.sleep(0.01)
            for pid in forks_adopted_by(os.getpid()) - self.forked:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)


def _processes() -> Iterator[tuple[int, str, int, int]]:
    """(pid, state, ppid, process group) of every process /proc shows."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                with open(f"/proc/{entry}/stat") as f:
                    state, ppid, pgrp = f.read().rsplit(")", 1)[1].split()[:3]
                yield int(entry), state, int(ppid), int(pgrp)


def _group_members(group: int) -> list[int]:
    return [pid for pid, state, _, pgrp in _processes() if pgrp == group and state != "Z"]


def forks_adopted_by(parent: int) -> set[int]:
    """Children of `parent` that a zygote forked (their command line is the zygote's)."""
    found = set()
    for pid, _, ppid, _ in _processes():
        if ppid == parent:
            with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"runtime.host.zygote" in f.read():
                    found.add(pid)
    return found


# -- the zygote process ------------------------------------------------------------------------------------
def _child(request: ForkRequest, sock: socket.socket, output_fd: int | None) -> None:
    """In the forked training process: become what `python script args` would have been, then run it."""
    import runpy

    sock.close()
    if output_fd is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(output_fd, 1)
        os.dup2(output_fd, 2)
        os.close(output_fd)
    os.setsid()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(request.env)
    argv = request.argv
    sys.argv = argv
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    random.seed()  # a new interpreter seeds from the OS; a fork would share the zygote's state
    with contextlib.suppress(ImportError):
        import numpy as np

        np.random.seed()
    runpy.run_path(argv[0], run_name="__main__")
    sys.exit(0)


def serve(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    import numpy  # noqa: F401  (what every training process imports first)
    import torch
    import torch.distributed

    import runtime  # noqa: F401

    # A script's first optimizer imports torch._dynamo (800 modules, over a second): construct one here, on a
    # one-element parameter (no computation, so no thread pool that a fork would break).
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    sock.sendall(b"ready\n")
    buffer = b""
    passed: collections.deque[int] = collections.deque()  # descriptors sent with requests, in order
    while True:
        try:
            chunk, fds, _, _ = socket.recv_fds(sock, 1 << 16, 16)
        except OSError:
            chunk, fds = b"", []
        passed.extend(fds)
        if not chunk:
            return  # the launcher is gone, or closed the socket: the job is over
        buffer += chunk
        while b"\n" in buffer:
            line, _, buffer = buffer.partition(b"\n")
            request = ForkRequest.from_json(line)
            output_fd = passed.popleft() if request.output and passed else None
            r, w = os.pipe()
            middle = os.fork()
            if middle == 0:
                os.close(r)
                pid = os.fork()
                if pid == 0:
                    os.close(w)
                    _child(request, sock, output_fd)  # never returns: the script's own exit ends the process
                os.write(w, f"{pid}\n".encode())
                os._exit(0)  # orphan the training process: the launcher (a subreaper) adopts it
            os.close(w)
            if output_fd is not None:
                os.close(output_fd)  # the training process holds it now
            with os.fdopen(r) as f:
                pid_line = f.readline().strip()
            os.waitpid(middle, 0)
            sock.sendall(f"{pid_line}\n".encode())


if __name__ == "__main__":
    serve(int(sys.argv[1]))
