"""The job's secret in AWS: Secrets Manager and SSM Parameter Store, and the policies that let a job's hosts read it.

- `AwsSecretsManagerStore`: tagged with the job, and a resource policy (`secrets_manager_policy`) that lets the
  job's instance role read it and denies every other principal;
- `AwsParameterStore` (SecureString): tagged with the job; parameters have no resource policy, so who may read it
  is the instance role's identity policy (`instance_role_policy`).

Every call goes through `cloud.aws.client.AwsApi` with its `SecretErrors`: no message quotes a parameter or a
response body. `fetch_aws_secret` is what a host runs at boot (through `python -m cloud.secrets fetch`);
`delete_job_secrets` is what a job's release (`AwsProvider.release_all`) runs.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Sequence
from typing import Any

from cloud.aws.client import AwsApi
from cloud.base import (
    JOB_TAG,
    MUTATE,
    CloudError,
    InvalidRequestError,
    NotFoundError,
    ReleaseSteps,
    RetryBudget,
    validate_job_id,
)
from cloud.secret_store import (
    JobSecretStore,
    SecretKind,
    SecretRef,
    remember_secret,
    secret_name_for,
)

log = logging.getLogger("cloud.secrets")  # the name users configure, as before the stores moved to cloud/aws/

_ROLE_ARN = re.compile(r"arn:aws[a-z-]*:iam::\d{12}:role/[A-Za-z0-9+=,.@_/-]{1,512}")


def secrets_manager_policy(reader_role_arns: Sequence[str]) -> dict[str, Any]:
    """The resource policy of a job's Secrets Manager secret: the given roles (the job's instance role first) may
    read it, every other principal is denied, the account's administrators included (they may still replace the
    policy). `aws:PrincipalArn` of an instance's assumed-role session is its role's ARN."""
    readers = list(reader_role_arns)
    if not readers:
        raise InvalidRequestError("give the job's instance role ARN: only it may read the job's secret")
    bad = [r for r in readers if not _ROLE_ARN.fullmatch(r)]
    if bad:
        raise InvalidRequestError(
            f"not IAM role ARNs: {bad} (give arn:aws:iam::ACCOUNT:role/NAME)", provider="aws", code="InvalidRoleArn"
        )
    read = ["secretsmanager:GetSecretValue", "secretsmanager:DescribeSecret"]
    return {
        "Version": "2012-10-17",
        "Statement": [
            {"Sid": "JobInstanceRoleReads", "Effect": "Allow", "Principal": {"AWS": readers}, "Action": read,
             "Resource": "*"},
            {"Sid": "NobodyElseReads", "Effect": "Deny", "Principal": "*", "Action": read, "Resource": "*",
             "Condition": {"StringNotEquals": {"aws:PrincipalArn": readers}}},
        ],
    }


def instance_role_policy(ref: SecretRef, *, account_id: str, kms_key_arn: str | None = None) -> dict[str, Any]:
    """The identity policy statements the job's instance role needs to fetch `ref` at boot, and nothing more: the
    only read access an SSM parameter has (parameters take no resource policy)."""
    if ref.kind == "azure-keyvault":
        raise InvalidRequestError("a Key Vault secret is read through an RBAC assignment: key_vault_reader_assignment")
    if not re.fullmatch(r"\d{12}", account_id):
        raise InvalidRequestError(f"account_id must be 12 digits, got {account_id!r}", provider="aws")
    partition = "aws-cn" if (ref.region or "").startswith("cn-") else "aws"
    if ref.kind == "aws-ssm":
        resource = f"arn:{partition}:ssm:{ref.region}:{account_id}:parameter{ref.name}"
        statements: list[dict[str, Any]] = [
            {"Sid": "ReadTheJobSecret", "Effect": "Allow", "Action": "ssm:GetParameter", "Resource": resource}
        ]
        service = "ssm"
    else:
        # A name's ARN ends in six random characters that Secrets Manager appends.
        resource = ref.name if ref.name.startswith("arn:") else (
            f"arn:{partition}:secretsmanager:{ref.region}:{account_id}:secret:{ref.name}-??????"
        )
        statements = [
            {"Sid": "ReadTheJobSecret", "Effect": "Allow", "Action": "secretsmanager:GetSecretValue",
             "Resource": resource}
        ]
        service = "secretsmanager"
    if kms_key_arn is not None:
        statements.append(
            {"Sid": "DecryptTheJobSecret", "Effect": "Allow", "Action": "kms:Decrypt", "Resource": kms_key_arn,
             "Condition": {"StringEquals": {"kms:ViaService": f"{service}.{ref.region}.amazonaws.com"}}}
        )
    return {"Version": "2012-10-17", "Statement": statements}


def _read(api: AwsApi, budget: RetryBudget, ref: SecretRef) -> str:
    """The current value of the AWS secret `ref` (remembered for redaction)."""
    if ref.kind == "aws-ssm":
        value = str(api.call("ssm", "get_parameter", budget, Name=ref.name, WithDecryption=True)["Parameter"]["Value"])
    else:
        value = str(api.call("secretsmanager", "get_secret_value", budget, SecretId=ref.name)["SecretString"])
    remember_secret(value)
    return value


class _AwsStore(JobSecretStore):
    """What both AWS stores share: one `AwsApi` for the store's region, its budget, and the refs it accepts."""

    service = ""

    def __init__(self, region: str, *, kms_key_id: str | None = None, session: Any | None = None,
                 endpoint_url: str | None = None, budget: RetryBudget = MUTATE) -> None:
        self.kms_key_id = kms_key_id
        self._api = AwsApi.for_secrets(region, session, endpoint_url)
        self._budget = budget

    def __repr__(self) -> str:
        return f"{type(self).__name__}(region={self._api.region!r})"

    def _call(self, operation: str, **params: Any) -> dict[str, Any]:
        return self._api.call(self.service, operation, self._budget, **params)

    def get(self, ref: SecretRef) -> str:
        self._check_ref(ref)
        return _read(self._api, self._budget, ref)

    def _put_params(self, job_id: str, secret: str, value_key: str, kms_key: str) -> dict[str, Any]:
        """What `put` sends to store `job_id`'s `secret`, once both are checked: its name, the value (as `value_key`),
        a description, and the store's KMS key (as `kms_key`) when it has one."""
        validate_job_id(job_id, provider="aws")
        params: dict[str, Any] = {
            "Name": self._name_to_put(job_id, secret),
            value_key: secret,
            "Description": f"TrainMover job secret of {job_id}",
        }
        if self.kms_key_id is not None:
            params[kms_key] = self.kms_key_id
        return params

    @staticmethod
    def _create_or_overwrite(
        exists: type[CloudError],
        code: str,
        create: Callable[[], dict[str, Any]],
        overwrite: Callable[[], dict[str, Any]],
    ) -> dict[str, Any]:
        """`create()`'s answer, or `overwrite()`'s where the secret exists already (`create` raised `exists` with
        `code`)."""
        try:
            return create()
        except exists as err:
            if err.code != code:
                raise
            return overwrite()

    def _delete(self, operation: str, **params: Any) -> None:
        """Delete a secret of this store by `operation`; one already gone is fine."""
        _deleted(self._api, self._budget, self.service, operation, **params)

    def _check_ref(self, ref: SecretRef) -> None:
        if ref.kind != self.kind or ref.region != self._api.region:
            raise InvalidRequestError(f"{ref.kind} secret in {ref.region} is not in this store ({self!r})")


class AwsSecretsManagerStore(_AwsStore):
    """Job secrets in AWS Secrets Manager, each tagged with its job and readable by the job's instance role only
    (`secrets_manager_policy`). `also_readable_by`: further role ARNs that may read it (an orchestrator's own role,
    for `get`); everyone else is denied by the resource policy."""

    kind: SecretKind = "aws-secretsmanager"
    service = "secretsmanager"

    def __init__(
        self,
        region: str,
        *,
        reader_role_arn: str,
        also_readable_by: Sequence[str] = (),
        kms_key_id: str | None = None,
        session: Any | None = None,
        endpoint_url: str | None = None,
        budget: RetryBudget = MUTATE,
    ) -> None:
        self._policy = json.dumps(secrets_manager_policy([reader_role_arn, *also_readable_by]))
        super().__init__(region, kms_key_id=kms_key_id, session=session, endpoint_url=endpoint_url, budget=budget)

    def put(self, job_id: str, secret: str) -> SecretRef:
        create = self._put_params(job_id, secret, "SecretString", "KmsKeyId")
        create["Tags"] = [{"Key": JOB_TAG, "Value": job_id}]
        stored = self._create_or_overwrite(
            InvalidRequestError,
            "ResourceExistsException",
            lambda: self._call("create_secret", **create),
            lambda: self._call("put_secret_value", SecretId=create["Name"], SecretString=secret),
        )
        arn = str(stored["ARN"])
        # BlockPublicPolicy: Secrets Manager refuses a policy that would grant access outside the account.
        self._call("put_resource_policy", SecretId=arn, ResourcePolicy=self._policy, BlockPublicPolicy=True)
        log.info("aws: stored the secret of job %s in Secrets Manager as %s", job_id, arn)
        return SecretRef(self.kind, arn, self._api.region)

    def delete(self, ref: SecretRef) -> None:
        self._check_ref(ref)
        # Without the recovery window a new job may reuse the name at once; the secret is per job anyway.
        self._delete("delete_secret", SecretId=ref.name, ForceDeleteWithoutRecovery=True)


class AwsParameterStore(_AwsStore):
    """Job secrets as SSM Parameter Store SecureString parameters (KMS-encrypted), tagged with their job. Parameters
    take no resource policy: grant the job's instance role `instance_role_policy(ref, ...)` and nothing wider."""

    kind: SecretKind = "aws-ssm"
    service = "ssm"

    def put(self, job_id: str, secret: str) -> SecretRef:
        params = self._put_params(job_id, secret, "Value", "KeyId")
        params["Type"] = "SecureString"
        # SSM takes Tags only on creation and refuses Tags with Overwrite: create first, overwrite if it exists.
        self._create_or_overwrite(
            CloudError,
            "ParameterAlreadyExists",
            lambda: self._call("put_parameter", Tags=[{"Key": JOB_TAG, "Value": job_id}], **params),
            lambda: self._call("put_parameter", Overwrite=True, **params),
        )
        log.info("aws: stored the secret of job %s in SSM Parameter Store as %s", job_id, params["Name"])
        return SecretRef(self.kind, params["Name"], self._api.region)

    def delete(self, ref: SecretRef) -> None:
        self._check_ref(ref)
        self._delete("delete_parameter", Name=ref.name)


def delete_job_secrets(
    job_id: str,
    steps: ReleaseSteps,
    *,
    region: str,
    session: Any | None = None,
    endpoint_url: str | None = None,
    budget: RetryBudget = MUTATE,
) -> None:
    """Delete `job_id`'s secret under its default names (`secret_name_for`) in both AWS stores, each recorded in
    `steps`: the SSM parameter (what the flows use) and the Secrets Manager secret. Credentials that may not use
    Secrets Manager at all (the per-job policy of `cloud.aws.iam` grants only the SSM parameter) cannot have made a
    secret there: that secret is then recorded as not looked for, not as a failure."""
    validate_job_id(job_id, provider="aws")
    api = AwsApi.for_secrets(region, session, endpoint_url)
    parameter = secret_name_for(job_id, "aws-ssm")
    steps.run(f"SSM parameter {parameter}", lambda: _deleted(api, budget, "ssm", "delete_parameter", Name=parameter))
    secret = secret_name_for(job_id, "aws-secretsmanager")

    def delete_secret() -> bool:
        try:
            # DeleteSecret with ForceDeleteWithoutRecovery succeeds for a name that does not exist: ask first, so
            # that a second release says it deleted nothing.
            api.call("secretsmanager", "describe_secret", budget, SecretId=secret)
        except NotFoundError:
            return False
        return _deleted(api, budget, "secretsmanager", "delete_secret", SecretId=secret,
                        ForceDeleteWithoutRecovery=True)

    steps.run(f"Secrets Manager secret {secret}", delete_secret,
              if_denied="these credentials may not use Secrets Manager, so they made no secret there")


def _deleted(api: AwsApi, budget: RetryBudget, service: str, operation: str, **params: Any) -> bool:
    """Delete one secret; True when it was there, False when it was already gone."""
    try:
        api.call(service, operation, budget, **params)
    except NotFoundError:
        return False
    return True


def fetch_aws_secret(
    ref: SecretRef, *, session: Any | None = None, endpoint_url: str | None = None, budget: RetryBudget = MUTATE
) -> str:
    """The AWS secret `ref` points to, read with this host's own identity (the instance role: boto3's default
    chain)."""
    assert ref.region is not None  # SecretRef checks it for AWS kinds
    return _read(AwsApi.for_secrets(ref.region, session, endpoint_url), budget, ref)


__all__ = [
    "AwsParameterStore",
    "AwsSecretsManagerStore",
    "delete_job_secrets",
    "fetch_aws_secret",
    "instance_role_policy",
    "secrets_manager_policy",
]
