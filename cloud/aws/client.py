"""The one boto3 adapter: every AWS call TrainMover makes (the EC2 provider's, its network's and notice queue's,
and the secret stores') goes through `AwsApi`, and every botocore error becomes a `CloudError` here.

Nothing outside this module sees a botocore exception. boto3 is imported lazily (when an `AwsApi` is made), so
importing `cloud.aws` works without it. botocore makes exactly one attempt per call (`one_attempt_config`): the
named retry budgets of `cloud.base` are the only retry policy.

Two translations of errors: `ProviderErrors` (the provider's calls: messages quote AWS's own and say what to do)
and `SecretErrors` (the secret stores: a message never quotes a parameter nor a response body, since either may
hold the secret, and the botocore exception is not kept as the cause, since its context holds the request).
"""

from __future__ import annotations

import difflib
import logging
import re
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from cloud.base import (
    DESCRIBE,
    CapacityError,
    CloudError,
    CredentialsError,
    InvalidRequestError,
    NotFoundError,
    PermissionDeniedError,
    QuotaError,
    RetryBudget,
    ServiceUnavailableError,
    ThrottledError,
    UnsupportedError,
    validate_endpoint_url,
    with_retries,
)
from cloud.secret_store import AWS_REGION

if TYPE_CHECKING:
    import boto3

log = logging.getLogger("cloud.aws")
_secrets_log = logging.getLogger("cloud.secrets")  # the secret stores' retries, logged where they were

POLICY_DOC = "docs/iam/trainmover-aws-policy.json"

# Error codes, from https://docs.aws.amazon.com/AWSEC2/latest/APIReference/errors-overview.html and the common
# errors of the query/JSON protocols. Order matters in `ProviderErrors.from_code`:
# InsufficientInstanceCapacity comes back as HTTP 500, and InvalidClientTokenId looks like an invalid parameter.
_CAPACITY = frozenset(
    {
        "InsufficientInstanceCapacity",
        "InsufficientHostCapacity",
        "InsufficientReservedInstanceCapacity",
        "InsufficientCapacity",
        "SpotMaxPriceTooLow",
    }
)
_QUOTA = frozenset({"InstanceLimitExceeded", "VcpuLimitExceeded", "MaxSpotInstanceCountExceeded"})
_THROTTLED = frozenset(
    {
        "RequestLimitExceeded",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestThrottledException",
        "TooManyRequestsException",
    }
)
_CREDENTIALS = frozenset(
    {
        "AuthFailure",
        "UnrecognizedClientException",
        "ExpiredToken",
        "ExpiredTokenException",
        "InvalidClientTokenId",
        "SignatureDoesNotMatch",
        "IncompleteSignature",
        "MissingAuthenticationToken",
        "InvalidAccessKeyId",
        "RequestExpired",
    }
)
_DENIED = frozenset({"UnauthorizedOperation", "AccessDenied", "AccessDeniedException", "OptInRequired"})
_NOT_FOUND = frozenset({"QueueDoesNotExist", "AWS.SimpleQueueService.NonExistentQueue", "ResourceNotFoundException"})
_INVALID = frozenset(
    {"Unsupported", "UnsupportedOperation", "MissingParameter", "ValidationError", "IncorrectInstanceState"}
)
_UNAVAILABLE = frozenset({"InternalError", "InternalFailure", "ServiceUnavailable", "Unavailable"})
_NOT_IMPLEMENTED = frozenset({"NotImplemented", "InvalidAction"})
# The title of a server's own error page for HTTP 500 or 501 (werkzeug, nginx, Apache), quoted by botocore's
# ResponseParserError when such a page arrives instead of an AWS error document.
_SERVER_ERROR_PAGE = re.compile(r"<title>\s*50[01] (?:Internal Server Error|Not Implemented)\s*</title>", re.IGNORECASE)


# The secret stores' error codes (Secrets Manager, SSM).
_AWS_THROTTLED = frozenset({"ThrottlingException", "Throttling", "TooManyUpdates", "RequestThrottled"})
_AWS_CREDENTIALS = frozenset(
    {"UnrecognizedClientException", "InvalidClientTokenId", "ExpiredTokenException", "ExpiredToken",
     "InvalidSignatureException", "SignatureDoesNotMatch", "MissingAuthenticationToken"}
)
_AWS_DENIED = frozenset({"AccessDeniedException", "AccessDenied", "KMSAccessDeniedException"})
_AWS_NOT_FOUND = frozenset({"ResourceNotFoundException", "ParameterNotFound", "ParameterVersionNotFound"})
_AWS_UNAVAILABLE = frozenset({"InternalServiceError", "InternalServerError", "InternalFailure", "ServiceUnavailable"})


def api_name(operation: str) -> str:
    """The name IAM and the EC2 API use for a boto3 method: run_instances -> RunInstances."""
    return "".join(part.capitalize() for part in operation.split("_"))


def did_you_mean(value: str, known: Iterable[str]) -> str:
    """"did you mean A, B? " naming the (at most three) closest of `known`, or "" when none is close."""
    close = difflib.get_close_matches(value, sorted(known), n=3)
    return f"did you mean {', '.join(close)}? " if close else ""


def load_boto3() -> Any:
    try:
        import boto3
    except ImportError as err:  # pragma: no cover - exercised only where boto3 is absent
        raise ImportError("the AWS provider needs boto3: pip install 'trainmover[aws]'") from err
    return boto3


def one_attempt_config(region: str, read_timeout_s: int) -> Any:
    """The botocore client config of every AWS call of this project.

    botocore retries by itself (legacy mode: 5 attempts on throttling and 5xx). Under `with_retries` that multiplies
    the attempts and hides how long a call may take, so botocore makes exactly one attempt and the named budgets
    (MUTATE, DESCRIBE) are the only retry policy. Timeouts bound every call.
    https://boto3.amazonaws.com/v1/documentation/api/latest/guide/retries.html
    """
    import botocore.config

    return botocore.config.Config(
        region_name=region,
        retries={"total_max_attempts": 1, "mode": "standard"},
        connect_timeout=5,
        read_timeout=read_timeout_s,
        user_agent_extra="trainmover",
    )



class ProviderErrors:
    """How the provider's calls fail: one `CloudError` per botocore error, with AWS's message and what to do."""

    hide_cause = False  # raised `from` the botocore error

    def __init__(self, region: str) -> None:
        import botocore.exceptions
        import botocore.parsers

        self.region = region
        self.exc = botocore.exceptions
        self.parser_error = botocore.parsers.ResponseParserError
        self.caught: tuple[type[Exception], ...] = (self.exc.BotoCoreError, self.exc.ClientError, self.parser_error)

    @staticmethod
    def missing_sdk(err: ImportError) -> Exception:
        return ImportError("the AWS provider needs boto3: pip install 'trainmover[aws]'")

    @staticmethod
    def check_endpoint(endpoint_url: str | None) -> str | None:
        return validate_endpoint_url(
            endpoint_url, provider="aws", example="https://ec2.us-east-1.amazonaws.com or http://127.0.0.1:5000"
        )

    @staticmethod
    def check_region(region: str, session: Any) -> None:
        known: set[str] = set()
        for partition in session.get_available_partitions():
            known.update(session.get_available_regions("ec2", partition_name=partition))
        if region not in known:
            raise InvalidRequestError(
                f"unknown AWS region {region!r}: {did_you_mean(region, known)}EC2 regions include us-east-1, "
                "us-west-2, eu-west-1, ap-northeast-1 (full list: `aws ec2 describe-regions`)",
                provider="aws",
                code="InvalidRegion",
            )

    @staticmethod
    def bad_endpoint(service: str, err: ValueError) -> CloudError:
        return InvalidRequestError(
            f"aws: cannot make a {service} client: {err}", provider="aws", code="InvalidEndpointUrl"
        )

    @staticmethod
    def log_retry(err: CloudError, attempt: int, delay_s: float) -> None:
        log.info("aws: %s (attempt %d); retrying in %.2f s", err, attempt, delay_s)

    @staticmethod
    def cloud_error(kind: type[CloudError], where: str, text: str, code: str) -> CloudError:
        """A `kind` of AWS error: `text` after where it happened, with the AWS error `code`."""
        return kind(f"{where}: {text}", provider="aws", code=code)

    def translate(self, err: Exception, service: str, operation: str) -> CloudError:
        """One `CloudError` for a botocore error, with a message that says what to do."""
        action = f"{service}:{api_name(operation)}"
        where = f"aws {self.region}: {action}"
        exc = self.exc
        name = type(err).__name__
        if isinstance(err, exc.NoCredentialsError | exc.PartialCredentialsError | exc.CredentialRetrievalError):
            return self.cloud_error(
                CredentialsError,
                where,
                f"no usable AWS credentials ({name}). Provide them through the standard chain (AWS_PROFILE, or "
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, ~/.aws/credentials, an instance role), or name a "
                "Prefect Secret block in the flow's credentials_block (docs/flows.md).",
                name,
            )
        token_errors = tuple(
            getattr(exc, name)
            for name in ("TokenRetrievalError", "SSOTokenLoadError", "UnauthorizedSSOTokenError")
            if hasattr(exc, name)
        )
        if token_errors and isinstance(err, token_errors):
            return self.cloud_error(
                CredentialsError,
                where,
                "the AWS SSO token is missing or expired: run `aws sso login` (or refresh the credentials of the "
                "flow's credentials block).",
                name,
            )
        if isinstance(err, exc.ClientError):
            error = err.response.get("Error", {})
            code = str(error.get("Code", "Unknown"))
            message = str(error.get("Message", "")).split(" Encoded authorization failure message:")[0]
            status = int(err.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
            return self.from_code(code, message, status, action, where)
        if isinstance(err, self.parser_error) and _SERVER_ERROR_PAGE.search(str(err)):
            # A web page titled "500 Internal Server Error" / "501 Not Implemented" instead of an AWS error document:
            # an AWS-compatible endpoint (moto, another cloud's EC2 API) that lacks the call, or fails on it every
            # time. Not retried: the next attempt meets the same server. (A gateway's 502/503/504 page still is.)
            return self.cloud_error(
                UnsupportedError,
                where,
                f"this endpoint does not implement {action} (it answered an HTTP 500/501 page, not an AWS error): use "
                "an endpoint that has it, or leave out what needs it",
                "NotImplemented",
            )
        if isinstance(err, exc.ConnectionError | exc.HTTPClientError | self.parser_error):
            return self.cloud_error(
                ServiceUnavailableError,
                where,
                f"the AWS API did not answer properly ({name}); it is retried within the call's budget. Check network "
                "access to the endpoint if this persists.",
                name,
            )
        if isinstance(err, exc.ParamValidationError):
            return self.cloud_error(InvalidRequestError, where, f"invalid parameters: {err}", "ParamValidation")
        return self.cloud_error(CloudError, where, f"{name}: {err}", name)

    @staticmethod
    def from_code(code: str, message: str, status: int, action: str, where: str) -> CloudError:
        said = f" ({code}: {message})" if message else f" ({code})"

        def error(kind: type[CloudError], text: str) -> CloudError:
            return ProviderErrors.cloud_error(kind, where, text, code)

        if code in _CAPACITY:
            return error(
                CapacityError,
                f"AWS has no capacity for this now{said}. Fall back: another zone, instance type or standby tier, or "
                "try again later.",
            )
        if code in _QUOTA:
            return error(
                QuotaError,
                f"an account limit stops this{said}. Ask for a higher EC2 quota in the Service Quotas console (e.g. "
                "'Running On-Demand P instances' or 'All P Spot Instance Requests'), or launch fewer.",
            )
        if code in _THROTTLED:
            return error(ThrottledError, f"AWS API rate limit hit{said}.")
        if code in _CREDENTIALS:
            hint = "check this machine's clock" if code == "RequestExpired" else "refresh or replace them"
            return error(
                CredentialsError,
                f"AWS refused the credentials ({code}): {hint}, through the standard chain (AWS_PROFILE, "
                "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, ~/.aws/credentials, instance role) or the flow's "
                "credentials_block.",
            )
        if code in _DENIED:
            return error(
                PermissionDeniedError,
                f"the credentials are not allowed to call {action} ({code}). Grant it: see {POLICY_DOC} "
                "(`aws sts decode-authorization-message` explains an encoded denial).",
            )
        if code in _NOT_IMPLEMENTED or (code == str(status) and status in (500, 501)):
            # AWS's own 5xx answers carry an error code; a bare HTTP 500/501 without one (botocore then uses the
            # status as the code) is an AWS-compatible endpoint that lacks the call (moto, another cloud's EC2 API).
            # Retrying would only wait: the call is as missing on the next attempt.
            return error(
                UnsupportedError,
                f"this endpoint does not implement {action}{said}: use an endpoint that has it, or leave out what "
                "needs it",
            )
        if code.endswith("NotFound") or code in _NOT_FOUND:
            return error(NotFoundError, f"not found{said}.")
        if code.startswith("Invalid") or code in _INVALID:
            return error(InvalidRequestError, f"AWS refused the request as invalid{said}.")
        if status >= 500 or code in _UNAVAILABLE:
            return error(
                ServiceUnavailableError, f"the AWS API failed on its side{said}; retried within the call's budget."
            )
        if 400 <= status < 500:
            return error(InvalidRequestError, f"AWS refused the request{said}.")
        return error(CloudError, f"AWS error{said}.")


class SecretErrors(ProviderErrors):
    """How the secret stores' calls fail: messages never quote a parameter (botocore's ParamValidationError quotes
    the values it refuses) and never a response body; the botocore error is not kept as the cause."""

    hide_cause = True

    def __init__(self, region: str) -> None:
        super().__init__(region)
        # A response the parser cannot read is not translated here: it reaches the caller as it is.
        self.caught = (self.exc.BotoCoreError, self.exc.ClientError)

    @staticmethod
    def missing_sdk(err: ImportError) -> Exception:
        return CloudError("aws: the secret stores need boto3: pip install 'trainmover[aws]'", provider="aws")

    @staticmethod
    def check_endpoint(endpoint_url: str | None) -> str | None:
        return endpoint_url  # a bad one is refused when its client is made (`bad_endpoint`)

    @staticmethod
    def check_region(region: str, session: Any) -> None:
        pass  # checked by its form before the session is made (`AwsApi.for_secrets`)

    @staticmethod
    def bad_endpoint(service: str, err: ValueError) -> CloudError:
        return InvalidRequestError(
            f"aws: cannot make a {service} client ({err}): give an absolute http(s) endpoint URL",
            provider="aws",
            code="InvalidEndpointUrl",
        )

    @staticmethod
    def log_retry(err: CloudError, attempt: int, delay_s: float) -> None:
        _secrets_log.info("%s (attempt %d); retrying in %.2f s", err, attempt, delay_s)

    def translate(self, err: Exception, service: str, operation: str) -> CloudError:
        action = f"{service}:{api_name(operation)}"
        where = f"aws {self.region}: {action}"
        exc = self.exc
        name = type(err).__name__
        if isinstance(err, exc.ClientError):
            return self._from_client_error(err, action)
        if isinstance(err, exc.NoCredentialsError):
            return self.cloud_error(
                CredentialsError,
                where,
                "no usable AWS credentials: provide them through the standard chain (AWS_PROFILE, environment, "
                "~/.aws/credentials, the instance role)",
                name,
            )
        if isinstance(err, exc.ParamValidationError):
            hidden = "invalid parameters (not shown: they may hold the secret)"
            return self.cloud_error(InvalidRequestError, where, hidden, "ParamValidation")
        return self.cloud_error(
            ServiceUnavailableError, where, f"the AWS API did not answer ({name}); check network access to it", name
        )

    def _from_client_error(self, err: Any, action: str) -> CloudError:
        error = err.response.get("Error", {})
        code = str(error.get("Code", "Unknown"))
        status = int(err.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        where = f"aws {self.region}: {action}"
        if code in _AWS_THROTTLED:
            return self.cloud_error(ThrottledError, where, f"AWS API rate limit hit ({code})", code)
        if code in _AWS_CREDENTIALS:
            refused = f"AWS refused the credentials ({code}): refresh them"
            return self.cloud_error(CredentialsError, where, refused, code)
        if code in _AWS_DENIED:
            return self.cloud_error(
                PermissionDeniedError,
                where,
                f"not allowed ({code}): the orchestrator needs {action} on the job's secret, the instance role needs "
                "read access to it (cloud.secrets.instance_role_policy) and kms:Decrypt on its key",
                code,
            )
        if code in _AWS_NOT_FOUND:
            return self.cloud_error(NotFoundError, where, f"no such secret ({code})", code)
        if status >= 500 or code in _AWS_UNAVAILABLE:
            return self.cloud_error(ServiceUnavailableError, where, f"AWS failed on its side ({code})", code)
        # The service's message is not quoted: for a refused value it may echo part of it.
        return self.cloud_error(InvalidRequestError, where, f"AWS refused the request ({code})", code)


class AwsApi:
    """boto3 clients for one region, each call translated into `CloudError` (by `errors`: `ProviderErrors` or
    `SecretErrors`) and retried within a named budget."""

    def __init__(
        self,
        region: str,
        session: boto3.Session | None,
        endpoint_url: str | None,
        *,
        errors: type[ProviderErrors] = ProviderErrors,
        read_timeout_s: int = 30,
    ) -> None:
        try:
            self._boto3 = load_boto3()
        except ImportError as err:
            raise errors.missing_sdk(err) from err
        self.errors = errors(region)
        self.region = region
        self._session = session if session is not None else self._boto3.Session(region_name=region)
        self._endpoint_url = self.errors.check_endpoint(endpoint_url)
        self._config = one_attempt_config(region, read_timeout_s=read_timeout_s)
        self._clients: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.errors.check_region(region, self._session)

    @classmethod
    def for_secrets(cls, region: str, session: Any | None, endpoint_url: str | None) -> AwsApi:
        """The secret stores' adapter: `SecretErrors`, a shorter read timeout, the region checked by its form."""
        try:
            load_boto3()
        except ImportError as err:
            raise SecretErrors.missing_sdk(err) from err
        if not AWS_REGION.fullmatch(region):
            raise InvalidRequestError(f"aws: invalid region {region!r} (e.g. us-east-1)", provider="aws")
        return cls(region, session, endpoint_url, errors=SecretErrors, read_timeout_s=20)

    def client(self, service: str) -> Any:
        with self._lock:
            if service not in self._clients:
                try:
                    self._clients[service] = self._session.client(
                        service, region_name=self.region, endpoint_url=self._endpoint_url, config=self._config
                    )
                except ValueError as err:  # botocore's "Invalid endpoint: ..."
                    raise self.errors.bad_endpoint(service, err) from err
            return self._clients[service]

    def call(self, service: str, operation: str, budget: RetryBudget, **params: Any) -> dict[str, Any]:
        client = self.client(service)
        errors = self.errors

        def once() -> dict[str, Any]:
            try:
                response: dict[str, Any] = getattr(client, operation)(**params)
            except errors.caught as err:
                translated = errors.translate(err, service, operation)
                if errors.hide_cause:
                    # The botocore exception's context holds the request's parameters: not kept.
                    raise translated from None
                raise translated from err
            return response

        return with_retries(once, budget, on_retry=errors.log_retry)

    def dry_run(self, operation: str, **params: Any) -> None:
        """Run an EC2 call with DryRun=True: returns when AWS says it would have succeeded (DryRunOperation)."""
        client = self.client("ec2")
        errors = self.errors

        def once() -> None:
            try:
                getattr(client, operation)(DryRun=True, **params)
            except errors.exc.ClientError as err:
                if err.response.get("Error", {}).get("Code") == "DryRunOperation":
                    return
                raise errors.translate(err, "ec2", operation) from err
            except (errors.exc.BotoCoreError, errors.parser_error) as err:
                raise errors.translate(err, "ec2", operation) from err

        with_retries(once, DESCRIBE, on_retry=errors.log_retry)


__all__ = [
    "POLICY_DOC",
    "AwsApi",
    "ProviderErrors",
    "SecretErrors",
    "api_name",
    "did_you_mean",
    "load_boto3",
    "one_attempt_config",
]
