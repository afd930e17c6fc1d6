"""Nothing orphaned: `trainmover cloud release --job J` deletes every resource of the job, on AWS (moto's server over
HTTP, behind the fault proxy that emulates placement groups) and on Azure (the local ARM and Key Vault servers), and
each test verifies it by listing what the cloud still holds afterwards.

A second release deletes nothing and says so; a deletion that fails is named in one line while the others still
happen; a launch that fails on placement groups deletes the security group it made, at once; an Azure release of a
job without a proximity placement group is quiet.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest

from cloud.aws import AwsProvider, ensure_notice_queue, notice_resource_names
from cloud.aws.network import job_resource_name
from cloud.azure import AzureProvider
from cloud.azure.network import job_network_names
from cloud.base import JOB_TAG, MUTATE, JobNetwork, LaunchRequest, UnsupportedError
from cloud.cli import release_job_resources
from cloud.secrets import AwsParameterStore, AwsSecretsManagerStore, AzureKeyVaultStore, secret_name_for
from tests.cloud.arm_server import ArmServer
from tests.cloud.aws_servers import FaultProxy, PlacementGroups, fault_proxy
from tests.cloud.keyvault_server import KeyVaultServer
from tests.cloud.test_azure import (
    CPU,
    LOCATION,
    RG,
    SUBSCRIPTION,
    bootstrap_for,
    make_provider,
)
from trainmover.cli import main

REGION = "us-east-1"
AMI = "ami-12c6146b"  # one of the AMIs moto ships
NETWORK = JobNetwork(store_port=29400, agent_port=29401, data_ports=(40000, 40999))
READER_ROLE = "arn:aws:iam::123456789012:role/trainmover-node"
LIVE = ["pending", "running", "stopping", "stopped", "shutting-down"]

NICS = "Microsoft.Network/networkInterfaces"
DISKS = "Microsoft.Compute/disks"
NSGS = "Microsoft.Network/networkSecurityGroups"
ASGS = "Microsoft.Network/applicationSecurityGroups"
PPGS = "Microsoft.Compute/proximityPlacementGroups"
VAULT_ID = f"/subscriptions/{SUBSCRIPTION}/resourceGroups/rg-vault/providers/Microsoft.KeyVault/vaults/kv-release"


# ------------------------------------------------------------------------------------------------ AWS




@pytest.fixture
def proxy(moto_url: str, placement_groups: PlacementGroups) -> Iterator[FaultProxy]:
    """moto behind the fault proxy, with placement groups (which moto lacks) emulated."""
    with fault_proxy(moto_url) as server:
        placement_groups.install(server)
        yield server




def session() -> boto3.Session:
    return boto3.Session(aws_access_key_id="testing", aws_secret_access_key="testing", region_name=REGION)


def make_job(url: str, job_id: str, *, instances: int = 2) -> dict[str, Any]:
    """Everything a job of the flows has on AWS: instances in the job's network (security group, cluster placement
    group), its notice queue and rules, its secret in SSM (what the flows use) and in Secrets Manager."""
    provider = AwsProvider(REGION, session=session(), endpoint_url=url, image=AMI)
    launched = provider.launch(LaunchRequest(job_id, "worker", "g5.xlarge", count=instances, network=NETWORK))
    ensure_notice_queue(job_id, region=REGION, session=session(), endpoint_url=url)
    AwsParameterStore(REGION, session=session(), endpoint_url=url).put(job_id, secrets.token_hex(32))
    AwsSecretsManagerStore(REGION, reader_role_arn=READER_ROLE, session=session(), endpoint_url=url).put(
        job_id, secrets.token_hex(32))
    return {"instances": sorted(i.instance_id for i in launched)}


def aws_leftovers(url: str, job_id: str, *, placement_groups: bool = True) -> dict[str, list[str]]:
    """What the cloud still holds of the job, by listing each kind of resource (live instances only);
    `placement_groups=False` where the endpoint has none to list."""
    s = session()
    ec2, ssm = s.client("ec2", endpoint_url=url), s.client("ssm", endpoint_url=url)
    by_tag = [{"Name": f"tag:{JOB_TAG}", "Values": [job_id]}]
    queue_name, rules = notice_resource_names(job_id)
    parameter, secret = secret_name_for(job_id, "aws-ssm"), secret_name_for(job_id, "aws-secretsmanager")
    reservations = ec2.describe_instances(Filters=[*by_tag, {"Name": "instance-state-name", "Values": LIVE}])
    return {
        "instances": [i["InstanceId"] for r in reservations["Reservations"] for i in r["Instances"]],
        "security groups": [g["GroupId"] for g in ec2.describe_security_groups(Filters=by_tag)["SecurityGroups"]],
        "placement groups": [g["GroupName"] for g in ec2.describe_placement_groups(Filters=by_tag)["PlacementGroups"]]
        if placement_groups else [],
        "queues": [q for q in s.client("sqs", endpoint_url=url).list_queues(QueueNamePrefix=queue_name).get(
            "QueueUrls", []) if q.rsplit("/", 1)[-1] == queue_name],
        "rules": [r["Name"] for r in s.client("events", endpoint_url=url).list_rules(
            NamePrefix=f"trainmover-{job_id}")["Rules"] if r["Name"] in rules.values()],
        "parameters": [p["Name"] for p in ssm.describe_parameters(
            ParameterFilters=[{"Key": "Name", "Values": [parameter]}])["Parameters"]],
        "secrets": [x["Name"] for x in s.client("secretsmanager", endpoint_url=url).list_secrets()["SecretList"]
                    if x["Name"] == secret],
    }


def nothing_left(leftovers: dict[str, list[str]]) -> bool:
    return not any(leftovers.values())


def test_aws_release_through_the_cli_leaves_nothing_of_the_job_and_spares_another_job(
    proxy: FaultProxy, aws_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    job, other = "job-rel-aws", "job-rel-aws-other"
    made = make_job(proxy.url, job)
    make_job(proxy.url, other, instances=1)
    before = aws_leftovers(proxy.url, job)
    assert all(before.values()), f"the scenario makes every kind of resource: {before}"
    queue_name, rules = notice_resource_names(job)
    aws = ["--provider", "aws", "--region", REGION, "--endpoint-url", proxy.url]

    assert main(["cloud", "release", *aws, "--job", job]) == 0

    captured = capsys.readouterr()
    assert sorted(captured.out.splitlines()) == sorted([
        *(f"instance {i}" for i in made["instances"]),
        f"security group {before['security groups'][0]}",
        f"placement group {job_resource_name(job)}",
        *(f"EventBridge rule {name}" for name in rules.values()),
        f"SQS queue {queue_name}",
        f"SSM parameter {secret_name_for(job, 'aws-ssm')}",
        f"Secrets Manager secret {secret_name_for(job, 'aws-secretsmanager')}",
    ])
    assert captured.err == f"aws: job {job}: terminated 2 instance(s) and deleted 8 other resource(s)\n"
    left = aws_leftovers(proxy.url, job)
    assert nothing_left(left), f"left behind: {left}"
    assert all(aws_leftovers(proxy.url, other).values()), "another job's resources are untouched"

    # Idempotent: nothing is left, so nothing is deleted, and it says so.
    assert main(["cloud", "release", *aws, "--job", job]) == 0
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"aws: job {job}: nothing to release (no resource of the job was left)\n"

    assert main(["cloud", "release", *aws, "--job", other]) == 0
    capsys.readouterr()
    assert nothing_left(aws_leftovers(proxy.url, other))


def test_a_failed_deletion_is_named_in_one_line_and_the_others_still_happen(
    proxy: FaultProxy, aws_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    job = "job-rel-fail"
    make_job(proxy.url, job, instances=1)
    [group] = aws_leftovers(proxy.url, job)["security groups"]
    proxy.fail("DeleteSecurityGroup", "UnauthorizedOperation", status=403)
    aws = ["--provider", "aws", "--region", REGION, "--endpoint-url", proxy.url]

    assert main(["cloud", "release", *aws, "--job", job]) == 1

    captured = capsys.readouterr()
    assert f"security group {group}" not in captured.out.splitlines()
    errors = [line for line in captured.err.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("trainmover cloud release: error: aws: job job-rel-fail: "
                                                     f"could not delete 1 resource(s): security group {group} (")
    assert "UnauthorizedOperation" in errors[0] and "run the release again" in errors[0]
    assert "Traceback" not in captured.err
    left = aws_leftovers(proxy.url, job)
    assert left.pop("security groups") == [group] and nothing_left(left), f"only the group is left: {left}"

    # The cause fixed, a second release deletes what is left, and only that.
    assert main(["cloud", "release", *aws, "--job", job]) == 0
    assert capsys.readouterr().out == f"security group {group}\n"
    assert nothing_left(aws_leftovers(proxy.url, job))


def test_a_launch_on_an_endpoint_without_placement_groups_fails_at_once_and_deletes_its_security_group(
    moto_url: str,
) -> None:
    """moto has no placement groups (HTTP 500 without an AWS error): that is no transient failure to retry for
    seconds, and the security group made for the launch must not outlive it."""
    job = "job-rel-nopg"
    with fault_proxy(moto_url) as bare:  # no placement group emulation
        provider = AwsProvider(REGION, session=session(), endpoint_url=bare.url, image=AMI)  # the default budgets
        assert provider.mutate_budget == MUTATE

        with pytest.raises(UnsupportedError, match=r"no cluster placement groups.*cluster_placement=False.*deleted"):
            provider.launch(LaunchRequest(job, "worker", "g5.xlarge", network=NETWORK))

        assert len(bare.seen("DescribePlacementGroups")) == 1, "not retried"
        assert [s.action for s in bare.seen() if s.action.endswith("SecurityGroup")] == [
            "CreateSecurityGroup", "DeleteSecurityGroup"]
        assert bare.seen("RunInstances") == []
        left = aws_leftovers(moto_url, job, placement_groups=False)
        assert nothing_left(left), f"left behind: {left}"

        # Releasing on such an endpoint works too: there is no placement group to look for, and nothing is left.
        report = provider.release_all(job)
        assert report.complete and report.instances == () and report.deleted == ()


# ------------------------------------------------------------------------------------------------ Azure


@pytest.fixture
def arm(tmp_path: Path) -> Iterator[ArmServer]:
    with ArmServer(tmp_path, subscription_id=SUBSCRIPTION, resource_groups=[RG], locations={LOCATION: [CPU]},
                   polls_per_operation=1) as server:
        yield server


def azure_leftovers(arm: ArmServer, kv: KeyVaultServer, job_id: str) -> dict[str, list[str]]:
    """What the servers still hold of the job, by listing each kind of resource."""
    names = job_network_names(job_id)
    return {
        "vms": [n for n in arm.vm_names() if n.startswith(f"tm-{job_id}-worker-")],
        "nics": [n for n in arm.resources(NICS) if n.startswith(f"tm-{job_id}-worker-")],
        "disks": [n for n in arm.resources(DISKS) if n.startswith(f"tm-{job_id}-worker-")],
        "network": [n for kind in (NSGS, ASGS, PPGS) for n in arm.resources(kind) if n in names.values()],
        "secrets": [n for n in kv.secret_names() if n == secret_name_for(job_id, "azure-keyvault")],
        # Who may read the job's secret: one role assignment per VM, on the vault.
        "role assignments": [a["name"] for a in arm.role_assignments(VAULT_ID)
                             if f"trainmover:job={job_id} " in a["properties"]["description"]],
    }


def test_azure_release_leaves_no_vm_nic_disk_network_or_secret_of_the_job(
    arm: ArmServer, vault: tuple[KeyVaultServer, AzureKeyVaultStore], capsys: pytest.CaptureFixture[str]
) -> None:
    kv, store = vault
    provider = make_provider(arm, key_vault=store, key_vault_resource_id=VAULT_ID)
    job, other = "job-rel-az", "job-rel-az-other"
    for job_id, count in ((job, 2), (other, 1)):
        ref = store.put(job_id, secrets.token_hex(32))
        provider.launch(LaunchRequest(job_id, "worker", CPU, count=count, network=NETWORK,
                                      bootstrap=bootstrap_for(job_id, ref)))
    before = azure_leftovers(arm, kv, job)
    assert all(before.values()) and len(before["network"]) == 3 and len(before["role assignments"]) == 2, before

    assert release_job_resources(provider, job) == 0

    out = capsys.readouterr()
    names = job_network_names(job)
    assert sorted(out.out.splitlines()) == sorted([
        *(f"instance {n}" for n in before["vms"]),
        f"network security group {names['nsg']}",
        f"application security group {names['asg']}",
        f"proximity placement group {names['ppg']}",
        f"Key Vault secret {store.vault_url}/secrets/{secret_name_for(job, 'azure-keyvault')}",
    ])
    assert out.err == f"azure: job {job}: terminated 2 instance(s) and deleted 4 other resource(s)\n"
    left = azure_leftovers(arm, kv, job)
    assert not any(left.values()), f"left behind: {left}"
    assert provider.secret_reader_grants(job) == [], "ARM lists no reader of the job's secret"
    assert all(azure_leftovers(arm, kv, other).values()), "another job's resources are untouched"

    assert release_job_resources(provider, job) == 0
    out = capsys.readouterr()
    assert out.out == "" and out.err == f"azure: job {job}: nothing to release (no resource of the job was left)\n"
    assert release_job_resources(provider, other) == 0
    assert not any(azure_leftovers(arm, kv, other).values())


def test_azure_release_without_a_placement_group_is_quiet(
    arm: ArmServer, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    provider: AzureProvider = make_provider(arm)  # no Key Vault: the secret is said to be not looked for
    job = "job-rel-noppg"
    provider.launch(LaunchRequest(job, "worker", CPU, network=JobNetwork(29400, 29401, cluster_placement=False)))
    assert arm.resources(PPGS) == {}

    with caplog.at_level(logging.DEBUG):
        released = provider.release_job(job)
        assert release_job_resources(provider, job) == 0

    assert len(released) == 1 and arm.vm_names() == []
    loud = [(r.name, r.levelname, r.getMessage()) for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert loud == [], "no false warning"
    assert "Traceback" not in caplog.text
    assert arm.calls("DELETE", "proximityPlacementGroups") == [], "nothing to delete, so nothing asked"
    assert arm.resources(NSGS) == {} and arm.resources(ASGS) == {}
    err = capsys.readouterr().err.splitlines()
    assert err == [f"azure: job {job}: nothing to release (no resource of the job was left)",
                   f"azure: job {job}: not looked for: Key Vault secret: no Key Vault given "
                   "(AzureProvider(key_vault=...), or --key-vault-url)"]
