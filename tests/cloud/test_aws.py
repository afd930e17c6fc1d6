"""The AWS provider against moto's server over HTTP, with a fault-injecting proxy for what moto never does
(throttling, capacity, denied permissions), and the IMDS notice source against a local metadata server."""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import re
import secrets
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import boto3
import pytest

from cloud.aws import AwsProvider, delete_notice_queue, ensure_notice_queue, notice_resource_names
from cloud.aws.iam import AWS_EXAMPLE, KMS_FOR_EBS_VOLUMES, AwsJobScope, aws_job_policy
from cloud.aws.network import job_resource_name, rule_atoms
from cloud.aws.notices import (
    REBALANCE_PATH,
    SPOT_ACTION_PATH,
    ImdsNoticeSource,
    event_refusal,
    notices_from_event,
    parse_event,
    parse_time,
)
from cloud.base import (
    JOB_TAG,
    ROLE_TAG,
    CapacityError,
    CloudError,
    CredentialsError,
    InvalidRequestError,
    JobNetwork,
    LaunchRequest,
    NotFoundError,
    Notice,
    PermissionDeniedError,
    QuotaError,
    RetryBudget,
    ServiceUnavailableError,
    ThrottledError,
    UnsupportedError,
)
from cloud.bootstrap import AGENT_UNIT, AgentBootstrap, render_cloud_init, render_units
from cloud.capacity import Fallbacks, wake_or_replace
from cloud.local import LocalProvider
from cloud.secrets import AwsParameterStore, AwsSecretsManagerStore, SecretRef
from tests.cloud.aws_servers import (
    FaultProxy,
    IamSimulator,
    ImdsServer,
    PlacementGroups,
    fault_proxy,
    imds_server,
)

REGION = "us-east-1"
AMI = "ami-12c6146b"  # one of the AMIs moto ships
FAST_MUTATE = RetryBudget("mutate-test", attempts=3, base_delay_s=0.01, max_delay_s=0.05, deadline_s=10.0)
FAST_DESCRIBE = RetryBudget("describe-test", attempts=3, base_delay_s=0.01, max_delay_s=0.05, deadline_s=10.0)
NOT_RUNNING = {"terminating", "terminated"}


def dummy_session() -> boto3.Session:
    return boto3.Session(aws_access_key_id="testing", aws_secret_access_key="not-a-real-secret", region_name=REGION)


def session_with_instance_profile(moto_url: str, job: str) -> tuple[boto3.Session, str]:
    """A session, and the name of the job's node instance profile it created in moto."""
    session = dummy_session()
    profile = f"trainmover-node-{job}"
    session.client("iam", endpoint_url=moto_url).create_instance_profile(InstanceProfileName=profile)
    return session, profile


# ------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def module_proxy(
    moto_url: str, placement_groups: PlacementGroups, iam_simulator: IamSimulator
) -> Iterator[FaultProxy]:
    with fault_proxy(moto_url) as proxy:
        placement_groups.install(proxy)
        iam_simulator.install(proxy)
        yield proxy


@pytest.fixture(scope="module")
def clean_url(moto_url: str, placement_groups: PlacementGroups) -> Iterator[str]:
    """moto behind a proxy that injects no fault: what fixtures clean up through."""
    with fault_proxy(moto_url) as proxy:
        placement_groups.install(proxy)
        yield proxy.url


@pytest.fixture
def proxy(module_proxy: FaultProxy) -> Iterator[FaultProxy]:
    module_proxy.reset()
    try:
        yield module_proxy
    finally:
        module_proxy.reset()


@pytest.fixture
def aws(proxy: FaultProxy) -> AwsProvider:
    return AwsProvider(
        REGION,
        session=dummy_session(),
        endpoint_url=proxy.url,
        image=AMI,
        mutate_budget=FAST_MUTATE,
        describe_budget=FAST_DESCRIBE,
    )


@pytest.fixture
def job(clean_url: str) -> Iterator[str]:
    """A fresh job id; whatever a test leaves of it is released afterwards (past any injected fault)."""
    job_id = f"job-{uuid.uuid4().hex[:8]}"
    try:
        yield job_id
    finally:
        AwsProvider(REGION, session=dummy_session(), endpoint_url=clean_url).release_job(job_id)


def assert_nothing_running(provider: AwsProvider, job_id: str) -> None:
    """Every test that launches ends here: release the job, then AWS must show none of its instances alive."""
    provider.release_job(job_id)
    left = [(i.instance_id, i.state) for i in provider.describe(job_id=job_id) if i.state not in NOT_RUNNING]
    assert left == [], f"instances leaked by {job_id}: {left}"


def bootstrap_for(job_id: str, secret: SecretRef) -> AgentBootstrap:
    return AgentBootstrap(
        job_id=job_id, coordinator_host="10.0.0.1", agent_port=29401, slots=8, source="trainmover[aws]==0.1.0",
        secret=secret, script="/opt/job/train.py",
    )


def free_closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ------------------------------------------------------------------------------------------------ launch


def test_on_demand_launch_tags_instances_and_volumes_and_is_found_by_job(
    aws: AwsProvider, proxy: FaultProxy, job: str, moto_url: str
) -> None:
    launched = aws.launch(LaunchRequest(job, "standby", "p5.48xlarge", count=2, tags={"team": "llm"}))

    assert len(launched) == 2
    assert {(i.job_id, i.role, i.market, i.instance_type) for i in launched} == {
        (job, "standby", "on-demand", "p5.48xlarge")
    }
    [run] = proxy.seen("RunInstances")
    assert (run.params["MinCount"], run.params["MaxCount"]) == ("2", "2")
    assert run.params["ClientToken"]
    ec2 = dummy_session().client("ec2", endpoint_url=moto_url)
    volumes = ec2.describe_volumes(Filters=[{"Name": f"tag:{JOB_TAG}", "Values": [job]}])["Volumes"]
    assert len(volumes) == 2
    volume_tags = {t["Key"]: t["Value"] for t in volumes[0]["Tags"]}
    assert (volume_tags[ROLE_TAG], volume_tags["team"]) == ("standby", "llm")

    seen = aws.describe(job_id=job)
    assert sorted(i.instance_id for i in seen) == sorted(i.instance_id for i in launched)
    assert {(i.state, i.health) for i in seen} == {("running", "ok")}
    assert all(i.zone and i.private_ip and i.launched_at for i in seen)
    assert_nothing_running(aws, job)


def test_spot_launch_goes_into_the_placement_group_and_zone(aws: AwsProvider, proxy: FaultProxy, job: str) -> None:
    [spot] = aws.launch(
        LaunchRequest(job, "worker", "p4d.24xlarge", market="spot", placement_group="pg-train", zone="us-east-1b")
    )

    assert (spot.market, spot.zone) == ("spot", "us-east-1b")
    [run] = proxy.seen("RunInstances")
    assert run.params["InstanceMarketOptions.MarketType"] == "spot"
    assert run.params["InstanceMarketOptions.SpotOptions.SpotInstanceType"] == "one-time"
    assert run.params["Placement.GroupName"] == "pg-train"
    assert run.params["Placement.AvailabilityZone"] == "us-east-1b"
    tag_specs = {v for k, v in run.params.items() if k.startswith("TagSpecification.") and k.endswith("ResourceType")}
    assert tag_specs == {"instance", "volume"}
    assert_nothing_running(aws, job)


def test_capacity_reservation_is_targeted_and_refused_for_spot(aws: AwsProvider, proxy: FaultProxy, job: str) -> None:
    reservation = "cr-0123456789abcdef0"
    with pytest.raises(InvalidRequestError, match="on-demand"):
        aws.launch(LaunchRequest(job, "worker", "p5.48xlarge", market="spot", capacity_reservation=reservation))
    assert proxy.seen("RunInstances") == []

    aws.launch(LaunchRequest(job, "worker", "p5.48xlarge", capacity_reservation=reservation))
    [run] = proxy.seen("RunInstances")
    target = "CapacityReservationSpecification.CapacityReservationTarget"
    assert run.params[f"{target}.CapacityReservationId"] == reservation
    assert "InstanceMarketOptions.MarketType" not in run.params
    assert_nothing_running(aws, job)


def test_a_capacity_block_and_a_reservation_group_are_targeted_as_ec2_wants(
    aws: AwsProvider, proxy: FaultProxy, job: str
) -> None:
    """A Capacity Block for ML: its reservation id and the capacity-block market; a capacity reservation group: its
    ARN as the target. Malformed targets and a block named by a group are refused before any launch."""
    target = "CapacityReservationSpecification.CapacityReservationTarget"
    aws.launch(LaunchRequest(job, "worker", "p5.48xlarge", capacity_reservation="cr-0123456789abcdef0",
                             capacity_block=True))
    group = "arn:aws:resource-groups:us-east-1:123456789012:group/trainmover-p5"
    aws.launch(LaunchRequest(job, "standby", "p5.48xlarge", capacity_reservation=group))
    block, grouped = proxy.seen("RunInstances")
    assert block.params[f"{target}.CapacityReservationId"] == "cr-0123456789abcdef0"
    assert block.params["InstanceMarketOptions.MarketType"] == "capacity-block"
    assert grouped.params[f"{target}.CapacityReservationResourceGroupArn"] == group
    assert "InstanceMarketOptions.MarketType" not in grouped.params
    proxy.reset()
    for bad, needle in (({"capacity_reservation": "cr-x; rm"}, "neither a reservation id"),
                        ({"capacity_reservation": group, "capacity_block": True}, "give its id")):
        with pytest.raises(InvalidRequestError, match=needle):
            aws.launch(LaunchRequest(job, "worker", "p5.48xlarge", **bad))  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="capacity_block needs capacity_reservation"):
        LaunchRequest(job, "worker", "p5.48xlarge", capacity_block=True)
    assert proxy.seen("RunInstances") == []
    assert_nothing_running(aws, job)


def test_unknown_instance_type_is_refused_before_launching(aws: AwsProvider, proxy: FaultProxy, job: str) -> None:
    with pytest.raises(InvalidRequestError, match=r"unknown instance type 'p5\.48xlargee'.*did you mean p5\.48xlarge"):
        aws.launch(LaunchRequest(job, "standby", "p5.48xlargee"))

    assert proxy.seen("RunInstances") == []
    assert_nothing_running(aws, job)


# ------------------------------------------------------------------------------------------------ job network

NETWORK = JobNetwork(store_port=29400, agent_port=29401, data_ports=(40000, 40999))


def job_groups(ec2: Any, job_id: str) -> list[dict[str, Any]]:
    groups: list[dict[str, Any]] = ec2.describe_security_groups(
        Filters=[{"Name": f"tag:{JOB_TAG}", "Values": [job_id]}]
    )["SecurityGroups"]
    return groups


def test_a_job_network_is_made_once_reused_by_replacements_and_deleted_after_the_instances(
    aws: AwsProvider, proxy: FaultProxy, job: str, moto_url: str, placement_groups: PlacementGroups
) -> None:
    ec2 = dummy_session().client("ec2", endpoint_url=moto_url)
    first = aws.launch(LaunchRequest(job, "worker", "g5.xlarge", count=2, network=NETWORK))
    # A replacement from a restarted orchestrator (a new provider finds the job's groups by tag), then one from the
    # same provider (it remembers them).
    restarted = AwsProvider(REGION, session=dummy_session(), endpoint_url=proxy.url, image=AMI,
                            mutate_budget=FAST_MUTATE, describe_budget=FAST_DESCRIBE)
    [replacement] = restarted.launch(LaunchRequest(job, "standby", "g5.xlarge", network=NETWORK))
    aws.launch(LaunchRequest(job, "standby", "g5.xlarge", network=NETWORK))

    assert len(proxy.seen("CreateSecurityGroup")) == 1 and len(proxy.seen("CreatePlacementGroup")) == 1
    [group] = job_groups(ec2, job)
    group_id, name = str(group["GroupId"]), job_resource_name(job)
    assert {t["Key"]: t["Value"] for t in group["Tags"]} == {JOB_TAG: job}
    # Ingress: exactly the job's ports, each only from the group itself; nothing from any address range.
    assert rule_atoms(group["IpPermissions"]) == {
        ("tcp", 29400, 29400, f"sg:{group_id}"),
        ("tcp", 29401, 29401, f"sg:{group_id}"),
        ("tcp", 40000, 40999, f"sg:{group_id}"),
    }
    assert placement_groups.groups[name]["strategy"] == "cluster"
    assert placement_groups.groups[name]["tags"] == {JOB_TAG: job}
    runs = proxy.seen("RunInstances")
    assert len(runs) == 3
    assert {(r.params["SecurityGroupId.1"], r.params["Placement.GroupName"]) for r in runs} == {(group_id, name)}
    assert all("SecurityGroupId.2" not in r.params for r in runs)
    ids = [i.instance_id for i in [*first, replacement]]
    reservations = ec2.describe_instances(InstanceIds=ids)["Reservations"]
    assert {g["GroupId"] for r in reservations for i in r["Instances"] for g in i["SecurityGroups"]} == {group_id}

    proxy.reset()
    aws.release_job(job)

    assert job_groups(ec2, job) == [] and name not in placement_groups.groups
    order = [s.action for s in proxy.seen() if s.action in ("TerminateInstances", "DeleteSecurityGroup",
                                                            "DeletePlacementGroup")]
    assert order == ["TerminateInstances", "DeleteSecurityGroup", "DeletePlacementGroup"]
    assert aws.release_job(job) == []  # nothing left: no group to delete, and no error
    assert_nothing_running(aws, job)


def test_efa_interfaces_on_every_network_card_in_the_jobs_group_and_refused_where_the_type_has_none(
    proxy: FaultProxy, job: str, moto_url: str
) -> None:
    subnet = dummy_session().client("ec2", endpoint_url=moto_url).describe_subnets()["Subnets"][0]["SubnetId"]
    aws = AwsProvider(REGION, session=dummy_session(), endpoint_url=proxy.url, image=AMI, subnet=subnet,
                      mutate_budget=FAST_MUTATE, describe_budget=FAST_DESCRIBE)
    aws.launch(LaunchRequest(job, "worker", "p4d.24xlarge", network=NETWORK, efa=True))
    (run,) = proxy.seen("RunInstances")
    cards = [run.params[f"NetworkInterface.{n}.NetworkCardIndex"] for n in range(1, 5)]
    assert cards == ["0", "1", "2", "3"] and "NetworkInterface.5.NetworkCardIndex" not in run.params
    assert [run.params[f"NetworkInterface.{n}.DeviceIndex"] for n in range(1, 5)] == ["0", "1", "1", "1"]
    assert {run.params[f"NetworkInterface.{n}.InterfaceType"] for n in range(1, 5)} == {"efa"}
    assert {run.params[f"NetworkInterface.{n}.SubnetId"] for n in range(1, 5)} == {subnet}
    groups = {run.params[f"NetworkInterface.{n}.SecurityGroupId.1"] for n in range(1, 5)}
    (authorize,) = proxy.seen("AuthorizeSecurityGroupIngress")
    assert groups == {authorize.params["GroupId"]}, "every adapter sits in the job's own group"
    assert "SubnetId" not in run.params and "SecurityGroupId.1" not in run.params

    proxy.reset()
    with pytest.raises(InvalidRequestError, match=r"g5\.xlarge has no Elastic Fabric Adapter"):
        aws.launch(LaunchRequest(job, "worker", "g5.xlarge", efa=True))
    no_subnet = AwsProvider(REGION, session=dummy_session(), endpoint_url=proxy.url, image=AMI,
                            mutate_budget=FAST_MUTATE, describe_budget=FAST_DESCRIBE)
    with pytest.raises(InvalidRequestError, match="EFA interfaces need a subnet"):
        no_subnet.launch(LaunchRequest(job, "worker", "p5.48xlarge", efa=True))
    assert proxy.seen("RunInstances") == []
    assert_nothing_running(aws, job)


def test_an_efa_launch_and_its_bootstrap_agree_and_the_agent_then_runs_with_the_efa_provider(job: str) -> None:
    ref = SecretRef("aws-ssm", f"/trainmover/{job}/job-secret", REGION)
    with pytest.raises(InvalidRequestError, match="efa=True but its bootstrap efa=False"):
        LaunchRequest(job, "worker", "p5.48xlarge", efa=True, bootstrap=bootstrap_for(job, ref))
    spec = dataclasses.replace(bootstrap_for(job, ref), efa=True)
    LaunchRequest(job, "worker", "p5.48xlarge", efa=True, bootstrap=spec)
    unit = render_units(spec)[AGENT_UNIT]
    assert "Environment=FI_PROVIDER=efa" in unit and "Environment=FI_EFA_USE_DEVICE_RDMA=1" in unit
    assert "FI_PROVIDER" not in render_units(bootstrap_for(job, ref))[AGENT_UNIT]
    with pytest.raises(UnsupportedError, match="no Elastic Fabric Adapter on this machine"):
        LocalProvider(slots=1).launch(LaunchRequest(job, "worker", "p5.48xlarge", efa=True))


def test_a_job_group_opened_wider_than_the_network_is_refused_before_launching(
    aws: AwsProvider, proxy: FaultProxy, job: str, moto_url: str
) -> None:
    aws.launch(LaunchRequest(job, "worker", "g5.xlarge", network=NETWORK))
    ec2 = dummy_session().client("ec2", endpoint_url=moto_url)
    [group] = job_groups(ec2, job)
    ec2.authorize_security_group_ingress(  # someone opens SSH to the world
        GroupId=group["GroupId"], IpPermissions=[{"IpProtocol": "tcp", "FromPort": 22, "ToPort": 22,
                                                  "IpRanges": [{"CidrIp": "0.0.0.0/0"}]}]
    )
    proxy.reset()
    restarted = AwsProvider(REGION, session=dummy_session(), endpoint_url=proxy.url, image=AMI)

    with pytest.raises(InvalidRequestError, match=r"admits more than .*cidr:0\.0\.0\.0/0"):
        restarted.launch(LaunchRequest(job, "standby", "g5.xlarge", network=NETWORK))

    assert proxy.seen("RunInstances") == []
    assert_nothing_running(aws, job)
    assert job_groups(ec2, job) == []


def test_network_release_waits_for_the_instances_and_for_ec2_to_free_the_group(
    aws: AwsProvider, proxy: FaultProxy, job: str, placement_groups: PlacementGroups
) -> None:
    aws.launch(LaunchRequest(job, "worker", "g5.xlarge", network=NETWORK))
    aws.terminate([i.instance_id for i in aws.describe(job_id=job)])
    # Right after termination EC2 still holds the instance's network interface in the group.
    proxy.fail("DeleteSecurityGroup", "DependencyViolation", status=400, times=2)
    gone = iter([False, False, True])
    sleeps: list[float] = []

    # The provider's own wait, with a recorded clock instead of real sleeps.
    left = aws._network.release(job, instances_gone=lambda: next(gone), timeout_s=30, poll_s=0.5,
                                sleep=sleeps.append)

    assert left == [] and sleeps == [0.5] * 4  # two polls for the instances, two refused deletions
    assert len(proxy.seen("DeleteSecurityGroup")) == 3 and job_resource_name(job) not in placement_groups.groups


def test_network_release_that_times_out_names_what_is_left_and_deletes_nothing(aws: AwsProvider, job: str) -> None:
    aws.launch(LaunchRequest(job, "worker", "g5.xlarge", network=NETWORK))

    left = aws._network.release(job, instances_gone=lambda: False, timeout_s=0, sleep=lambda _: None)

    assert len(left) == 2 and left[1] == job_resource_name(job) and left[0].startswith("sg-")
    assert_nothing_running(aws, job)  # a later release deletes them


def test_a_job_network_is_validated_when_the_request_is_made(aws: AwsProvider, proxy: FaultProxy) -> None:
    cases: list[tuple[dict[str, object], str]] = [
        ({"store_port": 0}, "store_port must be a TCP port"),
        ({"agent_port": 70000}, "agent_port must be a TCP port"),
        ({"data_ports": (41000, 40000)}, "first <= last"),
        ({"data_ports": (40000,)}, "data_ports must be"),
    ]
    for change, says in cases:
        with pytest.raises(InvalidRequestError, match=says):
            JobNetwork(**{"store_port": 29400, "agent_port": 29401, **change})  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match=re.escape("placement_group='pg-x' or network.cluster_placement")):
        LaunchRequest("job-n", "worker", "g5.xlarge", placement_group="pg-x", network=NETWORK)
    own = JobNetwork(29400, 29401, cluster_placement=False)
    LaunchRequest("job-n", "worker", "g5.xlarge", placement_group="pg-x", network=own)  # a group of the user's
    assert own.tcp_port_ranges() == ((29400, 29400), (29401, 29401), (32768, 60999))
    assert JobNetwork(29400, 29400, (29400, 29400)).tcp_port_ranges() == ((29400, 29400),)
    assert aws.capabilities().job_network
    assert proxy.seen() == []


# ------------------------------------------------------------------------------------------------ bootstrap


def test_a_bootstrapped_instance_holds_the_bootstrap_not_the_secret_and_keeps_it_when_parked_and_woken(
    proxy: FaultProxy, moto_url: str, job: str
) -> None:
    session, profile = session_with_instance_profile(moto_url, job)
    store = AwsSecretsManagerStore(
        REGION, reader_role_arn=f"arn:aws:iam::123456789012:role/{profile}", session=session, endpoint_url=moto_url
    )
    secret = secrets.token_hex(32)
    ref = store.put(job, secret)
    spec = bootstrap_for(job, ref)
    aws = AwsProvider(
        REGION, session=session, endpoint_url=proxy.url, image=AMI, instance_profile=profile,
        mutate_budget=FAST_MUTATE, describe_budget=FAST_DESCRIBE,
    )
    ec2 = session.client("ec2", endpoint_url=moto_url)

    def user_data(instance_id: str) -> str:
        # What anyone allowed DescribeInstanceAttribute reads, straight from moto.
        value = ec2.describe_instance_attribute(InstanceId=instance_id, Attribute="userData")["UserData"]["Value"]
        return base64.b64decode(value).decode()

    try:
        [standby] = aws.launch(LaunchRequest(job, "standby", "g5.xlarge", bootstrap=spec))

        document = user_data(standby.instance_id)
        assert document == render_cloud_init(spec)
        assert ref.name in document and secret not in document
        [run] = proxy.seen("RunInstances")
        assert run.params["IamInstanceProfile.Name"] == profile
        assert secret not in json.dumps(run.params)
        # The host's dead-man's switch powers it off from inside: EC2 terminates it then (API stops still park it).
        behaviour = ec2.describe_instance_attribute(InstanceId=standby.instance_id,
                                                    Attribute="instanceInitiatedShutdownBehavior")
        assert behaviour["InstanceInitiatedShutdownBehavior"]["Value"] == "terminate"

        # Parked and woken: EC2 keeps the user-data. cloud-init does not run it again; the unit it enabled starts
        # the agent at every boot.
        aws.stop([standby.instance_id])
        aws.wait_for_state([standby.instance_id], ["stopped"], timeout_s=10, poll_s=0.05)
        aws.start([standby.instance_id])
        aws.wait_for_state([standby.instance_id], ["running"], timeout_s=10, poll_s=0.05)
        assert user_data(standby.instance_id) == document
        cloud_config = json.loads(document.removeprefix("#cloud-config\n"))
        assert ["systemctl", "enable", "--now", AGENT_UNIT] in cloud_config["runcmd"]
        [unit] = [f["content"] for f in cloud_config["write_files"] if f["path"].endswith(AGENT_UNIT)]
        assert "WantedBy=multi-user.target" in unit and "Restart=on-failure" in unit
    finally:
        store.delete(ref)
    assert_nothing_running(aws, job)


def test_a_bootstrap_the_instance_could_not_use_is_refused_before_any_call(
    aws: AwsProvider, proxy: FaultProxy, job: str
) -> None:
    ssm = SecretRef("aws-ssm", f"/trainmover/{job}/job-secret", REGION)
    with pytest.raises(InvalidRequestError, match="instance_profile="):
        aws.launch(LaunchRequest(job, "worker", "g5.xlarge", bootstrap=bootstrap_for(job, ssm)))

    key_vault = SecretRef("azure-keyvault", "https://v.vault.azure.net/secrets/job-secret")
    profiled = AwsProvider(REGION, session=dummy_session(), endpoint_url=proxy.url, image=AMI, instance_profile="p")
    with pytest.raises(InvalidRequestError, match="Secrets Manager or SSM"):
        profiled.launch(LaunchRequest(job, "worker", "g5.xlarge", bootstrap=bootstrap_for(job, key_vault)))
    assert proxy.seen() == []


def test_a_promoted_standby_is_retagged_worker_and_only_its_role_tag_changes(
    aws: AwsProvider, proxy: FaultProxy, job: str
) -> None:
    [standby] = aws.launch(LaunchRequest(job, "standby", "g5.xlarge", tags={"team": "llm"}))

    promoted = aws.set_role(standby.instance_id, "worker")

    assert (promoted.role, promoted.job_id) == ("worker", job)
    [tagging] = proxy.seen("CreateTags")
    assert {k: v for k, v in tagging.params.items() if k.startswith("Tag.")} == {
        "Tag.1.Key": ROLE_TAG, "Tag.1.Value": "worker"
    }
    assert [i.role for i in aws.describe(job_id=job)] == ["worker"]
    with pytest.raises(InvalidRequestError, match="invalid role 'boss'"):
        aws.set_role(standby.instance_id, "boss")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="not EC2 instance ids"):
        aws.set_role("i-bad", "worker")
    assert len(proxy.seen("CreateTags")) == 1
    assert_nothing_running(aws, job)


# ------------------------------------------------------------------------------------------------ park / wake


def test_park_wake_and_terminate_round_trip(aws: AwsProvider, job: str) -> None:
    [standby] = aws.launch(LaunchRequest(job, "standby", "g6.12xlarge"))
    ids = [standby.instance_id]
    assert aws.capabilities().can_park("on-demand")

    aws.stop(ids)
    [parked] = aws.wait_for_state(ids, ["stopped"], timeout_s=10, poll_s=0.05)
    assert parked.parked and parked.health == "unknown"

    aws.start(ids)
    [woken] = aws.wait_for_state(ids, ["running"], timeout_s=10, poll_s=0.05)
    assert woken.health == "ok"

    aws.terminate(ids)
    aws.terminate(ids)  # terminating twice is not an error
    assert aws.describe(job_id=job) == []
    assert_nothing_running(aws, job)


def test_parking_a_one_time_spot_instance_is_refused_before_calling_aws(
    aws: AwsProvider, proxy: FaultProxy, job: str
) -> None:
    [spot] = aws.launch(LaunchRequest(job, "standby", "g5.xlarge", market="spot"))
    assert not aws.capabilities().can_park("spot")

    with pytest.raises(UnsupportedError, match="persistent spot"):
        aws.stop([spot.instance_id])

    assert proxy.seen("StopInstances") == []  # moto would have stopped it; real AWS refuses
    assert [i.state for i in aws.describe([spot.instance_id])] == ["running"]
    assert_nothing_running(aws, job)


def test_insufficient_capacity_on_start_is_a_capacity_error_not_retried(
    aws: AwsProvider, proxy: FaultProxy, job: str
) -> None:
    [standby] = aws.launch(LaunchRequest(job, "standby", "p5.48xlarge"))
    aws.stop([standby.instance_id])
    proxy.fail("StartInstances", "InsufficientInstanceCapacity", status=500, times=5)

    with pytest.raises(CapacityError, match="Fall back") as raised:
        aws.start([standby.instance_id])

    assert raised.value.code == "InsufficientInstanceCapacity"
    assert len(proxy.seen("StartInstances")) == 1
    assert [i.state for i in aws.describe([standby.instance_id])] == ["stopped"]
    assert_nothing_running(aws, job)


def test_a_standby_with_no_capacity_to_wake_is_replaced_in_the_documented_order(
    aws: AwsProvider, proxy: FaultProxy, job: str
) -> None:
    request = LaunchRequest(job, "standby", "p5.48xlarge", zone="us-east-1a")
    [standby] = aws.launch(request)
    aws.stop([standby.instance_id])
    proxy.fail("StartInstances", "InsufficientInstanceCapacity", status=500)
    proxy.fail(  # the other zone is full too
        "RunInstances",
        "InsufficientInstanceCapacity",
        status=500,
        when=lambda p: p.get("Placement.AvailabilityZone") == "us-east-1b",
    )

    outcome = wake_or_replace(
        aws, standby.instance_id, request, Fallbacks(zones=("us-east-1b",), instance_types=("p5e.48xlarge",))
    )

    assert [(a.candidate.step, a.error_code) for a in outcome.attempts] == [
        ("wake", "InsufficientInstanceCapacity"),
        ("zone", "InsufficientInstanceCapacity"),
        ("type", None),
    ]
    [replacement] = outcome.instances
    assert aws.describe([replacement.instance_id])[0].instance_type == "p5e.48xlarge"
    assert outcome.released == (standby.instance_id,)
    assert [i.state for i in aws.describe([standby.instance_id])] in ([], ["terminated"])
    assert_nothing_running(aws, job)


def test_terminate_skips_instances_already_gone(aws: AwsProvider, job: str) -> None:
    [worker] = aws.launch(LaunchRequest(job, "worker", "m5.large"))

    aws.terminate(["i-0123456789abcdef0", worker.instance_id])

    assert [i.state for i in aws.describe([worker.instance_id])] == ["terminated"]
    assert_nothing_running(aws, job)


# ------------------------------------------------------------------------------------------------ job ids, tags, ids


def _instances_xml(instance_id: str, job_id: str) -> str:
    """A DescribeInstances answer holding one running instance tagged with `job_id`."""
    return (
        '<?xml version="1.0" encoding="UTF-8"?>'
        '<DescribeInstancesResponse xmlns="http://ec2.amazonaws.com/doc/2016-11-15/"><requestId>r-1</requestId>'
        "<reservationSet><item><reservationId>r-0a</reservationId><ownerId>123456789012</ownerId><instancesSet><item>"
        f"<instanceId>{instance_id}</instanceId><instanceType>m5.large</instanceType>"
        "<instanceState><code>16</code><name>running</name></instanceState>"
        f"<tagSet><item><key>{JOB_TAG}</key><value>{job_id}</value></item></tagSet>"
        "</item></instancesSet></item></reservationSet></DescribeInstancesResponse>"
    )


def test_a_job_id_is_never_a_tag_wildcard(aws: AwsProvider, proxy: FaultProxy) -> None:
    # EC2 tag filters expand `*` and `?`: each of these would match other jobs (test_cli.py shows it end to end).
    for pattern in ("*", "job-?*", "llm-?b", "job a", ""):
        with pytest.raises(InvalidRequestError, match=re.escape("letters, digits, '.', '_' or '-'")):
            aws.release_job(pattern)
        with pytest.raises(InvalidRequestError, match="matched exactly"):
            aws.describe(job_id=pattern)
    assert proxy.seen() == [], "refused before any call"


def test_release_acts_only_on_instances_whose_tag_is_the_job(aws: AwsProvider, proxy: FaultProxy, job: str) -> None:
    other = f"{job}-other"
    [theirs] = aws.launch(LaunchRequest(other, "worker", "m5.large"))
    try:
        # As if EC2's filter had matched another job's instance: what comes back is checked, not trusted.
        proxy.answer("DescribeInstances", _instances_xml(theirs.instance_id, other))

        assert aws.release_job(job) == []

        assert proxy.seen("TerminateInstances") == []
        assert [i.state for i in aws.describe([theirs.instance_id])] == ["running"]
    finally:
        assert_nothing_running(aws, other)


def test_terminate_releases_every_well_formed_id_and_names_the_malformed(
    aws: AwsProvider, proxy: FaultProxy, job: str
) -> None:
    first, second = aws.launch(LaunchRequest(job, "worker", "m5.large", count=2))
    # EC2 refuses a whole call that holds one malformed id (moto answers NotFound instead): make it do so.
    proxy.fail(
        "TerminateInstances", "InvalidInstanceID.Malformed", status=400, times=10, when=lambda p: "i-bad" in p.values()
    )

    with pytest.raises(InvalidRequestError, match="'i-bad'") as raised:
        aws.terminate([first.instance_id, "i-bad", second.instance_id])

    assert "every other id of the call was terminated" in str(raised.value)
    assert {i.state for i in aws.describe([first.instance_id, second.instance_id])} <= NOT_RUNNING
    assert all("i-bad" not in s.params.values() for s in proxy.seen("TerminateInstances"))
    assert_nothing_running(aws, job)


def test_tags_are_validated_before_any_call(aws: AwsProvider, proxy: FaultProxy) -> None:
    cases: list[tuple[dict[str, str], str]] = [
        ({"k" * 129: "v"}, "129 characters, at most 128"),
        ({"team": "v" * 257}, "257 characters, at most 256"),
        ({"AWS:owner": "me"}, "starts with 'aws:', which is reserved"),
        ({f"t{n}": "v" for n in range(49)}, "49 tags, at most 48"),
        ({ROLE_TAG: "worker"}, "set by the provider"),
    ]
    for tags, says in cases:
        with pytest.raises(InvalidRequestError, match=re.escape(says)):
            aws.launch(LaunchRequest("job-tags", "worker", "m5.large", tags=tags))
    assert proxy.seen() == [], "refused before any call"


def test_role_and_market_are_checked_when_the_request_is_made() -> None:
    with pytest.raises(InvalidRequestError, match="invalid role 'boss': use one of worker, standby"):
        LaunchRequest("job-r", "boss", "m5.large")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="invalid market 'reserved'"):
        LaunchRequest("job-r", "worker", "m5.large", market="reserved")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="invalid job id 'a b'"):
        LaunchRequest("a b", "worker", "m5.large")


@pytest.mark.parametrize("url", ["not a url", "ftp://host", "http://[::1", "http://host:port"])
def test_an_invalid_endpoint_url_is_one_clear_error(url: str) -> None:
    with pytest.raises(InvalidRequestError, match="invalid endpoint URL"):
        AwsProvider(REGION, session=dummy_session(), endpoint_url=url)


# ------------------------------------------------------------------------------------------------ health


def _status_xml(instance_id: str, instance_status: str, system_status: str) -> str:
    return (
        '<?xml version="1.0" encoding="UTF-8"?>'
        '<DescribeInstanceStatusResponse xmlns="http://ec2.amazonaws.com/doc/2016-11-15/">'
        "<requestId>r-1</requestId><instanceStatusSet><item>"
        f"<instanceId>{instance_id}</instanceId><availabilityZone>us-east-1a</availabilityZone>"
        "<instanceState><code>16</code><name>running</name></instanceState>"
        f"<systemStatus><status>{system_status}</status></systemStatus>"
        f"<instanceStatus><status>{instance_status}</status></instanceStatus>"
        "</item></instanceStatusSet></DescribeInstanceStatusResponse>"
    )


@pytest.mark.parametrize(
    ("instance_status", "system_status", "health"),
    [("impaired", "ok", "impaired"), ("ok", "initializing", "initializing"), ("insufficient-data", "ok", "unknown")],
)
def test_health_comes_from_the_status_checks(
    aws: AwsProvider, proxy: FaultProxy, job: str, instance_status: str, system_status: str, health: str
) -> None:
    [worker] = aws.launch(LaunchRequest(job, "worker", "g5.xlarge"))
    proxy.answer("DescribeInstanceStatus", _status_xml(worker.instance_id, instance_status, system_status))

    assert [i.health for i in aws.describe(job_id=job)] == [health]
    assert [i.health for i in aws.describe(job_id=job)] == ["ok"]  # moto's own answer once the canned one is used
    assert_nothing_running(aws, job)


# ------------------------------------------------------------------------------------------------ errors


def test_throttled_launch_is_retried_with_the_same_client_token(aws: AwsProvider, proxy: FaultProxy, job: str) -> None:
    proxy.fail("RunInstances", "RequestLimitExceeded", status=503, times=2)

    launched = aws.launch(LaunchRequest(job, "worker", "m5.large", count=2))

    runs = proxy.seen("RunInstances")
    assert len(runs) == 3  # two throttled (each a single HTTP attempt: botocore does not retry), one served
    assert len({r.params["ClientToken"] for r in runs}) == 1
    assert len(launched) == 2
    assert_nothing_running(aws, job)


def test_throttling_that_outlasts_the_budget_raises_throttled_error(aws: AwsProvider, proxy: FaultProxy) -> None:
    proxy.fail("DescribeInstances", "RequestLimitExceeded", status=503, times=100)

    with pytest.raises(ThrottledError, match="rate limit") as raised:
        aws.describe(job_id="any")

    assert len(proxy.seen("DescribeInstances")) == FAST_DESCRIBE.attempts
    assert raised.value.transient and raised.value.code == "RequestLimitExceeded"
    assert type(raised.value.__cause__).__name__ == "ClientError"


@pytest.mark.parametrize(
    ("code", "status", "error", "says"),
    [
        ("InsufficientInstanceCapacity", 500, CapacityError, "Fall back"),
        ("InstanceLimitExceeded", 400, QuotaError, "Service Quotas"),
        ("VcpuLimitExceeded", 400, QuotaError, "Service Quotas"),
        ("AuthFailure", 401, CredentialsError, "AWS_PROFILE"),
        ("UnauthorizedOperation", 403, PermissionDeniedError, "ec2:RunInstances"),
        ("InvalidParameterCombination", 400, InvalidRequestError, "invalid"),
        ("Unsupported", 400, InvalidRequestError, "invalid"),
        ("InvalidAMIID.NotFound", 400, NotFoundError, "not found"),
        ("InternalError", 500, ServiceUnavailableError, "failed on its side"),
    ],
)
def test_ec2_errors_become_one_clear_cloud_error(
    aws: AwsProvider, proxy: FaultProxy, job: str, code: str, status: int, error: type[CloudError], says: str
) -> None:
    proxy.fail("RunInstances", code, status=status, times=100)

    with pytest.raises(error, match=says) as raised:
        aws.launch(LaunchRequest(job, "worker", "m5.large"))

    assert raised.value.code == code and raised.value.provider == "aws"
    assert "not-a-real-secret" not in str(raised.value)
    assert len(proxy.seen("RunInstances")) == (FAST_MUTATE.attempts if raised.value.transient else 1)
    assert_nothing_running(aws, job)


def test_unreachable_endpoint_is_service_unavailable() -> None:
    provider = AwsProvider(
        REGION,
        session=dummy_session(),
        endpoint_url=f"http://127.0.0.1:{free_closed_port()}",
        describe_budget=FAST_DESCRIBE,
    )
    with pytest.raises(ServiceUnavailableError, match="did not answer"):
        provider.describe(job_id="any")


def test_unknown_region_names_valid_ones() -> None:
    with pytest.raises(InvalidRequestError, match=r"'us-est-1': did you mean .*us-east-1") as raised:
        AwsProvider("us-est-1", session=dummy_session())
    assert "us-west-2" in str(raised.value)
    with pytest.raises(InvalidRequestError, match="describe-regions"):
        AwsProvider("moon-base-1", session=dummy_session())


@pytest.fixture
def no_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """An environment where boto3's standard chain finds nothing (and does not wait for an instance role)."""
    for name in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_PROFILE",
        "AWS_DEFAULT_PROFILE",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", f"{tmp_path}/no-config")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", f"{tmp_path}/no-credentials")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.mark.usefixtures("no_credentials")
def test_missing_credentials_give_one_clear_message(proxy: FaultProxy) -> None:
    provider = AwsProvider(REGION, endpoint_url=proxy.url, image=AMI, describe_budget=FAST_DESCRIBE)

    with pytest.raises(CredentialsError) as raised:
        provider.describe(job_id="any")

    message = str(raised.value)
    assert "AWS_PROFILE" in message and "credentials_block" in message
    assert "botocore" not in message and "Traceback" not in message
    assert type(raised.value.__cause__).__name__ == "NoCredentialsError"
    [credentials] = provider.check()
    assert (credentials.name, credentials.ok) == ("credentials", False)
    assert "AWS_PROFILE" in credentials.detail
    assert proxy.seen() == []  # signing failed before anything was sent


# ------------------------------------------------------------------------------------------------ check


def test_check_against_moto_allows_everything_and_creates_nothing(aws: AwsProvider, proxy: FaultProxy) -> None:
    results = aws.check()

    assert [r for r in results if not r.ok] == []
    exact = {
        "credentials",
        "ec2:RunInstances",
        "ec2:StartInstances",
        "ec2:StopInstances",
        "ec2:TerminateInstances",
        "ec2:CreateTags",
        "ec2:DescribeInstances",
        "ec2:DescribeInstanceStatus",
        "ec2:DescribeInstanceTypes",
        "ec2:DescribeSpotPriceHistory",
    }
    assert exact <= {r.name for r in results}
    # Every other permission of the job policy (no PassRole without a node role), through IAM's simulator.
    statements = aws_job_policy(AwsJobScope("trainmover-check", (REGION,), (AMI,), ("t3.micro",)))["Statement"]
    granted = {a for st in statements for a in ([st["Action"]] if isinstance(st["Action"], str) else st["Action"])}
    simulated = {r.name.removesuffix(" (simulated)") for r in results if r.name not in exact}
    assert simulated == granted
    assert {"ec2:CreateSecurityGroup", "ssm:PutParameter", "sqs:CreateQueue", "events:PutRule"} <= simulated
    mutating = {"RunInstances", "StartInstances", "StopInstances", "TerminateInstances", "CreateTags",
                "CreateSecurityGroup", "CreatePlacementGroup", "PutParameter", "CreateQueue", "PutRule"}
    assert all(s.dry_run for s in proxy.seen() if s.action in mutating)


def test_check_names_a_denied_permission(aws: AwsProvider, proxy: FaultProxy) -> None:
    proxy.fail("StopInstances", "UnauthorizedOperation", status=403, dry_run=True)

    results = {r.name: r for r in aws.check()}

    assert not results["ec2:StopInstances"].ok
    assert "ec2:StopInstances" in results["ec2:StopInstances"].detail
    assert "trainmover-aws-policy.json" in results["ec2:StopInstances"].detail
    assert all(r.ok for name, r in results.items() if name != "ec2:StopInstances")


# ------------------------------------------------------------------------------------------------ prices


def test_prices_spot_from_history_on_demand_from_the_table(
    aws: AwsProvider, proxy: FaultProxy, caplog: pytest.LogCaptureFixture
) -> None:
    assert aws.hourly_price_usd("p5.48xlarge") == pytest.approx(55.04)
    assert aws.hourly_price_usd("p5.48xlarge", "spot") == pytest.approx(0.00001)  # moto's fixed spot price

    proxy.answer(
        "DescribeSpotPriceHistory",
        '<DescribeSpotPriceHistoryResponse xmlns="http://ec2.amazonaws.com/doc/2016-11-15/">'
        "<requestId>r-2</requestId><spotPriceHistorySet/></DescribeSpotPriceHistoryResponse>",
    )
    with caplog.at_level(logging.WARNING, logger="cloud.aws"):
        assert aws.hourly_price_usd("g6.xlarge", "spot") == pytest.approx(0.8048)
    assert "no spot price history for g6.xlarge" in caplog.text

    overridden = AwsProvider(REGION, session=dummy_session(), endpoint_url=proxy.url, prices_usd_per_h={"x1.big": 3.0})
    assert overridden.hourly_price_usd("x1.big") == 3.0
    with pytest.raises(InvalidRequestError, match="prices_usd_per_h"):
        aws.hourly_price_usd("x1.big")


# ------------------------------------------------------------------------------------------------ notices


def _event(detail_type: str, source: str, detail: dict[str, object], **extra: object) -> dict[str, object]:
    return {"Source": source, "DetailType": detail_type, "Detail": json.dumps(detail), **extra}


ACCOUNT = "123456789012"  # moto's account: its STS answers it and its EventBridge stamps it on every event
NOT_IN_LOGS = "do-not-log-this-body"


def _envelope(detail_type: str, detail: dict[str, object], *, source: str = "aws.ec2", account: str = ACCOUNT,
              region: str = REGION, event_id: str | None = None) -> str:
    """An SQS message body as EventBridge writes it."""
    return json.dumps({
        "version": "0", "id": event_id or str(uuid.uuid4()), "detail-type": detail_type, "source": source,
        "account": account, "time": "2026-03-01T12:00:00Z", "region": region, "resources": [],
        "detail": {**detail, "note": NOT_IN_LOGS},
    })


@pytest.fixture
def notice_job(proxy: FaultProxy, clean_url: str, job: str) -> Iterator[tuple[str, str]]:
    """The job's notice queue (queue URL, job id), deleted afterwards."""
    queue_url = ensure_notice_queue(job, region=REGION, session=dummy_session(), endpoint_url=proxy.url)
    try:
        yield queue_url, job
    finally:
        delete_notice_queue(job, region=REGION, session=dummy_session(), endpoint_url=clean_url)


def test_eventbridge_notices_of_the_jobs_instances_arrive_through_sqs(
    aws: AwsProvider, proxy: FaultProxy, moto_url: str, notice_job: tuple[str, str]
) -> None:
    queue_url, job_id = notice_job
    session = dummy_session()
    events = session.client("events", endpoint_url=moto_url)
    _, rules = notice_resource_names(job_id)
    assert {r["Name"] for r in events.list_rules(NamePrefix=f"trainmover-{job_id}")["Rules"]} == set(rules.values())
    assert ensure_notice_queue(job_id, region=REGION, session=session, endpoint_url=proxy.url) == queue_url
    launched = aws.launch(LaunchRequest(job_id, "worker", "g5.xlarge", count=3))
    spot, rebalance, maintained = (i.instance_id for i in launched)
    provider = AwsProvider(REGION, session=session, endpoint_url=proxy.url, notice_queue_url=queue_url,
                           notice_job_id=job_id)
    assert provider.poll_notices() == []
    spot_detail = {"instance-id": spot, "instance-action": "stop"}
    health_detail = {
        "service": "EC2",
        "eventTypeCategory": "scheduledChange",
        "eventTypeCode": "AWS_EC2_INSTANCE_REBOOT_MAINTENANCE_SCHEDULED",
        "startTime": "Sat, 05 Jun 2027 15:10:09 GMT",
        "affectedEntities": [{"entityValue": maintained}],
    }

    # The rules deliver: three events reach the queue, the RDS one does not. moto 5.2.5 delivers them without the
    # envelope's `account` (its input-template parser drops it; EventBridge always sets it), so each is refused.
    events.put_events(
        Entries=[
            _event("EC2 Spot Instance Interruption Warning", "aws.ec2", spot_detail),
            _event("EC2 Instance Rebalance Recommendation", "aws.ec2", {"instance-id": rebalance}),
            _event("AWS Health Event", "aws.health", health_detail),
            _event("AWS Health Event", "aws.health", {"service": "RDS", "eventTypeCategory": "scheduledChange"}),
        ]
    )
    assert provider.poll_notices(timeout_s=5) == []
    assert provider.dropped_notice_counts() == {"account": 3}

    # The same events as EventBridge writes them, account included:
    # https://docs.aws.amazon.com/eventbridge/latest/userguide/eb-events-structure.html
    sqs = session.client("sqs", endpoint_url=moto_url)
    for body in (
        _envelope("EC2 Spot Instance Interruption Warning", spot_detail),
        _envelope("EC2 Instance Rebalance Recommendation", {"instance-id": rebalance}),
        _envelope("AWS Health Event", health_detail, source="aws.health"),
    ):
        sqs.send_message(QueueUrl=queue_url, MessageBody=body)

    notices = provider.poll_notices(timeout_s=5)

    by_kind = {n.kind: n for n in notices}
    assert sorted(by_kind) == ["rebalance_recommendation", "scheduled_maintenance", "spot_interruption"]
    assert len(notices) == 3
    assert by_kind["spot_interruption"].instance_id == spot and by_kind["spot_interruption"].source == "eventbridge"
    assert by_kind["spot_interruption"].deadline_at == datetime(2026, 3, 1, 12, 2, tzinfo=UTC).timestamp()
    assert "instance-action=stop" in by_kind["spot_interruption"].detail
    assert by_kind["rebalance_recommendation"].instance_id == rebalance
    assert by_kind["scheduled_maintenance"].instance_id == maintained
    assert by_kind["scheduled_maintenance"].deadline_at == datetime(2027, 6, 5, 15, 10, 9, tzinfo=UTC).timestamp()
    assert provider.dropped_notice_counts() == {"account": 3}

    # EventBridge delivers at least once: a second copy of an event is not a second notice.
    copy = _envelope("EC2 Instance Rebalance Recommendation", {"instance-id": spot}, event_id="evt-1")
    sqs.send_message(QueueUrl=queue_url, MessageBody=copy)
    sqs.send_message(QueueUrl=queue_url, MessageBody=copy)
    assert [n.instance_id for n in provider.poll_notices(timeout_s=2)] == [spot]
    assert_nothing_running(aws, job_id)


def test_a_queue_message_that_fails_a_check_moves_nothing_and_is_dropped_once(
    aws: AwsProvider, proxy: FaultProxy, moto_url: str, notice_job: tuple[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    queue_url, job_id = notice_job
    session = dummy_session()
    [ours] = aws.launch(LaunchRequest(job_id, "worker", "g5.xlarge"))
    other_job = f"{job_id}-other"
    [theirs] = aws.launch(LaunchRequest(other_job, "worker", "g5.xlarge"))
    spot = "EC2 Spot Instance Interruption Warning"
    sqs = session.client("sqs", endpoint_url=moto_url)
    # A genuine event for another job's instance (the rules match every instance of the account), then messages
    # that anyone allowed sqs:SendMessage on the queue could write.
    forged = {
        "genuine, another job's": _envelope(spot, {"instance-id": theirs.instance_id}),
        "source": _envelope(spot, {"instance-id": ours.instance_id}, source="custom.app"),
        "account": _envelope(spot, {"instance-id": ours.instance_id}, account="210987654321"),
        "region": _envelope(spot, {"instance-id": ours.instance_id}, region="eu-west-1"),
        "kind": _envelope("EC2 Instance State-change Notification", {"instance-id": ours.instance_id}),
        "instance": _envelope(spot, {"instance-id": "i-0123456789abcdef0"}),  # no such instance
        "malformed": "{" + NOT_IN_LOGS,
    }
    for body in forged.values():
        sqs.send_message(QueueUrl=queue_url, MessageBody=body)
    provider = AwsProvider(REGION, session=session, endpoint_url=proxy.url, notice_queue_url=queue_url,
                           notice_job_id=job_id, describe_budget=FAST_DESCRIBE)

    with caplog.at_level(logging.WARNING, logger="cloud.aws"):
        assert provider.poll_notices(timeout_s=5) == []

    assert provider.dropped_notice_counts() == {"source": 1, "account": 1, "region": 1, "kind": 1, "instance": 2,
                                                "malformed": 1}
    warnings = [r.getMessage() for r in caplog.records if r.name == "cloud.aws"]
    assert len(warnings) == 7 and all("dropped notice message" in w for w in warnings)
    assert NOT_IN_LOGS not in caplog.text and "210987654321" not in caplog.text
    assert provider.poll_notices() == []  # dropped messages were deleted, not left to come back
    assert [i.state for i in aws.describe([ours.instance_id, theirs.instance_id])] == ["running", "running"]
    assert_nothing_running(aws, other_job)
    assert_nothing_running(aws, job_id)


def test_a_notice_queue_without_its_job_is_refused_before_reading_it(aws: AwsProvider, proxy: FaultProxy) -> None:
    provider = AwsProvider(REGION, session=dummy_session(), endpoint_url=proxy.url, notice_queue_url="http://q")
    with pytest.raises(InvalidRequestError, match="notice_job_id"):
        provider.poll_notices()
    assert proxy.seen() == []
    with pytest.raises(InvalidRequestError, match="not 12 digits"):
        AwsProvider(REGION, session=dummy_session(), account_id="1234")


def test_event_envelopes_are_checked_before_their_notices_count() -> None:
    body = _envelope("EC2 Spot Instance Interruption Warning", {"instance-id": "i-0123456789abcdef0"})
    event = parse_event(body, received_at=0.0)
    assert (event.source, event.account, event.region) == ("aws.ec2", ACCOUNT, REGION)
    assert event_refusal(event, account_id=ACCOUNT, region=REGION) is None
    refused = {
        "account": event_refusal(event, account_id="210987654321", region=REGION),
        "region": event_refusal(event, account_id=ACCOUNT, region="us-west-2"),
        "source": event_refusal(
            parse_event(body.replace('"aws.ec2"', '"aws.health"'), received_at=0.0), account_id=ACCOUNT, region=REGION
        ),
    }
    assert {check: r.check if r else None for check, r in refused.items()} == {c: c for c in refused}
    other_account = refused["account"]
    assert other_account is not None and "...4321" in other_account.detail
    assert "210987654321" not in other_account.detail


def test_poll_notices_without_a_queue_returns_nothing(aws: AwsProvider) -> None:
    assert aws.poll_notices(timeout_s=0) == []


def test_event_parsing_refuses_what_is_not_an_event() -> None:
    with pytest.raises(ValueError, match="not JSON"):
        notices_from_event("{", received_at=0.0)
    with pytest.raises(ValueError, match="detail"):
        notices_from_event('{"detail-type": "x"}', received_at=0.0)
    with pytest.raises(ValueError, match="instance id"):
        notices_from_event('{"detail-type": "EC2 Spot Instance Interruption Warning", "detail": {}}', received_at=0.0)
    assert notices_from_event('{"detail-type": "Something else", "detail": {}}', received_at=0.0) == []
    assert parse_time("2026-01-01T00:00:00Z") == parse_time("Thu, 01 Jan 2026 00:00:00 GMT")


# ------------------------------------------------------------------------------------------------ IMDS


@pytest.fixture
def imds() -> Iterator[ImdsServer]:
    with imds_server() as server:
        yield server


def test_imds_without_notices_answers_404_and_gives_nothing(imds: ImdsServer) -> None:
    source = ImdsNoticeSource("i-0abc", endpoint=imds.url, token_ttl_s=300)

    assert source.poll() == []
    assert source.poll() == []
    assert imds.token_requests == [300]  # one token, reused
    assert imds.gets(SPOT_ACTION_PATH) == 2 and imds.gets(REBALANCE_PATH) == 2
    assert "token" not in repr(source).lower()


def test_imds_notice_posted_while_polling_is_seen_once(imds: ImdsServer) -> None:
    source = ImdsNoticeSource("i-0abc", endpoint=imds.url)
    seen: list[list[Notice]] = []
    found = threading.Event()
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            notices = source.poll()
            if notices:
                seen.append(list(notices))
                found.set()
            stop.wait(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        assert imds.wait_for_gets(SPOT_ACTION_PATH, 2, timeout_s=5), "the watcher never polled"
        assert not found.is_set()
        imds.post_spot_action("terminate", "2026-03-01T12:02:00Z")
        assert found.wait(timeout=5), "the posted notice was never seen"
        polled = imds.gets(SPOT_ACTION_PATH)
        assert imds.wait_for_gets(SPOT_ACTION_PATH, polled + 3, timeout_s=5)  # still posted, polled again...
    finally:
        stop.set()
        watcher.join(timeout=5)
    assert len(seen) == 1  # ...but returned only once
    [notice] = seen[0]
    assert notice.kind == "spot_interruption" and notice.instance_id == "i-0abc" and notice.source == "imds"
    assert notice.deadline_at == datetime(2026, 3, 1, 12, 2, tzinfo=UTC).timestamp()


def test_imds_token_refused_with_401_is_refreshed(imds: ImdsServer) -> None:
    source = ImdsNoticeSource("i-0abc", endpoint=imds.url)
    assert source.poll() == []
    imds.revoke_tokens()
    imds.post_rebalance("2026-03-01T11:00:00Z")

    [notice] = source.poll()

    assert notice.kind == "rebalance_recommendation" and notice.deadline_at is None
    assert len(imds.token_requests) == 2


def test_imds_deduplicates_but_reports_a_new_notice(imds: ImdsServer) -> None:
    source = ImdsNoticeSource("i-0abc", endpoint=imds.url)
    imds.post_rebalance("2026-03-01T11:00:00Z")
    assert [n.kind for n in source.poll()] == ["rebalance_recommendation"]
    assert source.poll() == []

    imds.post_spot_action("stop", "2026-03-01T12:02:00Z")
    imds.post_rebalance("2026-03-01T11:30:00Z")
    assert sorted(n.kind for n in source.poll()) == ["rebalance_recommendation", "spot_interruption"]
    assert source.poll() == []


def test_imds_unreachable_is_service_unavailable() -> None:
    source = ImdsNoticeSource("i-0abc", endpoint=f"http://127.0.0.1:{free_closed_port()}", timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(ServiceUnavailableError, match="unreachable"):
        source.poll()
    assert time.monotonic() - started < 5


def test_imds_is_never_asked_through_a_proxy(imds: ImdsServer, monkeypatch: pytest.MonkeyPatch) -> None:
    dead_proxy = f"http://127.0.0.1:{free_closed_port()}"  # whatever goes through it fails
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.setenv(name, dead_proxy)
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    assert urllib.request.getproxies()["http"] == dead_proxy  # plain urllib would use it
    source = ImdsNoticeSource("i-0abc", endpoint=imds.url, timeout_s=2.0)
    imds.post_rebalance("2026-03-01T11:00:00Z")

    assert [n.kind for n in source.poll()] == ["rebalance_recommendation"]
    assert len(imds.token_requests) == 1


# ------------------------------------------------------------------------------------------------ packaging


def test_importing_cloud_aws_needs_no_boto3_and_launching_says_how_to_install() -> None:
    script = (
        "import sys; sys.modules['boto3'] = None\n"
        "import cloud.aws, cloud.aws.notices\n"
        "try:\n"
        "    cloud.aws.AwsProvider('us-east-1')\n"
        "except ImportError as err:\n"
        "    print(err)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert "pip install 'trainmover[aws]'" in done.stdout


# ------------------------------------------------------------------------------------------------ IAM policy

# API calls whose IAM permission has another name, and permissions a call needs beyond its own name.
_PERMISSION_OF = {"sqs:DeleteMessageBatch": "sqs:DeleteMessage"}
_IMPLIED = {
    "ec2:RunInstances": {"ec2:CreateTags", "iam:PassRole"},  # PassRole: it launches with the node's profile
    "ec2:CreateSecurityGroup": {"ec2:CreateTags"},  # both tag what they create (TagSpecifications)
    "ec2:CreatePlacementGroup": {"ec2:CreateTags"},
    "sqs:CreateQueue": {"sqs:TagQueue"},
    "events:PutRule": {"events:TagResource"},
    "ssm:PutParameter": {"ssm:AddTagsToResource"},  # it tags the parameter it creates
}


def test_the_iam_policy_lists_exactly_the_actions_the_provider_calls(
    proxy: FaultProxy, moto_url: str, job: str
) -> None:
    session, profile = session_with_instance_profile(moto_url, job)
    queue_url = ensure_notice_queue(job, region=REGION, session=session, endpoint_url=proxy.url)
    try:
        provider = AwsProvider(
            REGION,
            session=session,
            endpoint_url=proxy.url,
            image=AMI,
            notice_queue_url=queue_url,
            notice_job_id=job,
            instance_profile=profile,
        )
        # A bootstrapped launch needs nothing more than a plain one: the host reads its secret with its own role.
        # Into a subnet and the job's network: the group is made in the subnet's VPC, and deleted on release.
        # The flows store the job's secret for its hosts and delete it at the release.
        store = AwsParameterStore(REGION, session=session, endpoint_url=proxy.url)
        ref = store.put(job, secrets.token_hex(32))
        store.delete(ref)
        subnet = session.client("ec2", endpoint_url=moto_url).describe_subnets()["Subnets"][0]["SubnetId"]
        [standby] = provider.launch(
            LaunchRequest(job, "standby", "g5.xlarge", bootstrap=bootstrap_for(job, ref), subnet=subnet,
                          network=NETWORK)
        )
        [run] = proxy.seen("RunInstances")
        assert run.params["MetadataOptions.HttpTokens"] == "required", "the policy allows only IMDSv2 launches"
        assert run.params["IamInstanceProfile.Name"] == profile
        provider.stop([standby.instance_id])
        provider.start([standby.instance_id])
        provider.set_role(standby.instance_id, "worker")  # a promotion
        provider.hourly_price_usd("g5.xlarge", "spot")
        # Straight to moto, past the proxy: only the provider's own calls are counted.
        session.client("sqs", endpoint_url=moto_url).send_message(QueueUrl=queue_url, MessageBody="{}")
        provider.poll_notices(timeout_s=1)
        assert all(r.ok for r in provider.check())
        assert_nothing_running(provider, job)
    finally:
        delete_notice_queue(job, region=REGION, session=session, endpoint_url=proxy.url)
    network_calls = {s.action for s in proxy.seen()} & {"CreateSecurityGroup", "AuthorizeSecurityGroupIngress",
                                                        "DeleteSecurityGroup", "DescribeSubnets",
                                                        "CreatePlacementGroup", "DeletePlacementGroup"}
    assert len(network_calls) == 6, "the scenario exercises the whole job network"

    called = {_PERMISSION_OF.get(f"{s.service}:{s.action}", f"{s.service}:{s.action}") for s in proxy.seen()}
    called |= {implied for action in list(called) for implied in _IMPLIED.get(action, set())}
    called.discard("sts:GetCallerIdentity")  # needs no permission and cannot be denied
    called.discard("iam:SimulatePrincipalPolicy")  # check's question about the caller, not a call the job makes
    # EC2 calls KMS on the caller's behalf for CMK-encrypted volumes (moto encrypts nothing).
    called |= {*KMS_FOR_EBS_VOLUMES, "kms:CreateGrant"}
    statements = aws_job_policy(AWS_EXAMPLE)["Statement"]
    granted = {a for st in statements for a in ([st["Action"]] if isinstance(st["Action"], str) else st["Action"])}
    assert granted == called


def test_the_job_policy_is_a_valid_iam_policy_document(moto_url: str) -> None:
    iam = dummy_session().client("iam", endpoint_url=moto_url)
    for scope in (AWS_EXAMPLE, AwsJobScope("job-min", ("eu-west-1", "us-west-2"), (AMI,), ("g5.xlarge",))):
        document = json.dumps(aws_job_policy(scope))
        name = f"trainmover-{scope.job_id}-{uuid.uuid4().hex[:6]}"
        arn = iam.create_policy(PolicyName=name, PolicyDocument=document)["Policy"]["Arn"]
        iam.delete_policy(PolicyArn=arn)
        # IAM's limit for a managed policy, whitespace not counted.
        assert len(re.sub(r"\s", "", document)) < 6144
