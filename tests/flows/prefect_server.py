"""A real Prefect server, work pool and worker for the end-to-end flow tests, each a process this module stops.

`PrefectStack` starts `prefect server start` on a free port in its own PREFECT_HOME, waits (bounded) for
/api/health, creates the process work pool `trainmover-local`, starts a worker that polls every second, and runs the
Prefect CLI against that server: the same steps a user takes before pressing "Run" in the UI. Every process it
started is stopped by its pid in `close()` (SIGTERM, a second SIGTERM for a worker that ignores the first, then
SIGKILL); the flow runs' own processes are the worker's business. Every wait polls against a deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[2]
PREFECT = str(Path(sys.executable).with_name("prefect"))
POOL = "trainmover-local"
CHROMIUM = "/usr/bin/chromium"

T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def poll(what: str, check: Callable[[], T | None], timeout_s: float, every_s: float = 0.25) -> T:
    """Call `check` until it returns something other than None; TimeoutError naming `what` past the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value is not None:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(every_s)


def stop_process(proc: subprocess.Popen[bytes], term_s: float = 15.0, kill_s: float = 10.0) -> None:
    """SIGTERM, then (a Prefect worker may ignore the first) a second SIGTERM, then SIGKILL; each wait bounded."""
    for sig, wait_s in ((signal.SIGTERM, term_s / 2), (signal.SIGTERM, term_s / 2), (signal.SIGKILL, kill_s)):
        if proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait_s)


def tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


class PrefectStack:
    """A Prefect server with its UI, the local process work pool and a worker, all under `home` (see module doc)."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.logs = home / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_url = f"{self.url}/api"
        self.env = {
            **os.environ,
            "PREFECT_HOME": str(home / "prefect-home"),
            "PREFECT_API_URL": self.api_url,
            # FACTS.md: on a non-default port the UI needs this too, or it cannot reach the API.
            "PREFECT_SERVER_UI_API_URL": self.api_url,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_WORKER_QUERY_SECONDS": "1",
            "PREFECT_CLI_PROMPT": "false",
            "PREFECT_CLI_COLORS": "false",
            "PREFECT_CLI_WRAP_LINES": "false",
            "PYTHONUNBUFFERED": "1",
        }
        self.env.pop("PREFECT_PROFILE", None)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.timings: dict[str, float] = {}

    # -- processes ----------------------------------------------------------------------------------
    def _spawn(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        with open(self.logs / f"{name}.log", "wb") as log:
            proc = subprocess.Popen([PREFECT, *args], cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        self.procs[name] = proc
        return proc

    def start(self, health_timeout_s: float = 90.0) -> PrefectStack:
        t0 = time.monotonic()
        server = self._spawn("server", "server", "start", "--host", "127.0.0.1", "--port", str(self.port))

        def healthy() -> bool | None:
            if server.poll() is not None:
                raise RuntimeError(f"prefect server exited with {server.returncode}:\n{tail(self.logs / 'server.log')}")
            try:
                with urllib.request.urlopen(f"{self.api_url}/health", timeout=2) as r:
                    return True if r.status == 200 else None
            except (urllib.error.URLError, OSError):
                return None

        poll("prefect server /api/health", healthy, health_timeout_s)
        self.timings["server_healthy_s"] = time.monotonic() - t0
        self.cli("work-pool", "create", POOL, "--type", "process", "--overwrite")
        self._spawn("worker", "worker", "start", "--pool", POOL, "--name", "e2e-worker")
        return self

    def close(self) -> None:
        # The worker first: it must not pick up anything while the server goes away.
        for name in ("worker", "server"):
            if name in self.procs:
                stop_process(self.procs[name])

    # -- the CLI and the API ------------------------------------------------------------------------
    def cli(self, *args: str, timeout_s: float = 120.0, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run `prefect ARGS` from the repo root against this server; a failure shows the command's output."""
        done = subprocess.run(
            [PREFECT, *args], cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout_s, check=False
        )
        if check and done.returncode != 0:
            raise AssertionError(
                f"prefect {' '.join(args)} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            )
        return done

    def api(self, method: str, path: str, body: Any = None, timeout_s: float = 10.0) -> Any:
        """One JSON call to the server's REST API."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            f"{self.api_url}{path}", data=data, method=method, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.loads(r.read() or b"null")

    @contextlib.contextmanager
    def settings(self) -> Iterator[None]:
        """Point this process's Prefect client (`get_client()`) at the server for the duration."""
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings(updates={PREFECT_API_URL: self.api_url}):
            yield

    def diagnostics(self) -> str:
        return "\n".join(f"--- {p.name} (tail) ---\n{tail(p)}" for p in sorted(self.logs.glob("*.log")))


def chromium_or_fail() -> str:
    """The Chromium binary; a missing one is a failed test (CI must install it), never a skip."""
    path = CHROMIUM if Path(CHROMIUM).is_file() else shutil.which("chromium")
    if path is None:
        raise AssertionError(
            f"{CHROMIUM} not found: the UI check needs Debian's Chromium. Install it with `apt-get install -y chromium`"
        )
    return path


def chromium(
    url: str, out_dir: Path, *, screenshot: Path | None = None, budget_ms: int = 15000, timeout_s: float = 60.0
) -> str:
    """Load `url` in headless Chromium; return the rendered DOM (`--dump-dom`), or write a PNG (`--screenshot`).

    `--virtual-time-budget` lets the single-page UI fetch and render before Chromium dumps or shoots the page.
    """
    profile = out_dir / "chromium-profile"
    profile.mkdir(parents=True, exist_ok=True)
    args = [
        chromium_or_fail(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        "--window-size=1400,1800",
        f"--virtual-time-budget={budget_ms}",
    ]
    args += [f"--screenshot={screenshot}"] if screenshot is not None else ["--dump-dom"]
    done = subprocess.run([*args, url], capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise AssertionError(f"chromium exited {done.returncode} on {url}:\n{done.stderr[-3000:]}")
    return done.stdout
