"""A new interpreter of this environment, for what only a fresh process shows: which modules an import loads,
how a command behaves when a package is missing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    """`code` run by `python -c` from the repository root, its output captured (60 s at most)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)


def loaded_by(imports: str, packages: list[str]) -> list[str]:
    """Those of `packages` (top-level names) that a fresh interpreter has loaded after running `imports`."""
    out = run_python(f"import json, sys\n{imports}\nprint(json.dumps([m for m in {packages!r} if m in sys.modules]))\n")
    assert out.returncode == 0, out.stderr
    loaded: list[str] = json.loads(out.stdout)
    return loaded
