"""The job's secret in the cloud's secret store: put by the orchestrator, fetched by each host at boot.

The job's secret authenticates every link and store record of a job (runtime.auth), so it never travels in
user-data (any process on the instance, and anyone allowed DescribeInstanceAttribute or to read a VM's model, can
read that). Instead the orchestrator puts it in a secret store that only the job's own instance identity may read,
and the bootstrap (cloud.bootstrap) fetches it at every boot into a root-only file on tmpfs:

- AWS Secrets Manager (`AwsSecretsManagerStore`): tagged with the job, and a resource policy that lets the job's
  instance role read it and denies every other principal;
- AWS SSM Parameter Store, SecureString (`AwsParameterStore`): tagged with the job; parameters have no resource
  policy, so who may read it is the instance role's identity policy (`instance_role_policy`);
- Azure Key Vault (`AzureKeyVaultStore`), through its REST data plane with a bearer token from an Azure SDK
  credential or the VM's managed identity (`ImdsManagedIdentity`); who may read it is an RBAC role assignment of
  "Key Vault Secrets User" on the secret itself (`key_vault_reader_assignment`).

A `SecretRef` says where a secret lives, never its value; it is all the bootstrap carries. Secret values never
appear in messages, logs or reprs: botocore logs request parameters and response bodies at DEBUG, so every value
this module handles is redacted from botocore's loggers (`_REDACTOR`). On a host, `python -m cloud.secrets fetch`
writes the secret to a file (mode 600) for `trainmover agent --secret-file`.
"""

from __future__ import annotations

import abc
import argparse
import contextlib
import hashlib
import json
import logging
import os
import re
import ssl
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Protocol, get_args

from cloud.base import (
    JOB_TAG,
    MUTATE,
    CloudError,
    CredentialsError,
    InvalidRequestError,
    NotFoundError,
    PermissionDeniedError,
    RetryBudget,
    ServiceUnavailableError,
    ThrottledError,
    validate_job_id,
    with_retries,
)

log = logging.getLogger(__name__)

SecretKind = Literal["aws-secretsmanager", "aws-ssm", "azure-keyvault", "local-file"]

KEY_VAULT_API_VERSION = "7.4"
KEY_VAULT_RESOURCE = "https://vault.azure.net"  # the token audience of every public-cloud vault
KEY_VAULT_SECRETS_USER_ROLE = "4633458b-17de-408a-b874-0445c86b69e6"  # built-in role: read secret contents
IMDS_URL = "http://169.254.169.254"  # both clouds' instance metadata service; never through a proxy
IMDS_TOKEN_API_VERSION = "2018-02-01"
MIN_SECRET_CHARS = 32  # runtime.auth's minimum; cloud/ may not import runtime, so it is checked again here

_AWS_REGION = re.compile(r"[a-z]{2}(?:-[a-z]+)+-\d{1,2}")
_SM_NAME = re.compile(r"[A-Za-z0-9/_+=.@-]{1,512}")
_SM_ARN = re.compile(r"arn:aws[a-z-]*:secretsmanager:([a-z0-9-]+):\d{12}:secret:[A-Za-z0-9/_+=.@-]{1,512}")
_SSM_NAME = re.compile(r"/[A-Za-z0-9_./-]{1,1010}")
_ROLE_ARN = re.compile(r"arn:aws[a-z-]*:iam::\d{12}:role/[A-Za-z0-9+=,.@_/-]{1,512}")
_KV_SECRET_NAME = re.compile(r"[0-9A-Za-z-]{1,127}")
_GUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")


# ---------------------------------------------------------------------------------------------------- redaction


class _Redactor(logging.Filter):
    """Replaces every secret value this process handed to a store with `[redacted]` in the records of the loggers
    it is attached to. botocore logs a request's parameters (`botocore.endpoint`) and a response's body
    (`botocore.parsers`) at DEBUG, SecretString and Value included."""

    LOGGERS = ("botocore.endpoint", "botocore.parsers", "urllib3.connectionpool")

    def __init__(self) -> None:
        super().__init__()
        self._values: set[str] = set()
        self._lock = threading.Lock()
        self._attached = False

    def remember(self, value: str) -> None:
        with self._lock:
            self._values.add(value)
            if not self._attached:
                for name in self.LOGGERS:
                    logging.getLogger(name).addFilter(self)
                self._attached = True

    def filter(self, record: logging.LogRecord) -> bool:
        with self._lock:
            values = tuple(self._values)
        if not values:
            return True
        try:
            text = record.getMessage()
        except Exception:  # a malformed record is the logging module's to report, not ours
            return True
        if any(v in text for v in values):
            for v in values:
                text = text.replace(v, "[redacted]")
            record.msg, record.args = text, None
        return True


_REDACTOR = _Redactor()


def _check_value(secret: str) -> str:
    if not isinstance(secret, str) or len(secret.strip()) < MIN_SECRET_CHARS or any(c.isspace() for c in secret):
        raise InvalidRequestError(
            f"the job secret must be at least {MIN_SECRET_CHARS} printable characters without spaces (for example "
            "python -c 'import secrets; print(secrets.token_hex(32))')",
            code="InvalidSecret",
        )
    _REDACTOR.remember(secret)
    return secret


# ---------------------------------------------------------------------------------------------------- where


@dataclass(frozen=True, slots=True)
class SecretRef:
    """Where a job's secret lives: everything a host needs to fetch it with its own identity, never the value."""

    kind: SecretKind
    name: str
    """Secrets Manager: the secret's ARN (or name); SSM: the parameter name (`/trainmover/JOB/job-secret`);
    Key Vault: the secret's URL without a version (`https://VAULT.vault.azure.net/secrets/NAME`); local-file: the
    absolute path of a file only its owner can read, on a filesystem every local host shares (the local provider)."""
    region: str | None = None
    """AWS: the region of the secret (taken from a Secrets Manager ARN when not given). Azure: unused."""
    identity_client_id: str | None = None
    """Azure: the client id of the VM's user-assigned managed identity that reads it; None: the system-assigned one."""

    def __post_init__(self) -> None:
        if self.kind not in get_args(SecretKind):
            raise InvalidRequestError(
                f"unknown secret store {self.kind!r}: use one of {', '.join(get_args(SecretKind))}",
                code="InvalidSecretRef",
            )
        if self.kind == "azure-keyvault":
            self._check_key_vault()
            return
        if self.kind == "local-file":
            if not os.path.isabs(self.name) or "\0" in self.name or self.region or self.identity_client_id:
                raise InvalidRequestError(
                    "a local-file secret is the absolute path of a file, with no region or identity; got "
                    f"{self.name!r}",
                    code="InvalidSecretRef",
                )
            return
        if self.identity_client_id is not None:
            raise InvalidRequestError("identity_client_id is for Azure Key Vault only", code="InvalidSecretRef")
        arn = _SM_ARN.fullmatch(self.name) if self.kind == "aws-secretsmanager" else None
        if arn is not None and self.region is None:
            object.__setattr__(self, "region", arn.group(1))
        elif arn is not None and arn.group(1) != self.region:
            raise InvalidRequestError(
                f"the secret ARN is in {arn.group(1)}, not {self.region}: give the ARN's region",
                code="InvalidSecretRef",
            )
        if self.region is None or not _AWS_REGION.fullmatch(self.region):
            raise InvalidRequestError(
                f"{self.kind}: give the AWS region of the secret (e.g. us-east-1), got {self.region!r}",
                code="InvalidSecretRef",
            )
        if self.kind == "aws-secretsmanager" and not (arn or _SM_NAME.fullmatch(self.name)):
            raise InvalidRequestError(
                f"invalid Secrets Manager secret {self.name!r}: give its ARN, or a name of letters, digits and "
                "/_+=.@-",
                code="InvalidSecretRef",
            )
        if self.kind == "aws-ssm" and not _SSM_NAME.fullmatch(self.name):
            raise InvalidRequestError(
                f"invalid SSM parameter name {self.name!r}: give a path such as /trainmover/JOB/job-secret "
                "(letters, digits and _./-)",
                code="InvalidSecretRef",
            )

    def _check_key_vault(self) -> None:
        parts = urllib.parse.urlsplit(self.name)
        segments = parts.path.strip("/").split("/")
        valid = (
            parts.scheme == "https"
            and bool(parts.hostname)
            and re.fullmatch(r"[A-Za-z0-9.-]+", parts.hostname or "") is not None
            and not parts.query
            and not parts.fragment
            and not parts.username
            and len(segments) == 2
            and segments[0] == "secrets"
            and _KV_SECRET_NAME.fullmatch(segments[1]) is not None
        )
        if not valid:
            raise InvalidRequestError(
                f"invalid Key Vault secret URL {self.name!r}: give https://VAULT.vault.azure.net/secrets/NAME (NAME: "
                "letters, digits and '-'; no version, so a host always reads the current one)",
                code="InvalidSecretRef",
            )
        if self.region is not None:
            raise InvalidRequestError("region is for AWS secrets only", code="InvalidSecretRef")
        if self.identity_client_id is not None and not _GUID.fullmatch(self.identity_client_id):
            raise InvalidRequestError(
                "identity_client_id must be the managed identity's client id (a GUID), got "
                f"{self.identity_client_id!r}",
                code="InvalidSecretRef",
            )

    @property
    def vault_url(self) -> str:
        """Key Vault: the vault's URL (`https://VAULT.vault.azure.net`)."""
        parts = urllib.parse.urlsplit(self.name)
        return f"{parts.scheme}://{parts.netloc}"

    @property
    def secret_name(self) -> str:
        """Key Vault: the secret's name in its vault."""
        return self.name.rstrip("/").rsplit("/", 1)[-1]


def secret_name_for(job_id: str, kind: SecretKind) -> str:
    """The default name of a job's secret in a store: one per job, found again from the job id alone."""
    validate_job_id(job_id)
    if kind == "aws-secretsmanager":
        return f"trainmover/{job_id}/job-secret"
    if kind == "aws-ssm":
        return f"/trainmover/{job_id}/job-secret"
    if kind == "local-file":
        return f"{job_id}.secret"
    # Key Vault names allow only letters, digits and '-': the job id's '.' and '_' are folded, and a digest of the
    # exact id keeps 'a.b' and 'a-b' apart.
    digest = hashlib.sha256(job_id.encode()).hexdigest()[:8]
    return f"trainmover-{re.sub(r'[._]', '-', job_id)}-{digest}"


class JobSecretStore(abc.ABC):
    """A cloud secret store holding job secrets: three calls, each bounded and retried only on transient errors."""

    @abc.abstractmethod
    def put(self, job_id: str, secret: str) -> SecretRef:
        """Store (or replace) `job_id`'s secret, readable only by the job's instance identity; where it lives."""

    @abc.abstractmethod
    def get(self, ref: SecretRef) -> str:
        """The secret's current value. NotFoundError when there is none."""

    @abc.abstractmethod
    def delete(self, ref: SecretRef) -> None:
        """Remove the secret for good (the flows do it when the job is released). A missing secret is no error."""


# ---------------------------------------------------------------------------------------------------- AWS

_AWS_THROTTLED = frozenset({"ThrottlingException", "Throttling", "TooManyUpdates", "RequestThrottled"})
_AWS_CREDENTIALS = frozenset(
    {"UnrecognizedClientException", "InvalidClientTokenId", "ExpiredTokenException", "ExpiredToken",
     "InvalidSignatureException", "SignatureDoesNotMatch", "MissingAuthenticationToken"}
)
_AWS_DENIED = frozenset({"AccessDeniedException", "AccessDenied", "KMSAccessDeniedException"})
_AWS_NOT_FOUND = frozenset({"ResourceNotFoundException", "ParameterNotFound", "ParameterVersionNotFound"})
_AWS_UNAVAILABLE = frozenset({"InternalServiceError", "InternalServerError", "InternalFailure", "ServiceUnavailable"})


class _AwsSecretsApi:
    """One boto3 client per service for one region, each call translated into `CloudError` within a budget.

    Messages never quote a parameter (botocore's ParamValidationError quotes the values it refuses) and never a
    response body."""

    def __init__(self, region: str, session: Any | None, endpoint_url: str | None, budget: RetryBudget) -> None:
        try:
            import boto3
            import botocore.exceptions
        except ImportError as err:
            raise CloudError(
                "aws: the secret stores need boto3: pip install 'trainmover[aws]'", provider="aws"
            ) from err
        if not _AWS_REGION.fullmatch(region):
            raise InvalidRequestError(f"aws: invalid region {region!r} (e.g. us-east-1)", provider="aws")
        self.region = region
        self.budget = budget
        self._exc = botocore.exceptions
        self._session = session if session is not None else boto3.Session(region_name=region)
        self._endpoint_url = endpoint_url
        from cloud.aws import one_attempt_config

        self._config = one_attempt_config(region, read_timeout_s=20)  # the named budget is the only retry policy
        self._clients: dict[str, Any] = {}
        self._lock = threading.Lock()

    def call(self, service: str, operation: str, **params: Any) -> dict[str, Any]:
        with self._lock:
            if service not in self._clients:
                try:
                    self._clients[service] = self._session.client(
                        service, region_name=self.region, endpoint_url=self._endpoint_url, config=self._config
                    )
                except ValueError as err:  # botocore's "Invalid endpoint: ..."
                    raise InvalidRequestError(
                        f"aws: cannot make a {service} client ({err}): give an absolute http(s) endpoint URL",
                        provider="aws",
                        code="InvalidEndpointUrl",
                    ) from err
            client = self._clients[service]
        action = f"{service}:{''.join(p.capitalize() for p in operation.split('_'))}"

        def once() -> dict[str, Any]:
            try:
                response: dict[str, Any] = getattr(client, operation)(**params)
            except self._exc.ClientError as err:
                raise self._from_client_error(err, action) from None
            except self._exc.NoCredentialsError as err:
                raise CredentialsError(
                    f"aws {self.region}: {action}: no usable AWS credentials: provide them through the standard "
                    "chain (AWS_PROFILE, environment, ~/.aws/credentials, the instance role)",
                    provider="aws",
                    code=type(err).__name__,
                ) from None
            except self._exc.ParamValidationError:
                raise InvalidRequestError(
                    f"aws {self.region}: {action}: invalid parameters (not shown: they may hold the secret)",
                    provider="aws",
                    code="ParamValidation",
                ) from None
            except self._exc.BotoCoreError as err:
                raise ServiceUnavailableError(
                    f"aws {self.region}: {action}: the AWS API did not answer ({type(err).__name__}); check network "
                    "access to it",
                    provider="aws",
                    code=type(err).__name__,
                ) from None
            return response

        # `from None` above: the botocore exception's context holds the request's parameters.
        return with_retries(once, self.budget, on_retry=_log_retry)

    def _from_client_error(self, err: Any, action: str) -> CloudError:
        error = err.response.get("Error", {})
        code = str(error.get("Code", "Unknown"))
        status = int(err.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        where = f"aws {self.region}: {action}"
        if code in _AWS_THROTTLED:
            return ThrottledError(f"{where}: AWS API rate limit hit ({code})", provider="aws", code=code)
        if code in _AWS_CREDENTIALS:
            return CredentialsError(f"{where}: AWS refused the credentials ({code}): refresh them", provider="aws",
                                    code=code)
        if code in _AWS_DENIED:
            return PermissionDeniedError(
                f"{where}: not allowed ({code}): the orchestrator needs {action} on the job's secret, the instance "
                "role needs read access to it (cloud.secrets.instance_role_policy) and kms:Decrypt on its key",
                provider="aws",
                code=code,
            )
        if code in _AWS_NOT_FOUND:
            return NotFoundError(f"{where}: no such secret ({code})", provider="aws", code=code)
        if status >= 500 or code in _AWS_UNAVAILABLE:
            return ServiceUnavailableError(f"{where}: AWS failed on its side ({code})", provider="aws", code=code)
        # The service's message is not quoted: for a refused value it may echo part of it.
        return InvalidRequestError(f"{where}: AWS refused the request ({code})", provider="aws", code=code)


def _log_retry(err: CloudError, attempt: int, delay_s: float) -> None:
    log.info("%s (attempt %d); retrying in %.2f s", err, attempt, delay_s)


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


class AwsSecretsManagerStore(JobSecretStore):
    """Job secrets in AWS Secrets Manager, each tagged with its job and readable by the job's instance role only
    (`secrets_manager_policy`). `also_readable_by`: further role ARNs that may read it (an orchestrator's own role,
    for `get`); everyone else is denied by the resource policy."""

    kind: SecretKind = "aws-secretsmanager"

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
        self.kms_key_id = kms_key_id
        self._api = _AwsSecretsApi(region, session, endpoint_url, budget)

    def __repr__(self) -> str:
        return f"AwsSecretsManagerStore(region={self._api.region!r})"

    def put(self, job_id: str, secret: str) -> SecretRef:
        validate_job_id(job_id, provider="aws")
        _check_value(secret)
        name = secret_name_for(job_id, self.kind)
        create: dict[str, Any] = {
            "Name": name,
            "SecretString": secret,
            "Description": f"TrainMover job secret of {job_id}",
            "Tags": [{"Key": JOB_TAG, "Value": job_id}],
        }
        if self.kms_key_id is not None:
            create["KmsKeyId"] = self.kms_key_id
        try:
            arn = str(self._api.call("secretsmanager", "create_secret", **create)["ARN"])
        except InvalidRequestError as err:
            if err.code != "ResourceExistsException":
                raise
            arn = str(self._api.call("secretsmanager", "put_secret_value", SecretId=name, SecretString=secret)["ARN"])
        # BlockPublicPolicy: Secrets Manager refuses a policy that would grant access outside the account.
        self._api.call(
            "secretsmanager", "put_resource_policy", SecretId=arn, ResourcePolicy=self._policy, BlockPublicPolicy=True
        )
        log.info("aws: stored the secret of job %s in Secrets Manager as %s", job_id, arn)
        return SecretRef(self.kind, arn, self._api.region)

    def get(self, ref: SecretRef) -> str:
        self._check_ref(ref)
        value = str(self._api.call("secretsmanager", "get_secret_value", SecretId=ref.name)["SecretString"])
        _REDACTOR.remember(value)
        return value

    def delete(self, ref: SecretRef) -> None:
        self._check_ref(ref)
        with contextlib.suppress(NotFoundError):
            # Without the recovery window a new job may reuse the name at once; the secret is per job anyway.
            self._api.call("secretsmanager", "delete_secret", SecretId=ref.name, ForceDeleteWithoutRecovery=True)

    def _check_ref(self, ref: SecretRef) -> None:
        if ref.kind != self.kind or ref.region != self._api.region:
            raise InvalidRequestError(f"{ref.kind} secret in {ref.region} is not in this store ({self!r})")


class AwsParameterStore(JobSecretStore):
    """Job secrets as SSM Parameter Store SecureString parameters (KMS-encrypted), tagged with their job. Parameters
    take no resource policy: grant the job's instance role `instance_role_policy(ref, ...)` and nothing wider."""

    kind: SecretKind = "aws-ssm"

    def __init__(
        self,
        region: str,
        *,
        kms_key_id: str | None = None,
        session: Any | None = None,
        endpoint_url: str | None = None,
        budget: RetryBudget = MUTATE,
    ) -> None:
        self.kms_key_id = kms_key_id
        self._api = _AwsSecretsApi(region, session, endpoint_url, budget)

    def __repr__(self) -> str:
        return f"AwsParameterStore(region={self._api.region!r})"

    def put(self, job_id: str, secret: str) -> SecretRef:
        validate_job_id(job_id, provider="aws")
        _check_value(secret)
        name = secret_name_for(job_id, self.kind)
        params: dict[str, Any] = {
            "Name": name,
            "Value": secret,
            "Type": "SecureString",
            "Description": f"TrainMover job secret of {job_id}",
        }
        if self.kms_key_id is not None:
            params["KeyId"] = self.kms_key_id
        try:
            # SSM takes Tags only on creation and refuses Tags with Overwrite: create first, overwrite if it exists.
            self._api.call("ssm", "put_parameter", Tags=[{"Key": JOB_TAG, "Value": job_id}], **params)
        except CloudError as err:
            if err.code != "ParameterAlreadyExists":
                raise
            self._api.call("ssm", "put_parameter", Overwrite=True, **params)
        log.info("aws: stored the secret of job %s in SSM Parameter Store as %s", job_id, name)
        return SecretRef(self.kind, name, self._api.region)

    def get(self, ref: SecretRef) -> str:
        self._check_ref(ref)
        value = str(self._api.call("ssm", "get_parameter", Name=ref.name, WithDecryption=True)["Parameter"]["Value"])
        _REDACTOR.remember(value)
        return value

    def delete(self, ref: SecretRef) -> None:
        self._check_ref(ref)
        with contextlib.suppress(NotFoundError):
            self._api.call("ssm", "delete_parameter", Name=ref.name)

    def _check_ref(self, ref: SecretRef) -> None:
        if ref.kind != self.kind or ref.region != self._api.region:
            raise InvalidRequestError(f"{ref.kind} secret in {ref.region} is not in this store ({self!r})")


# ---------------------------------------------------------------------------------------------------- Azure


class AccessToken(NamedTuple):
    """A bearer token and its expiry (epoch seconds): the shape of azure.core.credentials.AccessToken."""

    token: str
    expires_on: int


class TokenSource(Protocol):
    """What the Key Vault client needs of a credential: azure-identity's credentials and `ImdsManagedIdentity`."""

    def get_token(self, *scopes: str) -> Any: ...


def _no_proxy_opener() -> urllib.request.OpenerDirector:
    # IMDS is link-local: a proxy cannot reach it (and must never see its tokens), whatever HTTP(S)_PROXY says.
    return urllib.request.build_opener(urllib.request.ProxyHandler({}))


class ImdsManagedIdentity:
    """The VM's managed identity: tokens from the Azure instance metadata service, with the `Metadata: true` header
    it requires and never through a proxy. https://learn.microsoft.com/entra/identity/managed-identities-azure-resources/how-to-use-vm-token"""

    def __init__(self, client_id: str | None = None, *, imds_url: str = IMDS_URL, timeout_s: float = 5.0) -> None:
        self.client_id = client_id
        self.imds_url = imds_url.rstrip("/")
        self.timeout_s = timeout_s

    def get_token(self, *scopes: str) -> AccessToken:
        resource = (scopes[0] if scopes else KEY_VAULT_RESOURCE).removesuffix("/.default")
        query = {"api-version": IMDS_TOKEN_API_VERSION, "resource": resource}
        if self.client_id is not None:
            query["client_id"] = self.client_id
        url = f"{self.imds_url}/metadata/identity/oauth2/token?{urllib.parse.urlencode(query)}"
        request = urllib.request.Request(url, headers={"Metadata": "true"})
        try:
            with _no_proxy_opener().open(request, timeout=self.timeout_s) as response:
                body = json.loads(response.read())
        except urllib.error.HTTPError as err:
            # 400 identity_not_found: no identity assigned; 429 / 5xx: IMDS is busy (it asks for retries).
            if err.code == 429 or err.code >= 500:
                raise ThrottledError(f"azure IMDS: token request answered {err.code}", provider="azure") from None
            raise CredentialsError(
                f"azure IMDS: no managed identity token ({err.code}): assign a managed identity to the VM (with "
                "identity_client_id for a user-assigned one) and give it read access to the job's secret",
                provider="azure",
                code=str(err.code),
            ) from None
        except (urllib.error.URLError, TimeoutError, OSError) as err:
            raise ServiceUnavailableError(
                f"azure IMDS at {self.imds_url} did not answer ({type(err).__name__}): this only works on an Azure VM",
                provider="azure",
            ) from None
        return AccessToken(str(body["access_token"]), int(body.get("expires_on") or 0))


def key_vault_reader_assignment(vault_resource_id: str, secret_name: str, principal_id: str) -> dict[str, Any]:
    """The ARM role assignment (PUT .../providers/Microsoft.Authorization/roleAssignments/{new guid}) that lets the
    job's managed identity read its secret and nothing else in the vault: "Key Vault Secrets User" scoped to the
    one secret (a vault with the RBAC permission model). Returns {"scope", "properties"}."""
    if not re.fullmatch(r"/subscriptions/[^/]+/resourceGroups/[^/]+/providers/Microsoft\.KeyVault/vaults/[^/]+",
                        vault_resource_id, flags=re.IGNORECASE):
        raise InvalidRequestError(f"not a Key Vault resource id: {vault_resource_id!r}", provider="azure")
    if not _KV_SECRET_NAME.fullmatch(secret_name) or not _GUID.fullmatch(principal_id):
        raise InvalidRequestError("give the secret's name and the identity's principal id (a GUID)", provider="azure")
    subscription = vault_resource_id.split("/")[2]
    return {
        "scope": f"{vault_resource_id}/secrets/{secret_name}",
        "properties": {
            "roleDefinitionId": f"/subscriptions/{subscription}/providers/Microsoft.Authorization/roleDefinitions/"
            f"{KEY_VAULT_SECRETS_USER_ROLE}",
            "principalId": principal_id,
            "principalType": "ServicePrincipal",
        },
    }


class AzureKeyVaultStore(JobSecretStore):
    """Job secrets in one Azure Key Vault, through its REST data plane (api-version 7.4), tagged with their job.

    `credential`: anything with `get_token(scope)` (an azure-identity credential, or `ImdsManagedIdentity` on a VM);
    default: azure-identity's DefaultAzureCredential. https only (a bearer token never crosses plain http);
    `ssl_context` verifies the vault's certificate (default: the system's CAs).
    `identity_client_id` goes into the refs this store returns: the user-assigned identity hosts read them with.
    """

    kind: SecretKind = "azure-keyvault"

    def __init__(
        self,
        vault_url: str,
        *,
        credential: TokenSource | None = None,
        identity_client_id: str | None = None,
        timeout_s: float = 10.0,
        budget: RetryBudget = MUTATE,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.vault_url = vault_url.rstrip("/")
        self.ssl_context = ssl_context
        SecretRef(self.kind, f"{self.vault_url}/secrets/probe", identity_client_id=identity_client_id)  # one check
        self.credential = credential
        self.identity_client_id = identity_client_id
        self.timeout_s = timeout_s
        self.budget = budget
        self._token: AccessToken | None = None

    def __repr__(self) -> str:
        return f"AzureKeyVaultStore(vault_url={self.vault_url!r})"

    def put(self, job_id: str, secret: str) -> SecretRef:
        validate_job_id(job_id, provider="azure")
        _check_value(secret)
        name = secret_name_for(job_id, self.kind)
        body = {"value": secret, "contentType": "text/plain", "tags": {JOB_TAG: job_id},
                "attributes": {"enabled": True}}
        self._call("PUT", name, body)
        log.info("azure: stored the secret of job %s in %s as %s", job_id, self.vault_url, name)
        return SecretRef(self.kind, f"{self.vault_url}/secrets/{name}", identity_client_id=self.identity_client_id)

    def get(self, ref: SecretRef) -> str:
        self._check_ref(ref)
        value = str(self._call("GET", ref.secret_name)["value"])
        _REDACTOR.remember(value)
        return value

    def delete(self, ref: SecretRef) -> None:
        self._check_ref(ref)
        with contextlib.suppress(NotFoundError):
            # A soft delete: a vault with purge protection keeps it (unreadable) for its retention period.
            self._call("DELETE", ref.secret_name)

    def _check_ref(self, ref: SecretRef) -> None:
        if ref.kind != self.kind or ref.vault_url != self.vault_url:
            raise InvalidRequestError(f"{ref.kind} secret {ref.name} is not in this vault ({self.vault_url})")

    def _bearer(self) -> str:
        if self._token is None or self._token.expires_on - 300 < time.time():
            credential = self.credential
            if credential is None:
                try:
                    from azure.identity import DefaultAzureCredential
                except ImportError as err:
                    raise CloudError(
                        "azure: azure-identity is not installed: pip install 'trainmover[azure]'", provider="azure"
                    ) from err
                credential = self.credential = DefaultAzureCredential()
            try:
                got = credential.get_token(f"{KEY_VAULT_RESOURCE}/.default")
            except CloudError:
                raise
            except Exception as err:  # azure-identity's ClientAuthenticationError and kin; their text names no secret
                first = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
                raise CredentialsError(
                    f"azure: no token for Key Vault ({first}): log in with `az login`, or run where a managed identity "
                    "is assigned",
                    provider="azure",
                    code=type(err).__name__,
                ) from None
            self._token = AccessToken(str(got.token), int(got.expires_on))
        return self._token.token

    def _call(self, method: str, name: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        url = f"{self.vault_url}/secrets/{name}?api-version={KEY_VAULT_API_VERSION}"
        data = json.dumps(body).encode() if body is not None else None
        action = f"{method} {self.vault_url}/secrets/{name}"

        def once() -> dict[str, Any]:
            headers = {"Authorization": f"Bearer {self._bearer()}", "Accept": "application/json"}
            if data is not None:
                headers["Content-Type"] = "application/json"
            request = urllib.request.Request(url, data=data, method=method, headers=headers)
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s, context=self.ssl_context) as response:
                    payload: dict[str, Any] = json.loads(response.read() or b"{}")
                    return payload
            except urllib.error.HTTPError as err:
                raise _key_vault_error(err, action) from None
            except (urllib.error.URLError, TimeoutError, OSError) as err:
                raise ServiceUnavailableError(
                    f"azure: {action}: Key Vault did not answer ({type(err).__name__}); check the vault URL and the "
                    "network",
                    provider="azure",
                    code=type(err).__name__,
                ) from None

        return with_retries(once, self.budget, on_retry=_log_retry)


def _key_vault_error(err: urllib.error.HTTPError, action: str) -> CloudError:
    try:
        code = str(json.loads(err.read() or b"{}").get("error", {}).get("code") or err.code)
    except (ValueError, AttributeError):
        code = str(err.code)
    status = err.code
    if status == 401:
        return CredentialsError(
            f"azure: {action}: Key Vault refused the token ({code}): log in again, or check the managed identity",
            provider="azure",
            code=code,
        )
    if status == 403:
        return PermissionDeniedError(
            f"azure: {action}: forbidden ({code}): the orchestrator needs the 'Key Vault Secrets Officer' role on the "
            "vault, a host 'Key Vault Secrets User' on its job's secret (key_vault_reader_assignment)",
            provider="azure",
            code=code,
        )
    if status == 404:
        return NotFoundError(f"azure: {action}: no such secret ({code})", provider="azure", code=code)
    if status == 429:
        return ThrottledError(f"azure: {action}: Key Vault throttled the call ({code})", provider="azure", code=code)
    if status >= 500:
        return ServiceUnavailableError(f"azure: {action}: Key Vault failed ({code})", provider="azure", code=code)
    return InvalidRequestError(f"azure: {action}: Key Vault refused the request ({code})", provider="azure", code=code)


# ---------------------------------------------------------------------------------------------------- local


class LocalFileStore(JobSecretStore):
    """Job secrets as files in one directory, each readable by its owner only: the local provider's hosts share this
    machine's filesystem and read the file where it is (`trainmover agent --secret-file`)."""

    kind: SecretKind = "local-file"

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = os.path.abspath(directory)

    def __repr__(self) -> str:
        return f"LocalFileStore({self.directory!r})"

    def put(self, job_id: str, secret: str) -> SecretRef:
        _check_value(secret)
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        ref = SecretRef(self.kind, os.path.join(self.directory, secret_name_for(job_id, self.kind)))
        write_secret_file(ref.name, secret)
        return ref

    def get(self, ref: SecretRef) -> str:
        self._check_ref(ref)
        try:
            st = os.stat(ref.name)
            if st.st_mode & 0o077:
                raise PermissionDeniedError(
                    f"local: the secret file {ref.name} is readable by other users (mode {st.st_mode & 0o777:o}); "
                    f"run `chmod 600 {ref.name}`",
                    provider="local",
                )
            with open(ref.name, encoding="utf-8") as f:
                return f.read().strip()
        except FileNotFoundError:
            raise NotFoundError(f"local: no secret file {ref.name}", provider="local") from None

    def delete(self, ref: SecretRef) -> None:
        self._check_ref(ref)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(ref.name)

    def _check_ref(self, ref: SecretRef) -> None:
        if ref.kind != self.kind or os.path.dirname(ref.name) != self.directory:
            raise InvalidRequestError(f"local: {ref.kind} secret {ref.name!r} is not in {self.directory}")


# ---------------------------------------------------------------------------------------------------- on the host


def fetch_secret(
    ref: SecretRef,
    *,
    aws_session: Any | None = None,
    endpoint_url: str | None = None,
    credential: TokenSource | None = None,
    imds_url: str = IMDS_URL,
    budget: RetryBudget = MUTATE,
    ssl_context: ssl.SSLContext | None = None,
) -> str:
    """The secret `ref` points to, read with this host's own identity: the instance role (boto3's default chain) on
    AWS, the VM's managed identity (IMDS) on Azure. What a host runs at boot, before its agent starts."""
    if ref.kind == "local-file":
        return LocalFileStore(os.path.dirname(ref.name)).get(ref)
    if ref.kind == "azure-keyvault":
        store = AzureKeyVaultStore(
            ref.vault_url,
            credential=credential or ImdsManagedIdentity(ref.identity_client_id, imds_url=imds_url),
            budget=budget,
            ssl_context=ssl_context,
        )
        return store.get(ref)
    assert ref.region is not None  # SecretRef checks it for AWS kinds
    api = _AwsSecretsApi(ref.region, aws_session, endpoint_url, budget)
    if ref.kind == "aws-ssm":
        value = str(api.call("ssm", "get_parameter", Name=ref.name, WithDecryption=True)["Parameter"]["Value"])
    else:
        value = str(api.call("secretsmanager", "get_secret_value", SecretId=ref.name)["SecretString"])
    _REDACTOR.remember(value)
    return value


def write_secret_file(path: str, secret: str) -> None:
    """Write `secret` to `path`, readable by its owner only (what runtime.auth.read_secret_file demands). Replaces
    a previous file atomically; never follows a link planted at `path`."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(secret.strip() + "\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def main(argv: Sequence[str] | None = None, *, fetch: Callable[[SecretRef], str] = fetch_secret) -> int:
    """`python -m cloud.secrets fetch --kind K --name N [--region R] [--identity-client-id ID] --to FILE`."""
    parser = argparse.ArgumentParser(prog="python -m cloud.secrets", description="Fetch the job's secret to a file.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("fetch", help="read the job's secret with this host's identity into FILE (mode 600)")
    p.add_argument("--kind", required=True, choices=get_args(SecretKind))
    p.add_argument("--name", required=True, help="the secret's ARN or name, parameter name, or Key Vault URL")
    p.add_argument("--region", help="AWS: the secret's region")
    p.add_argument("--identity-client-id", help="Azure: a user-assigned managed identity's client id")
    p.add_argument("--to", required=True, metavar="FILE")
    ns = parser.parse_args(argv)
    try:
        ref = SecretRef(ns.kind, ns.name, ns.region, ns.identity_client_id)
        write_secret_file(ns.to, _check_value(fetch(ref)))
    except (CloudError, OSError) as exc:
        print(f"trainmover secret fetch: {exc}", file=sys.stderr)
        return 2
    print(f"trainmover secret fetch: the job's secret from {ref.kind} is in {ns.to}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
