"""AzureProvider and ScheduledEventsSource against local servers: the real azure-mgmt-compute SDK speaks HTTPS to
tests/cloud/arm_server.py (long-running operations included), and the notice source speaks http to a local IMDS.

Every test that launches VMs ends by checking that the server holds none.
"""

from __future__ import annotations

import base64
import email.utils
import json
import re
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from azure.core.credentials import AccessToken
from azure.identity import CredentialUnavailableError

from cloud.azure import REQUIRED_ACTIONS, AzureProvider, action_allowed
from cloud.azure.notices import ScheduledEventsSource
from cloud.base import (
    JOB_TAG,
    ROLE_TAG,
    CapacityError,
    CredentialsError,
    InvalidRequestError,
    JobNetwork,
    LaunchRequest,
    Notice,
    PermissionDeniedError,
    QuotaError,
    RetryBudget,
    ServiceUnavailableError,
    ThrottledError,
    UnsupportedError,
)
from cloud.bootstrap import AgentBootstrap, render_cloud_init
from cloud.capacity import wake_or_replace
from cloud.secrets import AzureKeyVaultStore, SecretRef
from tests.cloud.arm_server import ArmServer, Fault, ImdsServer
from tests.cloud.keyvault_server import key_vault

SUBSCRIPTION = "00000000-0000-0000-0000-00000000cafe"
RG = "rg-trainmover"
LOCATION = "eastus"
GPU = "Standard_ND96isr_H100_v5"
CPU = "Standard_D2s_v5"
SUBNET = f"/subscriptions/{SUBSCRIPTION}/resourceGroups/{RG}/providers/Microsoft.Network/virtualNetworks/vnet/subnets/s"
TOKEN = "fake-bearer-token-do-not-log"
FAST = RetryBudget("test", attempts=4, base_delay_s=0.01, max_delay_s=0.02, deadline_s=10.0)


class FakeCredential:
    """A TokenCredential (azure.core's protocol): hands out a fixed token and counts the calls."""

    def __init__(self) -> None:
        self.calls = 0

    def get_token(self, *scopes: str, **kwargs: Any) -> AccessToken:
        self.calls += 1
        return AccessToken(TOKEN, int(time.time()) + 3600)


class FakeVaultCredential:
    """A credential for the local Key Vault: one token it accepts."""

    def __init__(self, token: str) -> None:
        self.token = token

    def get_token(self, *scopes: str, **kwargs: Any) -> AccessToken:
        return AccessToken(self.token, int(time.time()) + 3600)


class UnavailableCredential:
    """A credential that finds nothing to authenticate with, raising azure-identity's own error."""

    def get_token(self, *scopes: str, **kwargs: Any) -> AccessToken:
        raise CredentialUnavailableError(message="EnvironmentCredential authentication unavailable. No env vars set.")


@pytest.fixture
def arm(tmp_path: Path) -> Iterator[ArmServer]:
    with ArmServer(
        tmp_path,
        subscription_id=SUBSCRIPTION,
        resource_groups=[RG],
        locations={LOCATION: [CPU, GPU, "Standard_NC24ads_A100_v4"], "westus3": [CPU]},
        polls_per_operation=2,
    ) as server:
        yield server


def make_provider(arm: ArmServer, *, location: str = LOCATION, credential: Any = None, **kwargs: Any) -> AzureProvider:
    return AzureProvider(
        SUBSCRIPTION,
        RG,
        location,
        credential=credential or FakeCredential(),
        base_url=arm.url,
        subnet_id=SUBNET,
        ssh_public_key="ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAItest trainmover@test",
        # The server's throw-away CA; tiny polling interval since the server sends no Retry-After on operations.
        client_kwargs={"connection_verify": str(arm.ca_path), "polling_interval": 0.01},
        mutate_budget=FAST,
        describe_budget=FAST,
        lro_timeout_s=20.0,
        **kwargs,
    )


@pytest.fixture
def provider(arm: ArmServer) -> AzureProvider:
    return make_provider(arm)


def release_and_assert_empty(provider: AzureProvider, arm: ArmServer, job_id: str) -> None:
    provider.release_job(job_id)
    assert arm.vm_names() == [], "VMs leaked"


def puts(arm: ArmServer) -> list[Any]:
    return arm.calls("PUT", r"/virtualMachines/")


def bootstrap_for(job_id: str, secret: SecretRef) -> AgentBootstrap:
    return AgentBootstrap(
        job_id=job_id, coordinator_host="10.0.0.4", agent_port=29401, slots=8, source="trainmover[azure]==0.1.0",
        secret=secret, script="/opt/job/train.py",
    )


# ------------------------------------------------------------------------------------------------ launch


def test_launch_on_demand_puts_tagged_vms_with_their_own_nic(provider: AzureProvider, arm: ArmServer) -> None:
    request = LaunchRequest("job-a", "worker", GPU, count=2, zone="2", tags={"team": "llm"})
    launched = provider.launch(request)

    assert [i.state for i in launched] == ["running", "running"]
    assert {i.job_id for i in launched} == {"job-a"} and {i.market for i in launched} == {"on-demand"}
    assert all(i.instance_id.startswith("tm-job-a-worker-") for i in launched)
    assert [i.zone for i in launched] == ["2", "2"]
    body = puts(arm)[0].body
    assert body["tags"] == {"team": "llm", JOB_TAG: "job-a", ROLE_TAG: "worker"}
    assert body["zones"] == ["2"]
    props = body["properties"]
    assert "priority" not in props and "evictionPolicy" not in props
    network = props["networkProfile"]
    assert network["networkApiVersion"]
    nic = network["networkInterfaceConfigurations"][0]["properties"]
    assert nic["ipConfigurations"][0]["properties"]["subnet"]["id"] == SUBNET
    assert nic["deleteOption"] == "Delete" and props["storageProfile"]["osDisk"]["deleteOption"] == "Delete"
    release_and_assert_empty(provider, arm, "job-a")


def test_a_bootstrapped_vm_gets_the_document_as_custom_data_an_identity_and_never_the_secret(
    arm: ArmServer, tmp_path: Path
) -> None:
    # With the vault's resource id, the provider lets the VM's identity read the secret (test_azure_identities.py).
    provider = make_provider(arm, key_vault_resource_id=f"/subscriptions/{SUBSCRIPTION}/resourceGroups/rg-vault/"
                             "providers/Microsoft.KeyVault/vaults/kv-b")
    (tmp_path / "kv").mkdir()
    with key_vault(tmp_path / "kv") as (vault, _):
        store = AzureKeyVaultStore(
            vault.url, credential=FakeVaultCredential(vault.tokens.issue()), budget=FAST,
            ssl_context=vault.client_ssl_context(),
        )
        secret = secrets.token_hex(32)
        ref = store.put("job-b", secret)
        spec = bootstrap_for("job-b", ref)

        [vm] = provider.launch(LaunchRequest("job-b", "standby", GPU, bootstrap=spec))

        [put] = puts(arm)
        [granted] = arm.role_assignments()
        assert granted["properties"]["principalId"] == arm.principal_id(vm.instance_id, RG)
        os_profile = put.body["properties"]["osProfile"]
        document = base64.b64decode(os_profile["customData"]).decode()
        assert document == render_cloud_init(spec)
        assert ref.name in document and secret not in json.dumps(put.body)
        assert "userData" not in put.body["properties"], "cloud-init does not run properties.userData"
        # The host reads its secret with the VM's own identity, which ARM creates with the VM.
        assert put.body["identity"] == {"type": "SystemAssigned"}
        principal = provider.identity_principal_id(vm.instance_id)
        assert principal == arm.vm(vm.instance_id, RG)["identity"]["principalId"]
        store.delete(ref)
    release_and_assert_empty(provider, arm, "job-b")
    assert arm.role_assignments() == [], "the VM's reader role went with it"


def test_raw_user_data_goes_to_custom_data_too(provider: AzureProvider, arm: ArmServer) -> None:
    provider.launch(LaunchRequest("job-u", "worker", CPU, user_data="#cloud-config\nruncmd: [[true]]\n"))

    props = puts(arm)[0].body["properties"]
    assert base64.b64decode(props["osProfile"]["customData"]).decode() == "#cloud-config\nruncmd: [[true]]\n"
    assert "userData" not in props and "identity" not in puts(arm)[0].body
    with pytest.raises(InvalidRequestError, match="no system-assigned identity"):
        provider.identity_principal_id(puts(arm)[0].path.rsplit("/", 1)[-1])
    release_and_assert_empty(provider, arm, "job-u")


def test_a_bootstrap_a_vm_could_not_use_is_refused_before_any_call(provider: AzureProvider, arm: ArmServer) -> None:
    aws_secret = SecretRef("aws-ssm", "/trainmover/job-c/job-secret", "us-east-1")
    with pytest.raises(InvalidRequestError, match="from Key Vault with its managed identity"):
        provider.launch(LaunchRequest("job-c", "worker", CPU, bootstrap=bootstrap_for("job-c", aws_secret)))
    user_assigned = SecretRef(
        "azure-keyvault", "https://v.vault.azure.net/secrets/s",
        identity_client_id="11111111-2222-3333-4444-555555555555",
    )
    with pytest.raises(InvalidRequestError, match="system-assigned identity"):
        provider.launch(LaunchRequest("job-c", "worker", CPU, bootstrap=bootstrap_for("job-c", user_assigned)))
    assert arm.requests == []


def test_a_promoted_standby_is_retagged_worker_keeping_its_other_tags(provider: AzureProvider, arm: ArmServer) -> None:
    [standby] = provider.launch(LaunchRequest("job-p", "standby", CPU, tags={"team": "llm"}))

    promoted = provider.set_role(standby.instance_id, "worker")

    assert (promoted.role, promoted.job_id, promoted.state) == ("worker", "job-p", "running")
    [patch] = arm.calls("PATCH", r"/virtualMachines/")
    assert patch.body == {"tags": {"team": "llm", JOB_TAG: "job-p", ROLE_TAG: "worker"}}
    assert arm.vm(standby.instance_id, RG)["tags"][ROLE_TAG] == "worker"
    with pytest.raises(InvalidRequestError, match="invalid role"):
        provider.set_role(standby.instance_id, "boss")  # type: ignore[arg-type]
    assert len(arm.calls("PATCH")) == 1
    release_and_assert_empty(provider, arm, "job-p")


def test_launch_spot_asks_for_deallocate_on_eviction(provider: AzureProvider, arm: ArmServer) -> None:
    launched = provider.launch(
        LaunchRequest("job-s", "standby", GPU, market="spot", placement_group="/ppg/id", tags={"tier": "warm"})
    )

    assert [(i.market, i.role) for i in launched] == [("spot", "standby")]
    props = puts(arm)[0].body["properties"]
    assert props["priority"] == "Spot"
    assert props["evictionPolicy"] == "Deallocate"
    assert props["billingProfile"] == {"maxPrice": -1}
    assert props["proximityPlacementGroup"] == {"id": "/ppg/id"}
    assert arm.vm(launched[0].instance_id, RG)["tags"][ROLE_TAG] == "standby"
    release_and_assert_empty(provider, arm, "job-s")


def test_spot_with_capacity_reservation_is_refused_before_any_call(provider: AzureProvider, arm: ArmServer) -> None:
    with pytest.raises(InvalidRequestError, match="capacity reservation"):
        provider.launch(LaunchRequest("job-x", "standby", GPU, market="spot", capacity_reservation="/crg/id"))
    assert arm.requests == []


NSGS, ASGS = "Microsoft.Network/networkSecurityGroups", "Microsoft.Network/applicationSecurityGroups"
PPGS = "Microsoft.Compute/proximityPlacementGroups"


def test_a_job_network_is_made_once_reused_by_replacements_and_deleted_after_the_vms(
    provider: AzureProvider, arm: ArmServer
) -> None:
    """The job's own NSG (its ports from its own hosts, the rest of the virtual network denied), its application
    security group on every NIC, its proximity placement group; a replacement joins them; the release deletes the
    VMs first (ARM refuses to delete what a NIC references), then the three."""
    assert provider.capabilities().job_network
    network = JobNetwork(29400, 29401, data_ports=(40000, 40999))
    provider.launch(LaunchRequest("job-net", "worker", GPU, count=2, network=network))
    provider.launch(LaunchRequest("job-net", "standby", GPU, network=network))  # a replacement
    (nsg,) = arm.resources(NSGS).values()
    (asg,) = arm.resources(ASGS).values()
    (ppg,) = arm.resources(PPGS).values()
    assert {nsg["tags"]["trainmover:job"], asg["tags"]["trainmover:job"], ppg["tags"]["trainmover:job"]} == {"job-net"}
    rules = {r["name"]: r["properties"] for r in nsg["properties"]["securityRules"]}
    allow, deny = rules["trainmover-job-ports"], rules["trainmover-deny-vnet-inbound"]
    assert (allow["access"], allow["direction"], allow["protocol"]) == ("Allow", "Inbound", "Tcp")
    assert allow["destinationPortRanges"] == ["29400-29401", "40000-40999"] or sorted(
        allow["destinationPortRanges"]) == ["29400", "29401", "40000-40999"]
    assert allow["sourceApplicationSecurityGroups"] == allow["destinationApplicationSecurityGroups"] == [
        {"id": asg["id"]}]
    assert "sourceAddressPrefix" not in allow, "only the job's hosts, never an address range"
    assert (deny["access"], deny["sourceAddressPrefix"], deny["priority"] > allow["priority"]) == (
        "Deny", "VirtualNetwork", True)
    for name in arm.vm_names():
        props = arm.vm(name, RG)["properties"]
        nic = props["networkProfile"]["networkInterfaceConfigurations"][0]["properties"]
        assert nic["networkSecurityGroup"] == {"id": nsg["id"]}
        assert nic["ipConfigurations"][0]["properties"]["applicationSecurityGroups"] == [{"id": asg["id"]}]
        assert props["proximityPlacementGroup"] == {"id": ppg["id"]}
    assert len(arm.calls("PUT", "networkSecurityGroups/")) == 1, "made once, then reused"

    # While a VM holds them they cannot go: ARM refuses, as the server does.
    assert provider._job_network.release("job-net") and arm.resources(NSGS)
    release_and_assert_empty(provider, arm, "job-net")
    assert arm.resources(NSGS) == arm.resources(ASGS) == arm.resources(PPGS) == {}


def test_a_job_network_without_cluster_placement_and_a_bad_launch_make_nothing(
    provider: AzureProvider, arm: ArmServer
) -> None:
    provider.launch(LaunchRequest("job-np", "worker", GPU, network=JobNetwork(29400, 29401, cluster_placement=False)))
    assert arm.resources(PPGS) == {} and len(arm.resources(NSGS)) == 1
    release_and_assert_empty(provider, arm, "job-np")
    with pytest.raises(InvalidRequestError, match="neither 'publisher:offer:sku:version'"):
        provider.launch(LaunchRequest("job-nk", "worker", GPU, image="not-an-image", network=JobNetwork(29400, 29401)))
    assert arm.resources(NSGS) == {}, "a launch refused for its own mistake leaves no network behind"


@pytest.mark.parametrize("ssh_from", [
    "10.0.9.4/32",
    f"/subscriptions/{SUBSCRIPTION}/resourceGroups/rg-net/providers/Microsoft.Network/applicationSecurityGroups/bastion",
])
def test_a_jump_host_may_ssh_to_the_jobs_hosts_only_when_asked(arm: ArmServer, ssh_from: str) -> None:
    network = JobNetwork(29400, 29401, cluster_placement=False)
    make_provider(arm).launch(LaunchRequest("job-nossh", "worker", CPU, network=network))
    make_provider(arm, ssh_from=ssh_from).launch(LaunchRequest("job-ssh", "worker", CPU, network=network))

    nsgs = arm.resources(NSGS)
    by_job = {n["tags"][JOB_TAG]: {r["name"]: r["properties"] for r in n["properties"]["securityRules"]}
              for n in nsgs.values()}
    assert "trainmover-jump-host-ssh" not in by_job["job-nossh"], "off by default"
    ssh = by_job["job-ssh"]["trainmover-jump-host-ssh"]
    assert (ssh["access"], ssh["protocol"], ssh["destinationPortRange"]) == ("Allow", "Tcp", "22")
    assert ssh["priority"] < by_job["job-ssh"]["trainmover-deny-vnet-inbound"]["priority"]
    [asg] = [a for a in arm.resources(ASGS).values() if a["tags"][JOB_TAG] == "job-ssh"]
    assert ssh["destinationApplicationSecurityGroups"] == [{"id": asg["id"]}], "the job's hosts only"
    if ssh_from.startswith("/"):
        assert ssh["sourceApplicationSecurityGroups"] == [{"id": ssh_from}] and "sourceAddressPrefix" not in ssh
    else:
        assert ssh["sourceAddressPrefix"] == ssh_from and "sourceApplicationSecurityGroups" not in ssh
    for job in ("job-nossh", "job-ssh"):
        make_provider(arm).release_all(job)
    assert arm.resources(NSGS) == {} and arm.vm_names() == []


@pytest.mark.parametrize("ssh_from", ["0.0.0.0/0", "10.0.0.0/8", "10.0.9.4/24", "bastion", "*"])
def test_ssh_from_the_internet_or_a_malformed_source_is_refused_when_the_provider_is_made(
    arm: ArmServer, ssh_from: str
) -> None:
    with pytest.raises(InvalidRequestError, match="neither a CIDR of at most a /16"):
        make_provider(arm, ssh_from=ssh_from)
    assert arm.requests == []


def test_long_running_operations_are_polled_until_they_succeed(arm: ArmServer, tmp_path: Path) -> None:
    arm.polls_per_operation = 3
    provider = make_provider(arm)
    [vm] = provider.launch(LaunchRequest("job-p", "worker", CPU))

    # The PUT answered 201 + Azure-AsyncOperation; the SDK polled it 3 times, then read the VM (final GET).
    assert len(arm.calls("GET", r"/operations/")) == 3
    assert vm.state == "running" and vm.health == "ok"
    release_and_assert_empty(provider, arm, "job-p")
    assert len(arm.calls("GET", r"/operations/")) == 6


def test_describe_by_job_sees_only_that_job(provider: AzureProvider, arm: ArmServer) -> None:
    mine = provider.launch(LaunchRequest("job-1", "worker", CPU, count=2))
    other = provider.launch(LaunchRequest("job-2", "standby", CPU))

    described = provider.describe(job_id="job-1")
    assert sorted(i.instance_id for i in described) == sorted(i.instance_id for i in mine)
    assert provider.describe([other[0].instance_id])[0].role == "standby"
    assert provider.describe(["no-such-vm"]) == []
    provider.release_job("job-2")
    release_and_assert_empty(provider, arm, "job-1")


def test_park_deallocates_and_wakes_never_powers_off(provider: AzureProvider, arm: ArmServer) -> None:
    [vm] = provider.launch(LaunchRequest("job-park", "standby", CPU))

    parked = provider.stop([vm.instance_id])
    assert parked[0].parked and arm.vm(vm.instance_id, RG)["power"] == "deallocated"
    woken = provider.start([vm.instance_id])
    assert woken[0].running

    assert len(arm.calls("POST", r"/deallocate$")) == 1
    assert len(arm.calls("POST", r"/start$")) == 1
    assert arm.calls("POST", r"/powerOff$") == [], "powerOff keeps the host and keeps billing"
    release_and_assert_empty(provider, arm, "job-park")


def test_terminate_deletes_and_gone_vms_are_fine(provider: AzureProvider, arm: ArmServer) -> None:
    [vm] = provider.launch(LaunchRequest("job-del", "worker", CPU))

    provider.terminate([vm.instance_id])
    assert arm.vm_names() == []
    provider.terminate([vm.instance_id, "never-existed"])  # already gone: no error
    assert len(arm.calls("DELETE")) == 3
    assert provider.describe(job_id="job-del") == []


# ------------------------------------------------------------------------------------------------ errors


def test_allocation_failed_on_start_is_a_capacity_error(provider: AzureProvider, arm: ArmServer) -> None:
    [vm] = provider.launch(LaunchRequest("job-cap", "standby", GPU))
    provider.stop([vm.instance_id])
    arm.inject(
        Fault("start", "AllocationFailed", message="Allocation failed. Please try another size.", in_operation=True)
    )

    with pytest.raises(CapacityError, match="AllocationFailed") as caught:
        provider.start([vm.instance_id])

    assert caught.value.code == "AllocationFailed" and caught.value.__cause__ is not None
    assert len(arm.calls("POST", r"/start$")) == 1, "capacity is an outcome, not retried"
    assert provider.describe([vm.instance_id])[0].parked
    release_and_assert_empty(provider, arm, "job-cap")


def test_a_standby_that_cannot_be_allocated_is_replaced_on_demand(provider: AzureProvider, arm: ArmServer) -> None:
    request = LaunchRequest("job-cap-fb", "standby", GPU, market="spot")
    [vm] = provider.launch(request)
    provider.stop([vm.instance_id])
    arm.inject(Fault("start", "AllocationFailed", message="Allocation failed.", in_operation=True))

    outcome = wake_or_replace(provider, vm.instance_id, request)

    assert [(a.candidate.step, a.candidate.market, a.error_code) for a in outcome.attempts] == [
        ("wake", "spot", "AllocationFailed"),
        ("on-demand", "on-demand", None),
    ]
    [replacement] = outcome.instances
    assert replacement.market == "on-demand" and outcome.released == (vm.instance_id,)
    assert [i.instance_id for i in provider.describe(job_id="job-cap-fb")] == [replacement.instance_id]
    release_and_assert_empty(provider, arm, "job-cap-fb")


def test_throttling_is_retried_within_the_budget(provider: AzureProvider, arm: ArmServer) -> None:
    arm.inject(Fault("create", "TooManyRequests", status=429, times=2, retry_after_s=0))

    [vm] = provider.launch(LaunchRequest("job-429", "worker", CPU))

    assert vm.running
    assert len(puts(arm)) == 3
    release_and_assert_empty(provider, arm, "job-429")


def test_throttling_beyond_the_budget_raises_throttled(provider: AzureProvider, arm: ArmServer) -> None:
    arm.inject(Fault("create", "TooManyRequests", status=429, times=100, retry_after_s=0))

    with pytest.raises(ThrottledError, match="throttled") as caught:
        provider.launch(LaunchRequest("job-429x", "worker", CPU))

    assert caught.value.transient
    assert len(puts(arm)) == FAST.attempts, "only our budget retries: the SDK's own retries are off"
    release_and_assert_empty(provider, arm, "job-429x")


def test_retry_after_is_a_lower_bound_on_the_delay(arm: ArmServer) -> None:
    provider = make_provider(arm)
    provider.describe_budget = RetryBudget("slow-ok", attempts=3, base_delay_s=0.001, max_delay_s=5.0)
    arm.inject(Fault("get", "TooManyRequests", status=429, times=1, retry_after_s=1))

    started = time.monotonic()
    assert provider.describe(["missing"]) == []
    assert time.monotonic() - started >= 1.0


def test_server_errors_are_retried(provider: AzureProvider, arm: ArmServer) -> None:
    arm.inject(Fault("list", "InternalServerError", status=500, times=2))
    assert provider.describe(job_id="nobody") == []
    assert len(arm.calls("GET", r"/virtualMachines$")) == 3


@pytest.mark.parametrize(
    ("code", "status", "message", "error", "match"),
    [
        pytest.param(
            "AuthorizationFailed", 403,
            "The client does not have authorization to perform action 'Microsoft.Compute/virtualMachines/write'",
            PermissionDeniedError, r"Microsoft\.Compute/virtualMachines/write.*trainmover-azure-role\.json",
            id="forbidden-names-the-action-and-the-role",
        ),
        pytest.param(
            "OperationNotAllowed", 409,
            "Operation could not be completed as it results in exceeding approved standardNDSH100v5Family Cores quota.",
            QuotaError, "quota",
            id="quota-is-a-quota-error",
        ),
    ],
)
def test_a_refused_create_is_one_clear_error_not_retried(
    provider: AzureProvider, arm: ArmServer, code: str, status: int, message: str, error: type[Exception], match: str
) -> None:
    arm.inject(Fault("create", code, status=status, message=message))
    with pytest.raises(error, match=match):
        provider.launch(LaunchRequest("job-refused", "worker", GPU))
    assert len(puts(arm)) == 1
    release_and_assert_empty(provider, arm, "job-refused")


def test_unknown_location_is_invalid_before_any_put(arm: ArmServer) -> None:
    provider = make_provider(arm, location="atlantis")
    with pytest.raises(InvalidRequestError, match="unknown location 'atlantis'") as caught:
        provider.launch(LaunchRequest("job-loc", "worker", CPU))
    assert "eastus" in str(caught.value)
    assert puts(arm) == []
    assert arm.vm_names() == []


def test_unknown_size_is_invalid_before_any_put(provider: AzureProvider, arm: ArmServer) -> None:
    with pytest.raises(InvalidRequestError, match="Standard_ND96isr_H100_v5") as caught:
        provider.launch(LaunchRequest("job-size", "worker", "Standard_ND96isr_H200_v9"))
    assert "'Standard_ND96isr_H200_v9' is not offered in 'eastus'" in str(caught.value)
    assert puts(arm) == []
    assert arm.vm_names() == []


@pytest.mark.parametrize("in_operation", [True, False], ids=["fails-while-provisioning", "refused-at-put"])
def test_failed_launch_leaves_no_vm(provider: AzureProvider, arm: ArmServer, in_operation: bool) -> None:
    fault = Fault("create", "AllocationFailed", status=409, skip=1, in_operation=in_operation)
    arm.inject(fault)

    with pytest.raises(CapacityError):
        provider.launch(LaunchRequest("job-3", "worker", GPU, count=3))

    assert arm.vm_names() == []
    # Refused at PUT: the 3rd VM is never asked for. Failed while provisioning: all 3 were asked for in parallel.
    assert len(puts(arm)) == (3 if in_operation else 2)
    assert len(arm.calls("DELETE")) == (3 if in_operation else 2)
    release_and_assert_empty(provider, arm, "job-3")


def test_a_throttled_status_poll_is_polled_again_after_retry_after(provider: AzureProvider, arm: ArmServer) -> None:
    # ARM throttles the second poll of the create; the VM is being created all the same. Giving up would fail the
    # launch and delete a VM that was about to run.
    arm.inject(Fault("poll:create", "TooManyRequests", status=429, skip=1, retry_after_s=1))

    started = time.monotonic()
    [vm] = provider.launch(LaunchRequest("job-poll-429", "worker", CPU))

    assert vm.running and time.monotonic() - started >= 1.0, "Retry-After is honoured"
    assert len(puts(arm)) == 1, "the operation was polled again, not started again"
    assert len(arm.calls("GET", r"/operations/")) == arm.polls_per_operation + 1
    release_and_assert_empty(provider, arm, "job-poll-429")


def test_throttled_polls_past_the_operation_budget_fail_the_launch_and_leave_no_vm(arm: ArmServer) -> None:
    provider = make_provider(arm)
    provider.lro_timeout_s = 0.5  # the operation's budget; each Retry-After (1 s) would pass it
    arm.inject(Fault("poll:create", "TooManyRequests", status=429, times=100, retry_after_s=1))

    with pytest.raises(ThrottledError):
        provider.launch(LaunchRequest("job-poll-budget", "worker", CPU))

    # One poll of the create (not retried past the budget), then the cleanup's delete, polled as usual.
    assert len(arm.calls("GET", r"/operations/")) == 1 + arm.polls_per_operation
    assert len(arm.calls("DELETE")) == 1 and arm.vm_names() == []


def test_terminate_deletes_every_valid_vm_and_names_the_malformed_one(provider: AzureProvider, arm: ArmServer) -> None:
    first, second = provider.launch(LaunchRequest("job-term", "worker", CPU, count=2))
    arm.inject(Fault("delete", "OperationNotAllowed", status=409, message="busy"))  # the first delete is refused

    with pytest.raises(InvalidRequestError, match=r"not VM names .*'bad/name'") as caught:
        provider.terminate([first.instance_id, "bad/name", second.instance_id])

    assert "busy" in str(caught.value), "the refused delete is reported too"
    assert arm.vm_names() == [first.instance_id], "the second VM was deleted although the first delete failed"
    assert not arm.calls(pattern="bad"), "a malformed name never reaches ARM"
    release_and_assert_empty(provider, arm, "job-term")


@pytest.mark.parametrize("job_id", ["*", "job-?", "job a", "", "x" * 64])
def test_job_ids_are_validated_and_never_a_pattern(provider: AzureProvider, arm: ArmServer, job_id: str) -> None:
    with pytest.raises(InvalidRequestError, match="letters, digits"):
        provider.release_job(job_id)
    with pytest.raises(InvalidRequestError, match="matched exactly"):
        provider.describe(job_id=job_id)
    assert arm.requests == []


@pytest.mark.parametrize(
    ("tags", "says"),
    [
        ({"a/b": "v"}, "contains /"),
        ({"Microsoft.Owner": "v"}, "starts with 'microsoft'"),
        ({"k" * 513: "v"}, "513 characters, at most 512"),
        ({"team": "v" * 257}, "257 characters, at most 256"),
        ({f"t{n}": "v" for n in range(49)}, "49 tags, at most 48"),
        ({JOB_TAG: "other-job"}, "set by the provider"),
    ],
)
def test_tags_are_validated_before_any_call(
    provider: AzureProvider, arm: ArmServer, tags: dict[str, str], says: str
) -> None:
    with pytest.raises(InvalidRequestError, match=re.escape(says)):
        provider.launch(LaunchRequest("job-tags", "worker", CPU, tags=tags))
    assert arm.requests == []


def test_an_invalid_endpoint_is_one_clear_error() -> None:
    with pytest.raises(InvalidRequestError, match=re.escape("invalid endpoint URL 'management.azure.com'")):
        AzureProvider(SUBSCRIPTION, RG, LOCATION, credential=FakeCredential(), base_url="management.azure.com")


# ------------------------------------------------------------------------------------------------ credentials, check


def test_missing_credentials_say_how_to_log_in(arm: ArmServer) -> None:
    provider = make_provider(arm, credential=UnavailableCredential())

    with pytest.raises(CredentialsError, match="az login") as caught:
        provider.describe(job_id="any")

    message = str(caught.value)
    assert "AZURE_CLIENT_ID" in message and "managed identity" in message
    assert isinstance(caught.value.__cause__, CredentialUnavailableError)
    assert arm.requests == [], "nothing may leave without a token"
    [result] = provider.check()
    assert result.name == "credentials" and not result.ok


def test_token_never_appears_in_errors_or_reprs(provider: AzureProvider, arm: ArmServer) -> None:
    arm.inject(Fault("list", "AuthorizationFailed", status=403))
    with pytest.raises(PermissionDeniedError) as caught:
        provider.describe(job_id="any")
    assert TOKEN not in str(caught.value) and TOKEN not in repr(provider)
    assert arm.calls("GET")[0].headers["authorization"] == f"Bearer {TOKEN}"


def test_check_with_full_permissions(provider: AzureProvider, arm: ArmServer) -> None:
    results = provider.check()

    assert all(r.ok for r in results), [r for r in results if not r.ok]
    assert {r.name for r in results} >= {"credentials", *REQUIRED_ACTIONS}
    assert [r.method for r in arm.requests if r.method != "GET"] == [], "check creates nothing"
    [perm] = arm.calls("GET", r"/Microsoft\.Authorization/permissions$")
    assert perm.query["api-version"] == "2022-04-01"


def test_check_reports_what_is_missing(provider: AzureProvider, arm: ArmServer) -> None:
    arm.permissions = [
        {"actions": ["Microsoft.Compute/*/read", "Microsoft.Compute/virtualMachines/*"], "notActions": ["*/delete"]},
        {"actions": ["Microsoft.Network/*"], "notActions": []},
    ]
    missing = {r.name for r in provider.check() if not r.ok}

    assert missing == {
        "Microsoft.Compute/virtualMachines/delete",
        "Microsoft.Compute/disks/write",
        "Microsoft.Compute/disks/delete",
        "Microsoft.Compute/proximityPlacementGroups/write",  # the job network's (read is covered by */read)
        "Microsoft.Compute/proximityPlacementGroups/delete",
    }


def test_check_when_permissions_cannot_be_read(provider: AzureProvider, arm: ArmServer) -> None:
    arm.inject(Fault("permissions", "AuthorizationFailed", status=403))
    results = {r.name: r for r in provider.check()}
    assert not results["Microsoft.Authorization/permissions/read"].ok
    assert results["Microsoft.Compute/virtualMachines/read"].ok


def test_action_wildcards_are_case_insensitive() -> None:
    from cloud.azure.provider import _Permission

    grants = [_Permission(("microsoft.compute/*",), ("Microsoft.Compute/virtualMachines/delete",))]
    assert action_allowed("Microsoft.Compute/virtualMachines/start/action", grants)
    assert not action_allowed("Microsoft.Compute/virtualMachines/delete", grants)
    assert not action_allowed("Microsoft.Network/networkInterfaces/write", grants)
    assert action_allowed("Anything/at/all", [_Permission(("*",), ())])


# ------------------------------------------------------------------------------------------------ prices, capabilities


def test_prices_from_the_table_overrides_and_spot(provider: AzureProvider, arm: ArmServer) -> None:
    on_demand = provider.hourly_price_usd(GPU)
    assert on_demand > 50
    assert 0 < provider.hourly_price_usd(GPU, "spot") < on_demand
    custom = make_provider(arm, prices_usd_per_h={GPU: 60.0, f"{GPU}:spot": 20.0})
    assert custom.hourly_price_usd(GPU) == 60.0 and custom.hourly_price_usd(GPU, "spot") == 20.0
    with pytest.raises(InvalidRequestError, match="prices_usd_per_h"):
        provider.hourly_price_usd("Standard_Unknown_v1")
    assert provider.poll_notices(timeout_s=0.1) == []
    caps = provider.capabilities()
    assert caps.can_park("spot") and caps.can_park("on-demand") and caps.spot_notice_s == 30.0


# ------------------------------------------------------------------------------------------------ Scheduled Events


@pytest.fixture
def imds() -> Iterator[ImdsServer]:
    with ImdsServer() as server:
        yield server


def event(event_id: str, event_type: str, resources: list[str], not_before_s: float | None = 30.0) -> dict[str, Any]:
    not_before = "" if not_before_s is None else email.utils.formatdate(time.time() + not_before_s, usegmt=True)
    return {
        "EventId": event_id,
        "EventStatus": "Scheduled",
        "EventType": event_type,
        "ResourceType": "VirtualMachine",
        "Resources": resources,
        "NotBefore": not_before,
        "Description": "",
        "EventSource": "Platform",
        "DurationInSeconds": -1,
    }


def test_scheduled_events_none(imds: ImdsServer) -> None:
    source = ScheduledEventsSource("vm-1", endpoint=imds.url)
    assert source.poll() == []
    assert imds.bad_requests == [], "the Metadata: true header must be sent"


def test_preempt_appearing_between_polls_is_reported_once(imds: ImdsServer) -> None:
    source = ScheduledEventsSource("vm-1", endpoint=imds.url)
    found: list[Notice] = []
    stop = threading.Event()

    def watch() -> None:
        deadline = time.monotonic() + 10
        while not stop.is_set() and time.monotonic() < deadline:
            found.extend(source.poll())
            if found:
                return
            stop.wait(0.005)  # pacing of the watcher loop, not synchronization

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        assert imds.served.wait(5), "the watcher never polled"
        imds.add_event(event("ev-preempt", "Preempt", ["vm-1"], not_before_s=30))
        watcher.join(10)
        assert not watcher.is_alive()
    finally:
        stop.set()
        watcher.join(10)

    [notice] = found
    assert (notice.kind, notice.instance_id, notice.event_id, notice.source) == (
        "eviction",
        "vm-1",
        "ev-preempt",
        "scheduled-events",
    )
    assert notice.lead_s is not None and 25 <= notice.lead_s <= 31
    assert source.poll() == [], "the same EventId is reported once"


def test_freeze_terminate_and_other_vms(imds: ImdsServer) -> None:
    imds.add_event(event("ev-freeze", "Freeze", ["vm-1", "vm-2"], not_before_s=900))
    imds.add_event(event("ev-other", "Preempt", ["vm-2"]))
    imds.add_event(event("ev-term", "Terminate", ["VM-1"], not_before_s=None))
    source = ScheduledEventsSource("vm-1", endpoint=imds.url)

    notices = {n.event_id: n for n in source.poll()}

    assert set(notices) == {"ev-freeze", "ev-term"}, "events of other VMs are ignored"
    assert notices["ev-freeze"].kind == "scheduled_maintenance"
    assert notices["ev-freeze"].lead_s is not None and notices["ev-freeze"].lead_s > 800
    assert notices["ev-term"].kind == "eviction" and notices["ev-term"].deadline_at is None
    assert source.poll() == []


def test_acknowledge_approves_the_event(imds: ImdsServer) -> None:
    imds.add_event(event("ev-reboot", "Reboot", ["vm-1"], not_before_s=900))
    source = ScheduledEventsSource("vm-1", endpoint=imds.url)
    [notice] = source.poll()
    assert notice.event_id is not None

    source.acknowledge(notice.event_id)

    assert imds.acked.wait(5)
    assert imds.acknowledged == ["ev-reboot"]
    assert json.loads(json.dumps(imds.events)) == []


def test_unreachable_metadata_service_is_one_clear_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    source = ScheduledEventsSource("vm-1", endpoint=f"http://127.0.0.1:{port}", timeout_s=0.5)
    with pytest.raises(ServiceUnavailableError, match="only on an Azure VM"):
        source.poll()


# ------------------------------------------------------------------------------------------------ packaging


def test_sdk_is_imported_lazily_and_its_absence_is_explained() -> None:
    # A fresh interpreter where the Azure SDK cannot be imported (None in sys.modules blocks an import).
    script = (
        "import sys\n"
        "import cloud.azure, cloud.azure.notices\n"
        "assert not [m for m in sys.modules if m.startswith('azure')], 'cloud.azure imported the SDK eagerly'\n"
        "sys.modules['azure.mgmt.compute'] = None\n"
        "from cloud.base import CloudError\n"
        "try:\n"
        "    cloud.azure.AzureProvider('sub', 'rg', 'eastus', credential=object())\n"
        "except CloudError as err:\n"
        "    print(err)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=Path(__file__).parents[2]
    )
    assert done.returncode == 0, done.stderr
    assert "pip install 'trainmover[azure]'" in done.stdout


def test_custom_role_grants_exactly_what_the_provider_needs() -> None:
    role = json.loads((Path(__file__).parents[2] / "docs/iam/trainmover-azure-role.json").read_text())
    assert set(role) >= {"Name", "IsCustom", "Actions", "NotActions", "AssignableScopes"}
    assert role["IsCustom"] is True and role["NotActions"] == []
    assert sorted(role["Actions"]) == sorted([*REQUIRED_ACTIONS, "Microsoft.Authorization/permissions/read"])
    assert all("*" not in action for action in role["Actions"]), "least privilege: no wildcards"


def test_efa_and_capacity_blocks_are_aws_only_and_refused_before_any_call(
    provider: AzureProvider, arm: ArmServer
) -> None:
    with pytest.raises(UnsupportedError, match="InfiniBand"):
        provider.launch(LaunchRequest("job-x", "worker", GPU, efa=True))
    with pytest.raises(UnsupportedError, match="capacity reservation group"):
        provider.launch(LaunchRequest("job-x", "worker", GPU, capacity_reservation="cr-0123456789abcdef0",
                                      capacity_block=True))
    assert arm.requests == []
