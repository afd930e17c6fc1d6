"""Plumbing shared by the peer systems of the recovery benchmark.

This module owns what every peer needs and nothing peer-specific:

* launching worker processes (``sys.executable -m bench.peers.<peer> --worker``) with a clean environment,
  one thread per worker, and killing every process a runner started, including workers that a launcher
  such as torchrun put in sessions of their own (they report their pid in a pid file);
* small files written atomically (results, timings) and bounded polling for them;
* the state digest that all systems report, so the benchmark can check bit-identity;
* flat gradient buffers (``param.grad`` as views of one buffer per dtype), so one all-reduce per dtype
  exchanges every gradient, as DDP's bucket views do;
* step-time statistics from per-step timestamps.

Workers record ``time.time()`` (wall clock, comparable across processes on one machine) after every
committed step; runners turn those into steady-state step times and into the timelines of a recovery.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench.workload import SPEC_ENV, WorkloadSpec

REPO_ROOT = Path(__file__).resolve().parents[2]
"""The repository root: workers run with it as cwd and on PYTHONPATH."""

WARMUP_STEPS = 3
"""Steps left out of steady-state statistics (allocator and cache warm-up)."""

PID_DIR_ENV = "TM_PEER_PID_DIR"
"""Workers write ``<pid>.pid`` there first thing, so the runner can kill them by id even when a launcher
(torchrun) started them in a session of their own."""

POLL_S = 0.005
"""Interval of bounded polling loops; far below every duration measured (tens of ms and up)."""


class PeerError(RuntimeError):
    """A peer run failed (a worker crashed, or a bounded wait ran out)."""


# ----------------------------------------------------------------------------------------- small files


def write_json_atomic(path: Path, obj: Mapping[str, Any]) -> None:
    """Write JSON so that a reader sees either nothing or the whole file (write a temp file, then rename)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise PeerError(f"{path} does not hold a JSON object")
    return data


def wait_for_file(
    path: Path, timeout_s: float, procs: Iterable[subprocess.Popen[bytes]] = (), what: str = ""
) -> dict[str, Any]:
    """Poll until ``path`` exists (it is written atomically) and return its JSON.

    Fails early when one of ``procs`` exits with an error first, rather than waiting out the deadline.
    """
    deadline = time.monotonic() + timeout_s
    watched = list(procs)
    while not path.exists():
        for p in watched:
            rc = p.poll()
            if rc not in (None, 0):
                raise PeerError(f"process {p.args!r} exited with {rc} before {what or path.name} appeared")
        if time.monotonic() > deadline:
            raise PeerError(f"timed out after {timeout_s:.0f} s waiting for {what or path}")
        time.sleep(POLL_S)
    return read_json(path)


def read_step_log(path: Path) -> list[list[float]]:
    """Rows of whitespace-separated numbers, one per line, as appended by a worker (missing file: none)."""
    if not path.exists():
        return []
    rows: list[list[float]] = []
    for line in path.read_text().splitlines():
        parts = line.split()
        # A worker killed mid-write can leave a torn last line: skip anything unparsable.
        try:
            rows.append([float(x) for x in parts])
        except ValueError:
            continue
    return rows


def log_tail(path: Path, lines: int = 25) -> str:
    if not path.exists():
        return "(no log)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


# ----------------------------------------------------------------------------------------- processes


def free_port() -> int:
    """A TCP port free right now on localhost (the OS picks it; a small race with other programs remains)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Poll until something accepts TCP connections on localhost:port."""
    deadline = time.monotonic() + timeout_s
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(0.2)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        if proc is not None and proc.poll() is not None:
            raise PeerError(f"{proc.args!r} exited with {proc.returncode} before listening on {port}")
        if time.monotonic() > deadline:
            raise PeerError(f"nothing listened on port {port} within {timeout_s:.0f} s")
        time.sleep(POLL_S)


def worker_env(spec: WorkloadSpec, extra: Mapping[str, str], pid_dir: Path) -> dict[str, str]:
    """The environment of a worker: the spec, one intra-op thread, the repo importable."""
    env = dict(os.environ)
    env[SPEC_ENV] = spec.to_env()
    # One thread per worker: two workers on two cores, and the same count in every process, which
    # bit-identity needs (a different thread count changes reduction order inside matmuls).
    env["OMP_NUM_THREADS"] = "1"
    env["MKL_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env[PID_DIR_ENV] = str(pid_dir)
    env.update(extra)
    return env


def register_worker_pid() -> None:
    """Called first thing in a worker: lets the runner kill this process by id whatever launched it."""
    pid_dir = os.environ.get(PID_DIR_ENV)
    if pid_dir:
        (Path(pid_dir) / f"{os.getpid()}.pid").write_text(str(os.getpid()))


def fast_exit() -> None:
    """End a worker whose outputs are all written: skip interpreter finalization.

    After importing torch, finalization takes 0.4-1 s here; nothing after this point is measured, but
    the runner (and torchrun) would wait for it on every run.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _is_our_worker(pid: int, marker: str) -> bool:
    """Guard against pid reuse: only signal a pid whose command line is still one of our workers."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return marker in cmdline


class ProcessSet:
    """Every process a runner starts, killed on exit (normal or not).

    Processes are started in new sessions so that killing one also kills what it spawned (its process
    group); workers that a launcher placed in sessions of their own are found through their pid files.
    """

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.pid_dir = run_dir / "pids"
        self.pid_dir.mkdir(parents=True, exist_ok=True)
        self.procs: list[subprocess.Popen[bytes]] = []
        self._logs: list[Any] = []

    def start(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        stdout: int | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` with its output in ``<run_dir>/<name>.log`` (or piped when ``stdout`` is PIPE)."""
        log = open(self.run_dir / f"{name}.log", "wb")  # noqa: SIM115 (closed in close())
        self._logs.append(log)
        proc = subprocess.Popen(
            list(argv),
            env=dict(env),
            cwd=REPO_ROOT,
            stdin=subprocess.DEVNULL,
            stdout=log if stdout is None else stdout,
            stderr=log if stdout is None else subprocess.STDOUT,
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def kill_all(self) -> None:
        for proc in self.procs:
            # Kill the whole group even when the leader already exited: its children may remain.
            # The group id is the leader's pid (start_new_session), and only our processes are in it.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        for pid_file in self.pid_dir.glob("*.pid"):
            pid = int(pid_file.stem)
            if _is_our_worker(pid, "bench.peers"):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)

    def close(self) -> None:
        try:
            self.kill_all()
        finally:
            for log in self._logs:
                log.close()

    def __enter__(self) -> ProcessSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def wait_all(procs: Sequence[subprocess.Popen[bytes]], timeout_s: float, logs: Sequence[Path] = ()) -> None:
    """Wait for every process to exit (bounded); raise with the log tails when one failed."""
    deadline = time.monotonic() + timeout_s
    for p in procs:
        remaining = max(0.0, deadline - time.monotonic())
        try:
            p.wait(timeout=remaining)
        except subprocess.TimeoutExpired as e:
            tails = "\n".join(f"--- {log}\n{log_tail(log)}" for log in logs)
            raise PeerError(f"{p.args!r} still running after {timeout_s:.0f} s\n{tails}") from e
    failed = [p for p in procs if p.returncode != 0]
    if failed:
        tails = "\n".join(f"--- {log}\n{log_tail(log)}" for log in logs)
        raise PeerError(f"exit codes {[p.returncode for p in procs]}\n{tails}")


def worker_argv(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, "--worker", *args]


@contextlib.contextmanager
def run_dir(prefix: str) -> Iterator[Path]:
    """A scratch directory on local disk (checkpoints, result files), removed afterwards."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix=f"tm-{prefix}-") as d:
        yield Path(d)


def process_start_time(pid: int | None = None) -> float:
    """Wall-clock time at which a process started (Linux; resolution one clock tick, 10 ms).

    Lets a worker report when it was spawned although its first Python line runs after imports. The
    kernel gives the start in ticks after boot; converting through CLOCK_BOOTTIME (not /proc/stat's
    btime, which is rounded to whole seconds) keeps the error within a tick.
    """
    pid = os.getpid() if pid is None else pid
    stat = Path(f"/proc/{pid}/stat").read_text()
    # Field 22 (starttime); split after the ")" that ends the command name, which may contain spaces.
    start_ticks = int(stat.rsplit(")", 1)[1].split()[19])
    age = time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - age


# ----------------------------------------------------------------------------------------- training state


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of a tensor (0-dim included), independent of its strides."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def state_digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """sha256 over every model state tensor and every optimizer state value.

    Model: ``model.state_dict()`` tensors in its order. Optimizer: for each param group in order, for each
    of its params in order, the param's state values by sorted key; tensors as raw bytes, anything else as
    its ``repr``. Equal digests mean bit-identical training state.
    """
    h = hashlib.sha256()
    for value in model.state_dict().values():
        h.update(tensor_bytes(value))
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            for key in sorted(state):
                v = state[key]
                h.update(tensor_bytes(v) if isinstance(v, torch.Tensor) else repr(v).encode())
    return h.hexdigest()


def attach_flat_grads(model: nn.Module) -> list[torch.Tensor]:
    """Make every ``param.grad`` a view of one flat buffer per dtype and return the buffers.

    Backward then accumulates in place into the buffers, so the gradient exchange is one all-reduce per
    dtype with no copy in or out (what DDP's ``gradient_as_bucket_view`` does). Callers zero the buffers
    each step and must never call ``optimizer.zero_grad()`` (it would set the views to None).
    """
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for p in model.parameters():
        if p.requires_grad:
            by_dtype.setdefault(p.dtype, []).append(p)
    flats: list[torch.Tensor] = []
    for dtype, params in by_dtype.items():
        flat = torch.zeros(sum(p.numel() for p in params), dtype=dtype)
        offset = 0
        for p in params:
            p.grad = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        flats.append(flat)
    return flats


def check_flat_grads(model: nn.Module, flats: Sequence[torch.Tensor]) -> None:
    """Assert that backward accumulated into the flat buffers (it did not replace any ``.grad``)."""
    ranges = [(f.data_ptr(), f.data_ptr() + f.numel() * f.element_size()) for f in flats]
    for p in model.parameters():
        g = p.grad
        if g is None or not any(lo <= g.data_ptr() < hi for lo, hi in ranges):
            raise PeerError("a parameter's .grad is not a view of the flat gradient buffer")


# ----------------------------------------------------------------------------------------- statistics


def step_durations(times: Sequence[float]) -> list[float]:
    """Durations between consecutive step timestamps."""
    return [b - a for a, b in itertools.pairwise(times)]


def steady_step_s(times: Sequence[float], skip: int = WARMUP_STEPS) -> float:
    """Median step duration after the first ``skip`` steps (``times``: one timestamp per step, in order)."""
    durations = step_durations(times)[skip:]
    if not durations:
        durations = step_durations(times)
    if not durations:
        raise PeerError("not enough steps to measure a step time")
    return statistics.median(durations)


def rounded(d: Mapping[str, Any], ndigits: int = 4) -> dict[str, Any]:
    """Round floats (one level of nesting into dicts and lists) for readable reports."""

    def r(v: Any) -> Any:
        if isinstance(v, float):
            return round(v, ndigits)
        if isinstance(v, dict):
            return {k: r(x) for k, x in v.items()}
        if isinstance(v, list):
            return [r(x) for x in v]
        return v

    return {k: r(v) for k, v in d.items()}


def spread(values: Sequence[float]) -> dict[str, float | int | None]:
    """Median, min and max of repeated measurements (None for all three when there are none) and their count."""
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}
