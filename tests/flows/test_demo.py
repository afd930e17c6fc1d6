"""The main job: `trainmover demo` runs the resilient_training flow in Prefect's ephemeral mode, two failures."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.runtime.fresh import run_python
from tests.stack_dumps import assert_no_stack_dump


@pytest.mark.slow
def test_trainmover_demo_prewarms_recovers_twice_and_prices_checkpoint_restart(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"} | {"PREFECT_HOME": str(tmp_path / "h")}
    out = subprocess.run(
        [sys.executable, "-m", "trainmover.cli", "demo"],
        capture_output=True, text=True, timeout=400, cwd=tmp_path, env=env,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert "pre-warming to 1 warm standby" in text
    assert "2 interruption(s)" in text, text[-3000:]
    assert "[warm], predicted" in text and "[stopped], unpredicted" in text, text[-3000:]
    assert "Under checkpoint-restart the same failures would have cost 1800 s" in text
    assert "released" in text and "instance(s) of job trainmover-demo" in text
    assert_no_stack_dump(out.stderr)


def test_the_runtime_demo_needs_no_prefect_and_a_missing_prefect_is_one_clear_line() -> None:
    out = run_python("import sys; sys.modules['prefect'] = None\nfrom trainmover.cli import main\n"
                     "raise SystemExit(main(['demo']))\n")
    assert out.returncode == 2
    assert "pip install -e '.[flows]'" in out.stderr and "trainmover demo --runtime" in out.stderr
    assert "Traceback" not in out.stderr
