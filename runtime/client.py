"""The runtime's client for a supervisor outside the job: start a job, follow its events, steer it, stop it.

A scheduler (the Prefect flows in `flows/`, or any other) drives a job through this module only: the runtime owns
its command lines (`trainmover run` on one machine, `trainmover coordinator` when the job's hosts run agents), its
events file and its control store; a supervisor never builds the former nor parses the latter by hand.

- `JobSpec`: what to train, with how many workers and standbys; `Placement`: where the coordinator waits for the
  hosts' agents (a job across hosts).
- `RuntimeJob.start` spawns the job's launcher (its own process group, the job's secret in its environment only);
  `RuntimeJob.attach` takes over a job another process started, by its launcher's pid (a supervisor that died).
- `RuntimeJob.read_events` returns the events written since the last call, whole lines only, as typed records
  (`runtime.wire.event_records`: `match event: case Recovered(...)`); `set_standby_target` and `move` send the control
  commands, which a job that ended meanwhile simply does not need (`steer` is their deprecated by-name form);
  `committed_step` reads the last committed step; `stop` ends the launcher and everything it started.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from runtime.config import KNOBS, Backend, ShrinkMode
from runtime.wire.auth import ENV_SECRET
from runtime.wire.control import JobControl, JobEnded
from runtime.wire.event_records import ENDINGS, Event, EventError, parse_event

log = logging.getLogger("trainmover.client")

CONTROL_TIMEOUT_S = 60.0
"""How long a new control connection waits for the job's store to answer."""

STOP_GRACE_S = 20.0
"""How long `stop` waits after SIGTERM for the launcher to stop what it started, before SIGKILL."""

@dataclass(frozen=True, slots=True)
class JobSpec:
    """A training job as the runtime runs it: the script and its arguments, the data-parallel workers, the warm
    standbys to start with, the backend, an optional fault-injection plan (`runtime.faults`) and the step count."""

    script: Path
    workers: int
    standby: int = KNOBS.standby
    script_args: tuple[str, ...] = ()
    backend: Backend = KNOBS.backend
    faults: str | None = None
    steps: int | None = None
    threads: int = 1
    shrink: ShrinkMode = KNOBS.shrink
    """With no standby ready within the standby wait: continue with fewer members (runtime.training.elastic)."""
    hot_standbys: int = KNOBS.hot_standbys
    """Of the standbys, how many mirror the state every step (runtime.training.hot): the policy's hot tier."""


@dataclass(frozen=True, slots=True)
class Placement:
    """A job across hosts: the coordinator listens on `host` (control store at `port`, agents at `agent_port`) and
    waits up to `agents_wait_s` for `agents` hosts' agents of job `job_id` before it places workers and standbys."""

    job_id: str
    agents: int
    host: str
    port: int
    agent_port: int
    agents_wait_s: float


def _script_tail(spec: JobSpec) -> list[str]:
    argv = ["--nproc", str(spec.workers), "--standby", str(spec.standby), "--backend", spec.backend,
            "--threads", str(spec.threads), "--shrink", spec.shrink, "--quiet"]
    if spec.faults:
        argv += ["--faults", spec.faults]
    if spec.hot_standbys:
        argv += ["--hot-standbys", str(spec.hot_standbys)]
    argv += [str(spec.script.resolve()), *spec.script_args]
    if spec.steps is not None:
        argv += ["--steps", str(spec.steps)]
    return argv


def run_argv(spec: JobSpec, events: Path, port: int) -> list[str]:
    """`trainmover run`: the launcher starts the coordinator and every process on this machine."""
    return [sys.executable, "-m", "trainmover.cli", "run", "--events", str(events), "--port", str(port),
            *_script_tail(spec)]


def coordinator_argv(spec: JobSpec, events: Path, placement: Placement) -> list[str]:
    """`trainmover coordinator`: alone on this machine; the hosts' agents start the processes it places."""
    p = placement
    return [sys.executable, "-m", "trainmover.cli", "coordinator", "--agents", str(p.agents), "--job-id", p.job_id,
            "--agent-port", str(p.agent_port), "--agents-wait", f"{p.agents_wait_s:g}", "--host", p.host,
            "--port", str(p.port), "--events", str(events), *_script_tail(spec)]


class EventTail:
    """The events a job wrote to its JSON-lines file since the last `read`: whole lines only (a line being written
    is read the next time), as records (`runtime.wire.event_records.parse_event`); a line that is not JSON or not an
    event is skipped, with a warning when it is JSON that names an event."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._offset = 0

    def read_objects(self) -> list[dict[str, Any]]:
        """The new lines' JSON objects, as written."""
        if not self.path.exists():
            return []
        with self.path.open("rb") as f:
            f.seek(self._offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self._offset += end
        out: list[dict[str, Any]] = []
        for line in data[:end].splitlines():
            with contextlib.suppress(json.JSONDecodeError, UnicodeDecodeError):
                ev = json.loads(line)
                if isinstance(ev, dict):
                    out.append(ev)
        return out

    def read(self) -> list[Event]:
        out: list[Event] = []
        for raw in self.read_objects():
            try:
                out.append(parse_event(raw))
            except EventError as exc:
                log.warning("%s: skipped a line that is not an event: %s", self.path, exc)
        return out


def finished_in(events: Path) -> bool:
    """Whether a job's events file records that the job finished (its kind is enough)."""
    return any(ev.get("event") == "job_finished" for ev in EventTail(events).read_objects())


class Launcher(Protocol):
    """The job's launcher process, as far as a supervisor watches it."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


class AttachedLauncher:
    """A launcher that another process started (a re-attached job): watched by its pid, its end read from the
    job's events (`job_finished`: 0, else 1), since only its parent could read its exit status."""

    def __init__(self, pid: int, events: Path) -> None:
        self.pid = pid
        self.events = Path(events)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        try:
            state = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            state = "X"
        if state not in ("Z", "X"):
            return None
        self.returncode = 0 if finished_in(self.events) else 1
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            time.sleep(0.1)  # a poll pace: another process's exit has no fd this process can wait on
        return code


class RuntimeJob:
    """One running job, seen from its supervisor: its launcher, its events and its control store."""

    def __init__(self, launcher: Launcher, events: Path, host: str, port: int, secret: str) -> None:
        self.launcher = launcher
        self.events_path = Path(events)
        self.host = host
        self.port = port
        self._secret = secret
        self._tail = EventTail(self.events_path)
        self.control: JobControl | None = None
        self.over = False
        """The job's end was read from its events: its store is closing and answers no one any more."""

    @classmethod
    def start(cls, spec: JobSpec, events: Path, *, secret: str, log: Path, port: int = 0,
              placement: Placement | None = None) -> RuntimeJob:
        """Spawn the job: `trainmover run` on this machine, or with `placement` `trainmover coordinator` for the
        hosts' agents. `port` is the control store's port on this machine (unused with `placement`, which names
        the coordinator's). The launcher gets its own process group (`stop` ends all it started) and the secret in its
        environment only; its output goes to `log`. On this machine the control connection is made at once; across
        hosts once the job runs (`connect`, after the coordinator's first generation)."""
        if placement is None:
            if not 0 < port < 65536:
                raise ValueError(f"a job on this machine needs its control store's port, got {port}")
            argv, host = run_argv(spec, events, port), "127.0.0.1"
        else:
            argv, host, port = coordinator_argv(spec, events, placement), placement.host, placement.port
        with open(log, "ab") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, ENV_SECRET: secret})
        job = cls(proc, events, host, port, secret)
        if placement is None:
            job.connect()
        return job

    @classmethod
    def attach(cls, pid: int, events: Path, host: str, port: int, secret: str) -> RuntimeJob:
        """A job whose launcher another process started; connect with `connect` after reading its past events."""
        return cls(AttachedLauncher(pid, events), events, host, port, secret)

    @property
    def pid(self) -> int:
        return self.launcher.pid

    @property
    def returncode(self) -> int | None:
        return self.launcher.returncode

    def poll(self) -> int | None:
        return self.launcher.poll()

    def running(self) -> bool:
        return self.launcher.poll() is None

    def connect(self) -> bool:
        """Open the control connection if the job runs and has not ended; True when connected."""
        if self.control is None and not self.over and self.running():
            self.control = JobControl(self.host, self.port, timeout_s=CONTROL_TIMEOUT_S, secret=self._secret)
        return self.control is not None

    def read_events(self) -> list[Event]:
        """The events written since the last call, as records. Once the job's end is among them, the control
        connection is closed: the job's store is about to go and no call may reach it any more."""
        events = self._tail.read()
        if any(isinstance(ev, ENDINGS) for ev in events):
            self.over = True
            self._disconnect()
        return events

    def set_standby_target(self, n: int) -> bool:
        """Keep `n` unpromoted standbys from now on. False when there is no one to tell (not connected yet, or
        over): a job that ends meanwhile needs no steering, its end is read from its events."""
        return self._send(lambda control: control.set_standby_target(n))

    def move(self, ranks: Sequence[int], reason: str) -> bool:
        """Move these ranks' processes to standbys, on purpose (`reason`: in the `moved` event of a data-parallel job,
        moved at a step boundary; the cause `planned_move:<reason>` of a sharded job's failure path). False when there
        is no one to ask (not connected yet, or over)."""
        return self._send(lambda control: control.move(list(ranks), reason))

    def resize(self, width: int, reason: str) -> bool:
        """Run the job at `width` members (1 up to its nproc): fewer frees capacity, more grows back onto standbys;
        the `shrunk` and `grew` events say when. False when there is no one to ask (not connected yet, or over)."""
        return self._send(lambda control: control.resize(width, reason))

    def steer(self, command: Literal["set_standby_target", "move"], *args: Any) -> bool:
        """Deprecated: call `set_standby_target(n)` or `move(ranks, reason)`."""
        warnings.warn("RuntimeJob.steer is deprecated: call set_standby_target or move", DeprecationWarning,
                      stacklevel=2)
        if command == "set_standby_target":
            return self.set_standby_target(*args)
        if command == "move":
            return self.move(*args)
        raise ValueError(f"no command {command!r}: set_standby_target or move")

    def _send(self, command: Callable[[JobControl], object]) -> bool:
        if self.control is None:
            return False
        try:
            command(self.control)
        except JobEnded:
            return False
        return True

    def committed_step(self) -> int | None:
        """The last step the job committed; None before the first, when unknown, or once the launcher is gone."""
        if self.control is None or not self.running():
            return None
        try:
            return self.control.committed_step()
        except Exception:
            return None

    def wait(self, timeout_s: float) -> int | None:
        """The launcher's exit code, or None if it still runs after `timeout_s`."""
        try:
            return self.launcher.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """End the job: SIGTERM to the launcher's process group (it stops what it started), SIGKILL after
        `grace_s`. Safe to call twice, and on a job that ended by itself."""
        self._disconnect()
        if not self.running():
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGTERM)
        if self.wait(grace_s) is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
            self.wait(10.0)

    def _disconnect(self) -> None:
        if self.control is not None:
            with contextlib.suppress(Exception):
                self.control.close()
            self.control = None
