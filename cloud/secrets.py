"""The job's secret in the cloud's secret store: put by the orchestrator, fetched by each host at boot.

The job's secret authenticates every link and store record of a job (runtime.wire.auth), so it never travels in
user-data (any process on the instance, and anyone allowed DescribeInstanceAttribute or to read a VM's model, can
read that). Instead the orchestrator puts it in a secret store that only the job's own instance identity may read,
and the bootstrap (cloud.bootstrap) fetches it at every boot into a root-only file on tmpfs:

- AWS Secrets Manager (`AwsSecretsManagerStore`) and SSM Parameter Store (`AwsParameterStore`): `cloud.aws.secrets`;
- Azure Key Vault (`AzureKeyVaultStore`, `ImdsManagedIdentity`, `key_vault_reader_assignment`):
  `cloud.azure.secrets`;
- a local file (`LocalFileStore`): `cloud.local.secrets`;
- what they share (`SecretRef`, `JobSecretStore`, `secret_name_for`, redaction): `cloud.secret_store`.

This module re-exports them all, and is what a host runs: `python -m cloud.secrets fetch` reads the secret with
the host's own identity (`fetch_secret`) and writes it to a file (mode 600) for `trainmover agent --secret-file`.
Secret values never appear in messages, logs or reprs.
"""

from __future__ import annotations

import argparse
import os
import ssl
import sys
from collections.abc import Callable, Sequence
from typing import Any, get_args

from cloud.aws.secrets import (
    AwsParameterStore,
    AwsSecretsManagerStore,
    fetch_aws_secret,
    instance_role_policy,
    secrets_manager_policy,
)
from cloud.azure.secrets import (
    KEY_VAULT_API_VERSION,
    KEY_VAULT_RESOURCE,
    KEY_VAULT_SECRETS_USER_ROLE,
    AccessToken,
    AzureKeyVaultStore,
    ImdsManagedIdentity,
    TokenSource,
    fetch_key_vault_secret,
    key_vault_reader_assignment,
)
from cloud.base import MUTATE, CloudError, RetryBudget
from cloud.local.secrets import LocalFileStore
from cloud.notices import IMDS_URL
from cloud.secret_store import (
    MIN_SECRET_CHARS,
    JobSecretStore,
    SecretKind,
    SecretRef,
    check_secret_value,
    secret_name_for,
    write_secret_file,
)


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
        return fetch_key_vault_secret(
            ref, credential=credential, imds_url=imds_url, budget=budget, ssl_context=ssl_context
        )
    return fetch_aws_secret(ref, session=aws_session, endpoint_url=endpoint_url, budget=budget)


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
        write_secret_file(ns.to, check_secret_value(fetch(ref)))
    except (CloudError, OSError) as exc:
        print(f"trainmover secret fetch: {exc}", file=sys.stderr)
        return 2
    print(f"trainmover secret fetch: the job's secret from {ref.kind} is in {ns.to}", file=sys.stderr)
    return 0


__all__ = [
    "IMDS_URL",
    "KEY_VAULT_API_VERSION",
    "KEY_VAULT_RESOURCE",
    "KEY_VAULT_SECRETS_USER_ROLE",
    "MIN_SECRET_CHARS",
    "AccessToken",
    "AwsParameterStore",
    "AwsSecretsManagerStore",
    "AzureKeyVaultStore",
    "ImdsManagedIdentity",
    "JobSecretStore",
    "LocalFileStore",
    "SecretKind",
    "SecretRef",
    "TokenSource",
    "fetch_secret",
    "instance_role_policy",
    "key_vault_reader_assignment",
    "main",
    "secret_name_for",
    "secrets_manager_policy",
    "write_secret_file",
]


if __name__ == "__main__":
    sys.exit(main())
