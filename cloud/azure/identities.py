"""Who may read a job's Key Vault secret: one ARM role assignment per VM, made when the VM is launched and removed
when it is terminated or its job released.

Each VM that boots a job's agent (`LaunchRequest.bootstrap`) reads the job's secret with its system-assigned managed
identity. `SecretReaders.grant` gives that identity "Key Vault Secrets User" on exactly the job's secret
(`cloud.azure.secrets.key_vault_reader_assignment`), through azure-mgmt-authorization:

- under a **deterministic name**, a uuid5 of the job, the VM and the secret (`reader_assignment_name`): a retried
  launch PUTs the same assignment again instead of adding a second one;
- with a **description that names the job and the VM** (`reader_description`): role assignments carry no tags, so
  that description is how `grants`, `revoke_instances` and `release` find the job's assignments again, by listing
  the vault's scope (ARM lists the assignments at, above and below a scope).

A system-assigned identity is deleted with its VM, but its role assignments stay behind as "Identity not found"
entries that count against the subscription's limit of role assignments: hence the clean-up. Creating an assignment
needs `Microsoft.Authorization/roleAssignments/write` on the vault's scope (docs/cloud-azure.md says which built-in
roles hold it).
"""

from __future__ import annotations

import functools
import logging
import re
import urllib.parse
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, TypeVar

from cloud.azure.secrets import KEY_VAULT_SECRETS_USER_ROLE, key_vault_reader_assignment
from cloud.base import (
    CloudError,
    InvalidRequestError,
    NotFoundError,
    PermissionDeniedError,
    ReleaseSteps,
    validate_job_id,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

# Fixed for good: the names of every assignment made so far derive from it, and a retried launch must find them.
ASSIGNMENT_NAMESPACE = uuid.UUID("5d0c3f64-3a57-4b0e-9a55-7f1b2c0e8a11")
VAULT_RESOURCE_ID = re.compile(
    r"/subscriptions/([^/]+)/resourceGroups/([^/]+)/providers/Microsoft\.KeyVault/vaults/([0-9A-Za-z-]{3,24})",
    re.IGNORECASE,
)
VAULT_RESOURCE_ID_HINT = (
    "/subscriptions/<subscription>/resourceGroups/<group>/providers/Microsoft.KeyVault/vaults/<name> "
    "(`az keyvault show --name <name> --query id -o tsv`)"
)
_DESCRIPTION = re.compile(r"trainmover:job=(\S+) trainmover:instance=([^/\s]+)/(\S+?): ")
# A public or sovereign vault's host name starts with the vault's name (https://<name>.vault.azure.net).
_VAULT_HOST = re.compile(r"([0-9a-z-]{3,24})\.vault\.", re.IGNORECASE)


def vault_name(vault_resource_id: str) -> str:
    """The vault's name, once `vault_resource_id` is checked to be a Key Vault's resource id."""
    match = VAULT_RESOURCE_ID.fullmatch(vault_resource_id)
    if match is None:
        raise InvalidRequestError(
            f"azure: {vault_resource_id!r} is not a Key Vault resource id; give {VAULT_RESOURCE_ID_HINT}",
            provider="azure",
            code="InvalidKeyVaultResourceId",
        )
    return match.group(3)


def reader_assignment_name(job_id: str, instance_id: str, secret_name: str) -> str:
    """The role assignment's name (a GUID, as ARM requires): the same for the same job, VM and secret."""
    return str(uuid.uuid5(ASSIGNMENT_NAMESPACE, f"trainmover/{job_id}/{instance_id}/{secret_name}"))


def reader_description(job_id: str, resource_group: str, instance_id: str, secret_name: str) -> str:
    """What the assignment says about itself: the job and the VM (with its resource group) it was made for."""
    return (f"trainmover:job={job_id} trainmover:instance={resource_group}/{instance_id}: "
            f"lets this VM's managed identity read its job's secret {secret_name}")


@dataclass(frozen=True, slots=True)
class SecretReaderGrant:
    """One role assignment made by `SecretReaders.grant`, as ARM lists it."""

    assignment_id: str
    name: str
    scope: str
    principal_id: str
    job_id: str
    resource_group: str
    instance_id: str


class SecretReaders:
    """The secret-reader role assignments of the VMs of one resource group, on one vault (see the module
    docstring). `call(action, fn)` runs one ARM call under the provider's retry budget with its error mapping;
    `client()` returns the azure-mgmt-authorization client."""

    def __init__(self, vault_resource_id: str, resource_group: str, *, call: Callable[[str, Callable[[], Any]], Any],
                 client: Callable[[], Any]) -> None:
        self.vault_name = vault_name(vault_resource_id)
        self.vault_resource_id = vault_resource_id.rstrip("/")
        self.resource_group = resource_group
        self._call = call
        self._client = client

    def __repr__(self) -> str:
        return f"SecretReaders(vault={self.vault_name!r}, resource_group={self.resource_group!r})"

    def check_vault(self, vault_url: str) -> None:
        """Refuse a secret whose vault is not this one (where the name can be told from the URL's host): an
        assignment on another vault would not let the VM read it."""
        host = urllib.parse.urlsplit(vault_url).hostname or ""
        match = _VAULT_HOST.match(host)
        if match is not None and match.group(1).lower() != self.vault_name.lower():
            raise InvalidRequestError(
                f"azure: the job's secret is in the vault {match.group(1)!r} ({vault_url}), but the provider grants "
                f"read access on the vault {self.vault_name!r} (key_vault_resource_id): give the resource id of the "
                "vault that holds the secret",
                provider="azure",
                code="KeyVaultMismatch",
            )

    def grant(self, job_id: str, instance_id: str, secret_name: str, principal_id: str) -> None:
        """Let `principal_id` (the VM's system-assigned identity) read `secret_name`, and nothing else. Idempotent:
        a second grant of the same job, VM and secret PUTs the same assignment."""
        from azure.mgmt.authorization.v2022_04_01.models import RoleAssignmentCreateParameters

        body = key_vault_reader_assignment(self.vault_resource_id, secret_name, principal_id)
        scope, props = body["scope"], body["properties"]
        name = reader_assignment_name(job_id, instance_id, secret_name)
        parameters = RoleAssignmentCreateParameters(
            role_definition_id=props["roleDefinitionId"],
            principal_id=props["principalId"],
            # A new identity takes a while to reach every Entra ID replica; naming its type lets ARM skip the lookup
            # that would otherwise fail with PrincipalNotFound (https://learn.microsoft.com/azure/role-based-access-
            # control/role-assignments-template#new-service-principal).
            principal_type=props["principalType"],
            description=reader_description(job_id, self.resource_group, instance_id, secret_name),
        )
        client = self._client()
        action = f"Microsoft.Authorization/roleAssignments/write (Key Vault Secrets User for {instance_id})"
        try:
            self._call(action, lambda: client.role_assignments.create(scope, name, parameters))
        except PermissionDeniedError as err:
            raise PermissionDeniedError(
                f"azure: permission denied: {action} on the vault {self.vault_name!r} ({err.code}). To fix: give the "
                "orchestrator's identity a role that may assign roles on the vault: User Access Administrator or "
                "Owner, or Role Based Access Control Administrator (docs/cloud-azure.md, 'Who may read the secret')",
                provider="azure",
                code=err.code,
            ) from err
        except InvalidRequestError as err:
            if (err.code or "").lower() != "roleassignmentexists":
                raise
            # The same role on the same secret for the same identity exists under another name (made by hand): the
            # VM can read its secret; that assignment is not ours to delete later.
            log.info("azure: %s can already read %s (an assignment made outside TrainMover)", instance_id, secret_name)
            return
        log.info("azure: %s (job %s) may read its secret %s in %s", instance_id, job_id, secret_name, self.vault_name)

    def grants(self, job_id: str | None = None, instance_ids: Collection[str] | None = None
               ) -> list[SecretReaderGrant]:
        """The assignments this resource group's launches made on the vault (of `job_id`, of `instance_ids`), read
        from ARM: one list of the vault's scope."""
        if job_id is not None:
            validate_job_id(job_id, provider="azure")
        client = self._client()
        listed = self._call(
            f"Microsoft.Authorization/roleAssignments/read (vault {self.vault_name})",
            lambda: list(client.role_assignments.list_for_scope(self.vault_resource_id)),
        )
        secrets_scope = f"{self.vault_resource_id}/secrets/".lower()
        found: list[SecretReaderGrant] = []
        for assignment in listed:
            match = _DESCRIPTION.match(assignment.description or "")
            if (
                match is None
                or not (assignment.scope or "").lower().startswith(secrets_scope)
                or not (assignment.role_definition_id or "").lower().endswith(KEY_VAULT_SECRETS_USER_ROLE)
                or match.group(2).lower() != self.resource_group.lower()
                or (job_id is not None and match.group(1) != job_id)
                or (instance_ids is not None and match.group(3) not in instance_ids)
            ):
                continue
            found.append(SecretReaderGrant(
                assignment_id=str(assignment.id), name=str(assignment.name), scope=str(assignment.scope),
                principal_id=str(assignment.principal_id), job_id=match.group(1), resource_group=match.group(2),
                instance_id=match.group(3),
            ))
        return found

    def revoke(self, grant: SecretReaderGrant) -> bool:
        """Delete one assignment; False when it was already gone."""
        return _delete_assignment(self._call, self._client(), grant.scope, grant.name, grant.instance_id)

    def revoke_instances(self, instance_ids: Collection[str]) -> list[str]:
        """Delete the assignments of these VMs (terminated ones); what could not be deleted, each with why."""
        if not instance_ids:
            return []
        steps = ReleaseSteps()
        try:
            found = self.grants(instance_ids=instance_ids)
        except CloudError as err:
            return [f"the role assignments of {', '.join(sorted(instance_ids))} ({err})"]
        for grant in found:
            steps.run(f"role assignment {grant.name} of {grant.instance_id}",
                      lambda grant=grant: self.revoke(grant))  # type: ignore[misc]
        return list(steps.failed)

    def release(self, job_id: str, steps: ReleaseSteps) -> None:
        """Delete every assignment of the job on the vault (those of VMs deleted outside TrainMover included), each
        recorded in `steps`."""
        try:
            found = self.grants(job_id=job_id)
        except CloudError as err:
            steps.fail(f"the Key Vault role assignments of job {job_id}", err)
            return
        for grant in found:
            steps.run(f"Key Vault role assignment {grant.name} ({grant.instance_id})",
                      lambda grant=grant: self.revoke(grant))  # type: ignore[misc]


def _delete_assignment(call: Callable[[str, Callable[[], Any]], Any], client: Any, scope: str, name: str,
                       of: str) -> bool:
    """Delete one role assignment (`of`: whose, for the messages); False when it was already gone."""
    try:
        deleted = call(f"Microsoft.Authorization/roleAssignments/delete ({name}, {of})",
                       lambda: client.role_assignments.delete(scope, name))
    except NotFoundError:
        return False
    return deleted is not None  # ARM answers 204 (no body) when there was none


VIRTUAL_MACHINE_CONTRIBUTOR_ROLE = "9980e02c-c2be-4d73-94e8-173b1dc7cf3c"
"""Built-in role "Virtual Machine Contributor": manage virtual machines (deallocate among them), not the network or
storage they use; given to a VM's own identity on that VM alone (`SelfDeallocation`)."""
_SELF_DESCRIPTION = re.compile(r"trainmover:job=(\S+) trainmover:self-deallocate=([^/\s]+)/(\S+?): ")


class SelfDeallocation:
    """Each bootstrapped VM's system-assigned identity may deallocate its own VM, for its dead-man's switch
    (`cloud.azure.selfstop`): "Virtual Machine Contributor" on the VM's own scope, nothing above it (a custom role
    with the deallocate action alone would need `roleDefinitions/write` on the subscription). Made at launch,
    removed when the VM is terminated or its job released; found again by its description, which names the job and
    the VM (a listing of the VM's scope, or of the resource group's for a release)."""

    def __init__(self, subscription_id: str, resource_group: str, *,
                 call: Callable[[str, Callable[[], Any]], Any], client: Callable[[], Any]) -> None:
        self.subscription_id = subscription_id
        self.resource_group = resource_group
        self._call = call
        self._client = client

    def scope(self, instance_id: str) -> str:
        return (f"/subscriptions/{self.subscription_id}/resourceGroups/{self.resource_group}/providers/"
                "Microsoft.Compute/virtualMachines/" + instance_id)

    def grant(self, job_id: str, instance_id: str, principal_id: str) -> None:
        """Let `principal_id` (the VM's identity) deallocate the VM `instance_id`. Idempotent (a uuid5 name)."""
        from azure.mgmt.authorization.v2022_04_01.models import RoleAssignmentCreateParameters

        name = str(uuid.uuid5(ASSIGNMENT_NAMESPACE, f"self-deallocate|{self.resource_group}|{instance_id}|"
                                                    f"{principal_id}"))
        parameters = RoleAssignmentCreateParameters(
            role_definition_id=f"/subscriptions/{self.subscription_id}/providers/Microsoft.Authorization/"
                               f"roleDefinitions/{VIRTUAL_MACHINE_CONTRIBUTOR_ROLE}",
            principal_id=principal_id, principal_type="ServicePrincipal",
            description=f"trainmover:job={job_id} trainmover:self-deallocate={self.resource_group}/{instance_id}: "
                        "the VM deallocates itself when no coordinator of its job is reachable",
        )
        client = self._client()
        self._call(f"Microsoft.Authorization/roleAssignments/write (self-deallocation of {instance_id})",
                   lambda: client.role_assignments.create(self.scope(instance_id), name, parameters))

    def _ours(self, job_id: str | None, instance_ids: Collection[str] | None) -> list[Any]:
        """This resource group's self-deallocation assignments (of `job_id`, of `instance_ids`): one listing of
        the resource group's scope (ARM lists the assignments at, above and below it)."""
        client = self._client()
        scope = f"/subscriptions/{self.subscription_id}/resourceGroups/{self.resource_group}"
        listed = self._call(f"Microsoft.Authorization/roleAssignments/read ({self.resource_group})",
                            lambda: list(client.role_assignments.list_for_scope(scope)))
        found = []
        for assignment in listed:
            match = _SELF_DESCRIPTION.match(assignment.description or "")
            if match is None or match.group(2).lower() != self.resource_group.lower() \
                    or (job_id is not None and match.group(1) != job_id) \
                    or (instance_ids is not None and match.group(3) not in instance_ids):
                continue
            found.append(assignment)
        return found

    def grants(self, job_id: str) -> list[str]:
        """The VMs of `job_id` whose identity may deallocate itself, as ARM lists them now."""
        validate_job_id(job_id, provider="azure")
        return sorted(str(a.scope).rsplit("/", 1)[-1] for a in self._ours(job_id, None))

    def revoke_instances(self, instance_ids: Collection[str]) -> list[str]:
        """Delete the assignments of these (terminated) VMs, found in one listing; what could not be deleted, each
        with why."""
        if not instance_ids:
            return []
        steps = ReleaseSteps()
        self._revoke(f"the self-deallocation role assignments of {', '.join(sorted(instance_ids))}", steps,
                     None, instance_ids)
        return list(steps.failed)

    def release(self, job_id: str, steps: ReleaseSteps) -> None:
        """Delete every self-deallocation assignment of the job (VMs deleted outside TrainMover included)."""
        self._revoke(f"the self-deallocation role assignments of job {job_id}", steps, job_id, None)

    def _revoke(self, what: str, steps: ReleaseSteps, job_id: str | None,
                instance_ids: Collection[str] | None) -> None:
        try:
            found = self._ours(job_id, instance_ids)
        except CloudError as err:
            steps.fail(what, err)
            return
        client = self._client()
        for a in found:
            vm = str(a.scope).rsplit("/", 1)[-1]
            steps.run(f"self-deallocation role assignment {a.name} ({vm})", functools.partial(
                _delete_assignment, self._call, client, str(a.scope), str(a.name), vm))


__all__ = [
    "ASSIGNMENT_NAMESPACE",
    "VIRTUAL_MACHINE_CONTRIBUTOR_ROLE",
    "SecretReaderGrant",
    "SecretReaders",
    "SelfDeallocation",
    "reader_assignment_name",
    "reader_description",
    "vault_name",
]
