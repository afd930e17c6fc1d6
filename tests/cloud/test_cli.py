"""`trainmover cloud ...` through the real dispatcher, and `cloud.registry.make_provider`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cloud.aws.iam import AWS_EXAMPLE, aws_job_policy
from cloud.azure.iam import azure_job_role
from cloud.base import InvalidRequestError, LaunchRequest
from cloud.cli import format_checks, format_instances
from cloud.local import LocalProvider
from cloud.registry import PROVIDER_NAMES, make_provider
from trainmover.cli import main

ROOT = Path(__file__).resolve().parents[2]
# The console script that was installed with the interpreter running the tests, wherever its environment lives.
TRAINMOVER = Path(sys.executable).with_name("trainmover")


def test_check_of_the_local_provider_passes_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "check.json"
    assert main(["cloud", "check", "--provider", "local", "--json", str(out)]) == 0
    stdout = capsys.readouterr().out.splitlines()
    assert stdout[-1] == "local: all 4 checks passed"
    assert stdout[0].split()[:2] == ["ok", "slots"]
    payload = json.loads(out.read_text())
    assert payload["provider"] == "local" and payload["ok"] is True
    assert [c["name"] for c in payload["checks"]] == ["slots", "state-machine", "prices", "notices"]


def test_the_installed_command_checks_the_local_provider() -> None:
    assert TRAINMOVER.is_file(), f"no trainmover entry point next to {sys.executable}: pip install -e . first"
    result = subprocess.run(
        [str(TRAINMOVER), "cloud", "check", "--provider", "local"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "local: all 4 checks passed" in result.stdout
    assert result.stderr == ""


def test_an_unknown_aws_region_is_one_clear_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cloud", "check", "--provider", "aws", "--region", "nowhere-1"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("trainmover cloud check: error: unknown AWS region 'nowhere-1'")
    assert "us-east-1" in lines[0] and "Traceback" not in captured.err


def test_a_near_miss_region_gets_a_suggestion(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cloud", "describe", "--provider", "aws", "--region", "eu-west-1x", "--job", "j"]) == 2
    assert "did you mean eu-west-1" in capsys.readouterr().err


def test_aws_without_a_region_says_how_to_give_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("AWS_REGION", raising=False)
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    assert main(["cloud", "check", "--provider", "aws"]) == 2
    assert capsys.readouterr().err == "trainmover cloud check: error: no AWS region: pass --region or set AWS_REGION\n"


def test_aws_only_check_options_are_refused_for_another_provider(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cloud", "check", "--provider", "local", "--node-role-arn", "arn:aws:iam::1:role/x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "apply to `cloud check --provider aws` only" in err


def test_azure_without_a_subscription_names_every_missing_setting(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("AZURE_SUBSCRIPTION_ID", "AZURE_RESOURCE_GROUP", "AZURE_LOCATION"):
        monkeypatch.delenv(name, raising=False)
    assert main(["cloud", "check", "--provider", "azure", "--location", "eastus"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "--subscription (or AZURE_SUBSCRIPTION_ID)" in err and "--resource-group" in err
    assert "--location" not in err


def test_azure_without_credentials_is_one_line_saying_what_to_set(tmp_path: Path) -> None:
    # A fresh process, as a user runs it: azure-identity logs every credential it tried before raising, which only
    # shows up outside pytest's log capture. HOME is empty so that no token cache of this machine is found.
    env = {"PATH": os.defpath, "HOME": str(tmp_path), "AZURE_CONFIG_DIR": str(tmp_path / "az")}
    azure = ["--subscription", "00000000-0000-0000-0000-000000000000", "--resource-group", "rg", "--location", "eastus"]
    result = subprocess.run(
        [str(TRAINMOVER), "cloud", "describe", "--provider", "azure", *azure, "--job", "j1"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 2 and result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line.startswith("trainmover cloud describe: error: azure: no usable credentials")
    assert "az login" in line and "AZURE_CLIENT_ID" in line and "managed identity" in line


@pytest.mark.parametrize("provider", ["aws", "azure"])
def test_an_invalid_endpoint_url_is_one_line(provider: str, capsys: pytest.CaptureFixture[str]) -> None:
    where = ["--region", "us-east-1"] if provider == "aws" else ["--subscription", "s", "--resource-group", "rg"]
    argv = ["cloud", "describe", "--provider", provider, *where, "--location", "eastus", "--job", "j1"]
    assert main([*argv, "--endpoint-url", "not a url"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err
    assert lines[0].startswith(f"trainmover cloud describe: error: {provider}: invalid endpoint URL 'not a url': ")
    assert lines[0].endswith(
        "give an absolute http(s) URL such as "
        + (
            "https://ec2.us-east-1.amazonaws.com or http://127.0.0.1:5000"
            if provider == "aws"
            else "https://management.azure.com"
        )
        + ", or leave it out to use the cloud's own endpoint"
    )


@pytest.mark.parametrize("provider", PROVIDER_NAMES)
@pytest.mark.parametrize("action", ["describe", "release"])
def test_a_job_pattern_is_refused_before_any_provider_is_made(
    provider: str, action: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # No region, subscription or credentials: the job id is refused first.
    assert main(["cloud", action, "--provider", provider, "--job", "llm-?b"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "invalid job id 'llm-?b': use 1-63 letters, digits, '.', '_' or '-'" in err and "matched exactly" in err


def test_the_policy_command_prints_the_per_job_policy_and_the_azure_role(capsys: pytest.CaptureFixture[str]) -> None:
    scope = AWS_EXAMPLE
    argv = ["cloud", "policy", "--provider", "aws", "--job", scope.job_id, "--account", scope.account_id]
    argv += [f"--region={r}" for r in scope.regions] + [f"--image={i}" for i in scope.images]
    argv += [f"--instance-type={t}" for t in scope.instance_types] + [f"--kms-key={k}" for k in scope.kms_key_arns]
    assert main([*argv, "--node-role", str(scope.node_role_arn)]) == 0
    assert json.loads(capsys.readouterr().out) == aws_job_policy(scope)

    assert main(["cloud", "policy", "--provider", "aws", "--job", "llm-7b", "--region", "us-east-1"]) == 2
    assert "the policy needs at least one of images" in capsys.readouterr().err

    # With the bucket the flows stage the job's wheel and script in: exactly that job's prefix there.
    assert main([*argv, "--node-role", str(scope.node_role_arn), "--artifact-bucket", "team-artifacts"]) == 0
    staged = json.loads(capsys.readouterr().out)
    assert staged == aws_job_policy(dataclasses.replace(scope, artifact_bucket="team-artifacts"))
    assert f"arn:aws:s3:::team-artifacts/trainmover-jobs/{scope.job_id}/*" in json.dumps(staged)

    sub = "00000000-0000-0000-0000-00000000cafe"
    assert main(["cloud", "policy", "--provider", "azure", "--subscription", sub, "--resource-group", "rg-tm"]) == 0
    role = json.loads(capsys.readouterr().out)
    assert role == azure_job_role(sub, "rg-tm")
    assert role["AssignableScopes"] == [f"/subscriptions/{sub}/resourceGroups/rg-tm"]


def test_the_release_command_passes_the_vault_and_its_resource_id_to_the_azure_provider() -> None:
    from cloud.cli import add_cloud_parser, provider_options

    parser = argparse.ArgumentParser()
    add_cloud_parser(parser.add_subparsers(dest="command"))
    vault_id = "/subscriptions/s/resourceGroups/g/providers/Microsoft.KeyVault/vaults/trainmover-kv"
    ns = parser.parse_args(["cloud", "release", "--provider", "azure", "--job", "j1", "--subscription", "s",
                            "--resource-group", "g", "--location", "eastus",
                            "--key-vault-url", "https://trainmover-kv.vault.azure.net",
                            "--key-vault-resource-id", vault_id])
    options = provider_options(ns)
    assert options["key_vault_resource_id"] == vault_id and options["key_vault"].vault_url.startswith("https://")


def test_an_unwritable_json_file_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cloud", "check", "--provider", "local", "--json", str(tmp_path)]) == 2
    assert f"--json {tmp_path}: cannot write" in capsys.readouterr().err


def test_describe_and_release_of_a_job_without_instances(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cloud", "describe", "--provider", "local", "--job", "j1"]) == 0
    assert capsys.readouterr().out == "local: 0 instance(s) of job j1\n"
    assert main(["cloud", "release", "--provider", "local", "--job", "j1"]) == 0
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == "local: job j1: nothing to release (no resource of the job was left)\n"


def test_the_instance_table_and_the_check_verdict_read_well() -> None:
    cloud = LocalProvider(slots=2)
    instances = cloud.launch(LaunchRequest(job_id="j", role="worker", instance_type="g5.xlarge", count=2))
    cloud.stop([instances[1].instance_id])
    table = format_instances(cloud.describe(job_id="j")).splitlines()
    assert table[0].split() == ["instance", "role", "type", "market", "state", "health", "zone", "private", "ip"]
    assert table[1].split()[:5] == ["local-000001", "worker", "g5.xlarge", "on-demand", "running"]
    assert table[2].split()[4] == "stopped"
    assert cloud.release_job("j") == ["local-000001", "local-000002"]
    assert cloud.describe(job_id="j") == []

    from cloud.base import CheckResult

    verdict = format_checks("aws", [CheckResult("credentials", True), CheckResult("ec2:RunInstances", False, "denied")])
    assert verdict.splitlines()[-1] == "aws: 1 of 2 checks failed: ec2:RunInstances"
    assert "FAIL  ec2:RunInstances  denied" in verdict


def test_make_provider_builds_the_local_provider_with_its_options() -> None:
    cloud = make_provider("local", slots=2, start_delay_s=1.0)
    assert isinstance(cloud, LocalProvider) and cloud.slots == 2 and cloud.start_delay_s == 1.0


def test_make_provider_refuses_unknown_names_and_options() -> None:
    with pytest.raises(InvalidRequestError, match="unknown provider 'gcp'; choose one of local, aws, azure"):
        make_provider("gcp")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="accepts: slots, prices_usd_per_h, start_delay_s, clock"):
        make_provider("local", region="us-east-1")
    assert PROVIDER_NAMES == ("local", "aws", "azure")


@pytest.mark.parametrize(("provider", "blocked", "extra"), [("aws", "boto3", "aws"), ("azure", "azure", "azure")])
def test_a_missing_sdk_is_one_message_naming_the_extra(provider: str, blocked: str, extra: str) -> None:
    # A fresh interpreter where the SDK cannot be imported (None in sys.modules makes `import` fail), as on a
    # machine installed without the extra.
    code = (
        "import sys\n"
        f"for name in [m for m in sys.modules if m == {blocked!r} or m.startswith({blocked!r} + '.')]:\n"
        "    del sys.modules[name]\n"
        f"sys.modules[{blocked!r}] = None\n"
        "from cloud.registry import make_provider\n"
        "from cloud.base import UnsupportedError\n"
        "try:\n"
        f"    make_provider({provider!r}, **{_options(provider)!r})\n"
        "except UnsupportedError as err:\n"
        "    print(err)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith(f"pip install 'trainmover[{extra}]'"), result.stdout
    assert f"the {provider} provider needs its cloud SDK" in result.stdout


def _options(provider: str) -> dict[str, str]:
    if provider == "aws":
        return {"region": "us-east-1"}
    return {"subscription_id": "00000000-0000-0000-0000-000000000000", "resource_group": "rg", "location": "eastus"}


# ------------------------------------------------------------------------------------ against a real EC2 API (moto)


@pytest.fixture(scope="module")
def moto_url() -> Iterator[str]:
    """moto's server, behind a proxy that adds the placement groups (release looks for the job's) and the IAM policy
    simulator (check asks it) that moto lacks."""
    from tests.cloud.aws_servers import IamSimulator, PlacementGroups, fault_proxy, moto_server

    with moto_server() as url, fault_proxy(url) as proxy:
        PlacementGroups().install(proxy)
        IamSimulator().install(proxy)
        yield proxy.url



def _an_ami(url: str) -> str:
    import boto3

    ec2 = boto3.client("ec2", region_name="us-east-1", endpoint_url=url)
    return str(ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"])


def test_aws_check_describe_and_release_through_the_cli(
    moto_url: str, aws_env: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("AWS_REGION", "us-east-1")  # the region comes from the environment
    ami = _an_ami(moto_url)
    aws = ["--provider", "aws", "--endpoint-url", moto_url]

    role = "arn:aws:iam::123456789012:role/trainmover-node"
    assert main(["cloud", "check", *aws, "--image", ami, "--node-role-arn", role]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("aws: all ")
    assert any(" iam:PassRole" in line for line in out)  # the simulation asked about the node role

    provider = make_provider("aws", region="us-east-1", endpoint_url=moto_url, image=ami)
    job = "job-cli-aws"
    try:
        launched = sorted(
            i.instance_id
            for i in provider.launch(LaunchRequest(job_id=job, role="standby", instance_type="g5.xlarge", count=2))
        )
        assert main(["cloud", "describe", *aws, "--job", job]) == 0
        out = capsys.readouterr().out
        assert all(i in out for i in launched) and out.endswith(f"aws: 2 instance(s) of job {job}\n")

        assert main(["cloud", "release", *aws, "--job", job]) == 0
        captured = capsys.readouterr()
        assert sorted(captured.out.splitlines()) == [f"instance {i}" for i in launched]
        assert captured.err == f"aws: job {job}: terminated 2 instance(s) and deleted 0 other resource(s)\n"
    finally:
        provider.release_job(job)
    assert provider.describe(job_id=job) == []


def test_aws_check_without_an_image_fails_the_launch_check_with_exit_1(
    moto_url: str, aws_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["cloud", "check", "--provider", "aws", "--region", "us-east-1", "--endpoint-url", moto_url]) == 1
    verdict = capsys.readouterr().out.splitlines()[-1]
    assert verdict.startswith("aws: 1 of ") and verdict.endswith("checks failed: ec2:RunInstances")


def test_release_of_a_wildcard_job_terminates_nothing(
    moto_url: str, aws_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    provider = make_provider("aws", region="us-east-1", endpoint_url=moto_url, image=_an_ami(moto_url))
    jobs = ["llm-7b", "llm-8b"]
    try:
        for job in jobs:
            provider.launch(LaunchRequest(job_id=job, role="worker", instance_type="m5.large"))
        aws = ["--provider", "aws", "--region", "us-east-1", "--endpoint-url", moto_url]

        for pattern in ("llm-?b", "*"):  # both match both jobs as EC2 tag filters
            assert main(["cloud", "release", *aws, "--job", pattern]) == 2
            captured = capsys.readouterr()
            assert captured.out == "" and captured.err.count("\n") == 1 and "matched exactly" in captured.err

        assert [len(provider.describe(job_id=job)) for job in jobs] == [1, 1]
    finally:
        for job in jobs:
            provider.release_job(job)


def test_missing_aws_credentials_fail_check_and_stop_describe_with_one_line(
    moto_url: str, aws_env: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    aws = ["--provider", "aws", "--region", "us-east-1", "--endpoint-url", moto_url]

    assert main(["cloud", "check", *aws]) == 1  # a failed check, reported as such
    out = capsys.readouterr().out
    assert "FAIL  credentials" in out and "AWS_ACCESS_KEY_ID" in out

    assert main(["cloud", "describe", *aws, "--job", "j"]) == 2  # an operation that cannot run at all
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "credentials" in err and "Traceback" not in err
