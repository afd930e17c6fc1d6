"""The per-instance bootstrap: a valid cloud-init document whose scripts parse, start exactly the intended argv
(hostile values stay inert), fetch the secret at boot into a root-only file, and refuse bad inputs one by one."""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import re
import secrets
import shlex
import subprocess
import sys
import types
from dataclasses import replace
from pathlib import Path
from typing import Any

import boto3
import pytest
import yaml

from cloud.base import InvalidRequestError, LaunchRequest, RetryBudget
from cloud.bootstrap import (
    AGENT_UNIT,
    COORDINATOR_UNIT,
    ORPHANED_EXIT,
    AgentBootstrap,
    HeadCoordinator,
    ImageMismatchError,
    ImageVersions,
    azure_custom_data,
    check_image,
    main,
    observe_image,
    render_agent_start,
    render_cloud_init,
    render_coordinator_start,
    validate_pinned_source,
)
from cloud.secrets import AwsSecretsManagerStore, SecretRef
from runtime.cli import add_agent_parser, add_coordinator_parser

ROOT = Path(__file__).resolve().parents[2]
REGION = "us-east-1"
SECRET_ARN = "arn:aws:secretsmanager:us-east-1:123456789012:secret:trainmover/llm-7b/job-secret-AbCdEf"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
HOSTILE_ARGS = (
    "--steps", "1000",
    "$(touch {canary})", "`touch {canary}`", "; touch {canary}", "'quoted' \"double\"", "line\nbreak",
    "*", "${{HOME}}", "--secret-file=/etc/shadow", "", "-", "\\",
)
IMAGE = ImageVersions(driver="550.90.07", cuda="12.4", nccl="2.21.5", torch="2.6.0+cu124", trainmover="0.1.0")


def spec(**changes: Any) -> AgentBootstrap:
    base = AgentBootstrap(
        job_id="llm-7b", coordinator_host="10.0.0.1", agent_port=29401, slots=8, source="trainmover[aws]==0.1.0",
        secret=SecretRef("aws-secretsmanager", SECRET_ARN), script="/opt/job/train.py", script_args=("--steps", "10"),
    )
    return replace(base, **changes)


def bash_syntax_ok(script: str) -> None:
    result = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True, timeout=10)
    assert result.returncode == 0, result.stderr


def fake_bin(directory: Path, record: Path) -> Path:
    """A PATH directory whose `trainmover` records its argv, the secret file's mode and digest, then exits; `python`
    is this interpreter (the real secret fetch runs); `ip` shows one interface."""
    directory.mkdir()
    (directory / "trainmover").write_text(
        f"#!{sys.executable}\n"
        "import hashlib, json, os, stat, sys\n"
        "argv = sys.argv[1:]\n"
        "path = argv[argv.index('--secret-file') + 1]\n"
        "info = {'argv': argv, 'mode': stat.S_IMODE(os.stat(path).st_mode),\n"
        "        'dir_mode': stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode),\n"
        "        'sha256': hashlib.sha256(open(path).read().strip().encode()).hexdigest()}\n"
        f"open({str(record)!r}, 'w').write(json.dumps(info))\n"
    )
    (directory / "ip").write_text(
        "#!/bin/bash\necho '2: ens5    inet 10.1.2.3/24 brd 10.1.2.255 scope global dynamic ens5'\n"
    )
    os.symlink(sys.executable, directory / "python")
    for name in ("trainmover", "ip"):
        (directory / name).chmod(0o755)
    return directory


# ------------------------------------------------------------------------------------------------ the document


def test_the_document_is_cloud_config_with_scripts_that_parse_and_units_that_come_back() -> None:
    bootstrap = spec(head=HeadCoordinator(agents=2, nproc=8, standby=8, store_port=29400), image=IMAGE)
    document = render_cloud_init(bootstrap)
    assert document.startswith("#cloud-config\n")
    parsed = yaml.safe_load(document)
    files = {f["path"]: f for f in parsed["write_files"]}
    assert set(files) == {
        "/opt/trainmover/bin/install", "/opt/trainmover/bin/agent-start", "/opt/trainmover/bin/coordinator-start",
        f"/etc/systemd/system/{AGENT_UNIT}", f"/etc/systemd/system/{COORDINATOR_UNIT}",
    }
    for path in ("/opt/trainmover/bin/install", "/opt/trainmover/bin/agent-start",
                 "/opt/trainmover/bin/coordinator-start"):
        bash_syntax_ok(files[path]["content"])
    # Run by the unprivileged service user; it holds no secret (it fetches it at every start).
    assert files["/opt/trainmover/bin/agent-start"]["permissions"] == "0755"
    agent_unit = files[f"/etc/systemd/system/{AGENT_UNIT}"]["content"]
    for line in ("Restart=on-failure", "WantedBy=multi-user.target", "RuntimeDirectory=trainmover-agent",
                 "RuntimeDirectoryMode=0700", "UMask=0077", "StartLimitIntervalSec=0", "User=trainmover",
                 "WorkingDirectory=/opt/trainmover/work", f"RestartPreventExitStatus={ORPHANED_EXIT}"):
        assert line in agent_unit.splitlines()
    # The dead-man's switch: the agent (unprivileged) exits with its status, the unit powers the host off.
    assert "ExecStopPost=+/bin/sh -c 'if [ \"$EXIT_STATUS\" = 5 ]; then systemctl poweroff; fi'" in agent_unit
    assert "Restart=no" in files[f"/etc/systemd/system/{COORDINATOR_UNIT}"]["content"].splitlines()
    assert parsed["runcmd"][0] == ["/opt/trainmover/bin/install"]
    assert parsed["runcmd"][-1] == ["systemctl", "enable", "--now", AGENT_UNIT]  # enabled: starts at every boot
    install = files["/opt/trainmover/bin/install"]["content"]
    assert "pip install --no-deps" in install and "'trainmover[aws]==0.1.0'" in install
    assert "useradd --system" in install and "/opt/conda/envs/pytorch/bin/python" in install
    assert "for attempt in $(seq 1 3)" in install, "an install from the index is retried"
    agent_start = files["/opt/trainmover/bin/agent-start"]["content"]
    assert 'export NO_PROXY="169.254.169.254' in agent_start
    assert "python -m cloud.bootstrap check-image --driver 550.90.07 --cuda 12.4" in agent_start
    # Where the secret lives is in the document; nothing that could carry its value is.
    assert SECRET_ARN in agent_start and "TRAINMOVER_JOB_SECRET" not in document
    assert base64.b64decode(azure_custom_data(document)).decode() == document


def test_the_agent_watches_its_clouds_notices_when_the_bootstrap_says_so() -> None:
    assert "--notices aws" in render_agent_start(spec(notices="aws")).splitlines()[-1]
    assert "--notices azure" in render_agent_start(spec(notices="azure")).splitlines()[-1]
    assert "--notices" not in render_agent_start(spec())


@pytest.mark.parametrize(("slots", "efa", "environment"), [
    (8, False, ["CUDA_DEVICE_ORDER=PCI_BUS_ID"]),
    (8, True, ["FI_PROVIDER=efa", "FI_EFA_USE_DEVICE_RDMA=1", "CUDA_DEVICE_ORDER=PCI_BUS_ID"]),
    (1, False, []),
])
def test_the_agent_runs_one_process_per_slot_with_the_hosts_gpus_in_pci_order(
    slots: int, efa: bool, environment: list[str]
) -> None:
    """An 8-GPU host's agent starts with `--slots 8` (the agent parser reads it back), and its unit orders the
    GPUs by PCI bus so that slot i's CUDA_VISIBLE_DEVICES=i is nvidia-smi's GPU i; EFA hosts add libfabric's."""
    document = yaml.safe_load(render_cloud_init(spec(slots=slots, efa=efa)))
    files = {f["path"]: f["content"] for f in document["write_files"]}
    exec_line = files["/opt/trainmover/bin/agent-start"].splitlines()[-1]
    assert f" --slots {slots} " in exec_line
    parser = argparse.ArgumentParser()
    add_agent_parser(parser.add_subparsers(dest="command"))
    assert exec_line.startswith("exec trainmover agent ")
    assert parser.parse_args(shlex.split(exec_line)[2:]).slots == slots
    unit = files[f"/etc/systemd/system/{AGENT_UNIT}"].splitlines()
    assert [line.removeprefix("Environment=") for line in unit if line.startswith("Environment=")] == environment


def test_an_ipv6_coordinator_is_bracketed_as_the_agent_parses_it() -> None:
    from runtime.host.agent import AgentConfig

    bootstrap = spec(coordinator_host="fd00::1")
    assert bootstrap.coordinator == "[fd00::1]:29401"
    assert AgentConfig(coordinator=bootstrap.coordinator, slots=1, secret="x" * 32).endpoint() == ("fd00::1", 29401)


# ------------------------------------------------------------------------------------------------ run for real


def test_hostile_script_arguments_reach_the_coordinator_exactly_and_run_nothing(tmp_path: Path) -> None:
    canary = tmp_path / "pwned"
    args = tuple(a.format(canary=canary) for a in HOSTILE_ARGS)
    script = str(tmp_path / "my job" / "train $(touch x).py")
    bootstrap = spec(script=script, script_args=args, head=HeadCoordinator(2, 4, 2, 29400, backend="gloo"))
    start = render_coordinator_start(bootstrap)
    bash_syntax_ok(start)
    record = tmp_path / "argv.json"
    bin_dir = fake_bin(tmp_path / "bin", record)
    # The fetch is stubbed here (the next test runs it for real): a `python` that writes a fixed secret.
    (bin_dir / "python").unlink()
    (bin_dir / "python").write_text('#!/bin/bash\nfor a; do last="$a"; done\nprintf "%064d\\n" 7 > "$last"\n')
    (bin_dir / "python").chmod(0o755)
    run_dir = tmp_path / "run"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "RUNTIME_DIRECTORY": str(run_dir), "HOME": str(tmp_path)}
    result = subprocess.run(["bash", "-c", start], env=env, capture_output=True, text=True, timeout=30,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    received = json.loads(record.read_text())
    assert received["argv"] == [
        "coordinator", "--agents", "2", "--host", "10.0.0.1", "--port", "29400", "--agent-port", "29401",
        "--nproc", "4", "--standby", "2", "--backend", "gloo", "--secret-file", str(run_dir / "job.secret"),
        script, *args,
    ]
    assert not canary.exists() and not (tmp_path / "x").exists()
    # What `trainmover coordinator` itself makes of that argv: the script and every argument, unchanged.
    parser = argparse.ArgumentParser()
    add_coordinator_parser(parser.add_subparsers(dest="command"))
    ns = parser.parse_args(received["argv"])
    assert ns.script == script and tuple(ns.args) == args  # the LaunchConfig field the option fills


def test_the_agent_starts_with_the_secret_fetched_from_secrets_manager_into_a_root_only_file(
    moto_url: str, tmp_path: Path
) -> None:
    session = boto3.Session(aws_access_key_id="testing", aws_secret_access_key="not-a-real-key", region_name=REGION)
    fast = RetryBudget("bootstrap-test", attempts=2, base_delay_s=0.01, max_delay_s=0.02, deadline_s=5.0)
    secret = secrets.token_hex(32)
    ref = AwsSecretsManagerStore(REGION, reader_role_arn="arn:aws:iam::123456789012:role/nodes", session=session,
                                 endpoint_url=moto_url, budget=fast).put("boot-job", secret)
    train = tmp_path / "train.py"
    train.write_text("print('train')\n")
    bootstrap = spec(job_id="boot-job", slots=2, secret=ref, script=str(train), interface="ens5")
    start = render_agent_start(bootstrap)
    bash_syntax_ok(start)
    record = tmp_path / "argv.json"
    bin_dir = fake_bin(tmp_path / "bin", record)
    run_dir = tmp_path / "run"
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin", "RUNTIME_DIRECTORY": str(run_dir), "PYTHONPATH": str(ROOT),
        # The instance role's credentials, as boto3's default chain would find them; moto stands in for AWS.
        "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "not-a-real-key", "AWS_ENDPOINT_URL": moto_url,
        "NO_PROXY": "example.com",
    }
    result = subprocess.run(["bash", "-c", start], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert secret not in result.stdout + result.stderr
    received = json.loads(record.read_text())
    assert received["argv"] == [
        "agent", "--coordinator", "10.0.0.1:29401", "--slots", "2", "--secret-file", str(run_dir / "job.secret"),
        "--job-id", "boot-job", "--orphan-timeout", "900", "--orphan-command", "true", "--address", "10.1.2.3",
    ]
    assert received["mode"] == 0o600 and received["dir_mode"] == 0o700
    assert received["sha256"] == hashlib.sha256(secret.encode()).hexdigest()
    parser = argparse.ArgumentParser()
    add_agent_parser(parser.add_subparsers(dest="command"))
    ns = parser.parse_args(received["argv"])
    assert (ns.coordinator, ns.slots, ns.job_id, ns.address) == ("10.0.0.1:29401", 2, "boot-job", "10.1.2.3")
    assert (ns.orphan_timeout_s, ns.orphan_command) == (900.0, "true")


def test_a_host_without_the_script_or_the_secret_does_not_start_its_agent(tmp_path: Path) -> None:
    record = tmp_path / "argv.json"
    bin_dir = fake_bin(tmp_path / "bin", record)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "RUNTIME_DIRECTORY": str(tmp_path / "run"),
           "PYTHONPATH": str(ROOT)}
    no_secret = render_agent_start(spec(secret=SecretRef("aws-ssm", "/trainmover/llm-7b/job-secret", REGION)))
    # No instance role yet (as early in a boot): one message, exit 2, and systemd tries again (Restart=on-failure).
    env_no_creds = {**env, "AWS_EC2_METADATA_DISABLED": "true", "HOME": str(tmp_path),
                    "AWS_CONFIG_FILE": str(tmp_path / "none"), "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none")}
    result = subprocess.run(["bash", "-c", no_secret], env=env_no_creds, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and not record.exists()
    assert result.stderr.startswith("trainmover secret fetch: ") and "no usable AWS credentials" in result.stderr
    assert result.stderr.count("\n") == 1  # one line, no traceback

    (bin_dir / "python").unlink()
    (bin_dir / "python").write_text('#!/bin/bash\nfor a; do last="$a"; done\nprintf "%064d\\n" 7 > "$last"\n')
    (bin_dir / "python").chmod(0o755)
    missing = render_agent_start(spec(script=str(tmp_path / "absent.py")))
    result = subprocess.run(["bash", "-c", missing], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 1 and "is not on this host" in result.stderr and not record.exists()


# ------------------------------------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"job_id": "llm-*"}, "invalid job id"),
        ({"job_id": "a b"}, "invalid job id"),
        ({"coordinator_host": "10.0.0.1; rm -rf /"}, "invalid coordinator address"),
        ({"coordinator_host": ""}, "invalid coordinator address"),
        ({"agent_port": 0}, "invalid agent port"),
        ({"agent_port": 65536}, "invalid agent port"),
        ({"agent_port": True}, "invalid agent port"),
        ({"slots": 0}, "invalid slots"),
        ({"slots": 65}, "invalid slots"),
        ({"slots": "8"}, "invalid slots"),
        ({"source": "trainmover"}, "not pinned"),
        ({"source": "trainmover>=0.1"}, "not pinned"),
        ({"source": "trainmover==0.*"}, "not pinned"),
        ({"source": "trainmover==0.1.0; rm -rf /"}, "not pinned"),
        ({"source": "trainmover @ git+https://github.com/org/trainmover@main"}, "not pinned"),
        ({"source": "trainmover @ git+https://github.com/org/trainmover@0123abc"}, "not pinned"),
        ({"source": f"trainmover @ git+ssh://git@github.com/org/trainmover@{COMMIT}"}, "not pinned"),
        ({"source": f"trainmover @ git+https://user:token@github.com/org/trainmover@{COMMIT}"}, "not pinned"),
        ({"secret": "the-secret-itself"}, "SecretRef"),
        ({"script": "train.py"}, "absolute path"),
        ({"script_args": ("a\0b",)}, "NUL"),
        ({"address": "10.0.0.5", "interface": "ens5"}, "not both"),
        ({"address": "host-a"}, "invalid address"),
        ({"interface": "ens5; reboot"}, "invalid interface"),
        ({"notices": "gcp"}, "notices must be"),
        ({"efa": "yes"}, "efa must be True or False"),
    ],
)
def test_each_bad_input_is_one_clear_error(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        spec(**changes)


@pytest.mark.parametrize(
    "source",
    [
        "trainmover==0.1.0",
        "trainmover[aws]==0.1.0",
        "trainmover[aws,azure]===0.1.0+build.3",
        f"trainmover[aws] @ git+https://github.com/org/trainmover@{COMMIT}",
        f"trainmover @ git+https://git.example.com:8443/org/trainmover.git@{COMMIT}#subdirectory=python",
    ],
)
def test_pinned_sources_are_accepted(source: str) -> None:
    assert validate_pinned_source(source) == source


@pytest.mark.parametrize(
    ("changes", "message"),
    [({"agents": 0}, "agents"), ({"standby": -1}, "standby"), ({"store_port": 70000}, "store port"),
     ({"backend": "mpi"}, "backend")],
)
def test_a_bad_head_is_one_clear_error(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        replace(HeadCoordinator(2, 4, 2, 29400), **changes)


def test_a_document_over_the_user_data_limit_is_refused_before_launch() -> None:
    with pytest.raises(InvalidRequestError, match="16384-byte user-data limit"):
        render_cloud_init(spec(script_args=("x" * 17000,), head=HeadCoordinator(2, 4, 2, 29400)))


# ------------------------------------------------------------------------------------------------ image contract


def test_the_image_check_names_every_difference_in_one_message(capsys: pytest.CaptureFixture[str]) -> None:
    check_image(IMAGE, IMAGE)
    other = replace(IMAGE, nccl="2.20.5", torch="2.6.0+cu121")
    with pytest.raises(ImageMismatchError) as err:
        check_image(IMAGE, other)
    message = str(err.value)
    assert "nccl 2.20.5 (the job expects 2.21.5); torch 2.6.0+cu121 (the job expects 2.6.0+cu124)" in message
    assert "driver" not in message and "not bit-exact" in message
    argv = ["check-image", "--driver", "550.90.07", "--cuda", "12.4", "--nccl", "2.21.5", "--torch", "2.6.0+cu124",
            "--trainmover", "0.1.0"]
    assert main(argv, observe=lambda: IMAGE) == 0
    assert main(argv, observe=lambda: other) == 2
    assert capsys.readouterr().err.count("\n") == 1  # one line, no traceback
    with pytest.raises(InvalidRequestError, match="invalid image versions for torch"):
        replace(IMAGE, torch="2.6; rm -rf /")


def test_observe_image_reads_the_stack_torch_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    # A stand-in for a CUDA build of torch (importing the real one costs seconds; `python -m cloud.bootstrap
    # check-image` on a CPU host reports driver/cuda/nccl "none").
    fake = types.ModuleType("torch")
    fake.__version__ = "2.6.0+cu124"  # type: ignore[attr-defined]
    fake.version = types.SimpleNamespace(cuda="12.4")  # type: ignore[attr-defined]
    fake.cuda = types.SimpleNamespace(nccl=types.SimpleNamespace(version=lambda: (2, 21, 5)))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", fake)
    observed = observe_image(run=lambda argv: "550.90.07\n550.90.07\n")
    assert (observed.driver, observed.cuda, observed.nccl, observed.torch) == ("550.90.07", "12.4", "2.21.5",
                                                                                "2.6.0+cu124")

    def no_gpu(argv: Any) -> str:
        raise FileNotFoundError("nvidia-smi")

    assert observe_image(run=no_gpu).driver == "none"



@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"job_id": "other-job"}, "the bootstrap is for job 'llm-7b', the launch for 'other-job'"),
        ({"user_data": "#!/bin/sh"}, "give bootstrap or user_data, not both"),
        ({"count": 2, "bootstrap": spec(address="10.0.0.9")}, "fits one instance only"),
        (
            {"count": 2, "bootstrap": spec(head=HeadCoordinator(agents=2, nproc=2, standby=1, store_port=29400))},
            "fits one instance only",
        ),
        ({"bootstrap": render_cloud_init(spec())}, "bootstrap must be a cloud.bootstrap.AgentBootstrap, got str"),
    ],
)
def test_a_launch_request_refuses_a_bootstrap_that_does_not_fit_it(changes: dict[str, Any], message: str) -> None:
    fields: dict[str, Any] = {"job_id": "llm-7b", "role": "standby", "instance_type": "g5.xlarge", "bootstrap": spec()}
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        LaunchRequest(**{**fields, **changes})
    # One document fits any number of hosts without a fixed address.
    assert LaunchRequest(**{**fields, "count": 3}).bootstrap == spec()


def test_the_units_dead_mans_switch_status_is_the_agents() -> None:
    from runtime.host import agent

    assert ORPHANED_EXIT == agent.ORPHANED_EXIT


def test_a_staged_wheel_is_installed_from_its_checked_file_and_a_staged_script_lands_at_its_path() -> None:
    from cloud.artifacts import Artifact

    wheel = Artifact("trainmover-0.1.0-py3-none-any.whl", "https://bucket.s3/w?X-Amz-Signature=s", "a" * 64)
    script = Artifact("train.py", "https://bucket.s3/t?X-Amz-Signature=s", "b" * 64)
    install = render_cloud_init(spec(wheel=wheel, script_file=script, script="/opt/job/train.py"))
    content = {f["path"]: f for f in yaml.safe_load(install)["write_files"]}["/opt/trainmover/bin/install"]["content"]
    bash_syntax_ok(content)
    assert f"tm_fetch 'https://bucket.s3/w?X-Amz-Signature=s' {'a' * 64}" in content
    assert "--no-index --ignore-installed /opt/trainmover/dist/trainmover-0.1.0-py3-none-any.whl" in content
    assert "'trainmover[aws]==0.1.0'" not in content, "nothing from an index"
    assert "install -m 0644 /opt/trainmover/dist/train.py /opt/job/train.py" in content
    with pytest.raises(InvalidRequestError, match="the script's file name"):
        spec(script_file=Artifact("other.py", "https://b/o", "c" * 64))

