"""Baking a host image for teams that bake theirs: the script that makes a cloud's GPU base image meet TrainMover's
image contract (docs/cloud-bootstrap.md), which the Packer template in deploy/packer/ runs.

A host booted from a stock image installs at first boot what its job needs (cloud.bootstrap.render_install); what
that install cannot do is bring a Python 3.11+ with the job's torch, a few GB and minutes per host. The bake does
that once, into the image: it makes the service user and its working directory (the same lines as the boot's),
keeps the image's own Python when one of 3.11+ already has the pinned torch (a Deep Learning AMI's or a DSVM's
conda environment), and otherwise makes one in `/opt/trainmover/python` (a venv over the distribution's Python,
installed with apt when absent) with the pinned torch from its index; then it installs TrainMover's own
dependencies into whichever Python it kept. Each download is retried. The boot's Python
search looks there first (`cloud.artifacts.PYTHONS`). TrainMover itself is not baked in: each job's own wheel is
installed at boot, checked against its digest, so one image serves every version.

`python -m cloud.image bake-script [--torch V] [--torch-index URL] [--python 3.11]` prints the script;
deploy/packer/bake.sh is that output for the defaults (a test keeps them equal).
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from cloud.artifacts import BAKED_PYTHON, PYTHONS, render_python_select
from cloud.base import InvalidRequestError
from cloud.bootstrap import render_service_user

BAKED_ENV = BAKED_PYTHON.removesuffix("/bin/python")
INSTALL_ATTEMPTS = 3
_VERSION = re.compile(r"[0-9]+(?:\.[0-9]+){1,3}")
_PYTHON = re.compile(r"3\.(1[1-9]|[2-9][0-9])")
_INDEX = re.compile(r"(https|file)://[A-Za-z0-9._~:/?#\[\]@!$&'()*+,;=%-]+")
_REQUIREMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9_,-]+\])?([<>=!~]=?[A-Za-z0-9.*+]+(,[<>=!~]=?"
                          r"[A-Za-z0-9.*+]+)*)?")


@dataclass(frozen=True, slots=True)
class BakeSpec:
    """What a baked image carries. The defaults: the torch this project is tested with, CUDA 12.8 wheels."""

    torch: str = "2.13.0"
    """The torch version, pinned (`torch==V` from `torch_index`); the image contract's `torch` is it with the
    index's local tag (`2.13.0+cu128`)."""
    torch_index: str = "https://download.pytorch.org/whl/cu128"
    """The package index torch comes from (https://download.pytorch.org/whl/cpu for a CPU-only image)."""
    python: str = "3.11"
    """The Python installed with apt when the base image has none of 3.11+ with that torch."""
    packages: tuple[str, ...] = ("numpy>=1.26", "pydantic>=2.6", "cryptography>=42", "blake3>=0.4", "boto3>=1.34")
    """Besides torch, from the default index, into whichever Python the image keeps: TrainMover's own dependencies
    (its wheel is installed at boot without them, pyproject.toml's list; a test keeps them covered) and boto3 for
    AWS's secret fetch (harmless elsewhere)."""

    def __post_init__(self) -> None:
        if not _VERSION.fullmatch(self.torch):
            raise InvalidRequestError(f"bake: torch {self.torch!r} is not a version such as 2.13.0")
        if not _INDEX.fullmatch(self.torch_index):
            raise InvalidRequestError(f"bake: torch_index {self.torch_index!r} is not an https:// (or file://) URL")
        if not _PYTHON.fullmatch(self.python):
            raise InvalidRequestError(f"bake: python {self.python!r} must be 3.11 or newer, such as 3.11 or 3.12")
        bad = [p for p in self.packages if not _REQUIREMENT.fullmatch(p)]
        if bad:
            raise InvalidRequestError(f"bake: packages {bad} are not requirements such as numpy or pydantic>=2")


def _retried(command: str, what: str, attempts: int, backoff_s: int) -> list[str]:
    return [
        f"for attempt in $(seq 1 {attempts}); do",
        f"  if {command}; then break; fi",
        f'  if [ "$attempt" -eq {attempts} ]; then',
        f"    echo {shlex.quote(f'trainmover bake: {what} failed {attempts} times')} >&2",
        "    exit 1",
        "  fi",
        f"  sleep $((attempt * {backoff_s}))",
        "done",
    ]


def render_bake_python(spec: BakeSpec, pythons: Sequence[str] = PYTHONS, target: str = BAKED_ENV, *,
                       attempts: int = INSTALL_ATTEMPTS, backoff_s: int = 10) -> list[str]:
    """Bash lines that set `tm_python` to a Python 3.11+ with the pinned torch: the image's own when it has one,
    else one made in `target` (a venv over python`spec.python`, installed with apt when absent). Each download is
    tried `attempts` times, `backoff_s` x the attempt apart."""

    def retried(command: str, what: str) -> list[str]:
        return _retried(command, what, attempts, backoff_s)

    python = f"python{spec.python}"
    pip = "-m pip install --no-input --disable-pip-version-check"
    packages = " ".join(shlex.quote(p) for p in spec.packages)
    lines = [
        *render_python_select(pythons, torch_version=spec.torch, required=False),
        'if [ -z "$tm_python" ]; then',
        f'  echo "trainmover bake: no Python 3.11+ with torch {spec.torch} in the image (tried:${{tm_tried:- none}});'
        f' making {target}"',
        f"  if ! command -v {python} >/dev/null 2>&1; then",
        "    export DEBIAN_FRONTEND=noninteractive",
        *("    " + line for line in retried(
            f"apt-get update -qq && apt-get install -y -qq --no-install-recommends {python} {python}-venv",
            f"installing {python} with apt")),
        "  fi",
        f"  [ -x {target}/bin/python ] || {python} -m venv {target}  # a bake run again keeps what it made",
        *("  " + line for line in retried(
            f"{target}/bin/python {pip} torch=={spec.torch} --index-url {shlex.quote(spec.torch_index)}",
            f"installing torch {spec.torch}")),
        f"  tm_python={target}/bin/python",
        "fi",
    ]
    if spec.packages:  # into the kept Python too: a conda environment may lack some (already there: nothing done)
        lines += retried(f'"$tm_python" {pip} {packages}', "installing " + ", ".join(spec.packages))
    lines += [
        '"$tm_python" -c "import torch; print(\'trainmover bake: python\', __import__(\'sys\').version.split()[0], '
        "'torch', torch.__version__, 'cuda', torch.version.cuda or 'none')\"",
    ]
    return lines


def render_bake(spec: BakeSpec | None = None) -> str:
    """The whole bake script, run as root on the image builder's instance (Packer's shell provisioner)."""
    spec = spec or BakeSpec()
    lines = [
        "#!/bin/bash",
        "# Rendered by cloud.image.render_bake (python -m cloud.image bake-script): make this image meet",
        f"# TrainMover's image contract with torch {spec.torch} ({spec.torch_index}).",
        "set -euo pipefail",
        "umask 022",
        *render_service_user(),
        *render_bake_python(spec),
        # An image made from this instance must run cloud-init again on each of its instances (their user data).
        "if command -v cloud-init >/dev/null 2>&1; then cloud-init clean --logs; fi",
        "rm -rf /var/lib/apt/lists/* /root/.cache/pip",
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cloud.image")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("bake-script", help="print the script that makes a base image meet the image contract")
    defaults = BakeSpec()
    p.add_argument("--torch", default=defaults.torch)
    p.add_argument("--torch-index", default=defaults.torch_index)
    p.add_argument("--python", default=defaults.python)
    ns = parser.parse_args(argv)
    try:
        spec = BakeSpec(torch=ns.torch, torch_index=ns.torch_index, python=ns.python)
    except InvalidRequestError as exc:
        print(f"python -m cloud.image: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(render_bake(spec))
    return 0


__all__ = ["BAKED_ENV", "BakeSpec", "render_bake", "render_bake_python"]


if __name__ == "__main__":
    sys.exit(main())
