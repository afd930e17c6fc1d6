"""Baking a host image (cloud/image.py, deploy/packer/): the bake's Python lines run for real under bash, on an
"image" that already has the pinned torch and on one that has not (a venv made and torch installed into it with
pip, from a local index whose `torch` is a small stand-in distribution: the real one is gigabytes)."""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import torch

from cloud.artifacts import BAKED_PYTHON, PYTHONS
from cloud.base import InvalidRequestError
from cloud.bootstrap import IMPORTED_FROM_THE_IMAGE
from cloud.image import BakeSpec, main, render_bake, render_bake_python

ROOT = Path(__file__).resolve().parents[2]
PACKER = ROOT / "deploy" / "packer"
TORCH = torch.__version__.split("+")[0]


def _bash(lines: list[str], cwd: Path, path: str) -> subprocess.CompletedProcess[str]:
    script = "\n".join(["set -euo pipefail", *lines, 'echo "python=$tm_python"']) + "\n"
    # pip sees only the index the spec names: none of this machine's pip configuration or mirrors.
    env = {"PATH": path, "HOME": str(cwd), "PIP_CONFIG_FILE": os.devnull, "PIP_NO_CACHE_DIR": "1"}
    return subprocess.run(["bash", "-c", script], cwd=cwd, capture_output=True, text=True, timeout=300, check=False,
                          env=env)


def test_the_packer_templates_script_is_the_rendered_one_and_boot_looks_for_its_python_first() -> None:
    assert (PACKER / "bake.sh").read_text() == render_bake(), \
        "regenerate it: python -m cloud.image bake-script > deploy/packer/bake.sh"
    template = (PACKER / "trainmover-host.pkr.hcl").read_text()
    assert 'script          = "${path.root}/bake.sh"' in template
    assert 'http_tokens                 = "required"' in template  # the job policy launches IMDSv2 only
    assert PYTHONS[0] == BAKED_PYTHON


def test_the_bake_installs_and_the_boot_checks_every_dependency_of_trainmover() -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {d.split(">")[0].split("=")[0].split("<")[0].strip() for d in declared} - {"torch"}
    baked = {p.split(">")[0].split("=")[0].strip() for p in BakeSpec().packages}
    assert names <= baked, names - baked
    assert names | {"torch"} == set(IMPORTED_FROM_THE_IMAGE), "the boot's check imports each of them"


def test_an_image_with_the_pinned_torch_keeps_its_python(tmp_path: Path) -> None:
    lines = render_bake_python(BakeSpec(torch=TORCH, packages=()), pythons=(sys.executable,),
                               target=str(tmp_path / "env"))
    done = _bash(lines, tmp_path, os.environ["PATH"])
    assert done.returncode == 0, done.stderr
    assert "trainmover bake: python 3.11" in done.stdout and f"torch {torch.__version__}" in done.stdout
    assert done.stdout.splitlines()[-1] == f"python={sys.executable}"
    assert not (tmp_path / "env").exists(), "nothing installed"


def _stand_in_torch(index: Path, version: str) -> None:
    """A wheel named torch, of `version`, in a local simple index (`index/torch/`): what pip installs from it."""
    project = index / "torch"
    project.mkdir(parents=True)
    dist = f"torch-{version}.dist-info"
    files = {
        "torch/__init__.py": f"__version__ = '{version}+stand.in'\nfrom torch import version\n",
        "torch/version.py": "cuda = None\n",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(text.encode())}")
    files[f"{dist}/RECORD"] = "\n".join([*record, f"{dist}/RECORD,,"]) + "\n"
    wheel_name = f"torch-{version}-py3-none-any.whl"
    with zipfile.ZipFile(project / wheel_name, "w") as wheel:
        for name, text in files.items():
            wheel.writestr(name, text)
    # A file:// index is read as a web server's would be: each project's index.html (PEP 503).
    (project / "index.html").write_text(f'<html><body><a href="{wheel_name}">{wheel_name}</a></body></html>\n')


def test_an_image_without_it_gets_a_venv_with_the_pinned_torch_and_an_index_without_it_fails_the_bake(
    tmp_path: Path,
) -> None:
    index = tmp_path / "simple"
    _stand_in_torch(index, "1.0.0")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # The distribution's python3.11 (apt is then not needed), and an image Python with another torch.
    (bin_dir / "python3.11").symlink_to(Path(sys.base_prefix) / "bin" / "python3.11")
    other = bin_dir / "python-with-torch-2.4"
    other.write_text("#!/bin/sh\necho 'AssertionError: torch 2.4.1' >&2\nexit 1\n")
    other.chmod(0o755)
    target = tmp_path / "opt-trainmover-python"
    spec = BakeSpec(torch="9.8.7", torch_index=index.as_uri(), packages=())
    lines = render_bake_python(spec, pythons=(str(other),), target=str(target), attempts=2, backoff_s=0)
    path = f"{bin_dir}:/usr/bin:/bin"

    failed = _bash(lines, tmp_path, path)  # the index has no torch 9.8.7

    assert failed.returncode == 1
    assert failed.stderr.count("No matching distribution found for torch==9.8.7") == 2
    assert failed.stderr.strip().splitlines()[-1] == "trainmover bake: installing torch 9.8.7 failed 2 times"

    (index / "torch").rename(tmp_path / "old")
    _stand_in_torch(index, "9.8.7")
    done = _bash(lines, tmp_path, path)  # baked again, once the index has it

    assert done.returncode == 0, done.stderr
    assert "no Python 3.11+ with torch 9.8.7 in the image" in done.stdout
    assert "python-with-torch-2.4 (AssertionError: torch 2.4.1)" in done.stdout
    assert "torch 9.8.7+stand.in cuda none" in done.stdout
    assert done.stdout.splitlines()[-1] == f"python={target}/bin/python"


def test_a_bad_spec_is_one_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    for bad, match in ((dict(torch="latest"), "not a version"), (dict(python="3.9"), "3.11 or newer"),
                       (dict(torch_index="http://x"), "https://"), (dict(packages=("rm -rf /",)), "requirements")):
        with pytest.raises(InvalidRequestError, match=match):
            BakeSpec(**bad)  # type: ignore[arg-type]
    assert main(["bake-script", "--torch", "2.x"]) == 2
    assert capsys.readouterr().err == "python -m cloud.image: bake: torch '2.x' is not a version such as 2.13.0\n"
