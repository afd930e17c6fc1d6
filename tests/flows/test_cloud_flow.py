"""`resilient_training` on `provider: aws`, against moto's server over HTTP: the launch requests a real run sends.

moto runs no instance, so no agent ever joins and the run fails once `hosts_wait_s` is over; what is checked is
what EC2, SSM, SQS and EventBridge were asked for on the way, and that the release leaves nothing: every instance
launched boots the job's agent (the cloud-init document is in its user-data) and names where its secret lives,
never the secret; the secret is a SecureString in SSM Parameter Store, deleted at the release; the job has its own
security group, open only to itself on the coordinator's ports and the data ports, and its own cluster placement
group; the job's notices come through EventBridge rules into an SQS queue of its own, read while it runs and
deleted at the release; the coordinator waits for exactly the hosts launched and says why the run failed.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest

from cloud.bootstrap import AGENT_UNIT
from tests.cloud.aws_servers import FaultProxy, PlacementGroups, fault_proxy, moto_server

pytestmark = [pytest.mark.usefixtures("prefect_harness"), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
REGION = "us-east-1"
AMI = "ami-12c6146b"  # one of the AMIs moto ships
SECRET = "f" * 64  # what runtime.wire.auth.new_token gives the job in this test, to look for it everywhere


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, FaultProxy, PlacementGroups]]:
    """moto's server behind a proxy that records every request (and answers the placement-group calls moto lacks);
    the SDK's standard chain pointed at the proxy by the environment, as a worker host would be configured."""
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    with moto_server() as url, fault_proxy(url) as proxy:
        groups = PlacementGroups()
        groups.install(proxy)
        for name, value in {
            "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "not-a-real-secret",
            "AWS_DEFAULT_REGION": REGION, "AWS_ENDPOINT_URL": proxy.url,
        }.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setattr("runtime.wire.auth.new_token", lambda: SECRET)
        yield url, proxy, groups


def _params(seen: Any) -> dict[str, Any]:
    return dict(seen.params)


def test_an_aws_run_launches_hosts_that_boot_the_agent_with_the_secret_in_ssm_and_a_network_of_their_own(
    aws: tuple[str, FaultProxy, PlacementGroups],
) -> None:
    from flows.models import StandbyLimits, TrainingRun
    from flows.training import resilient_training

    url, proxy, groups = aws
    job = "cloud-flow"
    iam = boto3.client("iam", endpoint_url=url, region_name=REGION)
    iam.create_instance_profile(InstanceProfileName="trainmover-node-cloud-flow")
    run = TrainingRun(
        job_id=job, provider="aws", region=REGION, instance_type="g5.xlarge", workers=2,
        standby=StandbyLimits(min_warm=1, max_warm=1, max_stopped=0), script="examples/train_mlp.py",
        coordinator_address="127.0.0.1", image=AMI, instance_profile="trainmover-node-cloud-flow",
        hosts_wait_s=5, trainmover_source="trainmover==0.1.0",
    )
    state = resilient_training(run=run, max_wall_s=120.0, return_state=True)
    assert state.is_failed(), state
    with pytest.raises(RuntimeError, match=r"0 of 3 agents joined within 5 s.*journalctl -u trainmover-agent"):
        state.result()

    # Three instances, each booting the job's agent; the document names the secret's parameter, never the value.
    launches = proxy.seen("RunInstances")
    documents = []
    for seen in launches:
        p = _params(seen)
        document = base64.b64decode(p["UserData"]).decode()
        documents.append(document)
        assert p["ImageId"] == AMI and p["IamInstanceProfile.Name"] == "trainmover-node-cloud-flow"
        assert p["Placement.GroupName"], p
        assert SECRET not in json.dumps(p) and SECRET not in document
    assert sum(int(_params(s)["MaxCount"]) for s in launches) == 3
    for document in documents:
        config = json.loads(document.removeprefix("#cloud-config\n"))
        assert ["systemctl", "enable", "--now", AGENT_UNIT] in config["runcmd"]
        assert "/trainmover/cloud-flow/job-secret" in document and "aws-ssm" in document
        assert "127.0.0.1" in document and str(ROOT / "examples" / "train_mlp.py") in document
        assert "--notices aws" in document, "each host watches its own instance metadata for spot notices"
    # The secret went to SSM as a SecureString, and was deleted at the release.
    # (moto's backends are shared by the whole test process: look at this job's resources only.)
    ssm = boto3.client("ssm", endpoint_url=url, region_name=REGION)
    assert [p["Name"] for p in ssm.describe_parameters()["Parameters"] if f"/{job}/" in p["Name"]] == []
    # The job's own security group admits only itself; its placement group is the one every launch went into.
    (authorize,) = proxy.seen("AuthorizeSecurityGroupIngress")
    rules = _params(authorize)
    group_id = rules["GroupId"]
    sources = {v for k, v in rules.items() if k.endswith(".Groups.1.GroupId")}
    assert sources == {group_id} and not any(k.endswith("CidrIp") for k in rules), rules
    assert {p["SecurityGroupId.1"] for p in map(_params, launches)} == {group_id}
    (created,) = proxy.seen("CreatePlacementGroup")
    assert _params(created)["Strategy"] == "cluster"
    assert {_params(s)["Placement.GroupName"] for s in launches} == {_params(created)["GroupName"]}
    # Released: no instance of the job runs, its group and placement group are gone.
    ec2 = boto3.client("ec2", endpoint_url=url, region_name=REGION)
    states = [i["State"]["Name"] for r in ec2.describe_instances()["Reservations"] for i in r["Instances"]
              if {"Key": "trainmover:job", "Value": job} in i.get("Tags", [])]
    assert len(states) == 3 and set(states) <= {"terminated", "shutting-down"}, states
    assert proxy.seen("DeleteSecurityGroup") and groups.groups == {}
    # The job's notice wiring (EventBridge rules into an SQS queue of its own) was made, read, and deleted.
    sqs = boto3.client("sqs", endpoint_url=url, region_name=REGION)
    events = boto3.client("events", endpoint_url=url, region_name=REGION)
    assert [q for q in sqs.list_queues().get("QueueUrls", []) if job in q] == []
    assert [r["Name"] for r in events.list_rules()["Rules"] if job in r["Name"]] == []
    calls = [seen.action for seen in proxy.seen()]
    for made, used, deleted in (("CreateQueue", "ReceiveMessage", "DeleteQueue"), ("PutRule", "PutTargets",
                                                                                  "DeleteRule")):
        assert made in calls and used in calls and deleted in calls, calls
        assert calls.index(made) < calls.index("RunInstances") < calls.index(deleted)
    assert calls.index("PutParameter") < calls.index("RunInstances") < calls.index("DeleteParameter")
