"""`cloud check` beyond the dry runs: IAM's policy simulator asked about every permission a job's launch and release
need (security and placement groups, SSM, SQS, EventBridge, PassRole, KMS, S3), as the job would ask for them.

EC2's dry runs check a handful of calls exactly; the rest of a job's calls have no dry run.
`iam:SimulatePrincipalPolicy` evaluates the caller's own policies (identity-based, with permission boundaries) for a
list of actions on given resources, in a given request context, and creates nothing. The questions are read off the
job's own least-privilege policy (`cloud.aws.iam.aws_job_policy`): each statement's actions on its resources (a
wildcard in a resource name replaced by a concrete placeholder) with the context keys its conditions name, set to the
values the job's calls carry (its tag, the region, the instance type, IMDSv2). So a caller whose policies allow exactly
that document passes; one that lacks a statement, or scopes it tighter than the job's calls, fails with the action and
the resource named.

Limits, said where they apply: the simulator does not evaluate an organization's service control policies, nor
resource-based policies unless given them; an assumed role is simulated as its role (the session policy is not seen);
the root user and federated users cannot be simulated.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cloud.aws.iam import AwsJobScope, aws_job_policy
from cloud.base import CheckResult, CloudError, PermissionDeniedError, RetryBudget

if TYPE_CHECKING:
    from cloud.aws.client import AwsApi

SIMULATE = "iam:SimulatePrincipalPolicy"
PLACEHOLDER = "trainmover-check"
"""What a wildcard in a resource name becomes: the simulator matches the caller's patterns against a concrete name."""

_ASSUMED_ROLE = re.compile(r"arn:(aws[\w-]*):sts::(\d{12}):assumed-role/([\w+=,.@-]+)/[^/]+")
_USER_OR_ROLE = re.compile(r"arn:aws[\w-]*:iam::\d{12}:(?:user|role)/[\w+=,.@/-]+")
_CONTEXT_TYPES = {"Bool": "boolean"}


@dataclass(frozen=True, slots=True)
class Question:
    """One simulation: these actions on these resources, in this request context."""

    sid: str
    actions: tuple[str, ...]
    resources: tuple[str, ...]
    context: tuple[tuple[str, tuple[str, ...], str], ...]
    """(context key, values, IAM's ContextKeyType)."""

    def request(self, principal_arn: str) -> dict[str, Any]:
        """The SimulatePrincipalPolicy parameters."""
        params: dict[str, Any] = {
            "PolicySourceArn": principal_arn,
            "ActionNames": list(self.actions),
            "ResourceArns": list(self.resources),
        }
        if self.context:
            params["ContextEntries"] = [
                {"ContextKeyName": key, "ContextKeyValues": list(values), "ContextKeyType": kind}
                for key, values, kind in self.context
            ]
        return params


def principal_of(caller_arn: str) -> str | None:
    """The IAM principal the simulator takes for STS's `get_caller_identity` ARN: a user or role as is, an assumed
    role's session as its role (the path, which the session ARN drops, assumed empty); None for what cannot be
    simulated (the root user, a federated user)."""
    assumed = _ASSUMED_ROLE.fullmatch(caller_arn)
    if assumed:
        partition, account, role = assumed.groups()
        return f"arn:{partition}:iam::{account}:role/{role}"
    if _USER_OR_ROLE.fullmatch(caller_arn):
        return caller_arn
    return None


def _concrete(resource: str) -> str:
    return resource if resource == "*" else resource.replace("*", PLACEHOLDER)


def _context(condition: Mapping[str, Mapping[str, Any]]) -> tuple[tuple[str, tuple[str, ...], str], ...]:
    """The context the job's calls carry for a statement's condition: each key it names, with the first value it
    allows (a list-valued key such as `aws:TagKeys` with every value)."""
    entries: dict[str, tuple[tuple[str, ...], str]] = {}
    for operator, keys in condition.items():
        for key, allowed in keys.items():
            values = [allowed] if isinstance(allowed, str) else list(allowed)
            if operator.startswith("ForAllValues:"):
                entries[key] = (tuple(values), "stringList")
            else:
                kind = _CONTEXT_TYPES.get(operator, "string")
                entries[key] = ((values[0],), kind)
    return tuple((key, values, kind) for key, (values, kind) in sorted(entries.items()))


def questions(policy: Mapping[str, Any]) -> list[Question]:
    """The simulations that ask a caller's policies about every statement of a job policy."""
    out = []
    for statement in policy["Statement"]:
        actions = statement["Action"]
        resources = statement.get("Resource", "*")
        condition = statement.get("Condition", {})
        out.append(
            Question(
                sid=statement.get("Sid", ""),
                actions=(actions,) if isinstance(actions, str) else tuple(actions),
                resources=tuple(_concrete(r) for r in ([resources] if isinstance(resources, str) else resources)),
                context=_context(condition),
            )
        )
    return out


def _verdicts(results: Iterable[Mapping[str, Any]], question: Question) -> dict[str, str | None]:
    """Action -> None when allowed on every resource, else why not (the first resource refused, the decision)."""
    verdicts: dict[str, str | None] = {}
    for result in results:
        action = str(result.get("EvalActionName", ""))
        refused = [
            (str(r.get("EvalResourceName", "*")), str(r.get("EvalResourceDecision", "")))
            for r in result.get("ResourceSpecificResults") or []
            if r.get("EvalResourceDecision") != "allowed"
        ]
        if not result.get("ResourceSpecificResults") and result.get("EvalDecision") != "allowed":
            refused = [(str(result.get("EvalResourceName", "*")), str(result.get("EvalDecision", "")))]
        if refused:
            resource, decision = refused[0]
            keys = ", ".join(key for key, _, _ in question.context)
            verdicts[action] = (
                f"{decision} on {resource}" + (f" with {keys} as the job sets them" if keys else "")
                + f" (the job policy's statement {question.sid})"
            )
        else:
            verdicts.setdefault(action, None)
    return verdicts


def simulate_job_permissions(
    api: AwsApi, caller_arn: str, scope: AwsJobScope, budget: RetryBudget
) -> list[CheckResult]:
    """One `CheckResult` per action of the job policy: allowed when the simulator allows it on every resource, in
    every context, that the job uses it with."""
    principal = principal_of(caller_arn)
    if principal is None:
        return [CheckResult(SIMULATE, False, f"not verified: {caller_arn} cannot be simulated (the root user or a "
                                             "federated user); run check as the IAM user or role the job will use")]
    outcome: dict[str, str | None] = {}
    """Action -> None while allowed everywhere asked, else its first refusal (in the policy's order)."""
    for question in questions(aws_job_policy(scope)):
        try:
            results = _simulate(api, question.request(principal), budget)
        except PermissionDeniedError:
            return [CheckResult(SIMULATE, False, (
                f"not verified: {principal} may not call {SIMULATE} on itself, so the permissions that have no dry run "
                "(security and placement groups, SSM, SQS, EventBridge, PassRole, KMS, S3) were not checked; "
                f"allow {SIMULATE} on the principal's own ARN, or run check with credentials that may"))]
        except CloudError as err:
            return [CheckResult(SIMULATE, False, f"not verified: {err}")]
        for action, why in _verdicts(results, question).items():
            if outcome.get(action) is None:
                outcome[action] = why
    return [CheckResult(a, why is None, why or "allowed (IAM policy simulation)") for a, why in outcome.items()]


def _simulate(api: AwsApi, params: dict[str, Any], budget: RetryBudget) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    while True:
        page = api.call("iam", "simulate_principal_policy", budget, **params)
        results += page.get("EvaluationResults", [])
        if not page.get("IsTruncated"):
            return results
        params = {**params, "Marker": page["Marker"]}


__all__ = ["PLACEHOLDER", "SIMULATE", "Question", "principal_of", "questions", "simulate_job_permissions"]
