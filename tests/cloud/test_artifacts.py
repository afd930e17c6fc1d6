"""The job's code reaches its hosts from a source the job controls (cloud.artifacts): the orchestrator's own wheel
and the training script, staged with their digests, fetched by the host's rendered bash and refused unless intact.
The rendered lines run for real here (bash, curl, sha256sum, venv and pip, no index)."""

from __future__ import annotations

import hashlib
import logging
import subprocess
import sys
import urllib.request
from pathlib import Path

import boto3
import pytest

from cloud.artifacts import (
    Artifact,
    build_wheel,
    delete_s3,
    render_fetch,
    render_python_select,
    stage_local,
    stage_s3,
)
from cloud.base import InvalidRequestError
from tests.cloud.aws_servers import moto_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("dist"))


def _bash(lines: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    script = "\n".join(["set -euo pipefail", *lines]) + "\n"
    return subprocess.run(["bash", "-c", script], cwd=cwd, capture_output=True, text=True, timeout=300, check=False)


def test_a_host_installs_the_staged_wheel_with_no_index_and_runs_the_staged_script(wheel: Path, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('trained')\n")
    artifacts = stage_local([wheel, script], tmp_path / "staged")
    host = tmp_path / "host"
    host.mkdir()
    lines = render_python_select((sys.executable,))
    lines += render_fetch(artifacts, str(host / "dist"), attempts=2, backoff_s=0)
    lines += [
        f'"$tm_python" -m venv {host / "venv"}',
        f"{host / 'venv/bin/python'} -m pip install --no-deps --no-index --no-input --disable-pip-version-check -q "
        f"{host / 'dist' / wheel.name}",
        f"{host / 'venv/bin/python'} -c \"import importlib.metadata as m; print(m.version('trainmover'))\"",
        f"{host / 'venv/bin/python'} {host / 'dist/train.py'}",
    ]
    done = _bash(lines, host)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0.1.0", "trained"]


def test_a_tampered_file_is_refused_and_nothing_after_it_runs(wheel: Path, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('trained')\n")
    (artifact,) = stage_local([script], tmp_path / "staged")
    Path(artifact.url.removeprefix("file://")).write_text("print('owned')\n")  # someone rewrote the staged copy
    host = tmp_path / "host"
    done = _bash([*render_fetch([artifact], str(host), attempts=2, backoff_s=0), "echo reached"], tmp_path)
    assert done.returncode != 0 and "reached" not in done.stdout
    tampered = hashlib.sha256(b"print('owned')\n").hexdigest()
    assert f"train.py has SHA-256 {tampered}, the job expects {artifact.sha256}: refused" in done.stderr
    assert "could not fetch train.py intact in 2 attempts" in done.stderr
    assert not (host / "train.py").exists() and not (host / "train.py.part").exists()


def test_an_image_without_a_recent_python_with_torch_fails_at_once_naming_what_it_tried(tmp_path: Path) -> None:
    old = tmp_path / "python3.9"
    old.write_text("#!/bin/sh\necho 'AssertionError: 3.9.2' >&2\nexit 1\n")
    old.chmod(0o755)
    done = _bash(render_python_select((str(old), str(tmp_path / "absent"))), tmp_path)
    assert done.returncode == 1
    assert "no Python 3.11+ with torch installed" in done.stderr and "python3.9 (AssertionError: 3.9.2)" in done.stderr


def test_files_staged_in_the_jobs_bucket_are_fetched_over_presigned_urls_and_deleted_with_the_job(
    tmp_path: Path
) -> None:
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    with moto_server() as url:
        s3 = boto3.client("s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id="testing",
                          aws_secret_access_key="testing")
        s3.create_bucket(Bucket="team-artifacts")
        script = tmp_path / "train.py"
        script.write_text("print('trained')\n")
        (artifact,) = stage_s3([script], job_id="job-7", bucket="team-artifacts", client=s3)
        assert artifact.url.startswith(url) and "Signature" in artifact.url and "train.py" in repr(artifact)
        assert "Signature" not in repr(artifact), "a signed URL never shows whole"
        with urllib.request.urlopen(artifact.url, timeout=10) as r:  # no credentials: the URL is enough
            assert r.read() == script.read_bytes()
        done = _bash(render_fetch([artifact], str(tmp_path / "host"), attempts=1), tmp_path)
        assert done.returncode == 0, done.stderr
        assert (tmp_path / "host/train.py").read_bytes() == script.read_bytes()
        assert delete_s3(job_id="job-7", bucket="team-artifacts", client=s3) == 1
        assert s3.list_objects_v2(Bucket="team-artifacts").get("KeyCount") == 0


@pytest.mark.parametrize("bad", [
    {"name": "../etc/passwd"}, {"url": "ftp://x/y"}, {"url": "https://x/y\nrm -rf /"}, {"sha256": "ABC"},
])
def test_a_malformed_artifact_is_refused_with_what_to_give(bad: dict[str, str]) -> None:
    fields = {"name": "train.py", "url": "https://bucket/train.py", "sha256": "0" * 64, **bad}
    with pytest.raises(InvalidRequestError, match="give"):
        Artifact(**fields)
