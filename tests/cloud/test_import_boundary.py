"""DESIGN.md's dependency table for `cloud/`: importing it (and running the local provider) loads no cloud SDK and
none of the parts it must not depend on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = ["boto3", "botocore", "azure", "prefect", "torch", "sklearn", "policy", "runtime", "flows"]


def _loaded_forbidden(code: str) -> list[str]:
    probe = (
        f"{code}\n"
        "import json, sys\n"
        f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & set({FORBIDDEN!r}))))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    loaded: list[str] = json.loads(result.stdout.strip().splitlines()[-1])
    return loaded


def test_importing_the_cloud_package_loads_no_sdk_and_no_forbidden_part() -> None:
    assert _loaded_forbidden("import cloud, cloud.base, cloud.local, cloud.registry, cloud.notices, cloud.cli") == []


def test_checking_the_local_provider_through_the_dispatcher_loads_no_sdk() -> None:
    code = "from trainmover.cli import main\nassert main(['cloud', 'check', '--provider', 'local']) == 0"
    assert _loaded_forbidden(code) == []


def test_the_probe_would_see_a_forbidden_module() -> None:
    assert _loaded_forbidden("import json, botocore") == ["botocore"]
