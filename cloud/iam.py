"""Least privilege for one job: the AWS IAM policy and the Azure custom role its credentials need, as data.

`trainmover cloud policy` prints them; docs/iam/ holds one example of each, and a test keeps those files equal to
what these functions return (so the documented policy is the generated one, never a hand-edited copy).

AWS (`aws_job_policy`): every mutation is scoped to the job's own `trainmover:job` tag value (`aws:RequestTag` on
create, `aws:ResourceTag` afterwards), to the given regions, images and instance types, and to launches that
require IMDSv2; so are its own security group and (cluster) placement group. `iam:PassRole` is granted for the
node role alone and only to EC2; the KMS grants that CMK-encrypted EBS volumes need are limited to use through EC2;
the notice queue and rules are the job's own by name. Azure (`azure_job_role`): RBAC cannot condition VM writes on
tags, so the boundary is the resource group the role is assigned on, which must hold nothing but TrainMover's VMs
(docs/cloud-azure.md says why).

Pure functions of typed inputs: nothing here calls a cloud or imports an SDK.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cloud.base import JOB_TAG, ROLE_TAG, InvalidRequestError, Role, validate_job_id

# The IAM actions the AWS provider's calls need, by what uses them (a test checks them against the calls made).
EC2_READS = (
    "ec2:DescribeInstances",
    "ec2:DescribeInstanceStatus",
    "ec2:DescribeInstanceTypes",
    "ec2:DescribeSpotPriceHistory",
)
EC2_INSTANCE_MUTATIONS = ("ec2:StartInstances", "ec2:StopInstances", "ec2:TerminateInstances")
# The job's own security group and placement group (cloud.aws_network): found by tag, created once, deleted on release.
EC2_JOB_NETWORK_READS = ("ec2:DescribeSecurityGroups", "ec2:DescribePlacementGroups", "ec2:DescribeSubnets")
EC2_JOB_NETWORK_MUTATIONS = (
    "ec2:AuthorizeSecurityGroupIngress",
    "ec2:DeleteSecurityGroup",
    "ec2:DeletePlacementGroup",
)
# https://docs.aws.amazon.com/ebs/latest/userguide/ebs-encryption-requirements.html#ebs-encryption-permissions
KMS_FOR_EBS_VOLUMES = (
    "kms:Decrypt",
    "kms:DescribeKey",
    "kms:GenerateDataKeyWithoutPlaintext",
    "kms:ReEncryptFrom",
    "kms:ReEncryptTo",
)
NOTICE_QUEUE_READS = ("sqs:ReceiveMessage", "sqs:DeleteMessage", "sqs:GetQueueAttributes")
NOTICE_QUEUE_WIRING = (
    "sqs:CreateQueue",
    "sqs:TagQueue",
    "sqs:SetQueueAttributes",
    "sqs:GetQueueUrl",
    "sqs:DeleteQueue",
)
NOTICE_RULE_WIRING = ("events:PutRule", "events:TagResource", "events:RemoveTargets", "events:DeleteRule")
ROLES: tuple[Role, ...] = ("worker", "standby")

_REGION = re.compile(r"[a-z]{2}(?:-[a-z]+)+-\d{1,2}")
_AMI = re.compile(r"ami-(?:[0-9a-f]{8}|[0-9a-f]{17})")
_INSTANCE_TYPE = re.compile(r"[a-z][a-z0-9-]*\.[a-z0-9-]+")
_ACCOUNT = re.compile(r"\d{12}")
_ROLE_ARN = re.compile(r"arn:aws(?:-cn|-us-gov)?:iam::\d{12}:role/[\w+=,.@/-]{1,512}")
_KEY_ARN = re.compile(r"arn:aws(?:-cn|-us-gov)?:kms:[a-z0-9-]+:\d{12}:key/[A-Za-z0-9-]{1,128}")


@dataclass(frozen=True, slots=True)
class AwsJobScope:
    """What one job's AWS credentials may touch; validated when built."""

    job_id: str
    regions: tuple[str, ...]
    images: tuple[str, ...]  # AMI ids the job may launch
    instance_types: tuple[str, ...]
    account_id: str = "*"  # the 12-digit account; "*" leaves ARNs' account open
    node_role_arn: str | None = None  # the instances' role (in their instance profile): the only role it may pass
    kms_key_arns: tuple[str, ...] = ()  # CMKs that encrypt the AMI's snapshots or the account's default EBS key
    notice_wiring: bool = True  # also let it create and delete its notice queue and rules (ensure_notice_queue)

    def __post_init__(self) -> None:
        validate_job_id(self.job_id, provider="aws")
        _need("regions", self.regions, _REGION, "an AWS region such as us-east-1")
        _need("images", self.images, _AMI, "an AMI id such as ami-0123456789abcdef0")
        _need("instance_types", self.instance_types, _INSTANCE_TYPE, "an instance type such as p5.48xlarge")
        if self.account_id != "*" and not _ACCOUNT.fullmatch(self.account_id):
            raise InvalidRequestError(f"aws: account id {self.account_id!r} is not 12 digits", provider="aws")
        if self.node_role_arn is not None and not _ROLE_ARN.fullmatch(self.node_role_arn):
            raise InvalidRequestError(
                f"aws: node role {self.node_role_arn!r} is not an IAM role ARN (arn:aws:iam::<account>:role/<name>)",
                provider="aws",
            )
        for key in self.kms_key_arns:
            if not _KEY_ARN.fullmatch(key):
                raise InvalidRequestError(
                    f"aws: KMS key {key!r} is not a key ARN (arn:aws:kms:<region>:<account>:key/<key-id>; aliases "
                    "cannot scope a policy)",
                    provider="aws",
                )


def _need(label: str, values: Sequence[str], pattern: re.Pattern[str], example: str) -> None:
    if isinstance(values, str) or not values:
        raise InvalidRequestError(f"aws: the policy needs at least one of {label} (each {example})", provider="aws")
    bad = [v for v in values if not pattern.fullmatch(v)]
    if bad:
        raise InvalidRequestError(
            f"aws: {label}: {', '.join(map(repr, bad))} not valid; each must be {example}", provider="aws"
        )


def _partition(region: str) -> str:
    if region.startswith("cn-"):
        return "aws-cn"
    if region.startswith("us-gov-"):
        return "aws-us-gov"
    return "aws"


def aws_job_policy(scope: AwsJobScope) -> dict[str, Any]:
    """The IAM policy document (a dict, ready for json.dumps) that lets one job's credentials do exactly what
    `AwsProvider` and `ensure_notice_queue` do for that job, and nothing to any other job."""
    from cloud.aws import notice_resource_names  # no SDK import: cloud.aws loads boto3 lazily

    job, account = scope.job_id, scope.account_id

    def arns(service: str, resource: str, *, account_part: str | None = None) -> list[str]:
        acct = account if account_part is None else account_part
        return [f"arn:{_partition(r)}:{service}:{r}:{acct}:{resource}" for r in scope.regions]

    def regional(service: str, resource: str) -> list[str]:
        """The resource's ARN in each region; with several regions one ARN for any region, the statement then naming
        them in `in_regions` (IAM's 6,144-character limit on a managed policy leaves no room for a copy each)."""
        if len(scope.regions) == 1:
            return arns(service, resource)
        return [f"arn:{_partition(scope.regions[0])}:{service}:*:{account}:{resource}"]

    def in_regions(condition: dict[str, Any] | None = None) -> dict[str, Any]:
        """`condition`, with the requested region limited to the scope's when `regional` left it open."""
        condition = dict(condition or {})
        if len(scope.regions) > 1:
            condition["StringEquals"] = {"aws:RequestedRegion": list(scope.regions)}
        return {"Condition": condition} if condition else {}

    queue_name, rule_names = notice_resource_names(job)
    queue_arns = arns("sqs", queue_name)
    rule_arns = [arn for name in rule_names.values() for arn in regional("events", f"rule/{name}")]
    instances, volumes = arns("ec2", "instance/*"), arns("ec2", "volume/*")
    security_groups, placement_groups = arns("ec2", "security-group/*"), arns("ec2", "placement-group/*")
    this_job = {f"aws:ResourceTag/{JOB_TAG}": job}
    tagged_for_this_job = {f"aws:RequestTag/{JOB_TAG}": job}

    statements: list[dict[str, Any]] = [
        {
            # EC2 describe calls have no resource-level permissions: a region is the only possible limit.
            "Sid": "ReadFleetAndPricesInTheseRegions",
            "Effect": "Allow",
            "Action": [*EC2_READS, *EC2_JOB_NETWORK_READS],
            "Resource": "*",
            "Condition": {"StringEquals": {"aws:RequestedRegion": list(scope.regions)}},
        },
        {
            "Sid": "LaunchOnlyThisJobsInstancesOfTheseTypesWithImdsV2",
            "Effect": "Allow",
            "Action": "ec2:RunInstances",
            "Resource": instances,
            "Condition": {
                "StringEquals": {
                    f"aws:RequestTag/{JOB_TAG}": job,
                    f"aws:RequestTag/{ROLE_TAG}": list(ROLES),
                    "ec2:InstanceType": list(scope.instance_types),
                    "ec2:MetadataHttpTokens": "required",
                }
            },
        },
        {
            "Sid": "LaunchOnlyThisJobsVolumes",
            "Effect": "Allow",
            "Action": "ec2:RunInstances",
            "Resource": volumes,
            "Condition": {"StringEquals": {f"aws:RequestTag/{JOB_TAG}": job}},
        },
        {
            "Sid": "LaunchOnlyTheseImages",
            "Effect": "Allow",
            "Action": "ec2:RunInstances",
            "Resource": [arn for image in scope.images for arn in arns("ec2", f"image/{image}", account_part="")],
        },
        {
            # Narrow these to your subnets, security groups and placement groups when you know their ids.
            "Sid": "LaunchIntoTheNetwork",
            "Effect": "Allow",
            "Action": "ec2:RunInstances",
            "Resource": [
                arn
                for resource in (
                    "subnet/*",
                    "network-interface/*",
                    "security-group/*",
                    "placement-group/*",
                    "capacity-reservation/*",
                    "spot-instances-request/*",
                )
                for arn in regional("ec2", resource)
            ],
            **in_regions(),
        },
        {
            "Sid": "TagOnlyAtLaunchWithThisJob",
            "Effect": "Allow",
            "Action": "ec2:CreateTags",
            "Resource": instances + volumes,
            "Condition": {"StringEquals": {"ec2:CreateAction": "RunInstances", f"aws:RequestTag/{JOB_TAG}": job}},
        },
        {
            # An instance of this job may change role; it can never be moved to (or from) another job.
            "Sid": "RetagOnlyTheRoleOfThisJobsInstances",
            "Effect": "Allow",
            "Action": "ec2:CreateTags",
            "Resource": instances,
            "Condition": {
                "StringEquals": {**this_job, f"aws:RequestTag/{ROLE_TAG}": list(ROLES)},
                "ForAllValues:StringEquals": {"aws:TagKeys": [ROLE_TAG]},
            },
        },
        {
            "Sid": "ParkWakeReleaseOnlyThisJobsInstances",
            "Effect": "Allow",
            "Action": list(EC2_INSTANCE_MUTATIONS),
            "Resource": instances,
            "Condition": {"StringEquals": this_job},
        },
        {
            "Sid": "CreateOnlyThisJobsSecurityGroup",
            "Effect": "Allow",
            "Action": "ec2:CreateSecurityGroup",
            "Resource": security_groups,
            "Condition": {"StringEquals": tagged_for_this_job},
        },
        {
            # CreateSecurityGroup also authorizes on the VPC it creates the group in: the job's network's VPC.
            "Sid": "CreateSecurityGroupsInTheVpcs",
            "Effect": "Allow",
            "Action": "ec2:CreateSecurityGroup",
            "Resource": arns("ec2", "vpc/*"),
        },
        {
            "Sid": "CreateOnlyThisJobsClusterPlacementGroup",
            "Effect": "Allow",
            "Action": "ec2:CreatePlacementGroup",
            "Resource": placement_groups,
            "Condition": {"StringEquals": {**tagged_for_this_job, "ec2:PlacementGroupStrategy": "cluster"}},
        },
        {
            "Sid": "TagTheJobsNetworkOnlyAtCreation",
            "Effect": "Allow",
            "Action": "ec2:CreateTags",
            "Resource": security_groups + placement_groups,
            "Condition": {
                "StringEquals": {
                    "ec2:CreateAction": ["CreateSecurityGroup", "CreatePlacementGroup"],
                    **tagged_for_this_job,
                }
            },
        },
        {
            "Sid": "RuleAndDeleteOnlyThisJobsNetwork",
            "Effect": "Allow",
            "Action": list(EC2_JOB_NETWORK_MUTATIONS),
            "Resource": security_groups + placement_groups,
            "Condition": {"StringEquals": this_job},
        },
    ]
    if scope.node_role_arn is not None:
        statements.append(
            {
                "Sid": "PassOnlyTheNodeRoleAndOnlyToEc2",
                "Effect": "Allow",
                "Action": "iam:PassRole",
                "Resource": scope.node_role_arn,
                "Condition": {"StringEquals": {"iam:PassedToService": "ec2.amazonaws.com"}},
            }
        )
    if scope.kms_key_arns:
        # EC2 uses the key on the caller's behalf when it creates, attaches or starts CMK-encrypted volumes.
        via_ec2 = {"kms:ViaService": [f"ec2.{r}.amazonaws.com" for r in scope.regions]}
        statements += [
            {
                "Sid": "UseTheVolumeKeysOnlyThroughEc2",
                "Effect": "Allow",
                "Action": list(KMS_FOR_EBS_VOLUMES),
                "Resource": list(scope.kms_key_arns),
                "Condition": {"StringEquals": via_ec2},
            },
            {
                "Sid": "GrantTheVolumeKeysOnlyToEc2",
                "Effect": "Allow",
                "Action": "kms:CreateGrant",
                "Resource": list(scope.kms_key_arns),
                "Condition": {"StringEquals": via_ec2, "Bool": {"kms:GrantIsForAWSResource": "true"}},
            },
        ]
    statements.append(
        {
            # The flows store the job's secret for its hosts (cloud.secrets.AwsParameterStore, a SecureString) and
            # delete it at the release: this job's parameter path only.
            "Sid": "KeepOnlyThisJobsSecretParameter",
            "Effect": "Allow",
            "Action": ["ssm:PutParameter", "ssm:AddTagsToResource", "ssm:DeleteParameter"],
            "Resource": arns("ssm", f"parameter/trainmover/{job}/*"),
        }
    )
    statements.append(
        {
            "Sid": "ReadThisJobsNoticeQueue",
            "Effect": "Allow",
            "Action": list(NOTICE_QUEUE_READS),
            "Resource": queue_arns,
        }
    )
    if scope.notice_wiring:
        statements += [
            {
                # SetQueueAttributes rewrites the queue policy (who may send notices): this job's queue only.
                "Sid": "WireOnlyThisJobsNoticeQueue",
                "Effect": "Allow",
                "Action": list(NOTICE_QUEUE_WIRING),
                "Resource": queue_arns,
            },
            {
                "Sid": "WireOnlyThisJobsNoticeRules",
                "Effect": "Allow",
                "Action": list(NOTICE_RULE_WIRING),
                "Resource": rule_arns,
                **in_regions(),
            },
            {
                "Sid": "TargetOnlyThisJobsNoticeQueue",
                "Effect": "Allow",
                "Action": "events:PutTargets",
                "Resource": rule_arns,
                **in_regions({"ArnEquals": {"events:TargetArn": queue_arns}}),
            },
        ]
    return {"Version": "2012-10-17", "Statement": statements}


# The example in docs/iam/trainmover-aws-policy.json (AWS's documentation account and key ids).
AWS_EXAMPLE = AwsJobScope(
    job_id="llm-7b",
    regions=("us-east-1",),
    images=("ami-0123456789abcdef0",),
    instance_types=("p5.48xlarge",),
    account_id="123456789012",
    node_role_arn="arn:aws:iam::123456789012:role/trainmover-node",
    kms_key_arns=("arn:aws:kms:us-east-1:123456789012:key/1234abcd-12ab-34cd-56ef-1234567890ab",),
)

# ------------------------------------------------------------------------------------------------------ Azure

AZURE_ROLE_NAME = "TrainMover VM operator"
_SUBSCRIPTION = re.compile(r"[0-9a-fA-F]{8}-(?:[0-9a-fA-F]{4}-){3}[0-9a-fA-F]{12}")
_RESOURCE_GROUP = re.compile(r"[-\w._()]{0,89}[-\w_()]")


def azure_job_role(
    subscription_id: str = "<subscription-id>", resource_group: str = "<resource-group>"
) -> dict[str, Any]:
    """The custom role (a dict for `az role definition create`) with exactly the actions `AzureProvider` performs,
    assignable only on `resource_group`: a group dedicated to TrainMover's VMs (see docs/cloud-azure.md)."""
    from cloud.azure import REQUIRED_ACTIONS  # no SDK import: cloud.azure loads the SDK lazily

    placeholder = (subscription_id, resource_group) == ("<subscription-id>", "<resource-group>")
    if not placeholder:
        if not _SUBSCRIPTION.fullmatch(subscription_id):
            raise InvalidRequestError(f"azure: subscription id {subscription_id!r} is not a GUID", provider="azure")
        if not _RESOURCE_GROUP.fullmatch(resource_group):
            raise InvalidRequestError(
                f"azure: resource group {resource_group!r} is not a valid name (1-90 letters, digits, '-', '_', "
                "'.', '(', ')', not ending with '.')",
                provider="azure",
            )
    return {
        "Name": AZURE_ROLE_NAME,
        "IsCustom": True,
        "Description": (
            "Least privilege for cloud.azure.AzureProvider: create, park (deallocate), start, read and delete VMs "
            "with VM-managed NICs and OS disks, each job's own NSG, application security group and proximity "
            "placement group, list VM sizes, and read the caller's own permissions (check). "
            "Assign it only on a resource group dedicated to TrainMover's VMs: Azure RBAC cannot limit these "
            "actions by tag, so the group is the boundary."
        ),
        "Actions": [*REQUIRED_ACTIONS, "Microsoft.Authorization/permissions/read"],
        "NotActions": [],
        "DataActions": [],
        "NotDataActions": [],
        "AssignableScopes": [f"/subscriptions/{subscription_id}/resourceGroups/{resource_group}"],
    }


__all__ = ["AWS_EXAMPLE", "AZURE_ROLE_NAME", "AwsJobScope", "aws_job_policy", "azure_job_role"]
