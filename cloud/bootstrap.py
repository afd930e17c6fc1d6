"""The per-instance bootstrap: the cloud-init document that makes a launched instance a host of its job.

An instance boots with this document as its user-data (EC2) or `osProfile.customData` (Azure, base64: cloud-init
runs customData, not `properties.userData`). cloud-init, once per instance, writes three files and runs the
installer:

- `/opt/trainmover/bin/install`: a virtual environment over the image's Python (`--system-site-packages`: torch,
  CUDA and NCCL are the image's, see IMAGE_CONTRACT) and the job's pinned TrainMover source, `--no-deps`, so
  nothing unpinned is ever installed;
- `/opt/trainmover/bin/agent-start`: fetches the job's secret with the instance's own identity (cloud.secrets:
  Secrets Manager or SSM with the instance role, Key Vault with the VM's managed identity) into a root-only file on
  tmpfs, checks the image against the job's contract, then execs `trainmover agent --secret-file ...`;
- `trainmover-agent.service`: a systemd unit, enabled, so the agent starts at every boot (a parked standby that is
  woken boots again: cloud-init does not rerun, systemd does) and again after a failure (`Restart=on-failure`);
  its `/run/trainmover-agent` is tmpfs, gone when the service stops.

The secret itself is never in the document, only where to fetch it (a `SecretRef`). Every value a user gives is
validated here (one clear `InvalidRequestError` each) and shell-quoted where it reaches a script.

Optionally (`head=`) the instance also runs the job's coordinator, with the training script and its arguments,
bound to `coordinator_host` (so that host must be this instance's fixed private address).
"""

from __future__ import annotations

import argparse
import base64
import ipaddress
import json
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Literal, get_args

from cloud.artifacts import Artifact, render_fetch, render_python_select
from cloud.base import HostBootstrap, InvalidRequestError, LaunchRequest, validate_job_id
from cloud.secret_store import SecretRef

IMAGE_CONTRACT = """\
Every host of a job runs the same image: a handoff moves a rank's state to another host and the job's result is
bit-exact only between equal stacks (a different NCCL or torch changes reduction orders and kernels).

Equal on every host, checked at each agent start (`python -m cloud.bootstrap check-image`):
  driver      the NVIDIA driver version (`nvidia-smi --query-gpu=driver_version`), "none" without a GPU
  cuda        the CUDA version torch was built with (`torch.version.cuda`), "none" for a CPU build
  nccl        the NCCL version torch uses (`torch.cuda.nccl.version()`), "none" for a CPU build
  torch       `torch.__version__`, local tag included (2.6.0+cu124)
  trainmover  the installed TrainMover distribution's version

The image provides: Linux with systemd and cloud-init, python3 (3.11+) with venv, torch, numpy and pydantic
installed system-wide (the bootstrap's virtual environment sees them), boto3 on AWS (the secret fetch uses it;
Azure needs nothing: IMDS and Key Vault are plain HTTPS), `ip` (iproute2) when the agent binds to an interface,
and the training script at the same absolute path on every host. The bootstrap installs only the job's pinned
TrainMover source, without dependencies.
"""

IMAGE_FIELDS = ("driver", "cuda", "nccl", "torch", "trainmover")
NONE = "none"
"""The version of a component a host does not have (no GPU: no driver, CUDA or NCCL)."""

PREFIX = "/opt/trainmover"
VENV = f"{PREFIX}/venv"
DIST = f"{PREFIX}/dist"
"""Where the job's staged files land (the wheel, and the training script when it is staged)."""
WORK = f"{PREFIX}/work"
"""The agent's and its processes' working directory, the service user's."""
SERVICE_USER = "trainmover"
"""The unprivileged user the agent and every training process run as."""
ORPHAN_TIMEOUT_S = 900.0
"""The hosts' dead-man's switch: no coordinator of the job reachable for this long powers the host off."""
INSTALL_ATTEMPTS = 3
IMPORTED_FROM_THE_IMAGE = ("torch", "numpy", "pydantic", "cryptography", "blake3")
"""TrainMover's dependencies (pyproject.toml), which the image provides: its wheel is installed without them."""
ORPHANED_EXIT = 5
"""`runtime.host.agent.ORPHANED_EXIT`: the agent's status once its dead-man's switch fired (written twice: cloud
imports nothing of the runtime; a test checks they agree)."""
AGENT_UNIT = "trainmover-agent.service"
COORDINATOR_UNIT = "trainmover-coordinator.service"
SECRET_FILE_NAME = "job.secret"
EC2_USER_DATA_MAX_BYTES = 16 * 1024  # https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/user-data.html
AZURE_CUSTOM_DATA_MAX_BYTES = 64 * 1024  # base64; https://learn.microsoft.com/azure/virtual-machines/custom-data
MAX_SLOTS = 64

_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*")
_INTERFACE = re.compile(r"[A-Za-z0-9_.:-]{1,15}")
_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
_EXTRAS = rf"(?:\[{_NAME}(?:,{_NAME})*\])?"
_PIN_VERSION = re.compile(rf"({_NAME}){_EXTRAS}===?([0-9][0-9A-Za-z.+!-]*)")
_PIN_GIT = re.compile(
    rf"({_NAME}){_EXTRAS} @ git\+https://[A-Za-z0-9.-]+(?::\d{{1,5}})?/[A-Za-z0-9._~/-]+@([0-9a-f]{{40}})"
    r"(?:#subdirectory=[A-Za-z0-9._/-]+)?"
)
_VERSION = re.compile(r"[0-9A-Za-z][0-9A-Za-z.+_-]{0,63}")
Backend = Literal["gloo", "nccl"]


# ---------------------------------------------------------------------------------------------------- image


@dataclass(frozen=True, slots=True)
class ImageVersions:
    """The versions of a host's stack that must be equal on every host of a job (see IMAGE_CONTRACT)."""

    driver: str
    cuda: str
    nccl: str
    torch: str
    trainmover: str

    def __post_init__(self) -> None:
        bad = [f.name for f in fields(self) if not _VERSION.fullmatch(str(getattr(self, f.name)))]
        if bad:
            raise InvalidRequestError(
                f"invalid image versions for {', '.join(bad)}: give versions such as 12.4 or 2.6.0+cu124, or "
                f"'{NONE}' for what a CPU host lacks",
                code="InvalidImageContract",
            )


class ImageMismatchError(RuntimeError):
    """This host's stack differs from the job's image contract: its handoffs would not be bit-exact."""


def check_image(expected: ImageVersions, observed: ImageVersions) -> None:
    """Nothing when `observed` equals `expected`; one ImageMismatchError naming every difference otherwise."""
    diffs = [
        f"{name} {getattr(observed, name)} (the job expects {getattr(expected, name)})"
        for name in IMAGE_FIELDS
        if getattr(observed, name) != getattr(expected, name)
    ]
    if diffs:
        raise ImageMismatchError(
            f"this host's image differs from the job's: {'; '.join(diffs)}. A handoff between different stacks is "
            "not bit-exact: launch this host from the job's image (docs/cloud-bootstrap.md, the image contract)"
        )


def observe_image(run: Callable[[Sequence[str]], str] | None = None) -> ImageVersions:
    """This host's versions. torch is imported here, not at module import; `run` runs a command and returns its
    output (nvidia-smi for the driver), for tests."""
    import importlib.metadata

    def default_run(argv: Sequence[str]) -> str:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=20, check=True).stdout

    runner = run or default_run
    try:
        driver = runner(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]).split()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        driver = NONE
    try:
        import torch

        torch_version = str(torch.__version__)
        cuda = str(torch.version.cuda) if torch.version.cuda else NONE
        nccl = ".".join(str(p) for p in torch.cuda.nccl.version()) if torch.version.cuda else NONE
    except ImportError:
        torch_version = cuda = nccl = NONE
    try:
        trainmover = importlib.metadata.version("trainmover")
    except importlib.metadata.PackageNotFoundError:
        trainmover = NONE
    return ImageVersions(driver=driver, cuda=cuda, nccl=nccl, torch=torch_version, trainmover=trainmover)


# ---------------------------------------------------------------------------------------------------- inputs


def validate_pinned_source(requirement: str) -> str:
    """`requirement` when it pins one exact release (`trainmover[aws]==0.1.0`) or one git commit
    (`trainmover @ git+https://github.com/ORG/REPO@<40 hex digits>`); InvalidRequestError otherwise: a range, a
    branch or a tag could install something else on a replacement host than on the others."""
    if not isinstance(requirement, str) or not (
        _PIN_VERSION.fullmatch(requirement) or _PIN_GIT.fullmatch(requirement)
    ):
        raise InvalidRequestError(
            f"the TrainMover source {requirement!r} is not pinned: give NAME==VERSION (an exact release) or "
            "'NAME @ git+https://HOST/PATH@COMMIT' with the full 40-digit commit, so every host installs the same code",
            code="UnpinnedSource",
        )
    return requirement


def _validate_host(host: object) -> str:
    if isinstance(host, str):
        try:
            return str(ipaddress.ip_address(host))
        except ValueError:
            if _HOSTNAME.fullmatch(host):
                return host
    raise InvalidRequestError(
        f"invalid coordinator address {host!r}: give an IP address or a DNS name (the coordinator's, as its agents "
        "reach it)",
        code="InvalidCoordinator",
    )


def _validate_port(port: object, label: str) -> int:
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise InvalidRequestError(f"invalid {label} {port!r}: give a port in 1-65535", code="InvalidPort")
    return port


@dataclass(frozen=True, slots=True)
class HeadCoordinator:
    """Run the job's coordinator on this instance too (a head host): what `trainmover coordinator` takes."""

    agents: int
    """Hosts to wait for before starting (this one included when it also runs an agent)."""
    nproc: int
    """Workers (data-parallel ranks)."""
    standby: int
    """Warm standby processes."""
    store_port: int
    """The job's store port (`--port`): every process and the orchestrator connect to it."""
    backend: Backend = "nccl"

    def __post_init__(self) -> None:
        for label, value, low in (("agents", self.agents, 1), ("nproc", self.nproc, 1), ("standby", self.standby, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidRequestError(f"head: {label} must be an integer >= {low}, got {value!r}")
        _validate_port(self.store_port, "store port")
        if self.backend not in get_args(Backend):
            raise InvalidRequestError(f"head: backend must be one of {', '.join(get_args(Backend))}")


@dataclass(frozen=True, slots=True)
class AgentBootstrap(HostBootstrap):
    """What one instance needs to become a host of its job. Validated on construction, one message per mistake."""

    job_id: str
    coordinator_host: str
    """The coordinator's address as the agents reach it (an IP address or DNS name)."""
    agent_port: int
    """The coordinator's `--agent-port`."""
    slots: int
    """Processes this host runs, one per GPU (`Provider.accelerators(instance_type).slots`, 1 on a CPU type): 1-64.
    The agent gives each its own `LOCAL_RANK` and, on NCCL, its own GPU (`CUDA_VISIBLE_DEVICES`)."""
    source: str
    """The pinned TrainMover source (`validate_pinned_source`)."""
    secret: SecretRef
    """Where the host fetches the job's secret at every boot, with its own identity."""
    script: str
    """The training script's absolute path, the same on every host (the coordinator's spawn orders run it)."""
    script_args: tuple[str, ...] = ()
    """The script's arguments (used by a head's coordinator)."""
    address: str | None = None
    """The address this host's processes listen on; default: the one facing the coordinator."""
    interface: str | None = None
    """Or: listen on this interface's IPv4 address, found at boot (e.g. ens5)."""
    image: ImageVersions | None = None
    """The job's image contract; when given, the agent starts only on a host whose versions equal it."""
    head: HeadCoordinator | None = None
    """Also run the coordinator here, bound to `coordinator_host`."""
    efa: bool = False
    """The host has Elastic Fabric Adapters (`LaunchRequest.efa`): its agent runs with `EFA_ENVIRONMENT`."""
    notices: Literal["aws", "azure"] | None = None
    """The agent watches this cloud's instance metadata for the host's notices (`trainmover agent --notices`): a
    spot interruption, an eviction or maintenance moves the host's ranks to standbys before the cloud acts."""
    wheel: Artifact | None = None
    """The TrainMover wheel the orchestrator built and staged (cloud.artifacts): installed from that file, its
    SHA-256 checked, no index asked. Without it, `source` is installed from the index (pinned)."""
    script_file: Artifact | None = None
    """The training script, staged the same way and fetched to `script` (whose file name it must have), so that
    the image need not hold it."""
    orphan_timeout_s: float = ORPHAN_TIMEOUT_S
    """The agent's dead-man's switch (`trainmover agent --orphan-timeout`): with no coordinator of the job
    reachable for this long (its orchestrator died, or it ended and nobody released the host), the host powers
    off; on AWS the launch makes that a termination. 0: off."""
    orphan_deallocate: bool = False
    """Azure: when the dead-man's switch fires, the host first asks ARM to deallocate itself through its own
    identity (`cloud.azure.selfstop`; the launch grants it that on the VM alone), since a powered-off VM stays
    allocated and billed."""

    def __post_init__(self) -> None:
        validate_job_id(self.job_id)
        object.__setattr__(self, "coordinator_host", _validate_host(self.coordinator_host))
        _validate_port(self.agent_port, "agent port")
        if isinstance(self.slots, bool) or not isinstance(self.slots, int) or not 1 <= self.slots <= MAX_SLOTS:
            raise InvalidRequestError(
                f"invalid slots {self.slots!r}: give the host's GPU count, 1-{MAX_SLOTS}", code="InvalidSlots"
            )
        validate_pinned_source(self.source)
        if not isinstance(self.secret, SecretRef):
            raise InvalidRequestError("secret must be a SecretRef (where the host fetches it), never the secret")
        if not isinstance(self.script, str) or not self.script.startswith("/") or "\0" in self.script:
            raise InvalidRequestError(
                f"invalid script {self.script!r}: give its absolute path, the same on every host", code="InvalidScript"
            )
        object.__setattr__(self, "script_args", tuple(self.script_args))
        if any(not isinstance(a, str) or "\0" in a for a in self.script_args):
            raise InvalidRequestError("script arguments must be strings without NUL characters", code="InvalidScript")
        if not isinstance(self.efa, bool):
            raise InvalidRequestError(f"efa must be True or False, got {self.efa!r}", code="InvalidBootstrap")
        if not isinstance(self.orphan_deallocate, bool):
            raise InvalidRequestError(f"orphan_deallocate must be True or False, got {self.orphan_deallocate!r}",
                                      code="InvalidBootstrap")
        if self.notices not in (None, "aws", "azure"):
            raise InvalidRequestError(f"notices must be 'aws', 'azure' or None, got {self.notices!r}",
                                      code="InvalidBootstrap")
        if self.address is not None and self.interface is not None:
            raise InvalidRequestError("give address or interface, not both", code="InvalidBind")
        if self.address is not None:
            try:
                object.__setattr__(self, "address", str(ipaddress.ip_address(self.address)))
            except ValueError:
                raise InvalidRequestError(
                    f"invalid address {self.address!r}: give this host's IP address", code="InvalidBind"
                ) from None
        if self.interface is not None and not _INTERFACE.fullmatch(self.interface):
            raise InvalidRequestError(
                f"invalid interface {self.interface!r}: give a network interface name such as ens5", code="InvalidBind"
            )
        if self.wheel is not None and not (isinstance(self.wheel, Artifact) and self.wheel.name.endswith(".whl")):
            raise InvalidRequestError("wheel must be a cloud.artifacts.Artifact of a .whl file", code="InvalidArtifact")
        if self.script_file is not None and (not isinstance(self.script_file, Artifact)
                                             or self.script_file.name != self.script.rsplit("/", 1)[-1]):
            raise InvalidRequestError(
                f"the staged script must have the script's file name ({self.script.rsplit('/', 1)[-1]!r}): the host "
                "fetches it to that path", code="InvalidArtifact")
        if isinstance(self.orphan_timeout_s, bool) or not isinstance(self.orphan_timeout_s, (int, float)) \
                or not 0 <= self.orphan_timeout_s <= 7 * 86400:
            raise InvalidRequestError(f"invalid orphan_timeout_s {self.orphan_timeout_s!r}: give seconds, 0 (off) "
                                      "to a week", code="InvalidBootstrap")

    def check_launch(self, request: LaunchRequest) -> None:
        """InvalidRequestError when `request` cannot launch hosts with this bootstrap: another job, user_data too, a
        different efa, or one fixed address or head for several instances."""
        if self.job_id != request.job_id:
            raise InvalidRequestError(
                f"the bootstrap is for job {self.job_id!r}, the launch for {request.job_id!r}: an instance must "
                "join the job it is tagged with",
                code="InvalidBootstrap",
            )
        if request.user_data is not None:
            raise InvalidRequestError(
                "give bootstrap or user_data, not both: the bootstrap is the instance's whole user-data",
                code="InvalidBootstrap",
            )
        if self.efa != request.efa:
            raise InvalidRequestError(
                f"the launch asks efa={request.efa} but its bootstrap efa={self.efa}: set both, so that the agent "
                "runs with FI_PROVIDER=efa exactly on hosts that have the adapter",
                code="InvalidBootstrap",
            )
        if request.count > 1 and (self.address is not None or self.head is not None):
            what = "a fixed address" if self.address is not None else "the job's coordinator (head)"
            raise InvalidRequestError(
                f"the bootstrap gives every instance {what}, so it fits one instance only: launch the head (or the "
                "host with a fixed address) with count=1, the others with a bootstrap without it",
                code="InvalidBootstrap",
            )

    @property
    def powers_off_when_orphaned(self) -> bool:
        return bool(self.orphan_timeout_s)

    @property
    def coordinator(self) -> str:
        """`HOST:PORT` as `trainmover agent --coordinator` parses it (IPv6 in brackets)."""
        host = f"[{self.coordinator_host}]" if ":" in self.coordinator_host else self.coordinator_host
        return f"{host}:{self.agent_port}"


# ---------------------------------------------------------------------------------------------------- rendering


def _q(value: str) -> str:
    return shlex.quote(value)


def _argv(words: Sequence[str]) -> str:
    return " ".join(words)


def _fetch_secret_lines(secret: SecretRef, unit_dir: str) -> list[str]:
    fetch = ["python", "-m", "cloud.secrets", "fetch", "--kind", _q(secret.kind), "--name", _q(secret.name)]
    if secret.region is not None:
        fetch += ["--region", _q(secret.region)]
    if secret.identity_client_id is not None:
        fetch += ["--identity-client-id", _q(secret.identity_client_id)]
    fetch += ["--to", '"$secret_file"']
    return [
        # systemd's RuntimeDirectory= (tmpfs, mode 700, removed when the service stops) sets RUNTIME_DIRECTORY.
        f'secret_dir="${{RUNTIME_DIRECTORY:-/run/{unit_dir}}}"',
        'mkdir -p -m 700 "$secret_dir"',
        f'secret_file="$secret_dir/{SECRET_FILE_NAME}"',
        _argv(fetch),
    ]


def _preamble(job_id: str, what: str) -> list[str]:
    return [
        "#!/bin/bash",
        f"# Rendered by cloud.bootstrap for job {job_id}: {what}.",
        "set -euo pipefail",
        "umask 077",
        # Instance metadata (the instance role's or managed identity's tokens) is never asked through a proxy.
        'export NO_PROXY="169.254.169.254${NO_PROXY:+,$NO_PROXY}"',
        'export no_proxy="169.254.169.254${no_proxy:+,$no_proxy}"',
        f'export PATH="{VENV}/bin:$PATH"',
    ]


def render_agent_start(spec: AgentBootstrap) -> str:
    """The script the agent's unit runs: fetch the secret, check the image, exec `trainmover agent`."""
    lines = _preamble(spec.job_id, "fetch the job's secret, then start this host's agent")
    lines += _fetch_secret_lines(spec.secret, "trainmover-agent")
    if spec.image is not None:
        check = ["python", "-m", "cloud.bootstrap", "check-image"]
        for name in IMAGE_FIELDS:
            check += [f"--{name}", _q(getattr(spec.image, name))]
        lines.append(_argv(check))
    missing = (
        f"trainmover: the training script {spec.script} is not on this host: the job's image must hold it at the "
        "same path on every host"
    )
    lines += [
        f"if [ ! -f {_q(spec.script)} ]; then",
        f"  echo {_q(missing)} >&2",
        "  exit 1",
        "fi",
    ]
    agent = [
        "trainmover", "agent", "--coordinator", _q(spec.coordinator), "--slots", str(spec.slots),
        "--secret-file", '"$secret_file"', "--job-id", _q(spec.job_id),
    ]
    if spec.orphan_timeout_s:
        # The agent runs unprivileged: it stops its processes and exits ORPHANED_EXIT; the unit powers off.
        agent += ["--orphan-timeout", f"{spec.orphan_timeout_s:g}", "--orphan-command", "true"]
    if spec.notices is not None:
        agent += ["--notices", spec.notices]
    if spec.address is not None:
        agent += ["--address", _q(spec.address)]
    elif spec.interface is not None:
        lines += [
            f"address=\"$(ip -4 -o addr show dev {_q(spec.interface)} "
            "| awk '{split($4, a, \"/\"); print a[1]; exit}')\"",
            'if [ -z "$address" ]; then',
            f"  echo {_q(f'trainmover: interface {spec.interface} has no IPv4 address on this host')} >&2",
            "  exit 1",
            "fi",
        ]
        agent += ["--address", '"$address"']
    lines.append("exec " + _argv(agent))
    return "\n".join(lines) + "\n"


def render_coordinator_start(spec: AgentBootstrap) -> str:
    """The script a head host's coordinator unit runs: fetch the secret, exec `trainmover coordinator SCRIPT ARGS`."""
    head = spec.head
    if head is None:
        raise InvalidRequestError("this bootstrap has no head coordinator")
    lines = _preamble(spec.job_id, "fetch the job's secret, then start the job's coordinator")
    lines += _fetch_secret_lines(spec.secret, "trainmover-coordinator")
    words = [
        "trainmover", "coordinator", "--agents", str(head.agents), "--host", _q(spec.coordinator_host),
        "--port", str(head.store_port), "--agent-port", str(spec.agent_port), "--nproc", str(head.nproc),
        "--standby", str(head.standby), "--backend", head.backend, "--secret-file", '"$secret_file"',
        _q(spec.script), *(_q(a) for a in spec.script_args),
    ]
    lines.append("exec " + _argv(words))
    return "\n".join(lines) + "\n"


def render_service_user() -> list[str]:
    """Bash lines that make the unprivileged user the agent runs as, and its working directory (idempotent)."""
    return [
        f"id -u {SERVICE_USER} >/dev/null 2>&1 || useradd --system --no-create-home --home-dir {WORK} "
        f"--shell /usr/sbin/nologin {SERVICE_USER}",
        f"mkdir -p {WORK} && chown {SERVICE_USER}: {WORK} && chmod 0750 {WORK}",
    ]


def render_install(spec: AgentBootstrap) -> str:
    """The once-per-instance installer: the job's service user, the image's Python (a Deep Learning AMI's or
    DSVM's conda environment first; 3.11+ with torch, or one clear failure), a venv over it that sees its packages,
    and TrainMover without dependencies: from the staged wheel (its digest checked, no index), else the pinned
    source from the index, retried. The staged script, when there is one, is fetched to its path."""
    pip = f"{VENV}/bin/python -m pip install --no-deps --no-input --disable-pip-version-check"
    lines = [
        "#!/bin/bash",
        f"# Rendered by cloud.bootstrap for job {spec.job_id}: install TrainMover and the job's files.",
        "set -euo pipefail",
        "umask 022",
        *render_service_user(),
        *render_python_select(),
        f'"$tm_python" -m venv --system-site-packages {VENV}',
        # A venv made from a venv (or a conda env) sees the base interpreter's packages only: point it at the
        # image's environment itself, where torch is.
        f"tm_site=\"$({VENV}/bin/python -c 'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])')\"",
        "\"$tm_python\" -c 'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])' "
        '> "$tm_site/trainmover-image.pth"',
    ]
    staged = [a for a in (spec.wheel, spec.script_file) if a is not None]
    if staged:
        lines += render_fetch(staged, DIST)
    if spec.wheel is not None:
        # --ignore-installed: the image's environment may carry another TrainMover; the job's own goes here.
        lines.append(f"{pip} --no-index --ignore-installed {_q(DIST + '/' + spec.wheel.name)}")
    else:
        lines += [
            f"for attempt in $(seq 1 {INSTALL_ATTEMPTS}); do",
            f"  if {pip} {_q(spec.source)}; then break; fi",
            f'  if [ "$attempt" -eq {INSTALL_ATTEMPTS} ]; then',
            f"    echo {_q(f'trainmover: installing {spec.source} failed {INSTALL_ATTEMPTS} times')} >&2",
            "    exit 1",
            "  fi",
            "  sleep $((attempt * 10))",
            "done",
        ]
    if spec.script_file is not None:
        target = spec.script
        lines += [f"mkdir -p {_q(target.rsplit('/', 1)[0] or '/')}",
                  f"install -m 0644 {_q(DIST + '/' + spec.script_file.name)} {_q(target)}"]
    # The install works, or the unit never starts: the wheel came without its dependencies, so the image's own are
    # imported too (a missing one fails here, at boot, not at the job's first handoff).
    lines.append(f'"{VENV}/bin/python" -c "import {", ".join(IMPORTED_FROM_THE_IMAGE)}, runtime, cloud" || '
                 '{ echo "trainmover: the image lacks a package TrainMover needs (above); bake it in '
                 '(docs/cloud-bootstrap.md, Baking a host image)" >&2; exit 1; }')
    return "\n".join(lines) + "\n"


EFA_ENVIRONMENT = ("FI_PROVIDER=efa", "FI_EFA_USE_DEVICE_RDMA=1")
"""What the agent (and every process it starts) runs with on an EFA host: NCCL's aws-ofi-nccl plugin takes libfabric's
EFA provider, with GPUDirect RDMA."""

SLOTS_ENVIRONMENT = ("CUDA_DEVICE_ORDER=PCI_BUS_ID",)
"""What the agent (and every process it starts) runs with on a host of several slots: the agent gives slot i
`CUDA_VISIBLE_DEVICES=i`, and in PCI bus order i is the GPU that nvidia-smi and the instance type's topology (its
NUMA nodes and NICs) call i, not the i-th of CUDA's default fastest-first order."""


def agent_environment(spec: AgentBootstrap) -> tuple[str, ...]:
    """The agent unit's `Environment=` values for `spec`'s host (`EFA_ENVIRONMENT`, `SLOTS_ENVIRONMENT`). Nothing
    else is set: NCCL finds InfiniBand by itself, and the agent sets `NCCL_SOCKET_IFNAME` and `GLOO_SOCKET_IFNAME`
    per process to the interface of the address it binds (runtime.host.agent)."""
    return (EFA_ENVIRONMENT if spec.efa else ()) + (SLOTS_ENVIRONMENT if spec.slots > 1 else ())


def _unit(description: str, start: str, runtime_dir: str, *, restart: bool, environment: Sequence[str] = (),
          orphan: bool = False, deallocate: bool = False) -> str:
    # `+`: with full privileges, where the agent has none. Its dead-man's switch fired: power the host off, on Azure
    # after asking ARM to deallocate the VM (a powered-off VM stays allocated and billed).
    first = f"{VENV}/bin/python -m cloud.azure.selfstop; " if deallocate else ""
    fired = f"if [ \"$EXIT_STATUS\" = {ORPHANED_EXIT} ]; then {first}systemctl poweroff; fi"
    stop = [f"RestartPreventExitStatus={ORPHANED_EXIT}", f"ExecStopPost=+/bin/sh -c '{fired}'"] if orphan else []
    return "\n".join([
        "[Unit]",
        f"Description={description}",
        "Wants=network-online.target",
        "After=network-online.target",
        "StartLimitIntervalSec=0",  # keep coming back: a coordinator may be minutes away
        "",
        "[Service]",
        "Type=exec",
        f"User={SERVICE_USER}",
        f"WorkingDirectory={WORK}",
        *(f"Environment={value}" for value in environment),
        f"ExecStart={start}",
        f"Restart={'on-failure' if restart else 'no'}",
        "RestartSec=5",
        *stop,
        f"RuntimeDirectory={runtime_dir}",
        "RuntimeDirectoryMode=0700",
        "UMask=0077",
        "",
        "[Install]",
        "WantedBy=multi-user.target",
    ]) + "\n"


def render_units(spec: AgentBootstrap) -> dict[str, str]:
    """The systemd units by file name. The agent comes back after a failure and at every boot; a head's
    coordinator is not restarted (a new coordinator would be a new job: docs/multihost.md)."""
    units = {
        AGENT_UNIT: _unit(f"TrainMover agent of job {spec.job_id}", f"{PREFIX}/bin/agent-start", "trainmover-agent",
                          restart=True, environment=agent_environment(spec), orphan=bool(spec.orphan_timeout_s),
                          deallocate=spec.orphan_deallocate),
    }
    if spec.head is not None:
        units[COORDINATOR_UNIT] = _unit(
            f"TrainMover coordinator of job {spec.job_id}", f"{PREFIX}/bin/coordinator-start",
            "trainmover-coordinator", restart=False,
        )
    return units


def agent_bootstrap(request: LaunchRequest) -> AgentBootstrap | None:
    """The request's bootstrap as the `AgentBootstrap` it is (`LaunchRequest` holds a `cloud.base.HostBootstrap`)."""
    spec = request.bootstrap
    if spec is not None and not isinstance(spec, AgentBootstrap):
        raise InvalidRequestError(
            f"bootstrap must be a cloud.bootstrap.AgentBootstrap, got {type(spec).__name__}", code="InvalidBootstrap"
        )
    return spec


def render_cloud_init(spec: AgentBootstrap) -> str:
    """The cloud-init document (EC2 user-data; Azure customData after `azure_custom_data`). JSON under the
    `#cloud-config` header: valid YAML with every string escaped, so no value can change the document's shape."""
    files: list[Mapping[str, str]] = [
        {"path": f"{PREFIX}/bin/install", "permissions": "0755", "owner": "root:root", "content": render_install(spec)},
        {"path": f"{PREFIX}/bin/agent-start", "permissions": "0755", "owner": "root:root",
         "content": render_agent_start(spec)},
    ]
    runcmd: list[list[str]] = [[f"{PREFIX}/bin/install"], ["systemctl", "daemon-reload"]]
    if spec.head is not None:
        files.append({"path": f"{PREFIX}/bin/coordinator-start", "permissions": "0755", "owner": "root:root",
                      "content": render_coordinator_start(spec)})
        runcmd.append(["systemctl", "start", COORDINATOR_UNIT])
    for name, unit in render_units(spec).items():
        files.append({"path": f"/etc/systemd/system/{name}", "permissions": "0644", "owner": "root:root",
                      "content": unit})
    runcmd.append(["systemctl", "enable", "--now", AGENT_UNIT])
    document = "#cloud-config\n" + json.dumps({"write_files": files, "runcmd": runcmd}, indent=1) + "\n"
    if len(document.encode()) > EC2_USER_DATA_MAX_BYTES:
        raise InvalidRequestError(
            f"the bootstrap is {len(document.encode())} bytes, over EC2's {EC2_USER_DATA_MAX_BYTES}-byte user-data "
            "limit: shorten the script's arguments (put them in a file in the image)",
            code="UserDataTooLarge",
        )
    return document


def azure_custom_data(document: str) -> str:
    """`osProfile.customData`: the document base64-encoded (cloud-init decodes and runs it)."""
    encoded = base64.b64encode(document.encode()).decode("ascii")
    if len(encoded) > AZURE_CUSTOM_DATA_MAX_BYTES:
        raise InvalidRequestError(f"customData is {len(encoded)} bytes, over Azure's {AZURE_CUSTOM_DATA_MAX_BYTES}")
    return encoded


# ---------------------------------------------------------------------------------------------------- on the host


def main(argv: Sequence[str] | None = None, *, observe: Callable[[], ImageVersions] = observe_image) -> int:
    """`python -m cloud.bootstrap check-image --driver V --cuda V --nccl V --torch V --trainmover V`: exit 0 when
    this host's stack equals the job's, 2 with one message otherwise."""
    parser = argparse.ArgumentParser(prog="python -m cloud.bootstrap")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("check-image", help="compare this host's versions with the job's image contract")
    for name in IMAGE_FIELDS:
        p.add_argument(f"--{name}", required=True)
    ns = parser.parse_args(argv)
    try:
        check_image(ImageVersions(**{name: getattr(ns, name) for name in IMAGE_FIELDS}), observe())
    except (ImageMismatchError, InvalidRequestError) as exc:
        print(f"trainmover check-image: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
