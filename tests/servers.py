"""Stopping the server processes the tests start (Azurite, Prometheus): SIGTERM, then SIGKILL, every wait bounded."""

from __future__ import annotations

import subprocess


def stop(process: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """Ask `process` to end; kill it after `grace_s`; wait for it either way."""
    process.terminate()
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)
