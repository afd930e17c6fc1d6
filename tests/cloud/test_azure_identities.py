"""Who may read a job's Key Vault secret on Azure: each bootstrapped VM's identity gets "Key Vault Secrets User" on
exactly that secret when it is launched, and loses it when it is terminated or its job released. The real
azure-mgmt-authorization SDK speaks HTTPS to the local ARM server's roleAssignments routes; the secret lives in the
local Key Vault server.

And who may deallocate a VM: an Azure host whose job's coordinator is gone deallocates itself (its dead-man's switch),
since a powered-off VM stays allocated and billed. The launch lets each bootstrapped VM's identity deallocate its own
VM ("Virtual Machine Contributor" on that VM alone), the termination and the release take that away, and the host's
stop step (`python -m cloud.azure.selfstop`, as root, a process of its own trusting the ARM server's CA) finds its
own resource id and a token at the instance metadata service (a local one here) and asks ARM to deallocate it.
"""

from __future__ import annotations

import dataclasses
import http.server
import json
import logging
import os
import re
import secrets
import ssl
import subprocess
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from azure.core.exceptions import HttpResponseError
from azure.mgmt.authorization import AuthorizationManagementClient
from azure.mgmt.authorization.v2022_04_01.models import RoleAssignmentCreateParameters

from cloud.azure import AzureProvider
from cloud.azure.identities import VIRTUAL_MACHINE_CONTRIBUTOR_ROLE, reader_assignment_name
from cloud.azure.provider import KEY_VAULT_RESOURCE_ID_ENV, ROLE_ASSIGNMENT_ACTIONS
from cloud.azure.secrets import KEY_VAULT_SECRETS_USER_ROLE
from cloud.base import Instance, InvalidRequestError, LaunchRequest, PermissionDeniedError
from cloud.bootstrap import render_units
from cloud.secrets import AzureKeyVaultStore, SecretRef
from tests.cloud.arm_server import ArmServer, Fault
from tests.cloud.keyvault_server import KeyVaultServer
from tests.cloud.test_azure import (
    CPU,
    RG,
    SUBSCRIPTION,
    TOKEN,
    FakeCredential,
    bootstrap_for,
    make_provider,
)

# The vault lives in a resource group of its own, as docs/cloud-azure.md asks.
VAULT_ID = f"/subscriptions/{SUBSCRIPTION}/resourceGroups/rg-vault/providers/Microsoft.KeyVault/vaults/kv-training"
GUID = re.compile(r"[0-9a-f]{8}-(?:[0-9a-f]{4}-){3}[0-9a-f]{12}")


@pytest.fixture
def arm(tmp_path: Path) -> Iterator[ArmServer]:
    with ArmServer(tmp_path, subscription_id=SUBSCRIPTION, resource_groups=[RG], locations={"eastus": [CPU]},
                   polls_per_operation=1) as server:
        yield server


@pytest.fixture(autouse=True)
def no_vault_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY_VAULT_RESOURCE_ID_ENV, raising=False)


def granting_provider(arm: ArmServer, store: AzureKeyVaultStore) -> AzureProvider:
    return make_provider(arm, key_vault=store, key_vault_resource_id=VAULT_ID)


def launched(arm: ArmServer, store: AzureKeyVaultStore, job_id: str,
             count: int = 1) -> tuple[AzureProvider, SecretRef, list[Instance]]:
    """A provider that grants readers, a secret of `job_id` in the vault, and `count` workers of that job launched
    to read it."""
    provider = granting_provider(arm, store)
    ref = store.put(job_id, secrets.token_hex(32))
    vms = provider.launch(LaunchRequest(job_id, "worker", CPU, count=count, bootstrap=bootstrap_for(job_id, ref)))
    return provider, ref, vms


def assignments(arm: ArmServer, secret_ref: SecretRef | None = None) -> list[dict[str, object]]:
    """What ARM holds on the vault (on the one secret): the ground truth, read from the server."""
    scope = VAULT_ID if secret_ref is None else f"{VAULT_ID}/secrets/{secret_ref.secret_name}"
    return arm.role_assignments(scope)


def release(provider: AzureProvider, arm: ArmServer, job_id: str) -> None:
    """Release `job_id`, after which the server holds no role assignment on the vault and no VM."""
    provider.release_all(job_id)
    assert assignments(arm) == [] and arm.vm_names() == []


def test_each_launched_vm_may_read_exactly_its_jobs_secret_until_the_job_is_released(
    arm: ArmServer, vault: tuple[KeyVaultServer, AzureKeyVaultStore], caplog: pytest.LogCaptureFixture
) -> None:
    _, store = vault
    provider = granting_provider(arm, store)
    secret = secrets.token_hex(32)
    ref = store.put("job-id1", secret)
    other = store.put("job-id2", secrets.token_hex(32))

    with caplog.at_level(logging.DEBUG):
        vms = provider.launch(LaunchRequest("job-id1", "worker", CPU, count=2, bootstrap=bootstrap_for("job-id1", ref)))
        provider.launch(LaunchRequest("job-id2", "standby", CPU, bootstrap=bootstrap_for("job-id2", other)))

    granted = {a["properties"]["principalId"]: a for a in assignments(arm, ref)}  # type: ignore[index]
    assert len(granted) == 2 and len(assignments(arm)) == 3
    for vm in vms:
        principal = arm.principal_id(vm.instance_id, RG)
        assert GUID.fullmatch(principal)
        assignment = granted[principal]
        props = assignment["properties"]
        assert props["scope"] == f"{VAULT_ID}/secrets/{ref.secret_name}", "the one secret, not the vault"
        assert props["roleDefinitionId"].endswith(f"/roleDefinitions/{KEY_VAULT_SECRETS_USER_ROLE}")
        assert props["principalType"] == "ServicePrincipal"
        assert assignment["name"] == reader_assignment_name("job-id1", vm.instance_id, ref.secret_name)
        assert f"trainmover:job=job-id1 trainmover:instance={RG}/{vm.instance_id}" in props["description"]
    puts = arm.calls("PUT", r"/roleAssignments/")
    assert len(puts) == 3 and {p.query["api-version"] for p in puts} == {"2022-04-01"}
    assert puts[0].headers["authorization"] == f"Bearer {TOKEN}"
    assert secret not in json.dumps([r.body for r in arm.requests]) and secret not in caplog.text
    listed = provider.secret_reader_grants("job-id1")
    assert sorted(g.instance_id for g in listed) == sorted(vm.instance_id for vm in vms)

    report = provider.release_all("job-id1")

    assert report.failed == () and sorted(report.instances) == sorted(vm.instance_id for vm in vms)
    assert assignments(arm, ref) == [] and provider.secret_reader_grants("job-id1") == []
    assert [a["properties"]["scope"] for a in assignments(arm)] == [f"{VAULT_ID}/secrets/{other.secret_name}"], \
        "another job's reader is untouched"
    release(provider, arm, "job-id2")


def test_granting_again_puts_the_same_assignment_and_adds_none(
    arm: ArmServer, vault: tuple[KeyVaultServer, AzureKeyVaultStore]
) -> None:
    provider, ref, [vm] = launched(arm, vault[1], "job-id3")
    readers = provider.secret_readers
    assert readers is not None

    # What a launch retried after a lost answer does: the same name, so ARM answers the same assignment.
    readers.grant("job-id3", vm.instance_id, ref.secret_name, arm.principal_id(vm.instance_id, RG))

    [first, second] = [p.path for p in arm.calls("PUT", r"/roleAssignments/")]
    assert first == second
    assert len(assignments(arm)) == 1
    release(provider, arm, "job-id3")


def test_terminating_a_replaced_host_removes_its_assignment_only(
    arm: ArmServer, vault: tuple[KeyVaultServer, AzureKeyVaultStore]
) -> None:
    provider, _, [replaced, kept] = launched(arm, vault[1], "job-id4", count=2)

    provider.terminate([replaced.instance_id])

    assert [a["properties"]["principalId"] for a in assignments(arm)] == [arm.principal_id(kept.instance_id, RG)]
    release(provider, arm, "job-id4")


def test_release_deletes_the_assignments_of_vms_deleted_outside_trainmover(
    arm: ArmServer, vault: tuple[KeyVaultServer, AzureKeyVaultStore]
) -> None:
    provider, _, [vm] = launched(arm, vault[1], "job-id5")
    make_provider(arm).terminate([vm.instance_id])  # a provider that knows no vault: the assignment stays behind
    [left] = assignments(arm)

    report = provider.release_all("job-id5")

    assert f"Key Vault role assignment {left['name']} ({vm.instance_id})" in report.deleted
    assert report.failed == () and assignments(arm) == []
    again = provider.release_all("job-id5")
    assert not any("role assignment" in d for d in again.deleted)


def test_a_grant_the_caller_may_not_make_fails_the_launch_and_leaves_no_vm(
    arm: ArmServer, vault: tuple[KeyVaultServer, AzureKeyVaultStore]
) -> None:
    _, store = vault
    provider = granting_provider(arm, store)
    ref = store.put("job-id6", secrets.token_hex(32))
    arm.inject(Fault("put:roleAssignments", "AuthorizationFailed", status=403, times=10))

    with pytest.raises(PermissionDeniedError, match=r"on the vault 'kv-training'.*User Access Administrator"):
        provider.launch(LaunchRequest("job-id6", "worker", CPU, bootstrap=bootstrap_for("job-id6", ref)))

    assert arm.vm_names() == [] and assignments(arm) == []
    store.delete(ref)


def test_without_the_vaults_resource_id_a_bootstrap_is_refused_before_any_call(
    arm: ArmServer, vault: tuple[KeyVaultServer, AzureKeyVaultStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, store = vault
    ref = store.put("job-id7", secrets.token_hex(32))
    request = LaunchRequest("job-id7", "worker", CPU, bootstrap=bootstrap_for("job-id7", ref))

    with pytest.raises(InvalidRequestError, match=f"key_vault_resource_id=...\\) or set {KEY_VAULT_RESOURCE_ID_ENV}"):
        make_provider(arm, key_vault=store).launch(request)
    elsewhere = SecretRef("azure-keyvault", "https://kv-other.vault.azure.net/secrets/trainmover-job-id7-0123abcd")
    with pytest.raises(InvalidRequestError, match="secret is in the vault 'kv-other'"):
        granting_provider(arm, store).launch(
            LaunchRequest("job-id7", "worker", CPU, bootstrap=bootstrap_for("job-id7", elsewhere)))
    with pytest.raises(InvalidRequestError, match="not a Key Vault resource id"):
        make_provider(arm, key_vault_resource_id=f"/subscriptions/{SUBSCRIPTION}/resourceGroups/rg-vault")
    assert arm.requests == []

    monkeypatch.setenv(KEY_VAULT_RESOURCE_ID_ENV, VAULT_ID)
    from_env = make_provider(arm, key_vault=store).secret_readers
    assert from_env is not None and from_env.vault_resource_id == VAULT_ID
    store.delete(ref)


def test_check_reads_the_role_assignment_actions_on_the_vault(
    arm: ArmServer, vault: tuple[KeyVaultServer, AzureKeyVaultStore]
) -> None:
    _, store = vault
    provider = granting_provider(arm, store)
    results = {r.name: r for r in provider.check()}
    assert all(r.ok for r in results.values()), [r for r in results.values() if not r.ok]
    [at_vault] = arm.calls("GET", r"/vaults/kv-training/providers/Microsoft\.Authorization/permissions$")
    assert at_vault.query["api-version"] == "2022-04-01"

    # Full rights on the resource group say nothing about the vault, which lives in another group.
    arm.scope_permissions[VAULT_ID.lower()] = [{"actions": ["Microsoft.KeyVault/vaults/secrets/*"], "notActions": []}]
    missing = {r.name: r.detail for r in provider.check() if not r.ok}
    assert set(missing) == set(ROLE_ASSIGNMENT_ACTIONS)
    assert all("on the vault kv-training" in d and "User Access Administrator" in d for d in missing.values())

    no_vault = {r.name: r for r in make_provider(arm).check()}
    assert all(no_vault[a].ok and "not used" in no_vault[a].detail for a in ROLE_ASSIGNMENT_ACTIONS)


def test_the_local_arm_lists_role_assignments_with_the_filters_arm_supports(
    arm: ArmServer, vault: tuple[KeyVaultServer, AzureKeyVaultStore]
) -> None:
    """The server's list answers what ARM answers, through the real SDK: at, above and below a scope; atScope();
    principalId eq; and a wrong api-version or filter refused."""
    provider, ref, [a, b] = launched(arm, vault[1], "job-id8", count=2)
    client = AuthorizationManagementClient(FakeCredential(), SUBSCRIPTION, base_url=arm.url, retry_total=0,
                                           connection_verify=str(arm.ca_path))
    secret_scope = f"{VAULT_ID}/secrets/{ref.secret_name}"
    vault_group = f"/subscriptions/{SUBSCRIPTION}/resourceGroups/rg-vault"
    client.role_assignments.create(vault_group, "0f0e0d0c-0b0a-4909-8807-060504030201", RoleAssignmentCreateParameters(
        role_definition_id=f"/subscriptions/{SUBSCRIPTION}/providers/Microsoft.Authorization/roleDefinitions/"
        f"{KEY_VAULT_SECRETS_USER_ROLE}",
        principal_id="11111111-2222-3333-4444-555555555555", principal_type="Group"))  # a group, on the vault's group

    def names(scope: str, filter_: str | None = None) -> set[str]:
        return {str(x.name) for x in client.role_assignments.list_for_scope(scope, filter=filter_)}

    ours = {str(x["name"]) for x in assignments(arm, ref)}
    group_wide = {"0f0e0d0c-0b0a-4909-8807-060504030201"}
    assert names(VAULT_ID) == ours | group_wide, "at, above and below"
    assert names(secret_scope, "atScope()") == ours | group_wide, "at or above"
    assert names(VAULT_ID, "atScope()") == group_wide, "nothing below"
    principal = arm.principal_id(a.instance_id, RG)
    assert names(VAULT_ID, f"principalId eq '{principal}'") == {
        reader_assignment_name("job-id8", a.instance_id, ref.secret_name)}
    with pytest.raises(HttpResponseError) as refused:
        names(VAULT_ID, "roleDefinitionId eq 'x'")
    assert refused.value.status_code == 400
    context = ssl.create_default_context(cafile=str(arm.ca_path))
    request = urllib.request.Request(f"{arm.url}{VAULT_ID}/providers/Microsoft.Authorization/roleAssignments"
                                     "?api-version=2015-07-01", headers={"Authorization": "Bearer x"})
    with pytest.raises(urllib.error.HTTPError) as old_version:
        urllib.request.urlopen(request, timeout=10, context=context)
    assert old_version.value.code == 400
    client.role_assignments.delete(vault_group, "0f0e0d0c-0b0a-4909-8807-060504030201")
    provider.terminate([b.instance_id])
    provider.release_all("job-id8")
    assert assignments(arm) == [] and arm.role_assignments() == []
    client.close()


# -- the dead-man's switch's self-deallocation -------------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[2]
VM_SCOPE = f"/subscriptions/{SUBSCRIPTION}/resourceGroups/{RG}/providers/Microsoft.Compute/virtualMachines/"


class Imds:
    """The instance metadata service of one VM: its resource id and a token for its identity; `Metadata: true`
    required, as Azure's is. `asked` holds the paths it answered."""

    def __init__(self, resource_id: str, token: str) -> None:
        imds = self
        self.asked: list[str] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = urllib.parse.urlsplit(self.path).path
                if self.headers.get("Metadata") != "true":
                    self._answer(400, b'{"error": "Bad request. Required metadata header not specified"}')
                elif path == "/metadata/instance/compute/resourceId":
                    imds.asked.append(path)
                    self._answer(200, resource_id.encode())
                elif path == "/metadata/identity/oauth2/token":
                    imds.asked.append(path)
                    self._answer(200, json.dumps({"access_token": token, "token_type": "Bearer"}).encode())
                else:
                    self._answer(404, b"{}")

            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _selfstop(imds: Imds, arm: ArmServer) -> subprocess.CompletedProcess[str]:
    """The host's stop step, as a process of its own trusting the ARM server's CA."""
    return subprocess.run([sys.executable, "-m", "cloud.azure.selfstop", "--imds", imds.url, "--arm", arm.url,
                           "--attempts", "1"], capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env={**os.environ, "SSL_CERT_FILE": str(arm.ca_path)})


@pytest.fixture
def imds_for() -> Iterator[Any]:
    made: list[Imds] = []

    def make(resource_id: str, token: str) -> Imds:
        made.append(Imds(resource_id, token))
        return made[-1]

    yield make
    for imds in made:
        imds.close()


def test_each_vm_may_deallocate_itself_until_it_is_terminated_or_its_job_released(
    arm: ArmServer, vault: Any
) -> None:
    _, store = vault
    provider = granting_provider(arm, store)
    ref = store.put("job-ds1", "s" * 64)
    spec = dataclasses.replace(bootstrap_for("job-ds1", ref), orphan_deallocate=True)
    vms = [vm.instance_id for vm in provider.launch(LaunchRequest("job-ds1", "worker", CPU, count=3, bootstrap=spec))]
    plain = provider.launch(LaunchRequest("job-ds1", "standby", CPU, bootstrap=bootstrap_for("job-ds1", ref)))

    assert provider.self_deallocating("job-ds1") == sorted(vms)
    for vm in vms:
        (assignment,) = arm.role_assignments(VM_SCOPE + vm)
        props = assignment["properties"]
        assert props["scope"] == VM_SCOPE + vm, "the VM itself, nothing above it"
        assert props["principalId"] == arm.principal_id(vm, RG), "its own identity"
        assert props["roleDefinitionId"].endswith(f"/roleDefinitions/{VIRTUAL_MACHINE_CONTRIBUTOR_ROLE}")
    assert arm.role_assignments(VM_SCOPE + plain[0].instance_id) == [], "a host without the switch gets nothing"

    provider.terminate([vms[0]])
    assert arm.role_assignments(VM_SCOPE + vms[0]) == [] and provider.self_deallocating("job-ds1") == sorted(vms[1:])

    report = provider.release_all("job-ds1")
    assert report.failed == ()
    assert arm.role_assignments(VM_SCOPE) == [] and provider.self_deallocating("job-ds1") == []


def test_the_orphaned_host_deallocates_itself_through_its_own_identity(arm: ArmServer, vault: Any,
                                                                       imds_for: Any) -> None:
    _, store = vault
    provider = granting_provider(arm, store)
    ref = store.put("job-ds2", "s" * 64)
    spec = dataclasses.replace(bootstrap_for("job-ds2", ref), orphan_deallocate=True)
    (vm,) = provider.launch(LaunchRequest("job-ds2", "worker", CPU, bootstrap=spec))
    imds = imds_for(VM_SCOPE + vm.instance_id, "the-vms-own-token")

    done = _selfstop(imds, arm)

    assert done.returncode == 0, done.stderr
    assert f"asked Azure to deallocate {vm.instance_id}" in done.stderr
    assert imds.asked == ["/metadata/instance/compute/resourceId", "/metadata/identity/oauth2/token"]
    (call,) = arm.calls("POST", r"/deallocate$")
    assert call.path == f"{VM_SCOPE}{vm.instance_id}/deallocate"
    assert call.headers["authorization"] == "Bearer the-vms-own-token", "as the VM, with its own token"
    assert arm.vm(vm.instance_id, RG)["power"] in ("deallocating", "deallocated")
    # The unit's stop step runs it as root before powering off, only when the dead-man's switch fired.
    unit = next(iter(render_units(spec).values()))
    assert "python -m cloud.azure.selfstop; systemctl poweroff" in unit and '"$EXIT_STATUS" = 5' in unit
    assert "cloud.azure.selfstop" not in next(iter(render_units(bootstrap_for("job-ds2", ref)).values()))


def test_a_vm_refused_the_deallocation_says_why_and_the_unit_still_powers_it_off(arm: ArmServer, vault: Any,
                                                                                 imds_for: Any) -> None:
    _, _, [vm] = launched(arm, vault[1], "job-ds3")
    arm.inject(Fault("deallocate", "AuthorizationFailed", status=403))
    imds = imds_for(VM_SCOPE + vm.instance_id, "the-vms-own-token")

    done = _selfstop(imds, arm)

    assert done.returncode == 1
    assert "ARM refused the deallocation (HTTP 403)" in done.stderr and "deallocate/action" in done.stderr
    assert "it powers off and stays allocated" in done.stderr and "the-vms-own-token" not in done.stderr
