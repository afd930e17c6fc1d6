"""`cloud check` asks IAM's policy simulator about every permission of the job's policy (cloud.aws.simulation): boto3
against moto's server over HTTP, with `IamSimulator` answering SimulatePrincipalPolicy (moto lacks it) by evaluating
the principal's policy document."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest

from cloud.aws import AwsProvider
from cloud.aws.iam import AWS_EXAMPLE, AwsJobScope, aws_job_policy
from cloud.aws.simulation import PLACEHOLDER, SIMULATE, principal_of, questions
from cloud.base import CheckResult
from tests.cloud.aws_servers import FaultProxy, IamSimulator, fault_proxy
from tests.cloud.test_aws import AMI, FAST_DESCRIBE, REGION, dummy_session

JOB = "llm-7b"
NODE_ROLE = f"arn:aws:iam::{IamSimulator.ACCOUNT}:role/trainmover-node"
BUCKET = "trainmover-artifacts"
SCOPE = AwsJobScope(JOB, (REGION,), (AMI,), ("g5.xlarge",), account_id=IamSimulator.ACCOUNT,
                    node_role_arn=NODE_ROLE, artifact_bucket=BUCKET)
EXACT = {"credentials", "ec2:RunInstances", "ec2:StartInstances", "ec2:StopInstances", "ec2:TerminateInstances",
         "ec2:CreateTags", "ec2:DescribeInstances", "ec2:DescribeInstanceStatus", "ec2:DescribeInstanceTypes",
         "ec2:DescribeSpotPriceHistory"}
"""The rows the dry runs and reads check exactly; every other row is the simulator's."""


# ------------------------------------------------------------------------------------------------ in process


def test_the_principal_is_the_callers_user_or_role() -> None:
    assert principal_of("arn:aws:iam::123456789012:user/ops/alice") == "arn:aws:iam::123456789012:user/ops/alice"
    assert principal_of("arn:aws:sts::123456789012:assumed-role/trainmover-ci/gh-1234") == \
        "arn:aws:iam::123456789012:role/trainmover-ci"
    assert principal_of("arn:aws-cn:sts::123456789012:assumed-role/r/s") == "arn:aws-cn:iam::123456789012:role/r"
    for unsimulatable in ("arn:aws:iam::123456789012:root", "arn:aws:sts::123456789012:federated-user/bob", ""):
        assert principal_of(unsimulatable) is None


def test_each_statement_is_asked_with_the_context_its_conditions_name() -> None:
    asked = {q.sid: q for q in questions(aws_job_policy(AWS_EXAMPLE))}

    retag = asked["RetagOnlyTheRoleOfThisJobsInstances"]
    assert retag.actions == ("ec2:CreateTags",)
    assert retag.resources == (f"arn:aws:ec2:us-east-1:123456789012:instance/{PLACEHOLDER}",)
    assert dict((k, (v, t)) for k, v, t in retag.context) == {
        "aws:RequestTag/trainmover:role": (("worker",), "string"),
        "aws:ResourceTag/trainmover:job": (("llm-7b",), "string"),
        "aws:TagKeys": (("trainmover:role",), "stringList"),
    }
    grant = asked["GrantTheVolumeKeysOnlyToEc2"]
    assert ("kms:GrantIsForAWSResource", ("true",), "boolean") in grant.context
    request = asked["PassOnlyTheNodeRoleAndOnlyToEc2"].request("arn:aws:iam::123456789012:role/ops")
    assert request == {
        "PolicySourceArn": "arn:aws:iam::123456789012:role/ops",
        "ActionNames": ["iam:PassRole"],
        "ResourceArns": ["arn:aws:iam::123456789012:role/trainmover-node"],
        "ContextEntries": [{"ContextKeyName": "iam:PassedToService", "ContextKeyValues": ["ec2.amazonaws.com"],
                            "ContextKeyType": "string"}],
    }


# ------------------------------------------------------------------------------------------------ against moto


@pytest.fixture(scope="module")
def module_proxy(moto_url: str) -> Iterator[FaultProxy]:
    with fault_proxy(moto_url) as proxy:
        yield proxy


@pytest.fixture
def simulator(module_proxy: FaultProxy) -> Iterator[IamSimulator]:
    module_proxy.reset()
    simulator = IamSimulator()
    simulator.install(module_proxy)
    yield simulator
    module_proxy.reset()


def _check(proxy: FaultProxy) -> dict[str, CheckResult]:
    provider = AwsProvider(REGION, session=dummy_session(), endpoint_url=proxy.url, image=AMI,
                           describe_budget=FAST_DESCRIBE)
    results = provider.check("g5.xlarge", job_id=JOB, node_role_arn=NODE_ROLE, artifact_bucket=BUCKET)
    return {r.name: r for r in results}


def _simulated(results: dict[str, CheckResult]) -> dict[str, CheckResult]:
    return {name.removesuffix(" (simulated)"): r for name, r in results.items() if name not in EXACT}


def _granted(policy: dict[str, Any]) -> set[str]:
    actions = (st["Action"] for st in policy["Statement"])
    return {a for each in actions for a in ([each] if isinstance(each, str) else each)}


def _without(policy: dict[str, Any], sid: str) -> dict[str, Any]:
    kept = copy.deepcopy(policy)
    kept["Statement"] = [st for st in kept["Statement"] if st["Sid"] != sid]
    return kept


def test_a_caller_with_exactly_the_job_policy_passes_every_simulated_permission(
    simulator: IamSimulator, module_proxy: FaultProxy
) -> None:
    simulator.policy = aws_job_policy(SCOPE)

    simulated = _simulated(_check(module_proxy))

    assert {n for n, r in simulated.items() if not r.ok} == set()
    assert set(simulated) == _granted(simulator.policy)
    assert {"iam:PassRole", "s3:PutObject", "ec2:CreatePlacementGroup", "events:PutTargets"} <= set(simulated)
    assert {r["principal"] for r in simulator.requests} == {
        f"arn:aws:iam::{IamSimulator.ACCOUNT}:role/trainmover-orchestrator"}
    assert not any(s.action in {"CreateSecurityGroup", "PutParameter", "CreateQueue"} for s in module_proxy.seen())


def test_a_missing_statement_fails_its_actions_only_and_names_it(
    simulator: IamSimulator, module_proxy: FaultProxy
) -> None:
    simulator.policy = _without(aws_job_policy(SCOPE), "KeepOnlyThisJobsSecretParameter")

    results = _check(module_proxy)

    failed = {n for n, r in results.items() if not r.ok}
    assert failed == {"ssm:PutParameter", "ssm:AddTagsToResource", "ssm:DeleteParameter"}
    detail = results["ssm:PutParameter"].detail
    assert detail.startswith("implicitDeny on arn:aws:ssm:us-east-1:123456789012:parameter/trainmover/llm-7b/")
    assert "KeepOnlyThisJobsSecretParameter" in detail


def test_another_jobs_policy_fails_every_permission_scoped_to_this_jobs_tag(
    simulator: IamSimulator, module_proxy: FaultProxy
) -> None:
    other = AwsJobScope("llm-8b", (REGION,), (AMI,), ("g5.xlarge",), account_id=IamSimulator.ACCOUNT,
                        node_role_arn=NODE_ROLE, artifact_bucket=BUCKET)
    simulator.policy = aws_job_policy(other)

    simulated = _simulated(_check(module_proxy))

    for scoped in ("ec2:CreateSecurityGroup", "ec2:DeleteSecurityGroup", "ssm:PutParameter", "sqs:CreateQueue",
                   "s3:PutObject", "ec2:TerminateInstances"):
        assert not simulated[scoped].ok, scoped
    for shared in ("ec2:DescribeInstances", "ec2:DescribeSecurityGroups", "iam:PassRole"):
        assert simulated[shared].ok, shared


def test_an_explicit_deny_is_named_as_such(simulator: IamSimulator, module_proxy: FaultProxy) -> None:
    policy = aws_job_policy(SCOPE)
    policy["Statement"].append({"Effect": "Deny", "Action": "events:*", "Resource": "*"})
    simulator.policy = policy

    simulated = _simulated(_check(module_proxy))

    assert {n for n, r in simulated.items() if not r.ok} == {
        "events:PutRule", "events:TagResource", "events:RemoveTargets", "events:DeleteRule", "events:PutTargets"}
    assert simulated["events:PutRule"].detail.startswith("explicitDeny on arn:aws:events:us-east-1:")


def test_paged_answers_are_read_to_the_end(module_proxy: FaultProxy) -> None:
    module_proxy.reset()
    paged = IamSimulator(page_size=1)
    paged.install(module_proxy)
    paged.policy = _without(aws_job_policy(SCOPE), "WireOnlyThisJobsNoticeQueue")
    try:
        simulated = _simulated(_check(module_proxy))
    finally:
        module_proxy.reset()

    assert {n for n, r in simulated.items() if not r.ok} == {
        "sqs:CreateQueue", "sqs:TagQueue", "sqs:SetQueueAttributes", "sqs:GetQueueUrl", "sqs:DeleteQueue"}
    assert set(simulated) == _granted(aws_job_policy(SCOPE))  # every action, past every page


def test_a_caller_that_may_not_simulate_gets_one_row_that_says_what_to_grant(
    simulator: IamSimulator, module_proxy: FaultProxy
) -> None:
    module_proxy.fail("SimulatePrincipalPolicy", "AccessDenied", status=403)

    results = _check(module_proxy)

    assert {n for n, r in results.items() if not r.ok} == {SIMULATE}
    detail = results[SIMULATE].detail
    assert "role/trainmover-orchestrator may not call iam:SimulatePrincipalPolicy" in detail
    assert "allow iam:SimulatePrincipalPolicy on the principal's own ARN" in detail
    assert set(results) == EXACT | {SIMULATE}


def test_an_endpoint_without_the_simulator_is_not_verified_not_passed(moto_url: str) -> None:
    provider = AwsProvider(REGION, session=dummy_session(), endpoint_url=moto_url, image=AMI,
                           describe_budget=FAST_DESCRIBE)

    results = {r.name: r for r in provider.check()}

    # moto names its caller arn:aws:sts::ACCOUNT:user/moto, which AWS never returns: no IAM principal in it.
    assert not results[SIMULATE].ok and results[SIMULATE].detail.startswith("not verified: arn:aws:sts::")
    assert all(r.ok for n, r in results.items() if n != SIMULATE)
