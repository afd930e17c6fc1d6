"""The per-job AWS policy and the Azure role of cloud/iam.py: what each statement allows, and that the files in
docs/iam are exactly what the code generates (the moto test in test_aws.py checks that IAM parses the policy)."""

from __future__ import annotations

import dataclasses
import fnmatch
import json
from pathlib import Path
from typing import Any

import pytest

from cloud.aws import notice_resource_names
from cloud.aws.iam import AWS_EXAMPLE, AwsJobScope, aws_job_policy
from cloud.azure.iam import azure_job_role
from cloud.base import JOB_TAG, ROLE_TAG, InvalidRequestError

DOCS = Path(__file__).resolve().parents[2] / "docs" / "iam"
READS = {
    "ec2:DescribeInstances",
    "ec2:DescribeInstanceStatus",
    "ec2:DescribeInstanceTypes",
    "ec2:DescribeSpotPriceHistory",
    "ec2:DescribeSecurityGroups",
    "ec2:DescribePlacementGroups",
    "ec2:DescribeSubnets",
}
NETWORK_MUTATIONS = {
    "ec2:CreateSecurityGroup",
    "ec2:AuthorizeSecurityGroupIngress",
    "ec2:DeleteSecurityGroup",
    "ec2:CreatePlacementGroup",
    "ec2:DeletePlacementGroup",
}


def statements(scope: AwsJobScope = AWS_EXAMPLE) -> dict[str, dict[str, Any]]:
    return {st["Sid"]: st for st in aws_job_policy(scope)["Statement"]}


def actions(statement: dict[str, Any]) -> set[str]:
    action = statement["Action"]
    return {action} if isinstance(action, str) else set(action)


def resources(statement: dict[str, Any]) -> list[str]:
    resource = statement["Resource"]
    return [resource] if isinstance(resource, str) else list(resource)


def test_the_documented_files_are_the_generated_ones() -> None:
    assert json.loads((DOCS / "trainmover-aws-policy.json").read_text()) == aws_job_policy(AWS_EXAMPLE)
    assert json.loads((DOCS / "trainmover-azure-role.json").read_text()) == azure_job_role()


def test_every_instance_mutation_is_scoped_to_this_jobs_tag_value() -> None:
    job = AWS_EXAMPLE.job_id
    for sid, st in statements().items():
        assert st["Effect"] == "Allow" and "*" not in "".join(actions(st)), sid
        if actions(st) <= READS:
            continue
        ec2_instances = [r for r in resources(st) if ":instance/" in r or ":volume/" in r]
        if not ec2_instances:
            continue
        equals = st["Condition"]["StringEquals"]
        # On create the request must carry the job's tag; afterwards the resource must already have it.
        assert equals.get(f"aws:RequestTag/{JOB_TAG}") == job or equals.get(f"aws:ResourceTag/{JOB_TAG}") == job, sid
        assert "Null" not in st["Condition"], f"{sid}: any value of the tag is not enough"

    park = statements()["ParkWakeReleaseOnlyThisJobsInstances"]
    assert actions(park) == {"ec2:StartInstances", "ec2:StopInstances", "ec2:TerminateInstances"}
    retag = statements()["RetagOnlyTheRoleOfThisJobsInstances"]["Condition"]
    assert retag["ForAllValues:StringEquals"] == {"aws:TagKeys": [ROLE_TAG]}, "an instance never changes job"


def test_launches_are_limited_to_images_types_regions_and_imdsv2() -> None:
    scope = AwsJobScope(
        "job-x", ("us-east-1", "eu-west-1"), ("ami-0123456789abcdef0",), ("p5.48xlarge", "p4d.24xlarge")
    )
    sts = statements(scope)
    instance = sts["LaunchOnlyThisJobsInstancesOfTheseTypesWithImdsV2"]["Condition"]["StringEquals"]
    assert instance["ec2:InstanceType"] == ["p5.48xlarge", "p4d.24xlarge"]
    assert instance["ec2:MetadataHttpTokens"] == "required"
    assert resources(sts["LaunchOnlyTheseImages"]) == [
        "arn:aws:ec2:us-east-1::image/ami-0123456789abcdef0",
        "arn:aws:ec2:eu-west-1::image/ami-0123456789abcdef0",
    ]
    assert sts["ReadFleetAndPricesInTheseRegions"]["Condition"] == {
        "StringEquals": {"aws:RequestedRegion": ["us-east-1", "eu-west-1"]}
    }
    in_regions = {"aws:RequestedRegion": ["us-east-1", "eu-west-1"]}
    for sid, st in sts.items():
        for arn in (a for a in resources(st) if a != "*"):
            # An ARN open to any region (one for several, to fit IAM's size limit) comes with the region condition.
            region = arn.split(":")[3]
            region_open = region == "*" and st.get("Condition", {}).get("StringEquals", {}) == in_regions
            assert region_open or region in ("us-east-1", "eu-west-1"), f"{sid}: {arn} in another region"


def test_the_jobs_network_is_created_tagged_changed_and_deleted_only_as_this_jobs() -> None:
    job_tag = {f"aws:RequestTag/{JOB_TAG}": AWS_EXAMPLE.job_id}
    sts = statements()
    assert set(sts["ReadFleetAndPricesInTheseRegions"]["Action"]) == READS
    assert sts["CreateOnlyThisJobsSecurityGroup"]["Condition"] == {"StringEquals": job_tag}
    assert sts["CreateOnlyThisJobsClusterPlacementGroup"]["Condition"] == {
        "StringEquals": {**job_tag, "ec2:PlacementGroupStrategy": "cluster"}
    }
    assert sts["TagTheJobsNetworkOnlyAtCreation"]["Condition"] == {
        "StringEquals": {"ec2:CreateAction": ["CreateSecurityGroup", "CreatePlacementGroup"], **job_tag}
    }
    change = sts["RuleAndDeleteOnlyThisJobsNetwork"]
    assert change["Condition"] == {"StringEquals": {f"aws:ResourceTag/{JOB_TAG}": AWS_EXAMPLE.job_id}}
    assert all(":security-group/" in r or ":placement-group/" in r for r in resources(change))
    # The only network grant without the job's tag: the VPC side of CreateSecurityGroup (a VPC is not the job's).
    untagged = {sid for sid, st in sts.items() if actions(st) & NETWORK_MUTATIONS and "Condition" not in st}
    assert untagged == {"CreateSecurityGroupsInTheVpcs"}
    assert all(":vpc/" in r for r in resources(sts["CreateSecurityGroupsInTheVpcs"]))
    assert {a for st in sts.values() for a in actions(st)} >= NETWORK_MUTATIONS


def test_pass_role_only_for_the_node_role_and_kms_only_through_ec2() -> None:
    sts = statements()
    pass_role = [st for st in sts.values() if "iam:PassRole" in actions(st)]
    assert pass_role == [sts["PassOnlyTheNodeRoleAndOnlyToEc2"]]
    assert resources(pass_role[0]) == [AWS_EXAMPLE.node_role_arn]
    assert pass_role[0]["Condition"] == {"StringEquals": {"iam:PassedToService": "ec2.amazonaws.com"}}

    grant = sts["GrantTheVolumeKeysOnlyToEc2"]
    assert actions(grant) == {"kms:CreateGrant"} and resources(grant) == list(AWS_EXAMPLE.kms_key_arns)
    assert grant["Condition"]["Bool"] == {"kms:GrantIsForAWSResource": "true"}
    assert grant["Condition"]["StringEquals"] == {"kms:ViaService": ["ec2.us-east-1.amazonaws.com"]}
    assert sts["UseTheVolumeKeysOnlyThroughEc2"]["Condition"] == {"StringEquals": grant["Condition"]["StringEquals"]}

    bare = statements(AwsJobScope("job-x", ("us-east-1",), ("ami-0123456789abcdef0",), ("g5.xlarge",)))
    assert not [a for st in bare.values() for a in actions(st) if a.startswith(("iam:", "kms:"))]


def test_the_notice_queue_policy_can_be_set_only_on_this_jobs_queue() -> None:
    queue, rules = notice_resource_names(AWS_EXAMPLE.job_id)
    queue_arn = f"arn:aws:sqs:us-east-1:123456789012:{queue}"
    sts = statements()
    set_attributes = [st for st in sts.values() if "sqs:SetQueueAttributes" in actions(st)]
    assert len(set_attributes) == 1 and resources(set_attributes[0]) == [queue_arn]
    assert resources(sts["ReadThisJobsNoticeQueue"]) == [queue_arn]
    rule_arns = [f"arn:aws:events:us-east-1:123456789012:rule/{name}" for name in rules.values()]
    assert resources(sts["WireOnlyThisJobsNoticeRules"]) == rule_arns
    assert sts["TargetOnlyThisJobsNoticeQueue"]["Condition"] == {"ArnEquals": {"events:TargetArn": [queue_arn]}}

    no_wiring = AwsJobScope("job-x", ("us-east-1",), ("ami-0123456789abcdef0",), ("g5.xlarge",), notice_wiring=False)
    assert not [st for st in statements(no_wiring).values() if "sqs:SetQueueAttributes" in actions(st)]


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"job_id": "llm-*"}, "invalid job id"),
        ({"regions": ()}, "at least one of regions"),
        ({"regions": ("us-east-1*",)}, "regions: 'us-east-1*' not valid"),
        ({"images": ("ami-*",)}, "images: 'ami-*' not valid"),
        ({"instance_types": ("p5.*",)}, "instance_types: 'p5.*' not valid"),
        ({"account_id": "1234"}, "not 12 digits"),
        ({"node_role_arn": "arn:aws:iam::123456789012:role/*"}, "not an IAM role ARN"),
        ({"kms_key_arns": ("alias/ebs",)}, "not a key ARN"),
        ({"artifact_bucket": "Team_Artifacts"}, "invalid S3 bucket name"),
        ({"artifact_bucket": "team-artifacts", "artifact_prefix": "jobs/*"}, "invalid S3 key prefix"),
    ],
)
def test_a_scope_with_wildcards_or_typos_is_refused(change: dict[str, Any], says: str) -> None:
    fields = {
        "job_id": "llm-7b",
        "regions": ("us-east-1",),
        "images": ("ami-0123456789abcdef0",),
        "instance_types": ("p5.48xlarge",),
        **change,
    }
    with pytest.raises(InvalidRequestError, match=says.replace("*", r"\*")):
        AwsJobScope(**fields)


def test_the_azure_role_is_assignable_on_one_resource_group_only() -> None:
    role = azure_job_role("00000000-0000-0000-0000-00000000cafe", "rg-trainmover")
    assert role["AssignableScopes"] == [
        "/subscriptions/00000000-0000-0000-0000-00000000cafe/resourceGroups/rg-trainmover"
    ]
    assert "dedicated to TrainMover" in role["Description"]
    with pytest.raises(InvalidRequestError, match="not a GUID"):
        azure_job_role("sub", "rg")
    with pytest.raises(InvalidRequestError, match="not a valid name"):
        azure_job_role("00000000-0000-0000-0000-00000000cafe", "rg/*")


def test_the_orchestrator_may_keep_only_its_own_jobs_secret_parameter() -> None:
    st = statements(AWS_EXAMPLE)["KeepOnlyThisJobsSecretParameter"]
    assert actions(st) == {"ssm:PutParameter", "ssm:AddTagsToResource", "ssm:DeleteParameter"}
    assert resources(st) == ["arn:aws:ssm:us-east-1:123456789012:parameter/trainmover/llm-7b/*"]


def test_the_orchestrator_may_stage_list_and_delete_only_its_own_jobs_files_in_the_artifact_bucket() -> None:
    # The flows stage the job's wheel and script under PREFIX/JOB/ (flows.hosts.S3Staging); the hosts fetch them over
    # URLs the orchestrator signed, so its GetObject is theirs and the instances need no S3 permission.
    staged = dataclasses.replace(AWS_EXAMPLE, artifact_bucket="team-artifacts", artifact_prefix="ml/jobs")
    sts = statements(staged)
    s3 = {sid: st for sid, st in sts.items() if any(a.startswith("s3:") for a in actions(st))}
    assert s3 == {
        "StageOnlyThisJobsFiles": {
            "Sid": "StageOnlyThisJobsFiles", "Effect": "Allow",
            "Action": ["s3:PutObject", "s3:GetObject", "s3:DeleteObject"],
            "Resource": ["arn:aws:s3:::team-artifacts/ml/jobs/llm-7b/*"],
        },
        "ListOnlyThisJobsStagedFiles": {
            "Sid": "ListOnlyThisJobsStagedFiles", "Effect": "Allow", "Action": "s3:ListBucket",
            "Resource": ["arn:aws:s3:::team-artifacts"],
            "Condition": {"StringLike": {"s3:prefix": "ml/jobs/llm-7b/*"}},
        },
    }
    assert {sid: st for sid, st in sts.items() if sid not in s3} == statements(AWS_EXAMPLE), "nothing else changes"
    # IAM's `*` matches like fnmatch's: this job's files, never those of job "llm-7b-2" (the same first characters).
    (granted,) = resources(s3["StageOnlyThisJobsFiles"])
    assert fnmatch.fnmatchcase("arn:aws:s3:::team-artifacts/ml/jobs/llm-7b/trainmover-0.1.0-py3-none-any.whl", granted)
    assert not fnmatch.fnmatchcase("arn:aws:s3:::team-artifacts/ml/jobs/llm-7b-2/train.py", granted)
    # Without a bucket nothing of S3 is granted; in China and GovCloud the ARN's partition follows the regions.
    assert not [a for st in statements().values() for a in actions(st) if a.startswith("s3:")]
    china = AwsJobScope("job-x", ("cn-north-1",), ("ami-0123456789abcdef0",), ("g5.xlarge",),
                        artifact_bucket="team-artifacts")
    assert resources(statements(china)["StageOnlyThisJobsFiles"]) == [
        "arn:aws-cn:s3:::team-artifacts/trainmover-jobs/job-x/*"]
