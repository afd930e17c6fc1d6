"""The one Azure SDK adapter: the compute and network clients of one provider, every ARM call under a named retry
budget, the long-running operations bounded in time, and every SDK error translated into a `CloudError`.

`AzureProvider` (and its job network, through the callables it hands it) calls Azure only through an `AzureApi`.
The SDK is imported when one is made, never when this module is imported. Key Vault and the instance metadata
service are plain HTTPS (`cloud.azure.secrets`, `cloud.azure.notices`) and need no SDK.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from cloud.base import (
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
    validate_endpoint_url,
    with_retries,
)

if TYPE_CHECKING:
    from azure.core.credentials import TokenCredential
    from azure.core.polling import LROPoller
    from azure.mgmt.compute import ComputeManagementClient

PROVIDER = "azure"
INSTALL_HINT = "pip install 'trainmover[azure]'"
LOGIN_HINT = (
    "log in with `az login`, or set AZURE_TENANT_ID / AZURE_CLIENT_ID / AZURE_CLIENT_SECRET (a service principal), "
    "or run where a managed identity is assigned; see https://aka.ms/azsdk/python/identity/defaultazurecredential"
)
ROLE_HINT = "assign the custom role in docs/iam/trainmover-azure-role.json on the resource group (docs/cloud-azure.md)"

# Without a Retry-After header the SDK waits `polling_interval` between LRO polls; its default (30 s) would add
# up to half a minute to every start. Azure usually sends Retry-After on VM operations, which takes precedence.
DEFAULT_POLLING_INTERVAL_S = 5.0
# A status poll of a long-running operation that ARM throttles (429) or fails on its side (5xx) is retried, honouring
# Retry-After, within the operation's own time bound (`lro_timeout_s`): the operation itself is still running, and
# giving up would fail a launch (and delete its VMs) over one busy moment of the API. Backoff without Retry-After:
POLL_RETRY = RetryBudget("lro-poll", attempts=1_000, base_delay_s=1.0, max_delay_s=30.0, deadline_s=900.0)
_TRANSIENT_POLL_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_ARM_ENDPOINT = "https://management.azure.com"

_CAPACITY_CODES = frozenset(
    {
        "allocationfailed",
        "zonalallocationfailed",
        "overconstrainedallocationrequest",
        "overconstrainedzonalallocationrequest",
        "skunotavailable",
    }
)
_QUOTA_CODES = frozenset({"quotaexceeded", "operationnotallowedquotaexceeded"})
_PERMISSION_CODES = frozenset({"authorizationfailed", "linkedauthorizationfailed", "forbidden"})
_NOT_FOUND_CODES = frozenset({"resourcenotfound", "resourcegroupnotfound", "notfound", "parentresourcenotfound"})
_CREDENTIALS_CODES = frozenset({"invalidauthenticationtoken", "expiredauthenticationtoken", "authenticationfailed"})

T = TypeVar("T")


class AzureApi:
    """The Azure SDK for one subscription, resource group and location. `lro_timeout_s` bounds each long-running
    operation; `client_kwargs` go to the SDK clients (transport settings, `polling_interval`)."""

    def __init__(
        self,
        subscription_id: str,
        resource_group: str,
        location: str,
        *,
        credential: TokenCredential | None,
        base_url: str | None,
        client_kwargs: Mapping[str, object] | None,
        lro_timeout_s: float,
    ) -> None:
        self.subscription_id = subscription_id
        self.resource_group = resource_group
        self.location = location
        self.lro_timeout_s = lro_timeout_s
        validate_endpoint_url(base_url, provider=PROVIDER, example="https://management.azure.com")
        kwargs = dict(client_kwargs or {})
        self._polling_interval_s = float(kwargs.get("polling_interval", DEFAULT_POLLING_INTERVAL_S))  # type: ignore[arg-type]
        self._arm_endpoint = base_url or _ARM_ENDPOINT
        self.compute = self._make_client(credential, base_url, kwargs)
        self._network_client: Any = None
        self._authorization_client: Any = None
        self._network_lock = threading.Lock()

    def _make_client(
        self, credential: TokenCredential | None, base_url: str | None, kwargs: dict[str, object]
    ) -> ComputeManagementClient:
        try:
            from azure.mgmt.compute import ComputeManagementClient
        except ImportError as err:
            raise CloudError(f"azure: azure-mgmt-compute is not installed: {INSTALL_HINT}", provider=PROVIDER) from err
        if credential is None:
            try:
                from azure.identity import DefaultAzureCredential
            except ImportError as err:
                raise CloudError(f"azure: azure-identity is not installed: {INSTALL_HINT}", provider=PROVIDER) from err
            credential = DefaultAzureCredential()
        self._credential, self._base_url, self._client_kwargs = credential, base_url, kwargs
        # The SDK retries 429/5xx on its own (up to 10 times by default, honouring Retry-After). With our named
        # RetryBudgets around every call that would multiply the attempts and hide throttling from the budget, so
        # it retries nothing: https://learn.microsoft.com/python/api/azure-core/azure.core.pipeline.policies.retrypolicy
        kwargs.setdefault("retry_total", 0)
        kwargs.setdefault("polling_interval", DEFAULT_POLLING_INTERVAL_S)
        return ComputeManagementClient(credential, self.subscription_id, base_url=base_url, **kwargs)  # type: ignore[arg-type]

    def network(self) -> Any:
        """The azure-mgmt-network client (made on the first job network: a launch without one never needs it)."""
        with self._network_lock:
            if self._network_client is None:
                try:
                    from azure.mgmt.network import NetworkManagementClient
                except ImportError as err:
                    raise CloudError(f"azure: a job network needs azure-mgmt-network: {INSTALL_HINT}",
                                     provider=PROVIDER) from err
                self._network_client = NetworkManagementClient(
                    self._credential, self.subscription_id, base_url=self._base_url,
                    **self._client_kwargs,  # type: ignore[arg-type]
                )
            return self._network_client

    def authorization(self) -> Any:
        """The azure-mgmt-authorization client (made on the first launch whose hosts read a Key Vault secret, for the
        role assignments of `cloud.azure.identities`). Its subscription is this provider's; every call it makes names
        its scope in full, so a vault in another subscription of the tenant works too."""
        with self._network_lock:
            if self._authorization_client is None:
                try:
                    from azure.mgmt.authorization import AuthorizationManagementClient
                except ImportError as err:
                    raise CloudError(
                        "azure: granting VMs read access to the job's Key Vault secret needs azure-mgmt-authorization: "
                        f"{INSTALL_HINT}",
                        provider=PROVIDER,
                    ) from err
                self._authorization_client = AuthorizationManagementClient(
                    self._credential, self.subscription_id, base_url=self._base_url or _ARM_ENDPOINT,
                    **self._client_kwargs,  # type: ignore[arg-type]
                )
            return self._authorization_client

    def translate(self, err: Exception, action: str) -> CloudError | None:
        """The CloudError for an SDK exception, or None when `err` is not an SDK error (a programming error)."""
        from azure.core.exceptions import (
            ClientAuthenticationError,
            HttpResponseError,
            ServiceRequestError,
            ServiceResponseError,
        )

        if isinstance(err, CloudError):
            return err
        if isinstance(err, ClientAuthenticationError) and err.status_code is None:
            # Raised by the credential before any request left (CredentialUnavailableError and friends).
            first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            return CredentialsError(
                f"azure: no usable credentials for {action} ({first_line[:300].rstrip('.')}). To fix: {LOGIN_HINT}",
                provider=PROVIDER,
                code=type(err).__name__,
            )
        if isinstance(err, ServiceRequestError | ServiceResponseError):
            return ServiceUnavailableError(
                f"azure: {action} could not reach ARM ({type(err).__name__}); retry later or check the network",
                provider=PROVIDER,
                code=type(err).__name__,
            )
        if not isinstance(err, HttpResponseError):
            return None
        status = err.status_code or 0
        code = _error_code(err)
        lowered = (code or "").lower()
        detail = _error_message(err)
        where = f"{action} ({code or status}: {detail})"
        if lowered in _CAPACITY_CODES:
            return CapacityError(
                f"azure: no capacity for {where}. Fall back to another zone, size or tier, or wait",
                provider=PROVIDER,
                code=code,
            )
        if lowered in _QUOTA_CODES or (lowered == "operationnotallowed" and "quota" in detail.lower()):
            return QuotaError(
                f"azure: quota exceeded for {where}. Request more quota for this VM family in {self.location} "
                "(portal: Subscriptions > Usage + quotas)",
                provider=PROVIDER,
                code=code,
            )
        if status == 429 or lowered in {"toomanyrequests", "throttled"}:
            return ThrottledError(
                f"azure: ARM throttled {action} and the retry budget ran out; retry later or call less often",
                provider=PROVIDER,
                code=code or "TooManyRequests",
            )
        if status == 401 or lowered in _CREDENTIALS_CODES:
            return CredentialsError(
                f"azure: credentials refused for {action} ({code or status}). To fix: {LOGIN_HINT}",
                provider=PROVIDER,
                code=code,
            )
        if status == 403 or lowered in _PERMISSION_CODES:
            return PermissionDeniedError(
                f"azure: permission denied: {action} on resource group {self.resource_group!r} ({code or status}). "
                f"To fix: {ROLE_HINT}",
                provider=PROVIDER,
                code=code,
            )
        if status == 404 or lowered in _NOT_FOUND_CODES:
            return NotFoundError(f"azure: not found: {where}", provider=PROVIDER, code=code)
        if status >= 500 or lowered in {"internalservererror", "serviceunavailable", "internalexecutionerror"}:
            return ServiceUnavailableError(f"azure: ARM failed on its side: {where}", provider=PROVIDER, code=code)
        if status == 409 and lowered in {"operationnotallowed", "conflict"}:
            return InvalidRequestError(f"azure: ARM refused {where}", provider=PROVIDER, code=code)
        if 400 <= status < 500 or lowered == "invalidparameter":
            return InvalidRequestError(f"azure: invalid request: {where}", provider=PROVIDER, code=code)
        return ServiceUnavailableError(f"azure: unexpected answer to {where}", provider=PROVIDER, code=code)

    def call(self, action: str, call: Callable[[], T], budget: RetryBudget) -> T:
        """Run one SDK call under `budget`, with SDK errors mapped; Retry-After is a lower bound on the delay."""
        retry_after_s = 0.0

        def attempt() -> T:
            nonlocal retry_after_s
            try:
                return call()
            except Exception as err:
                mapped = self.translate(err, action)
                if mapped is None:
                    raise
                retry_after_s = _retry_after_s(err) if isinstance(mapped, ThrottledError) else 0.0
                if mapped is err:
                    raise
                raise mapped from err

        def sleep(delay_s: float) -> None:
            # with_retries picks a jittered delay; ARM's Retry-After says when it will accept us again. Capped at
            # the budget's max delay so that a large header cannot stretch the budget's deadline much.
            time.sleep(max(delay_s, min(retry_after_s, budget.max_delay_s)))

        return with_retries(attempt, budget, sleep=sleep)

    def polling(self) -> Any:
        """The SDK's ARM polling method for one long-running operation, with its status polls retried (see
        `POLL_RETRY`) until `lro_timeout_s` after the operation started."""
        return _poll_retrying_class()(
            self._polling_interval_s,
            path_format_arguments={"endpoint": self._arm_endpoint},
            budget_s=self.lro_timeout_s,
        )

    def wait(self, poller: LROPoller[Any], action: str) -> Any:
        """Wait for one long-running operation within `lro_timeout_s`; its failure becomes a CloudError."""
        try:
            result = poller.result(timeout=self.lro_timeout_s)
        except Exception as err:
            mapped = self.translate(err, action)
            if mapped is None:
                raise
            raise mapped from err
        if not poller.done():
            raise ServiceUnavailableError(
                f"azure: {action} did not finish within {self.lro_timeout_s:.0f} s; it may still complete "
                "(describe() shows its state)",
                provider=PROVIDER,
                code="LroTimeout",
            )
        return result

    def wait_all(self, pollers: Mapping[str, LROPoller[Any]], action: str) -> dict[str, CloudError]:
        """Wait for every operation (they run in parallel on ARM's side); the errors, by VM name."""
        errors: dict[str, CloudError] = {}
        for vm_name, poller in pollers.items():
            try:
                self.wait(poller, f"{action} {vm_name}")
            except CloudError as err:
                errors[vm_name] = err
        return errors


_POLL_RETRYING_CLASS: type | None = None


def _poll_retrying_class() -> type:
    """ARMPolling whose status polls survive throttling; built on first use so that importing this module never
    imports the SDK."""
    global _POLL_RETRYING_CLASS
    if _POLL_RETRYING_CLASS is not None:
        return _POLL_RETRYING_CLASS
    from azure.core.exceptions import ServiceRequestError, ServiceResponseError
    from azure.mgmt.core.polling.arm_polling import ARMPolling

    class PollRetryingArmPolling(ARMPolling):
        """The SDK's ARM polling, except that a 408/429/5xx status poll (or a dropped connection) is polled again
        after Retry-After (or a backoff) while the operation's time budget lasts. The client's own retry policy
        stays off (`retry_total=0`): the initial request of each operation is retried by our named budgets."""

        def __init__(self, timeout: float, *, budget_s: float, **kwargs: Any) -> None:
            super().__init__(timeout, **kwargs)
            self._budget_s = budget_s
            self._deadline: float | None = None
            self.poll_retries = 0

        def request_status(self, status_link: str) -> Any:
            if self._deadline is None:
                self._deadline = time.monotonic() + self._budget_s
            attempt = 0
            while True:
                try:
                    response = super().request_status(status_link)
                except (ServiceRequestError, ServiceResponseError):
                    if not self._pause(attempt, None):
                        raise
                else:
                    http = response.http_response
                    if http.status_code not in _TRANSIENT_POLL_STATUS or not self._pause(
                        attempt, _retry_after_header(http.headers)
                    ):
                        return response
                attempt += 1
                self.poll_retries += 1

        def _pause(self, attempt: int, retry_after_s: float | None) -> bool:
            """Wait before the next poll; False (and no wait) when that would pass the operation's deadline."""
            delay = retry_after_s if retry_after_s is not None else POLL_RETRY.delay_s(attempt)
            assert self._deadline is not None
            if time.monotonic() + delay > self._deadline:
                return False
            self._sleep(delay)
            return True

    _POLL_RETRYING_CLASS = PollRetryingArmPolling
    return PollRetryingArmPolling


def _retry_after_header(headers: Mapping[str, str]) -> float | None:
    try:
        value = headers.get("Retry-After")
        return None if value is None else max(0.0, float(value))
    except (TypeError, ValueError):
        return None  # an HTTP date: fall back to our backoff


def _error_code(err: Any) -> str | None:
    if err.error is not None and err.error.code:
        return str(err.error.code)
    body = _error_body(err)
    inner = body.get("error") if isinstance(body.get("error"), dict) else body
    code = inner.get("code") if isinstance(inner, dict) else None
    return str(code) if code else None


def _error_message(err: Any) -> str:
    if err.error is not None and err.error.message:
        return str(err.error.message)[:400]
    body = _error_body(err)
    inner = body.get("error") if isinstance(body.get("error"), dict) else body
    message = inner.get("message") if isinstance(inner, dict) else None
    return str(message or err.reason or "no detail")[:400]


def _error_body(err: Any) -> dict[str, Any]:
    try:
        body = json.loads(err.response.text()) if err.response is not None else {}
    except Exception:
        return {}
    return body if isinstance(body, dict) else {}


def _retry_after_s(err: Any) -> float:
    try:
        return max(0.0, float(err.response.headers.get("Retry-After", 0))) if err.response is not None else 0.0
    except (TypeError, ValueError):
        return 0.0


__all__ = [
    "DEFAULT_POLLING_INTERVAL_S",
    "INSTALL_HINT",
    "LOGIN_HINT",
    "POLL_RETRY",
    "PROVIDER",
    "ROLE_HINT",
    "AzureApi",
]
