"""Least privilege for one job on AWS: the IAM policy its credentials need, as data.

`trainmover cloud policy` prints it; docs/iam/trainmover-aws-policy.json holds one example, and a test keeps that
file equal to what `aws_job_policy` returns (so the documented policy is the generated one, never a hand-edited
copy). The Azure custom role is `cloud.azure.iam.azure_job_role`.

Every mutation is scoped to the job's own `trainmover:job` tag value (`aws:RequestTag` on create,
`aws:ResourceTag` afterwards), to the given regions, images and instance types, and to launches that require
IMDSv2; so are its own security group and (cluster) placement group. `iam:PassRole` is granted for the node role
alone and only to EC2; the KMS grants that CMK-encrypted EBS volumes need are limited to use through EC2; the
notice queue and rules are the job's own by name; with an artifact bucket, S3 objects only under the job's own
prefix (`PREFIX/JOB/`, where the flows stage its wheel and script: flows.hosts.S3Staging).

Pure functions of typed inputs: nothing here calls a cloud or imports an SDK.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cloud.artifacts import S3_PREFIX, s3_key, validate_s3_location
from cloud.aws.notices import notice_resource_names  # no SDK import: boto3 is loaded lazily
from cloud.base import JOB_TAG, ROLE_TAG, InvalidRequestError, Role, validate_job_id
from cloud.secret_store import AWS_REGION

# The IAM actions the AWS provider's calls need, by what uses them (a test checks them against the calls made).
EC2_READS = (
    "ec2:DescribeInstances",
    "ec2:DescribeInstanceStatus",
    "ec2:DescribeInstanceTypes",
    "ec2:DescribeSpotPriceHistory",
)
EC2_INSTANCE_MUTATIONS = ("ec2:StartInstances", "ec2:StopInstances", "ec2:TerminateInstances")
# The job's own security group and placement group (cloud.aws.network): found by tag, created once, deleted on release.
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
# The job's staged files (cloud.artifacts.stage_s3, presign_s3, delete_s3): GetObject is what a presigned URL the
# orchestrator signs is checked against, so the instances need no S3 permission of their own.
S3_STAGED_OBJECTS = ("s3:PutObject", "s3:GetObject", "s3:DeleteObject")
S3_STAGED_LISTING = "s3:ListBucket"
ROLES: tuple[Role, ...] = ("worker", "standby")

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
    artifact_bucket: str | None = None  # where the flows stage the job's wheel and script (TrainingRun's same field)
    artifact_prefix: str = S3_PREFIX  # the key prefix there; the job's files are under PREFIX/JOB/

    def __post_init__(self) -> None:
        validate_job_id(self.job_id, provider="aws")
        if self.artifact_bucket is not None:
            validate_s3_location(self.artifact_bucket, self.artifact_prefix)
        _need("regions", self.regions, AWS_REGION, "an AWS region such as us-east-1")
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


class _JobPolicy:
    """The statements of one job's policy, by what they allow, and the ARNs they name (in each of the scope's
    regions)."""

    def __init__(self, scope: AwsJobScope) -> None:
        self.scope = scope
        self.job, self.account = scope.job_id, scope.account_id
        queue_name, rule_names = notice_resource_names(self.job)
        self.queue_arns = self.arns("sqs", queue_name)
        self.rule_arns = [arn for name in rule_names.values() for arn in self.regional("events", f"rule/{name}")]
        self.instances, self.volumes = self.arns("ec2", "instance/*"), self.arns("ec2", "volume/*")
        self.security_groups = self.arns("ec2", "security-group/*")
        self.placement_groups = self.arns("ec2", "placement-group/*")
        self.this_job = {f"aws:ResourceTag/{JOB_TAG}": self.job}
        self.tagged_for_this_job = {f"aws:RequestTag/{JOB_TAG}": self.job}

    def arns(self, service: str, resource: str, *, account_part: str | None = None) -> list[str]:
        acct = self.account if account_part is None else account_part
        return [f"arn:{_partition(r)}:{service}:{r}:{acct}:{resource}" for r in self.scope.regions]

    def regional(self, service: str, resource: str) -> list[str]:
        """The resource's ARN in each region; with several regions one ARN for any region, the statement then naming
        them in `in_regions` (IAM's 6,144-character limit on a managed policy leaves no room for a copy each)."""
        if len(self.scope.regions) == 1:
            return self.arns(service, resource)
        return [f"arn:{_partition(self.scope.regions[0])}:{service}:*:{self.account}:{resource}"]

    def in_regions(self, condition: dict[str, Any] | None = None) -> dict[str, Any]:
        """`condition`, with the requested region limited to the scope's when `regional` left it open."""
        condition = dict(condition or {})
        if len(self.scope.regions) > 1:
            condition["StringEquals"] = {"aws:RequestedRegion": list(self.scope.regions)}
        return {"Condition": condition} if condition else {}

    def launch(self) -> list[dict[str, Any]]:
        """Read the fleet; launch only this job's instances and volumes, of its types and images."""
        scope, job, instances, volumes = self.scope, self.job, self.instances, self.volumes
        return [
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
                "Resource": [
                    arn for image in scope.images for arn in self.arns("ec2", f"image/{image}", account_part="")
                ],
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
                    for arn in self.regional("ec2", resource)
                ],
                **self.in_regions(),
            },
        ]

    def instance_mutations(self) -> list[dict[str, Any]]:
        """Tag at launch, retag the role, park, wake, release: this job's instances only."""
        job, instances, volumes, this_job = self.job, self.instances, self.volumes, self.this_job
        return [
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
        ]

    def job_network(self) -> list[dict[str, Any]]:
        """Create, rule and delete only this job's security group and cluster placement group."""
        security_groups, placement_groups = self.security_groups, self.placement_groups
        this_job, tagged_for_this_job = self.this_job, self.tagged_for_this_job
        return [
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
                "Resource": self.arns("ec2", "vpc/*"),
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

    def role_and_keys(self) -> list[dict[str, Any]]:
        """Pass only the node role, only to EC2; use the volume keys only through EC2 (each if the scope names it)."""
        scope = self.scope
        statements: list[dict[str, Any]] = []
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
        return statements

    def secret_and_notices(self) -> list[dict[str, Any]]:
        """Keep this job's secret parameter; read (with `notice_wiring`, also wire) its notice queue and rules."""
        scope, job, queue_arns, rule_arns = self.scope, self.job, self.queue_arns, self.rule_arns
        statements: list[dict[str, Any]] = []
        statements.append(
            {
                # The flows store the job's secret for its hosts (cloud.secrets.AwsParameterStore, a SecureString) and
                # delete it at the release: this job's parameter path only.
                "Sid": "KeepOnlyThisJobsSecretParameter",
                "Effect": "Allow",
                "Action": ["ssm:PutParameter", "ssm:AddTagsToResource", "ssm:DeleteParameter"],
                "Resource": self.arns("ssm", f"parameter/trainmover/{job}/*"),
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
                    **self.in_regions(),
                },
                {
                    "Sid": "TargetOnlyThisJobsNoticeQueue",
                    "Effect": "Allow",
                    "Action": "events:PutTargets",
                    "Resource": rule_arns,
                    **self.in_regions({"ArnEquals": {"events:TargetArn": queue_arns}}),
                },
            ]
        return statements


    def staging(self) -> list[dict[str, Any]]:
        """With an artifact bucket: put, sign and delete only this job's staged files, list only their prefix."""
        bucket = self.scope.artifact_bucket
        if bucket is None:
            return []
        partitions = sorted({_partition(r) for r in self.scope.regions})
        job_prefix = s3_key(self.scope.artifact_prefix, self.job, "") + "/"
        return [
            {
                "Sid": "StageOnlyThisJobsFiles",
                "Effect": "Allow",
                "Action": list(S3_STAGED_OBJECTS),
                "Resource": [f"arn:{p}:s3:::{bucket}/{job_prefix}*" for p in partitions],
            },
            {
                # ListBucket is a bucket's permission: only with a prefix inside the job's own.
                "Sid": "ListOnlyThisJobsStagedFiles",
                "Effect": "Allow",
                "Action": S3_STAGED_LISTING,
                "Resource": [f"arn:{p}:s3:::{bucket}" for p in partitions],
                "Condition": {"StringLike": {"s3:prefix": f"{job_prefix}*"}},
            },
        ]


def aws_job_policy(scope: AwsJobScope) -> dict[str, Any]:
    """The IAM policy document (a dict, ready for json.dumps) that lets one job's credentials do exactly what
    `AwsProvider`, `ensure_notice_queue` and (with `artifact_bucket`) the flows' staging do for that job, and nothing
    to any other job."""
    policy = _JobPolicy(scope)
    statements = [
        *policy.launch(),
        *policy.instance_mutations(),
        *policy.job_network(),
        *policy.role_and_keys(),
        *policy.secret_and_notices(),
        *policy.staging(),
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


__all__ = ["AWS_EXAMPLE", "AwsJobScope", "aws_job_policy"]
