"""Cloud credentials for the flows: read at run time from a Prefect `Secret` block, handed to the provider's SDK.

A deployment names the block (the flow's `credentials_block` parameter), never its value: the flow loads the
block when it runs, checks it holds the keys its provider needs, and passes them to the SDK's own credential
object (a boto3 `Session`, an azure-identity `ClientSecretCredential`). The values never go into the process
environment, a parameter, a log line or an artifact; the records here hold them as `SecretStr`, so a repr or a
validation error shows `**********`. Without a block the providers use their SDK's standard chain (an instance
profile, a managed identity, `az login`), which is still the best choice where the worker host has an identity.

The block holds one JSON object (see docs/flows.md for how to create it):
- AWS: `{"aws_access_key_id": ..., "aws_secret_access_key": ..., "aws_session_token": ...}` (the token optional);
- Azure: `{"tenant_id": ..., "client_id": ..., "client_secret": ...}` (a service principal).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError

from flows.models import BLOCK_NAME_PATTERN

DOC = "docs/flows.md, 'Credentials'"


class CredentialsBlockError(ValueError):
    """The named credentials block is missing or does not hold what the provider needs: a user's error."""


class AwsKeys(BaseModel):
    """An AWS access key (and, for temporary credentials, its session token)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    aws_access_key_id: str = Field(min_length=1, description="The access key id (AKIA... or ASIA...).")
    aws_secret_access_key: SecretStr = Field(min_length=1, description="The secret access key.")
    aws_session_token: SecretStr | None = Field(default=None, description="Session token of temporary credentials.")


class AzureServicePrincipal(BaseModel):
    """An Azure service principal's client secret credential."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tenant_id: str = Field(min_length=1, description="The Microsoft Entra tenant (directory) id.")
    client_id: str = Field(min_length=1, description="The service principal's application (client) id.")
    client_secret: SecretStr = Field(min_length=1, description="The service principal's client secret.")


CloudCredentials = AwsKeys | AzureServicePrincipal
_RECORDS: dict[str, type[AwsKeys] | type[AzureServicePrincipal]] = {"aws": AwsKeys, "azure": AzureServicePrincipal}


def _expected_keys(record: type[BaseModel]) -> str:
    return ", ".join(name for name in record.model_fields)


def load_credentials(block_name: str, provider: Literal["local", "aws", "azure"]) -> CloudCredentials:
    """The credentials in the Secret block `block_name` for `provider`, or one `CredentialsBlockError` that says
    what to do. No message here quotes a value from the block."""
    from prefect.blocks.system import Secret

    record = _RECORDS.get(provider)
    if record is None:
        raise CredentialsBlockError(
            f"credentials_block {block_name!r} is for provider 'aws' or 'azure'; run.provider is {provider!r}: "
            "leave credentials_block unset"
        )
    try:
        block = Secret.load(block_name)
    except ValueError:
        # Prefect raises ValueError("Unable to find block document named ...") for a name it does not know.
        raise CredentialsBlockError(
            f"no Secret block named {block_name!r} on this Prefect server: create it with the keys "
            f"{_expected_keys(record)} (see {DOC}), or set credentials_block to an existing one"
        ) from None
    assert isinstance(block, Secret)  # a sync caller gets the block, not a coroutine
    value: Any = block.get()
    if not isinstance(value, dict):
        raise CredentialsBlockError(
            f"Secret block {block_name!r} does not hold a JSON object; store {{{_expected_keys(record)}}} in it "
            f"(see {DOC})"
        )
    try:
        return record.model_validate(value)
    except ValidationError as err:
        # Only where and what: pydantic's default message would quote the input, which may be a secret.
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'value'}: {e['msg']}" for e in err.errors(include_input=False)
        )
        raise CredentialsBlockError(
            f"Secret block {block_name!r} is not {provider} credentials ({problems}); it needs the keys "
            f"{_expected_keys(record)} (see {DOC})"
        ) from None


def provider_options(credentials: CloudCredentials, region: str | None) -> dict[str, Any]:
    """The provider constructor's keyword argument that carries `credentials`: a boto3 session for AwsProvider,
    an azure-identity credential for AzureProvider. The SDKs are imported here, only when a block is used."""
    if isinstance(credentials, AwsKeys):
        import boto3

        token = credentials.aws_session_token
        session = boto3.Session(
            aws_access_key_id=credentials.aws_access_key_id,
            aws_secret_access_key=credentials.aws_secret_access_key.get_secret_value(),
            aws_session_token=token.get_secret_value() if token is not None else None,
            region_name=region,
        )
        return {"session": session}
    from azure.identity import ClientSecretCredential

    return {
        "credential": ClientSecretCredential(
            tenant_id=credentials.tenant_id,
            client_id=credentials.client_id,
            client_secret=credentials.client_secret.get_secret_value(),
        )
    }


__all__ = [
    "BLOCK_NAME_PATTERN",
    "AwsKeys",
    "AzureServicePrincipal",
    "CloudCredentials",
    "CredentialsBlockError",
    "load_credentials",
    "provider_options",
]
