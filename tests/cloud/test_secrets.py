"""The job's secret in AWS Secrets Manager / SSM (moto's server over HTTP) and Azure Key Vault (a local REST server
over HTTPS), put by the orchestrator and fetched by a host, with nothing of it in any log."""

from __future__ import annotations

import json
import logging
import os
import secrets
import stat
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest

from cloud.base import (
    JOB_TAG,
    CredentialsError,
    InvalidRequestError,
    NotFoundError,
    RetryBudget,
)
from cloud.secrets import (
    AccessToken,
    AwsParameterStore,
    AwsSecretsManagerStore,
    AzureKeyVaultStore,
    ImdsManagedIdentity,
    SecretRef,
    fetch_secret,
    instance_role_policy,
    key_vault_reader_assignment,
    main,
    secret_name_for,
    secrets_manager_policy,
    write_secret_file,
)
from tests.cloud.keyvault_server import KeyVaultServer, ManagedIdentityImds, TokenBook, key_vault

REGION = "us-east-1"
ROLE = "arn:aws:iam::123456789012:role/llm-7b-nodes"
ORCHESTRATOR = "arn:aws:iam::123456789012:role/trainmover-orchestrator"
FAST = RetryBudget("secrets-test", attempts=3, base_delay_s=0.01, max_delay_s=0.02, deadline_s=5.0)
IDENTITY = "0b6a4f1e-2c3d-4e5f-8a9b-0c1d2e3f4a5b"


def new_secret() -> str:
    return secrets.token_hex(32)


def session() -> boto3.Session:
    return boto3.Session(aws_access_key_id="testing", aws_secret_access_key="not-a-real-key", region_name=REGION)


@pytest.fixture(scope="module")
def vault(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[KeyVaultServer, ManagedIdentityImds]]:
    with key_vault(tmp_path_factory.mktemp("kv-tls")) as servers:
        yield servers


class StaticToken:
    """A credential that hands out one token (what an azure-identity credential looks like to the store)."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.scopes: list[str] = []

    def get_token(self, *scopes: str) -> AccessToken:
        self.scopes.extend(scopes)
        return AccessToken(self.token, 2**31)


def kv_store(server: KeyVaultServer, token: str | None = None) -> AzureKeyVaultStore:
    return AzureKeyVaultStore(
        server.url, credential=StaticToken(token or server.tokens.issue()), budget=FAST,
        ssl_context=server.client_ssl_context(),
    )


# ------------------------------------------------------------------------------------------------ AWS


def test_secrets_manager_secret_is_tagged_and_only_the_job_role_may_read_it(moto_url: str) -> None:
    store = AwsSecretsManagerStore(REGION, reader_role_arn=ROLE, also_readable_by=[ORCHESTRATOR], session=session(),
                                   endpoint_url=moto_url, budget=FAST)
    secret = new_secret()
    ref = store.put("llm-7b", secret)
    assert ref.kind == "aws-secretsmanager" and ref.region == REGION
    assert ref.name.startswith("arn:aws:secretsmanager:us-east-1:")
    assert ":secret:trainmover/llm-7b/job-secret" in ref.name
    assert store.get(ref) == secret

    sm = session().client("secretsmanager", endpoint_url=moto_url)
    described = sm.describe_secret(SecretId=ref.name)
    assert {"Key": JOB_TAG, "Value": "llm-7b"} in described["Tags"]
    policy = json.loads(sm.get_resource_policy(SecretId=ref.name)["ResourcePolicy"])
    allow, deny = policy["Statement"]
    assert allow["Effect"] == "Allow" and allow["Principal"] == {"AWS": [ROLE, ORCHESTRATOR]}
    assert deny["Effect"] == "Deny" and deny["Principal"] == "*"
    assert deny["Condition"] == {"StringNotEquals": {"aws:PrincipalArn": [ROLE, ORCHESTRATOR]}}
    assert "secretsmanager:GetSecretValue" in deny["Action"]

    # A second put (a job restarted with a new secret) replaces the value under the same name.
    replacement = new_secret()
    assert store.put("llm-7b", replacement).name == ref.name
    assert store.get(ref) == replacement

    store.delete(ref)
    with pytest.raises(NotFoundError):
        store.get(ref)
    store.delete(ref)  # already gone: no error


def test_ssm_secure_string_is_tagged_overwritten_and_deleted(moto_url: str) -> None:
    store = AwsParameterStore(REGION, session=session(), endpoint_url=moto_url, budget=FAST)
    secret = new_secret()
    ref = store.put("llm-13b", secret)
    assert ref == SecretRef("aws-ssm", "/trainmover/llm-13b/job-secret", REGION)
    ssm = session().client("ssm", endpoint_url=moto_url)
    raw = ssm.get_parameter(Name=ref.name)["Parameter"]
    assert raw["Type"] == "SecureString" and raw["Value"] != secret  # not readable without decryption
    tags = ssm.list_tags_for_resource(ResourceType="Parameter", ResourceId=ref.name)["TagList"]
    assert {"Key": JOB_TAG, "Value": "llm-13b"} in tags
    assert store.get(ref) == secret

    replacement = new_secret()
    store.put("llm-13b", replacement)
    assert store.get(ref) == replacement
    store.delete(ref)
    with pytest.raises(NotFoundError):
        store.get(ref)
    store.delete(ref)


def test_a_host_fetches_with_its_own_credentials_and_writes_a_root_only_file(moto_url: str, tmp_path: Path) -> None:
    secret = new_secret()
    ref = AwsParameterStore(REGION, session=session(), endpoint_url=moto_url, budget=FAST).put("host-fetch", secret)
    target = tmp_path / "job.secret"
    value = fetch_secret(ref, aws_session=session(), endpoint_url=moto_url, budget=FAST)
    write_secret_file(str(target), value)
    assert target.read_text() == secret + "\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    # The command the bootstrap runs, with the fetch injected: one line on success, exit 2 and no secret on failure.
    assert main(["fetch", "--kind", "aws-ssm", "--name", ref.name, "--region", REGION, "--to", str(target)],
                fetch=lambda r: secret) == 0

    def missing(r: SecretRef) -> str:
        raise NotFoundError("aws us-east-1: ssm:GetParameter: no such secret (ParameterNotFound)")

    assert main(["fetch", "--kind", "aws-ssm", "--name", "/trainmover/gone/job-secret", "--region", REGION,
                 "--to", str(target)], fetch=missing) == 2


def test_the_instance_role_policy_reads_one_secret_and_decrypts_only_through_its_service() -> None:
    ssm = instance_role_policy(SecretRef("aws-ssm", "/trainmover/llm-7b/job-secret", REGION), account_id="123456789012",
                               kms_key_arn="arn:aws:kms:us-east-1:123456789012:key/abc")
    read, decrypt = ssm["Statement"]
    assert read == {"Sid": "ReadTheJobSecret", "Effect": "Allow", "Action": "ssm:GetParameter",
                    "Resource": "arn:aws:ssm:us-east-1:123456789012:parameter/trainmover/llm-7b/job-secret"}
    assert decrypt["Condition"] == {"StringEquals": {"kms:ViaService": "ssm.us-east-1.amazonaws.com"}}
    by_name = instance_role_policy(SecretRef("aws-secretsmanager", "trainmover/llm-7b/job-secret", REGION),
                                   account_id="123456789012")
    assert by_name["Statement"][0]["Resource"] == (
        "arn:aws:secretsmanager:us-east-1:123456789012:secret:trainmover/llm-7b/job-secret-??????"
    )
    with pytest.raises(InvalidRequestError, match="role ARN"):
        secrets_manager_policy(["arn:aws:iam::123456789012:user/alice"])
    with pytest.raises(InvalidRequestError, match="instance role"):
        secrets_manager_policy([])


# ------------------------------------------------------------------------------------------------ Azure


def test_key_vault_put_get_delete_through_the_rest_api(vault: tuple[KeyVaultServer, ManagedIdentityImds]) -> None:
    server, _ = vault
    credential = StaticToken(server.tokens.issue())
    store = AzureKeyVaultStore(server.url, credential=credential, identity_client_id=IDENTITY, budget=FAST,
                               ssl_context=server.client_ssl_context())
    secret = new_secret()
    ref = store.put("llm.7b_run", secret)
    name = secret_name_for("llm.7b_run", "azure-keyvault")
    assert name.startswith("trainmover-llm-7b-run-") and name != secret_name_for("llm-7b-run", "azure-keyvault")
    assert ref == SecretRef("azure-keyvault", f"{server.url}/secrets/{name}", identity_client_id=IDENTITY)
    assert server.stored(name) == (secret, {JOB_TAG: "llm.7b_run"})
    assert credential.scopes == ["https://vault.azure.net/.default"]  # one token for the whole flow
    assert store.get(ref) == secret
    assert {(r.method, r.api_version) for r in server.requests if r.path.endswith(name)} == {
        ("PUT", "7.4"), ("GET", "7.4")
    }
    store.delete(ref)
    with pytest.raises(NotFoundError):
        store.get(ref)
    store.delete(ref)


def test_key_vault_answers_401_without_a_bearer_token_and_the_store_says_what_to_do(
    vault: tuple[KeyVaultServer, ManagedIdentityImds],
) -> None:
    server, _ = vault
    request = urllib.request.Request(f"{server.url}/secrets/anything?api-version=7.4")
    with pytest.raises(urllib.error.HTTPError) as raw:
        urllib.request.urlopen(request, timeout=5, context=server.client_ssl_context())
    assert raw.value.code == 401 and raw.value.headers["WWW-Authenticate"].startswith("Bearer ")
    with pytest.raises(CredentialsError, match="refused the token") as err:
        kv_store(server, token="forged").put("llm-7b", new_secret())
    assert err.value.code == "Unauthorized"


def test_key_vault_throttling_is_retried_within_the_budget(vault: tuple[KeyVaultServer, ManagedIdentityImds]) -> None:
    server, _ = vault
    store = kv_store(server)
    server.fail_next(429, "Throttled")
    secret = new_secret()
    ref = store.put("throttled", secret)
    assert store.get(ref) == secret
    store.delete(ref)


def test_a_vm_reads_its_secret_with_its_managed_identity_past_any_proxy(
    vault: tuple[KeyVaultServer, ManagedIdentityImds], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    server, imds = vault
    secret = new_secret()
    ref = kv_store(server).put("vm-read", secret)
    ref = SecretRef(ref.kind, ref.name, identity_client_id=IDENTITY)
    # A proxy that answers nothing: IMDS must be asked directly (urllib would otherwise proxy 127.0.0.1 too).
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    assert fetch_secret(ref, imds_url=imds.url, budget=FAST, ssl_context=server.client_ssl_context()) == secret
    asked = imds.requests[-1]
    assert asked["metadata_header"] == "True" and asked["resource"] == "https://vault.azure.net"
    assert asked["client_id"] == IDENTITY and asked["api-version"] == "2018-02-01"

    # Without the Metadata header IMDS refuses (as Azure's does), which the client turns into one clear error.
    bare = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with pytest.raises(urllib.error.HTTPError) as refused:
        bare.open(f"{imds.url}/metadata/identity/oauth2/token?resource=https://vault.azure.net", timeout=5)
    assert refused.value.code == 400
    with pytest.raises(CredentialsError, match="managed identity"):
        ImdsManagedIdentity(imds_url=f"{imds.url}/nowhere").get_token("https://vault.azure.net/.default")


def test_the_reader_assignment_is_scoped_to_the_one_secret() -> None:
    vault_id = "/subscriptions/sub-1/resourceGroups/rg/providers/Microsoft.KeyVault/vaults/tm-vault"
    body = key_vault_reader_assignment(vault_id, "trainmover-llm-7b-1a2b3c4d", IDENTITY)
    assert body["scope"] == f"{vault_id}/secrets/trainmover-llm-7b-1a2b3c4d"
    assert body["properties"]["roleDefinitionId"].endswith("/roleDefinitions/4633458b-17de-408a-b874-0445c86b69e6")
    assert body["properties"]["principalId"] == IDENTITY


# ------------------------------------------------------------------------------------------------ refs and logs


@pytest.mark.parametrize(
    ("kind", "name", "region", "message"),
    [
        ("gcp-secret", "x", None, "unknown secret store"),
        ("aws-ssm", "trainmover/no-leading-slash", REGION, "SSM parameter name"),
        ("aws-ssm", "/trainmover/x", None, "region"),
        ("aws-secretsmanager", "arn:aws:secretsmanager:eu-west-1:123456789012:secret:x", REGION, "is in eu-west-1"),
        ("aws-secretsmanager", "name with spaces", REGION, "Secrets Manager secret"),
        ("azure-keyvault", "http://tm.vault.azure.net/secrets/job", None, "Key Vault secret URL"),
        ("azure-keyvault", "https://tm.vault.azure.net/secrets/job/0123456789abcdef", None, "no version"),
        ("azure-keyvault", "https://tm.vault.azure.net/secrets/job_1", None, "letters, digits and '-'"),
    ],
)
def test_a_bad_secret_ref_is_one_clear_error(kind: str, name: str, region: str | None, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        SecretRef(kind, name, region)  # type: ignore[arg-type]


def test_a_short_secret_is_refused_before_any_call(moto_url: str) -> None:
    store = AwsParameterStore(REGION, session=session(), endpoint_url="http://127.0.0.1:9", budget=FAST)
    with pytest.raises(InvalidRequestError, match="at least 32"):
        store.put("llm-7b", "short")
    with pytest.raises(InvalidRequestError, match="invalid job id"):
        store.put("llm-*", new_secret())


def test_no_log_record_of_the_whole_flow_holds_a_secret(
    moto_url: str, vault: tuple[KeyVaultServer, ManagedIdentityImds], caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
) -> None:
    caplog.set_level(logging.DEBUG)  # botocore logs request parameters and response bodies at DEBUG
    server, imds = vault
    values = [new_secret() for _ in range(3)]
    stores = [
        AwsSecretsManagerStore(REGION, reader_role_arn=ROLE, session=session(), endpoint_url=moto_url, budget=FAST),
        AwsParameterStore(REGION, session=session(), endpoint_url=moto_url, budget=FAST),
        kv_store(server),
    ]
    errors: list[str] = []
    for store, secret in zip(stores, values, strict=True):
        ref = store.put("logged-job", secret)
        assert store.get(ref) == secret
        if ref.kind == "azure-keyvault":
            fetched = fetch_secret(ref, imds_url=imds.url, budget=FAST, ssl_context=server.client_ssl_context())
        else:
            fetched = fetch_secret(ref, aws_session=session(), endpoint_url=moto_url, budget=FAST)
        assert fetched == secret
        write_secret_file(str(tmp_path / f"{ref.kind}.secret"), fetched)
        errors.append(repr(store))
        store.delete(ref)
        with pytest.raises(NotFoundError) as gone:
            store.get(ref)
        errors.append(str(gone.value))
    assert len(caplog.records) > 20, "the capture saw the flow (botocore's DEBUG records included)"
    assert any(r.name == "botocore.endpoint" for r in caplog.records)
    captured = caplog.text + "\n".join(r.getMessage() for r in caplog.records) + "\n".join(errors)
    leaked = [i for i, secret in enumerate(values) if secret in captured]
    assert leaked == [], f"secrets of stores {leaked} reached a log record"
    assert "[redacted]" in captured  # botocore did try to log them


def test_write_secret_file_replaces_atomically_and_never_follows_a_link(tmp_path: Path) -> None:
    target = tmp_path / "job.secret"
    write_secret_file(str(target), new_secret())
    os.chmod(target, 0o644)
    second = new_secret()
    write_secret_file(str(target), second)
    assert target.read_text() == second + "\n" and stat.S_IMODE(target.stat().st_mode) == 0o600
    assert os.listdir(tmp_path) == ["job.secret"]


def test_tokens_from_the_book_are_what_the_vault_accepts() -> None:
    book = TokenBook()
    assert book.valid(book.issue()) and not book.valid("made-up")
