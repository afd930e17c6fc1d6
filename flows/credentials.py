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

A team's existing credentials block of Prefect's own integrations serves as well, under the same parameter: a
prefect-aws `AwsCredentials` block (type `aws-credentials`) for AWS, a prefect-azure
`AzureContainerInstanceCredentials` or `AzureBlobStorageCredentials` block (types
`azure-container-instance-credentials`, `azure-blob-storage-credentials`) for Azure. Neither package is needed:
the block's document is read by name through the Prefect client, with its secrets, and its fields (named as ours)
become the same records. A Secret block of the name is read first.
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

INTEGRATION_BLOCK_TYPES: dict[str, tuple[str, ...]] = {
    "aws": ("aws-credentials",),
    "azure": ("azure-container-instance-credentials", "azure-blob-storage-credentials"),
}
"""The block types of prefect-aws and prefect-azure that hold each provider's credentials, by their slugs; their
key fields have our records' names (AwsKeys, AzureServicePrincipal), so a document's fields map one to one."""


def _expected_keys(record: type[BaseModel]) -> str:
    return ", ".join(name for name in record.model_fields)


def _kinds(provider: str) -> str:
    """The blocks a provider's credentials may come from, for a message."""
    return " or ".join(["a Secret block", *(f"an {slug} block" for slug in INTEGRATION_BLOCK_TYPES[provider])])


def load_credentials(block_name: str, provider: Literal["local", "aws", "azure"]) -> CloudCredentials:
    """The credentials for `provider` in the block `block_name`: a Secret block holding the JSON object, else a
    prefect-aws / prefect-azure credentials block (`INTEGRATION_BLOCK_TYPES`); or one `CredentialsBlockError`
    that names the block and says what to do. No message here quotes a value from the block."""
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
        return _from_integration_block(block_name, provider, record)
    assert isinstance(block, Secret)  # a sync caller gets the block, not a coroutine
    value: Any = block.get()
    if not isinstance(value, dict):
        raise CredentialsBlockError(
            f"Secret block {block_name!r} does not hold a JSON object; store {{{_expected_keys(record)}}} in it "
            f"(see {DOC})"
        )
    return _validated(record, value, f"Secret block {block_name!r} is not {provider} credentials",
                      f"it needs the keys {_expected_keys(record)}")


def _validated(record: type[AwsKeys] | type[AzureServicePrincipal], value: dict[str, Any], what: str, fix: str
               ) -> CloudCredentials:
    try:
        return record.model_validate(value)
    except ValidationError as err:
        # Only where and what: pydantic's default message would quote the input, which may be a secret.
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'value'}: {e['msg']}" for e in err.errors(include_input=False)
        )
        raise CredentialsBlockError(f"{what} ({problems}); {fix} (see {DOC})") from None


def _from_integration_block(block_name: str, provider: str, record: type[AwsKeys] | type[AzureServicePrincipal]
                            ) -> CloudCredentials:
    """The credentials in the prefect-aws / prefect-azure block `block_name`, read as a document through the
    Prefect client (the integration packages need not be installed)."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        for slug in INTEGRATION_BLOCK_TYPES[provider]:
            try:
                document = client.read_block_document_by_name(block_name, slug, include_secrets=True)
            except ObjectNotFound:
                continue
            data = document.data
            # Only our record's fields, and only those set: the blocks carry others (a region, client parameters).
            keys = {k: data[k] for k in record.model_fields if data.get(k) not in (None, "")}
            missing = [k for k in record.model_fields if k not in keys and record.model_fields[k].is_required()]
            if missing:
                hint = ("; a profile_name is not read: a profile lives on one host's ~/.aws (leave credentials_block "
                        "unset and boto3's standard chain reads it there)" if data.get("profile_name") else "")
                raise CredentialsBlockError(
                    f"{slug} block {block_name!r} lacks {', '.join(missing)}{hint}: the flow passes the keys "
                    f"{_expected_keys(record)} to the SDK; fill them in the block (see {DOC})"
                )
            return _validated(record, keys, f"{slug} block {block_name!r} is not usable {provider} credentials",
                              f"fill {_expected_keys(record)} in it")
        # Not found under any type this provider reads: is the name another type's block (an Azure block for an AWS
        # run, a storage block)? Listed without secrets, for the message only.
        others = sorted({(d.block_type.slug if d.block_type is not None else str(d.block_type_name))
                         for d in client.read_block_documents(include_secrets=False) if d.name == block_name})
    if others:
        raise CredentialsBlockError(
            f"block {block_name!r} is of type {' and '.join(others)}, which holds no {provider} credentials: "
            f"run.provider {provider!r} reads them from {_kinds(provider)} of that name; name such a block in "
            f"credentials_block (see {DOC})"
        )
    integration = " or ".join(f"an {slug} block" for slug in INTEGRATION_BLOCK_TYPES[provider])
    raise CredentialsBlockError(
        f"no Secret block named {block_name!r} on this Prefect server, nor {integration} of that name: create a "
        f"Secret block with the keys {_expected_keys(record)} (see {DOC}), or set credentials_block to an existing one"
    )


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
    "INTEGRATION_BLOCK_TYPES",
    "AwsKeys",
    "AzureServicePrincipal",
    "CloudCredentials",
    "CredentialsBlockError",
    "load_credentials",
    "provider_options",
]
