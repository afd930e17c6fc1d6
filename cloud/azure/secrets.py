"""The job's secret in Azure Key Vault, through its REST data plane, read on a VM with its managed identity.

`AzureKeyVaultStore` talks to a vault with a bearer token from an Azure SDK credential or the VM's managed
identity (`ImdsManagedIdentity`, from the instance metadata service, never through a proxy); who may read a secret
is an RBAC role assignment of "Key Vault Secrets User" on the secret itself (`key_vault_reader_assignment`).
Standard library only (plus azure-identity's DefaultAzureCredential when no credential is given): a VM fetches its
job's secret without the Azure SDK. `fetch_key_vault_secret` is what a host runs at boot (through
`python -m cloud.secrets fetch`).
"""

from __future__ import annotations

import json
import logging
import re
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, NamedTuple, Protocol

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
from cloud.notices import IMDS_URL, imds_opener
from cloud.secret_store import (
    GUID,
    KEY_VAULT_SECRET_NAME,
    JobSecretStore,
    SecretKind,
    SecretRef,
    remember_secret,
)

log = logging.getLogger("cloud.secrets")  # the name users configure, as before the store moved to cloud/azure/

KEY_VAULT_API_VERSION = "7.4"
KEY_VAULT_RESOURCE = "https://vault.azure.net"  # the token audience of every public-cloud vault
KEY_VAULT_SECRETS_USER_ROLE = "4633458b-17de-408a-b874-0445c86b69e6"  # built-in role: read secret contents
IMDS_TOKEN_API_VERSION = "2018-02-01"


def _log_retry(err: CloudError, attempt: int, delay_s: float) -> None:
    log.info("%s (attempt %d); retrying in %.2f s", err, attempt, delay_s)


class AccessToken(NamedTuple):
    """A bearer token and its expiry (epoch seconds): the shape of azure.core.credentials.AccessToken."""

    token: str
    expires_on: int


class TokenSource(Protocol):
    """What the Key Vault client needs of a credential: azure-identity's credentials and `ImdsManagedIdentity`."""

    def get_token(self, *scopes: str) -> Any: ...


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
            with imds_opener().open(request, timeout=self.timeout_s) as response:
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
    if not KEY_VAULT_SECRET_NAME.fullmatch(secret_name) or not GUID.fullmatch(principal_id):
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
        name = self._name_to_put(job_id, secret)
        body = {"value": secret, "contentType": "text/plain", "tags": {JOB_TAG: job_id},
                "attributes": {"enabled": True}}
        self._call("PUT", name, body)
        log.info("azure: stored the secret of job %s in %s as %s", job_id, self.vault_url, name)
        return SecretRef(self.kind, f"{self.vault_url}/secrets/{name}", identity_client_id=self.identity_client_id)

    def get(self, ref: SecretRef) -> str:
        self._check_ref(ref)
        value = str(self._call("GET", ref.secret_name)["value"])
        remember_secret(value)
        return value

    def delete(self, ref: SecretRef) -> None:
        self.delete_if_present(ref)

    def delete_if_present(self, ref: SecretRef) -> bool:
        """Delete the secret; True when there was one, False when it was already gone (what a release reports)."""
        self._check_ref(ref)
        try:
            # A soft delete: a vault with purge protection keeps it (unreadable) for its retention period.
            self._call("DELETE", ref.secret_name)
        except NotFoundError:
            return False
        return True

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


def fetch_key_vault_secret(
    ref: SecretRef,
    *,
    credential: TokenSource | None = None,
    imds_url: str = IMDS_URL,
    budget: RetryBudget = MUTATE,
    ssl_context: ssl.SSLContext | None = None,
) -> str:
    """The Key Vault secret `ref` points to, read with `credential` (default: this VM's managed identity)."""
    store = AzureKeyVaultStore(
        ref.vault_url,
        credential=credential or ImdsManagedIdentity(ref.identity_client_id, imds_url=imds_url),
        budget=budget,
        ssl_context=ssl_context,
    )
    return store.get(ref)


__all__ = [
    "AccessToken",
    "AzureKeyVaultStore",
    "ImdsManagedIdentity",
    "TokenSource",
    "fetch_key_vault_secret",
    "key_vault_reader_assignment",
]
