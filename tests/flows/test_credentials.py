"""Cloud credentials through a Prefect Secret block, on Prefect's real engine (the session's server): the flow reads
the block when it runs and hands the keys to the SDK only; they reach no log record, parameter or artifact; a
missing or malformed block is one clear error before anything is provisioned."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest

from flows.credentials import AwsKeys, AzureServicePrincipal, CredentialsBlockError, load_credentials, provider_options
from flows.models import TrainingRun
from tests.flows.cloud_runs import AWS_LAUNCH

pytestmark = [pytest.mark.usefixtures("prefect_harness")]

AWS_RUN = TrainingRun(job_id="creds-aws", provider="aws", region="us-east-1", **AWS_LAUNCH)


class Provisioned(Exception):
    """Raised by the stand-in provider registry: the flow got as far as building its provider."""


@pytest.fixture
def aws_block() -> tuple[str, str]:
    """A Secret block holding AWS keys, with a secret value unique to this test; (block name, secret)."""
    from prefect.blocks.system import Secret

    name, secret = f"creds-{uuid.uuid4().hex[:8]}", f"wJalr-{uuid.uuid4().hex}"
    Secret(value={"aws_access_key_id": "AKIAEXAMPLE", "aws_secret_access_key": secret}).save(name)
    return name, secret


@pytest.fixture
def registry_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict[str, Any]]]:
    """Stand in for cloud.registry.make_provider: records what the flow would build it with, then stops the run."""
    import cloud.registry

    calls: list[tuple[str, dict[str, Any]]] = []

    def record(name: str, **options: Any) -> Any:
        calls.append((name, options))
        raise Provisioned("stopped where the provider would be built")

    monkeypatch.setattr(cloud.registry, "make_provider", record)
    return calls


def _what_the_server_holds(state: Any) -> str:
    """The run's parameters, log records and artifacts, as the server stores them."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterFlowRunId

    run_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(run_id)
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))
        artifacts = client.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))
    return "\n".join([repr(flow_run.parameters), *(log.message for log in logs), *(repr(a.data) for a in artifacts)])


def test_the_flow_hands_the_blocks_keys_to_boto3_and_to_nothing_the_server_keeps(
    aws_block: tuple[str, str], registry_calls: list[tuple[str, dict[str, Any]]]
) -> None:
    from flows.training import resilient_training

    name, secret = aws_block
    state = resilient_training(run=AWS_RUN, credentials_block=name, return_state=True)
    with pytest.raises(Provisioned):
        state.result()
    ((provider, options),) = registry_calls
    keys = options["session"].get_credentials()
    assert (provider, keys.access_key, keys.secret_key) == ("aws", "AKIAEXAMPLE", secret)
    # Run logs reach the API in batches: wait (bounded) for the run's error line, then look at everything.
    deadline = time.monotonic() + 10.0
    while "Provisioned" not in (held := _what_the_server_holds(state)):
        assert time.monotonic() < deadline, held
        time.sleep(0.3)
    assert name in held and secret not in held


def test_a_missing_block_fails_the_run_with_what_to_do_before_anything_is_provisioned(
    registry_calls: list[tuple[str, dict[str, Any]]],
) -> None:
    from flows.training import resilient_training

    state = resilient_training(run=AWS_RUN, credentials_block="no-such-block", return_state=True)
    with pytest.raises(CredentialsBlockError, match=r"no Secret block named 'no-such-block'.*aws_secret_access_key"):
        state.result()
    assert registry_calls == []


def test_a_block_with_the_wrong_keys_is_refused_without_quoting_its_values() -> None:
    from prefect.blocks.system import Secret

    name, secret = f"creds-{uuid.uuid4().hex[:8]}", f"s3cr3t-{uuid.uuid4().hex}"
    Secret(value={"client_id": "c", "client_secret": secret}).save(name)
    with pytest.raises(CredentialsBlockError, match="tenant_id") as refused:
        load_credentials(name, "azure")
    assert secret not in str(refused.value)
    with pytest.raises(CredentialsBlockError, match="aws_access_key_id: Field required") as refused:
        load_credentials(name, "aws")
    assert secret not in str(refused.value)


def test_azure_keys_become_a_client_secret_credential_and_reprs_hide_secrets() -> None:
    from azure.identity import ClientSecretCredential

    keys = AzureServicePrincipal(tenant_id="t", client_id="c", client_secret="very-secret")  # type: ignore[arg-type]
    (credential,) = provider_options(keys, "eastus").values()
    assert isinstance(credential, ClientSecretCredential)
    aws = AwsKeys(aws_access_key_id="AKIA", aws_secret_access_key="very-secret")  # type: ignore[arg-type]
    assert "very-secret" not in repr(keys) + repr(aws)


# -- a team's existing prefect-aws / prefect-azure block ------------------------------------------------------------
# Neither package is installed: these stand for their blocks as the server knows them, by type slug and fields. Saving
# one registers its block type and schema on the session's server, as `prefect block register -m prefect_aws` would.


def _integration_blocks() -> dict[str, type[Any]]:
    from prefect.blocks.core import Block
    from pydantic import SecretStr

    class AwsCredentials(Block):
        """prefect-aws's `AwsCredentials` fields."""

        _block_type_slug = "aws-credentials"
        aws_access_key_id: str | None = None
        aws_secret_access_key: SecretStr | None = None
        aws_session_token: str | None = None
        profile_name: str | None = None
        region_name: str | None = None

    class AzureContainerInstanceCredentials(Block):
        """prefect-azure's `AzureContainerInstanceCredentials` fields."""

        _block_type_slug = "azure-container-instance-credentials"
        client_id: str | None = None
        tenant_id: str | None = None
        client_secret: SecretStr | None = None

    return {"aws": AwsCredentials, "azure": AzureContainerInstanceCredentials}


INTEGRATION_BLOCKS = _integration_blocks()


def test_the_flow_takes_an_aws_credentials_block_and_hands_its_keys_to_boto3_only(
    registry_calls: list[tuple[str, dict[str, Any]]],
) -> None:
    from flows.training import resilient_training

    name, secret, token = f"aws-team-{uuid.uuid4().hex[:8]}", f"wJalr-{uuid.uuid4().hex}", f"tok-{uuid.uuid4().hex}"
    INTEGRATION_BLOCKS["aws"](aws_access_key_id="AKIATEAM", aws_secret_access_key=secret, aws_session_token=token,
                              region_name="eu-west-1").save(name)
    state = resilient_training(run=AWS_RUN, credentials_block=name, return_state=True)
    with pytest.raises(Provisioned):
        state.result()
    ((provider, options),) = registry_calls
    session = options["session"]
    keys = session.get_credentials()
    assert (provider, keys.access_key, keys.secret_key, keys.token) == ("aws", "AKIATEAM", secret, token)
    assert session.region_name == AWS_RUN.region  # the run's region, not the block's
    deadline = time.monotonic() + 10.0
    while "Provisioned" not in (held := _what_the_server_holds(state)):
        assert time.monotonic() < deadline, held
        time.sleep(0.3)
    assert name in held and secret not in held and token not in held


def test_an_azure_container_instance_credentials_block_becomes_the_service_principal() -> None:
    from azure.identity import ClientSecretCredential

    name, secret = f"az-team-{uuid.uuid4().hex[:8]}", f"s3cr3t-{uuid.uuid4().hex}"
    INTEGRATION_BLOCKS["azure"](tenant_id="tenant-1", client_id="client-1", client_secret=secret).save(name)
    keys = load_credentials(name, "azure")
    assert isinstance(keys, AzureServicePrincipal)
    assert (keys.tenant_id, keys.client_id, keys.client_secret.get_secret_value()) == ("tenant-1", "client-1", secret)
    (credential,) = provider_options(keys, "eastus").values()
    assert isinstance(credential, ClientSecretCredential) and secret not in repr(keys)


def test_a_block_of_another_type_or_missing_keys_is_one_error_naming_the_block_and_what_it_lacks() -> None:
    aws_name, azure_name, secret = (f"aws-{uuid.uuid4().hex[:8]}", f"az-{uuid.uuid4().hex[:8]}",
                                    f"s3cr3t-{uuid.uuid4().hex}")
    INTEGRATION_BLOCKS["aws"](aws_access_key_id="AKIATEAM", profile_name="ml-team").save(aws_name)
    INTEGRATION_BLOCKS["azure"](client_id="client-1", client_secret=secret).save(azure_name)
    with pytest.raises(CredentialsBlockError) as refused:
        load_credentials(aws_name, "aws")
    assert str(refused.value).startswith(f"aws-credentials block '{aws_name}' lacks aws_secret_access_key; a "
                                         "profile_name is not read"), refused.value
    with pytest.raises(CredentialsBlockError, match=f"azure-container-instance-credentials block '{azure_name}' "
                                                    "lacks tenant_id") as refused:
        load_credentials(azure_name, "azure")
    assert secret not in str(refused.value)
    with pytest.raises(CredentialsBlockError, match=f"block '{azure_name}' is of type azure-container-instance-"
                                                    r"credentials, which holds no aws credentials: run.provider 'aws' "
                                                    "reads them from a Secret block or an aws-credentials block"):
        load_credentials(azure_name, "aws")
