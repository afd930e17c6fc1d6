"""Azure virtual machines as TrainMover instances: `AzureProvider`, calling ARM through `cloud.azure.client.AzureApi`
(the one Azure SDK adapter, which also maps SDK errors to `CloudError`).

One provider manages the VMs of one resource group in one location through azure-mgmt-compute only: each VM
carries its own network interface (`networkProfile.networkInterfaceConfigurations`, created and deleted with the
VM), so no azure-mgmt-network client is needed. An instance id is the VM's name inside the resource group.

Parking is `deallocate` (compute billing stops, only disks bill), never `powerOff` (the VM keeps its host and
keeps billing: https://learn.microsoft.com/azure/virtual-machines/states-billing). Spot VMs are created with the
eviction policy `Deallocate`, so an evicted standby is parked rather than deleted.

The Azure SDKs are imported when an `AzureApi` is made: `import cloud.azure` never needs them installed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from cloud.accelerators import Accelerators, from_azure_sku, table_for
from cloud.azure.client import (
    PROVIDER,
    ROLE_HINT,
    AzureApi,
)
from cloud.azure.identities import VAULT_RESOURCE_ID_HINT, SecretReaderGrant, SecretReaders, SelfDeallocation
from cloud.azure.network import AzureJobNetwork, AzurePlacement
from cloud.azure.secrets import AzureKeyVaultStore
from cloud.base import (
    DESCRIBE,
    JOB_TAG,
    MUTATE,
    ROLE_TAG,
    Capabilities,
    CheckResult,
    CloudError,
    CredentialsError,
    Health,
    Instance,
    InstanceState,
    InvalidRequestError,
    LaunchRequest,
    Market,
    NotFoundError,
    Notice,
    Provider,
    ReleaseSteps,
    RetryBudget,
    Role,
    TagLimits,
    UnsupportedError,
    validate_job_id,
    validate_role,
    validate_tags,
)
from cloud.bootstrap import agent_bootstrap, azure_custom_data, render_cloud_init
from cloud.secret_store import SecretRef, secret_name_for

log = logging.getLogger("cloud.azure")  # the name users configure, as before the move to cloud/azure/

if TYPE_CHECKING:
    from azure.core.credentials import TokenCredential
    from azure.core.polling import LROPoller
    from azure.mgmt.compute.models import VirtualMachine

DEFAULT_IMAGE = "Canonical:ubuntu-24_04-lts:server:latest"
# The API version the compute RP uses to create the VM-managed NIC; it must be set with
# networkInterfaceConfigurations (https://learn.microsoft.com/rest/api/compute/virtual-machines/create-or-update).
NETWORK_API_VERSION = "2020-11-01"
PERMISSIONS_API_VERSION = "2022-04-01"
# https://learn.microsoft.com/azure/azure-resource-manager/management/tag-resources#limitations
TAG_LIMITS = TagLimits(
    "azure",
    max_tags=50,
    max_key_len=512,
    max_value_len=256,
    reserved_key_prefixes=("microsoft", "azure", "windows"),
    forbidden_key_chars="<>%&\\?/",
    doc="https://learn.microsoft.com/azure/azure-resource-manager/management/tag-resources#limitations",
)
# A VM's resource name: 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit and not ending with
# '.' or '-' (https://learn.microsoft.com/azure/azure-resource-manager/management/resource-name-rules#microsoftcompute).
_VM_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,62}[A-Za-z0-9_])?")

# Each bootstrapped VM's identity may read its job's Key Vault secret (cloud.azure.identities): one role assignment
# per VM on that secret, made at launch and removed with the VM. Needed on the vault's scope, which check() reads.
ROLE_ASSIGNMENT_ACTIONS: tuple[str, ...] = (
    "Microsoft.Authorization/roleAssignments/read",
    "Microsoft.Authorization/roleAssignments/write",
    "Microsoft.Authorization/roleAssignments/delete",
)
# Every ARM action the provider performs, directly or through a linked access check when the compute RP creates the
# VM's NIC and OS disk on our behalf. docs/iam/trainmover-azure-role.json grants exactly these.
REQUIRED_ACTIONS: tuple[str, ...] = (
    "Microsoft.Compute/virtualMachines/read",
    "Microsoft.Compute/virtualMachines/write",
    "Microsoft.Compute/virtualMachines/delete",
    "Microsoft.Compute/virtualMachines/start/action",
    "Microsoft.Compute/virtualMachines/deallocate/action",
    "Microsoft.Compute/locations/vmSizes/read",
    "Microsoft.Compute/skus/read",  # accelerators per VM size (`accelerators`: GPUs, RDMA)
    "Microsoft.Compute/disks/read",
    "Microsoft.Compute/disks/write",
    "Microsoft.Compute/disks/delete",
    "Microsoft.Network/networkInterfaces/read",
    "Microsoft.Network/networkInterfaces/write",
    "Microsoft.Network/networkInterfaces/delete",
    "Microsoft.Network/networkInterfaces/join/action",
    "Microsoft.Network/virtualNetworks/subnets/join/action",
    # The job's own network (LaunchRequest.network, cloud.azure.network): its NSG, its application security group
    # and its proximity placement group, made, joined by its NICs and VMs, and deleted.
    "Microsoft.Network/networkSecurityGroups/read",
    "Microsoft.Network/networkSecurityGroups/write",
    "Microsoft.Network/networkSecurityGroups/delete",
    "Microsoft.Network/networkSecurityGroups/join/action",
    "Microsoft.Network/applicationSecurityGroups/read",
    "Microsoft.Network/applicationSecurityGroups/write",
    "Microsoft.Network/applicationSecurityGroups/delete",
    "Microsoft.Network/applicationSecurityGroups/joinIpConfiguration/action",
    "Microsoft.Compute/proximityPlacementGroups/read",
    "Microsoft.Compute/proximityPlacementGroups/write",
    "Microsoft.Compute/proximityPlacementGroups/delete",
    *ROLE_ASSIGNMENT_ACTIONS,
)
# Where the vault's resource id comes from when AzureProvider is not given key_vault_resource_id.
KEY_VAULT_RESOURCE_ID_ENV = "AZURE_KEY_VAULT_RESOURCE_ID"

# On-demand list prices, USD per hour, Linux, pay-as-you-go, East US, as shown on
# https://azure.microsoft.com/pricing/details/virtual-machines/linux/ (read 2025-06; they change, and differ by
# region). Pass `prices_usd_per_h` to use your negotiated or regional prices.
ON_DEMAND_USD_PER_H: Mapping[str, float] = {
    "Standard_ND96isr_H100_v5": 98.32,
    "Standard_ND96amsr_A100_v4": 32.77,
    "Standard_ND96asr_v4": 27.20,
    "Standard_NC40ads_H100_v5": 6.98,
    "Standard_NC80adis_H100_v5": 13.96,
    "Standard_NC24ads_A100_v4": 3.67,
    "Standard_NC48ads_A100_v4": 7.35,
    "Standard_NC96ads_A100_v4": 14.69,
    "Standard_NC4as_T4_v3": 0.526,
    "Standard_NC64as_T4_v3": 4.352,
    "Standard_D2s_v5": 0.096,
    "Standard_D4s_v5": 0.192,
    "Standard_D8s_v5": 0.384,
    "Standard_D16s_v5": 0.768,
    "Standard_E8s_v5": 0.504,
}
# Azure spot prices float per size and region (https://azure.microsoft.com/pricing/spot-advisor/). Without a
# published figure we assume spot costs this fraction of on-demand (the spot advisor showed 60-80 % discounts on
# GPU sizes in 2025-06); override per size with the key "<size>:spot" in `prices_usd_per_h`.
SPOT_PRICE_FRACTION = 0.35

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class _Permission:
    """One entry of ARM's effective-permissions answer: actions granted minus notActions."""

    actions: tuple[str, ...]
    not_actions: tuple[str, ...]


def _pattern(action_glob: str) -> re.Pattern[str]:
    # ARM actions are case-insensitive and `*` spans path segments ("Microsoft.Compute/*", "*/read", "*").
    return re.compile("^" + ".*".join(re.escape(part) for part in action_glob.split("*")) + "$", re.IGNORECASE)


def action_allowed(action: str, permissions: Iterable[_Permission]) -> bool:
    """Whether `action` is granted by some permission entry without being excluded by that entry's notActions."""
    for entry in permissions:
        if any(_pattern(g).match(action) for g in entry.actions) and not any(
            _pattern(g).match(action) for g in entry.not_actions
        ):
            return True
    return False


def _slug(text: str, max_len: int) -> str:
    slug = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    return (slug[:max_len].rstrip("-")) or "job"


class AzureProvider(Provider):
    """Azure VMs of one resource group and location, tagged by job and role.

    `base_url` points the client at another ARM endpoint (a sovereign cloud, or a local test server);
    `client_kwargs` go to `ComputeManagementClient` (transport settings such as `connection_verify`, or
    `polling_interval`). The retry budgets and the bound on each long-running operation are keyword arguments
    so that tests and impatient callers can shorten them.

    `key_vault_resource_id` (default: `$AZURE_KEY_VAULT_RESOURCE_ID`) is the ARM resource id of the vault that holds
    the jobs' secrets: a launch whose hosts read their secret there grants each new VM's identity read access to
    that one secret (`cloud.azure.identities`), and is refused without it. `key_vault` is the same vault's data plane,
    where `release_all` deletes the job's secret.

    `ssh_from` (off by default) lets a jump host SSH to the hosts of every job launched with a `LaunchRequest.network`:
    a CIDR of the bastion (at most a /16) or its application security group's resource id, admitted on TCP 22 by
    the job's NSG (`cloud.azure.network`).
    """

    name = PROVIDER

    def __init__(
        self,
        subscription_id: str,
        resource_group: str,
        location: str,
        *,
        credential: TokenCredential | None = None,
        base_url: str | None = None,
        subnet_id: str | None = None,
        image: str | None = None,
        admin_username: str = "trainmover",
        ssh_public_key: str | None = None,
        prices_usd_per_h: Mapping[str, float] | None = None,
        client_kwargs: Mapping[str, object] | None = None,
        mutate_budget: RetryBudget = MUTATE,
        describe_budget: RetryBudget = DESCRIBE,
        lro_timeout_s: float = 900.0,
        key_vault: AzureKeyVaultStore | None = None,
        key_vault_resource_id: str | None = None,
        ssh_from: str | None = None,
    ) -> None:
        for label, value in (
            ("subscription_id", subscription_id),
            ("resource_group", resource_group),
            ("location", location),
        ):
            if not value:
                raise InvalidRequestError(f"azure: {label} must not be empty", provider=PROVIDER)
        self.subscription_id = subscription_id
        self.resource_group = resource_group
        self.location = location
        self.subnet_id = subnet_id
        self.image = image
        self.admin_username = admin_username
        self.ssh_public_key = ssh_public_key
        self.prices_usd_per_h = dict(prices_usd_per_h or {})
        self.mutate_budget = mutate_budget
        self.describe_budget = describe_budget
        # The vault that holds the job's secret (the flows' TrainingRun.key_vault_url): `release_all` deletes it.
        self.key_vault = key_vault
        self._sizes: frozenset[str] | None = None
        self._sizes_lock = threading.Lock()
        self._api = AzureApi(
            subscription_id, resource_group, location,
            credential=credential, base_url=base_url, client_kwargs=client_kwargs, lro_timeout_s=lro_timeout_s,
        )
        self._client = self._api.compute
        vault_id = key_vault_resource_id or os.environ.get(KEY_VAULT_RESOURCE_ID_ENV) or None
        # Who may read each job's secret: the VMs' role assignments on the vault (None: no vault known).
        self._secret_readers = None if vault_id is None else SecretReaders(
            vault_id, resource_group,
            call=lambda action, fn: self._api.call(action, fn, self.mutate_budget), client=self._api.authorization,
        )
        if self._secret_readers is not None and key_vault is not None:
            self._secret_readers.check_vault(key_vault.vault_url)
        # Who may deallocate itself: each bootstrapped VM whose dead-man's switch deallocates (cloud.azure.selfstop).
        self._self_deallocation = SelfDeallocation(
            subscription_id, resource_group,
            call=lambda action, fn: self._api.call(action, fn, self.mutate_budget), client=self._api.authorization,
        )
        self._job_network = AzureJobNetwork(
            resource_group=resource_group, location=location, subscription_id=subscription_id,
            call=lambda action, fn: self._api.call(action, fn, self.mutate_budget),
            network=self._api.network, compute=self._client, wait=self._api.wait, ssh_from=ssh_from,
        )

    @property
    def secret_readers(self) -> SecretReaders | None:
        """The role assignments that let VMs read their job's Key Vault secret (None: no vault resource id given)."""
        return self._secret_readers

    @property
    def lro_timeout_s(self) -> float:
        """The bound of each long-running operation (settable)."""
        return self._api.lro_timeout_s

    @lro_timeout_s.setter
    def lro_timeout_s(self, value: float) -> None:
        self._api.lro_timeout_s = value

    def __repr__(self) -> str:
        return f"AzureProvider(resource_group={self.resource_group!r}, location={self.location!r})"

    # ------------------------------------------------------------------------------------------------ validation

    def available_sizes(self) -> frozenset[str]:
        """The VM sizes offered in `location` (cached). InvalidRequestError when the location is unknown."""
        with self._sizes_lock:
            if self._sizes is None:
                action = f"Microsoft.Compute/locations/vmSizes/read in {self.location!r}"
                try:
                    sizes = self._api.call(
                        action,
                        lambda: [s.name for s in self._client.virtual_machine_sizes.list(self.location) if s.name],
                        self.describe_budget,
                    )
                except (NotFoundError, InvalidRequestError) as err:
                    raise InvalidRequestError(
                        f"azure: unknown location {self.location!r}: ARM lists no VM sizes there. Use a location "
                        "name such as 'eastus', 'westus3', 'swedencentral' (`az account list-locations -o table`)",
                        provider=PROVIDER,
                        code=err.code,
                    ) from err
                self._sizes = frozenset(sizes)
            return self._sizes

    def _validate_size(self, instance_type: str) -> None:
        sizes = self.available_sizes()
        if instance_type in sizes:
            return
        examples = sorted(s for s in sizes if s.startswith(("Standard_ND", "Standard_NC"))) or sorted(sizes)
        raise InvalidRequestError(
            f"azure: VM size {instance_type!r} is not offered in {self.location!r}. Sizes there include "
            f"{', '.join(examples[:6]) or 'none'} (`az vm list-sizes -l {self.location}`)",
            provider=PROVIDER,
            code="InvalidVmSize",
        )

    def _image_reference(self, image: str) -> dict[str, str]:
        if image.startswith("/"):
            return {"id": image}  # a gallery image or managed image resource id
        parts = image.split(":")
        if len(parts) != 4 or not all(parts):
            raise InvalidRequestError(
                f"azure: image {image!r} is neither 'publisher:offer:sku:version' nor an image resource id",
                provider=PROVIDER,
            )
        publisher, offer, sku, version = parts
        return {"publisher": publisher, "offer": offer, "sku": sku, "version": version}

    def _vm_body(self, request: LaunchRequest, vm_name: str, placement: AzurePlacement | None = None
                 ) -> dict[str, Any]:
        subnet = request.subnet or self.subnet_id
        if not subnet:
            raise InvalidRequestError(
                "azure: no subnet: pass subnet_id to AzureProvider or LaunchRequest.subnet (a subnet resource id)",
                provider=PROVIDER,
            )
        if not self.ssh_public_key:
            raise InvalidRequestError(
                "azure: no ssh_public_key: Linux VMs need one (password login is disabled on purpose)",
                provider=PROVIDER,
            )
        tags = {**request.tags, JOB_TAG: request.job_id, ROLE_TAG: request.role}
        properties: dict[str, Any] = {
            "hardwareProfile": {"vmSize": request.instance_type},
            "storageProfile": {
                "imageReference": self._image_reference(request.image or self.image or DEFAULT_IMAGE),
                "osDisk": {
                    "createOption": "FromImage",
                    "deleteOption": "Delete",  # the disk goes with the VM: terminate leaks nothing
                    "managedDisk": {"storageAccountType": "Premium_LRS"},
                },
            },
            "osProfile": self._os_profile(vm_name),
            "networkProfile": _network_profile(vm_name, subnet),
        }
        if request.market == "spot":
            # Deallocate (not Delete) on eviction: an evicted standby stays parked and can be started again.
            # maxPrice -1: pay up to the on-demand price, so we are evicted only for capacity, never for price.
            properties["priority"] = "Spot"
            properties["evictionPolicy"] = "Deallocate"
            properties["billingProfile"] = {"maxPrice": -1}
        if placement is not None:
            nic = properties["networkProfile"]["networkInterfaceConfigurations"][0]["properties"]
            nic["networkSecurityGroup"] = {"id": placement.nsg_id}
            nic["ipConfigurations"][0]["properties"]["applicationSecurityGroups"] = [{"id": placement.asg_id}]
        placement_group = placement.ppg_id if placement is not None and placement.ppg_id else request.placement_group
        if placement_group:
            properties["proximityPlacementGroup"] = {"id": placement_group}
        if request.capacity_reservation:
            properties["capacityReservation"] = {"capacityReservationGroup": {"id": request.capacity_reservation}}
        document = self._cloud_init(request)
        if document is not None:
            # cloud-init runs osProfile.customData (base64), not properties.userData (IMDS only: cloud-init does
            # not run it). https://learn.microsoft.com/azure/virtual-machines/custom-data
            properties["osProfile"]["customData"] = azure_custom_data(document)
        body: dict[str, Any] = {"location": self.location, "tags": tags, "properties": properties}
        if request.bootstrap is not None:
            # The host reads the job's secret from Key Vault with this identity (IMDS token); its principal id gets
            # "Key Vault Secrets User" on that one secret (cloud.secrets.key_vault_reader_assignment).
            body["identity"] = {"type": "SystemAssigned"}
        if request.zone:
            body["zones"] = [request.zone]
        return body

    def _os_profile(self, vm_name: str) -> dict[str, Any]:
        """Linux with SSH key login only (password login is disabled on purpose)."""
        return {
            "computerName": vm_name,
            "adminUsername": self.admin_username,
            "linuxConfiguration": {
                "disablePasswordAuthentication": True,
                "ssh": {
                    "publicKeys": [
                        {
                            "path": f"/home/{self.admin_username}/.ssh/authorized_keys",
                            "keyData": self.ssh_public_key,
                        }
                    ]
                },
            },
        }

    def _cloud_init(self, request: LaunchRequest) -> str | None:
        """The cloud-init document for customData: the rendered bootstrap (it names the job's secret, never holds
        it), or the request's own user_data. Checked before any call."""
        spec = agent_bootstrap(request)
        if spec is None:
            return request.user_data
        if spec.secret.kind != "azure-keyvault":
            raise InvalidRequestError(
                f"azure: the bootstrap's secret is in {spec.secret.kind}: an Azure VM fetches it from Key Vault with "
                "its managed identity (cloud.secrets.AzureKeyVaultStore)",
                provider=PROVIDER,
                code="InvalidBootstrap",
            )
        if spec.secret.identity_client_id is not None:
            raise InvalidRequestError(
                "azure: the bootstrap's secret names a user-assigned identity, which AzureProvider does not attach: "
                "use the VM's system-assigned identity (a SecretRef without identity_client_id)",
                provider=PROVIDER,
                code="InvalidBootstrap",
            )
        return render_cloud_init(spec)

    # ------------------------------------------------------------------------------------------------ Provider

    def capabilities(self) -> Capabilities:
        return Capabilities(
            provider=PROVIDER,
            spot=True,
            park_on_demand=True,
            park_spot=True,  # deallocate works for spot VMs too (and eviction deallocates them)
            placement_groups=True,
            capacity_reservations=True,
            notice_kinds=frozenset({"eviction", "scheduled_maintenance"}),
            spot_notice_s=30.0,
            job_network=True,
        )

    def launch(self, request: LaunchRequest) -> list[Instance]:
        validate_tags(request.tags, TAG_LIMITS)
        if request.efa:
            raise UnsupportedError(
                "azure: EFA is AWS's adapter; Azure's RDMA is InfiniBand on ND/HB sizes, which needs the VMs in one "
                "scale set or availability set, and the provider creates standalone VMs (docs/cloud-azure.md): "
                "launch without efa",
                provider=PROVIDER,
                code="UnsupportedEfa",
            )
        if request.capacity_block:
            raise UnsupportedError(
                "azure: Capacity Blocks are EC2's; reserve Azure capacity with a capacity reservation group "
                "(capacity_reservation=<group id>)",
                provider=PROVIDER,
                code="UnsupportedCapacityBlock",
            )
        if request.market == "spot" and request.capacity_reservation:
            raise InvalidRequestError(
                "azure: spot VMs cannot use a capacity reservation group; launch on-demand or drop the reservation",
                provider=PROVIDER,
            )
        # The launch token keeps names unique across launches of the same job and role: a PUT on an existing
        # name would silently update that VM instead of creating one.
        prefix = f"tm-{_slug(request.job_id, 30)}-{request.role}-{secrets.token_hex(3)}"
        names = [f"{prefix}-{index}" for index in range(request.count)]
        self._vm_body(request, names[0])  # every mistake the body can hold, refused before any call
        readers = self._secret_readers_for(request)
        self._validate_size(request.instance_type)
        # The job's NSG, ASG and proximity placement group: made on its first launch, reused by replacements.
        placement = self._job_network.ensure(request.job_id, request.network) if request.network else None
        bodies = {vm_name: self._vm_body(request, vm_name, placement) for vm_name in names}

        from azure.mgmt.compute.models import VirtualMachine

        pollers: dict[str, LROPoller[Any]] = {}
        errors: dict[str, CloudError] = {}
        for vm_name in names:
            action = f"Microsoft.Compute/virtualMachines/write ({vm_name}, {request.instance_type})"
            try:
                pollers[vm_name] = self._api.call(
                    action,
                    lambda vm_name=vm_name: self._client.virtual_machines.begin_create_or_update(  # type: ignore[misc]
                        self.resource_group, vm_name, VirtualMachine(bodies[vm_name]), polling=self._api.polling()
                    ),
                    self.mutate_budget,
                )
            except CloudError as err:
                errors[vm_name] = err
                break  # the rest would fail the same way; what was started is cleaned up below
        errors.update(self._api.wait_all(pollers, "create"))
        if errors:
            # A VM whose create failed may still exist (provisioningState Failed) and bill for its disk: delete
            # every name we sent, not only the ones that succeeded.
            attempted = [n for n in names if n in pollers or n in errors]
            self._cleanup(attempted)
            first = next(errors[n] for n in names if n in errors)
            raise first
        if readers is not None:
            spec = agent_bootstrap(request)
            assert spec is not None  # _secret_readers_for returned readers only for a bootstrap
            try:
                for vm_name in names:
                    readers.grant(request.job_id, vm_name, spec.secret.secret_name, self.identity_principal_id(vm_name))
            except CloudError:
                # A host that cannot read its secret never joins: delete the VMs (and what was granted) and say why.
                self._cleanup(names)
                raise
        spec = agent_bootstrap(request)
        if spec is not None and spec.orphan_deallocate and spec.orphan_timeout_s:
            for vm_name in names:
                try:
                    self._self_deallocation.grant(request.job_id, vm_name, self.identity_principal_id(vm_name))
                except CloudError as err:  # the host still powers off when orphaned: it only stays allocated
                    log.warning("azure: %s may not deallocate itself (%s): if its job's coordinator goes, it powers "
                                "off and stays allocated, billed, until the job is released", vm_name, err)
        return self.describe(names)

    def _secret_readers_for(self, request: LaunchRequest) -> SecretReaders | None:
        """Who grants the request's hosts read access to their Key Vault secret; None when they read none. Refused,
        before any call, when the provider does not know the vault's resource id."""
        spec = agent_bootstrap(request)
        if spec is None:
            return None
        if self._secret_readers is None:
            raise InvalidRequestError(
                f"azure: the hosts of job {request.job_id} read their secret from Key Vault ({spec.secret.vault_url}) "
                "and the provider grants each VM's identity read access to it, for which it needs the vault's "
                "resource id: pass AzureProvider(key_vault_resource_id=...) or set "
                f"{KEY_VAULT_RESOURCE_ID_ENV} to {VAULT_RESOURCE_ID_HINT}",
                provider=PROVIDER,
                code="NoKeyVaultResourceId",
            )
        self._secret_readers.check_vault(spec.secret.vault_url)
        return self._secret_readers

    def self_deallocating(self, job_id: str) -> list[str]:
        """The job's VMs whose identity may deallocate its own VM (their dead-man's switch), as ARM lists them now."""
        return self._self_deallocation.grants(job_id)

    def secret_reader_grants(self, job_id: str) -> list[SecretReaderGrant]:
        """The role assignments on the vault that let the job's VMs read its secret, as ARM lists them now (none
        when the provider knows no vault)."""
        validate_job_id(job_id, provider=PROVIDER)
        return [] if self._secret_readers is None else self._secret_readers.grants(job_id=job_id)

    def release_job(self, job_id: str) -> list[str]:
        """Delete the job's VMs (with their disks and NICs), then its NSG, ASG and proximity placement group
        (`LaunchRequest.network`); what ARM would not delete yet is logged, and a later `release_job` deletes it.
        `release_all` also deletes the job's Key Vault secret."""
        ids = self._terminate_job_instances(job_id)
        left = self._job_network.release(job_id)
        if left:
            log.warning("azure: job %s: could not delete %s; run release again", job_id, "; ".join(left))
        return ids

    def release_resources(self, job_id: str, steps: ReleaseSteps, *, instances_terminated: bool) -> None:
        """After the VMs (whose NICs, OS disks and secret-reader role assignments go with them): the job's NSG, ASG
        and proximity placement group, the role assignments of its VMs deleted outside TrainMover (on the vault of
        `key_vault_resource_id`), then its secret in `key_vault` (under its default name, `secret_name_for`)."""
        if instances_terminated:
            self._job_network.release(job_id, steps)
        else:
            steps.fail("the job's NSG, ASG and proximity placement group", "kept: its VMs were not deleted")
        self._self_deallocation.release(job_id, steps)
        if self._secret_readers is not None:
            self._secret_readers.release(job_id, steps)
        elif self.key_vault is not None:
            steps.skip("Key Vault role assignments", f"no key_vault_resource_id (or {KEY_VAULT_RESOURCE_ID_ENV}) given")
        if self.key_vault is None:
            steps.skip("Key Vault secret", "no Key Vault given (AzureProvider(key_vault=...), or --key-vault-url)")
            return
        vault = self.key_vault
        ref = SecretRef("azure-keyvault", f"{vault.vault_url}/secrets/{secret_name_for(job_id, 'azure-keyvault')}")
        steps.run(f"Key Vault secret {ref.name}", lambda: vault.delete_if_present(ref))

    def set_role(self, instance_id: str, role: Role) -> Instance:
        validate_role(role, provider=PROVIDER)
        _refuse_malformed([instance_id], "retag")
        action = f"Microsoft.Compute/virtualMachines/write ({instance_id}, tags)"
        vm = self._api.call(
            f"Microsoft.Compute/virtualMachines/read ({instance_id})",
            partial(self._client.virtual_machines.get, self.resource_group, instance_id),
            self.describe_budget,
        )
        tags = dict(vm.tags or {})
        if JOB_TAG not in tags:
            raise InvalidRequestError(
                f"azure: {instance_id} carries no {JOB_TAG} tag: not a TrainMover instance, so it is not retagged",
                provider=PROVIDER,
                code="NotTrainMoverInstance",
            )
        # A PATCH replaces the whole tag set: send every tag the VM has, with only the role changed.
        tags[ROLE_TAG] = role
        from azure.mgmt.compute.models import VirtualMachineUpdate

        poller = self._api.call(
            action,
            lambda: self._client.virtual_machines.begin_update(
                self.resource_group, instance_id, VirtualMachineUpdate(tags=tags), polling=self._api.polling()
            ),
            self.mutate_budget,
        )
        self._api.wait(poller, action)
        [instance] = self.describe([instance_id])
        return instance

    def identity_principal_id(self, instance_id: str) -> str:
        """The principal id of the VM's system-assigned identity (a bootstrapped VM has one): what
        `cloud.secrets.key_vault_reader_assignment` needs to let this VM, and no other, read the job's secret."""
        _refuse_malformed([instance_id], "read the identity of")
        vm = self._api.call(
            f"Microsoft.Compute/virtualMachines/read ({instance_id})",
            partial(self._client.virtual_machines.get, self.resource_group, instance_id),
            self.describe_budget,
        )
        principal = vm.identity.principal_id if vm.identity is not None else None
        if not principal:
            raise InvalidRequestError(
                f"azure: {instance_id} has no system-assigned identity: launch it with a bootstrap "
                "(LaunchRequest.bootstrap), which gives it one",
                provider=PROVIDER,
                code="NoManagedIdentity",
            )
        return str(principal)

    def _cleanup(self, vm_names: Sequence[str]) -> None:
        # The launch error is the one the caller needs; release_job(job_id) sweeps what is left by tag.
        with contextlib.suppress(CloudError):
            self.terminate(vm_names)

    def stop(self, instance_ids: Sequence[str]) -> list[Instance]:
        self._run_on_each(instance_ids, "deallocate", "Microsoft.Compute/virtualMachines/deallocate/action")
        return self.describe(instance_ids)

    def start(self, instance_ids: Sequence[str]) -> list[Instance]:
        self._run_on_each(instance_ids, "start", "Microsoft.Compute/virtualMachines/start/action")
        return self.describe(instance_ids)

    def _run_on_each(self, instance_ids: Sequence[str], verb: str, action: str) -> None:
        _refuse_malformed(instance_ids, verb)
        ops = self._client.virtual_machines
        begin: Callable[..., LROPoller[Any]] = ops.begin_deallocate if verb == "deallocate" else ops.begin_start
        pollers: dict[str, LROPoller[Any]] = {}
        errors: dict[str, CloudError] = {}
        for vm_name in instance_ids:
            try:
                pollers[vm_name] = self._api.call(
                    f"{action} ({vm_name})",
                    lambda vm_name=vm_name: begin(self.resource_group, vm_name, polling=self._api.polling()),  # type: ignore[misc]
                    self.mutate_budget,
                )
            except CloudError as err:
                errors[vm_name] = err  # the VMs are independent: still act on the others, then report
        errors.update(self._api.wait_all(pollers, action))
        if errors:
            raise next(errors[n] for n in instance_ids if n in errors)

    def terminate(self, instance_ids: Sequence[str]) -> None:
        action = "Microsoft.Compute/virtualMachines/delete"
        malformed = [n for n in instance_ids if not _is_vm_name(n)]
        pollers: dict[str, LROPoller[Any]] = {}
        errors: dict[str, CloudError] = {}
        # Release every VM that can be released, then report: one bad id or failed delete never leaves the others
        # of the call running (and billing).
        for vm_name in (n for n in instance_ids if _is_vm_name(n)):
            try:
                pollers[vm_name] = self._api.call(
                    f"{action} ({vm_name})",
                    lambda vm_name=vm_name: self._client.virtual_machines.begin_delete(  # type: ignore[misc]
                        self.resource_group, vm_name, polling=self._api.polling()
                    ),
                    self.mutate_budget,
                )
            except NotFoundError:
                continue  # already gone
            except CloudError as err:
                errors[vm_name] = err
        waited = self._api.wait_all(pollers, action)
        errors.update({n: e for n, e in waited.items() if not isinstance(e, NotFoundError)})
        deleted = [n for n in instance_ids if _is_vm_name(n) and n not in errors]
        self._revoke_secret_readers(deleted)
        left = self._self_deallocation.revoke_instances(deleted)
        if left:
            log.warning("azure: could not delete %s; the job's release deletes it", "; ".join(left))
        if malformed:
            raise InvalidRequestError(
                f"azure: not VM names ({VM_NAME_RULE}): {', '.join(map(repr, malformed))}; every other VM of the "
                "call was deleted" + (f", except: {next(iter(errors.values()))}" if errors else ""),
                provider=PROVIDER,
                code="InvalidResourceName",
            )
        if errors:
            raise next(iter(errors.values()))

    def _revoke_secret_readers(self, deleted: Sequence[str]) -> None:
        # The identity went with its VM; its role assignment would stay behind ("Identity not found"), granting
        # nothing but counting against the subscription's limit. Not fatal to the termination: the job's release
        # deletes what is left.
        if self._secret_readers is None or not deleted:
            return
        left = self._secret_readers.revoke_instances(deleted)
        if left:
            log.warning("azure: could not delete %s; the job's release deletes it", "; ".join(left))

    def describe(self, instance_ids: Sequence[str] | None = None, *, job_id: str | None = None) -> list[Instance]:
        if instance_ids is None:
            if job_id is None:
                raise InvalidRequestError("azure: describe needs instance_ids or job_id", provider=PROVIDER)
            validate_job_id(job_id, provider=PROVIDER)
            # ARM's list accepts $expand=instanceView only together with a scale-set $filter, so list the model
            # views, filter by tag here, then read each instance view.
            listed = self._api.call(
                f"Microsoft.Compute/virtualMachines/read (list {self.resource_group})",
                lambda: list(self._client.virtual_machines.list(self.resource_group)),
                self.describe_budget,
            )
            instance_ids = [vm.name for vm in listed if vm.name and (vm.tags or {}).get(JOB_TAG) == job_id]
        else:
            if job_id is not None:
                validate_job_id(job_id, provider=PROVIDER)
            _refuse_malformed(instance_ids, "describe")
        found: list[Instance] = []
        for vm_name in instance_ids:
            try:
                vm = self._api.call(
                    f"Microsoft.Compute/virtualMachines/read ({vm_name})",
                    partial(self._client.virtual_machines.get, self.resource_group, vm_name, expand="instanceView"),
                    self.describe_budget,
                )
            except NotFoundError:
                continue  # deleted: terminated instances are not listed
            instance = self._to_instance(vm)
            if job_id is None or instance.job_id == job_id:
                found.append(instance)
        return found

    def _to_instance(self, vm: VirtualMachine) -> Instance:
        tags = vm.tags or {}
        role_tag = tags.get(ROLE_TAG, "worker")
        role: Role = "standby" if role_tag == "standby" else "worker"
        market: Market = "spot" if _text(vm.priority).lower() == "spot" else "on-demand"
        codes = [s.code or "" for s in ((vm.instance_view.statuses if vm.instance_view else None) or [])]
        provisioning = next((c.split("/", 1)[1].lower() for c in codes if c.startswith("ProvisioningState/")), "")
        provisioning = provisioning or _text(vm.provisioning_state).lower()
        power = next((c.split("/", 1)[1].lower() for c in codes if c.startswith("PowerState/")), "")
        health_code = ""
        if vm.instance_view and vm.instance_view.vm_health and vm.instance_view.vm_health.status:
            health_code = (vm.instance_view.vm_health.status.code or "").lower()
        created = vm.time_created
        return Instance(
            instance_id=vm.name or "",
            provider=PROVIDER,
            job_id=tags.get(JOB_TAG, ""),
            role=role,
            instance_type=(vm.hardware_profile.vm_size if vm.hardware_profile else None) or "",
            market=market,
            state=_state(provisioning, power),
            health=_health(provisioning, power, health_code),
            zone=vm.zones[0] if vm.zones else None,
            launched_at=created.timestamp() if created else None,
        )

    def accelerators(self, instance_type: str) -> Accelerators:
        """The size's GPUs and InfiniBand from the location's resource SKUs (cloud.accelerators): one list per
        location, every VM size of it kept. Needs `Microsoft.Compute/skus/read`."""

        def load(_: str) -> list[Accelerators]:
            action = f"Microsoft.Compute/skus/read in {self.location!r}"

            def vm_sizes() -> list[Accelerators]:
                return [
                    from_azure_sku(sku.name, {c.name: c.value or "" for c in sku.capabilities or () if c.name})
                    for sku in self._client.resource_skus.list(filter=f"location eq '{self.location}'")
                    if sku.name and (sku.resource_type or "").lower() == "virtualmachines"
                    and any(loc.lower() == self.location.lower() for loc in sku.locations or ())
                ]

            return self._api.call(action, vm_sizes, self.describe_budget)

        found = table_for(self).lookup(instance_type, load)
        if found is None:
            raise InvalidRequestError(
                f"azure: VM size {instance_type!r} is not among the resource SKUs of {self.location!r} "
                f"(`az vm list-skus -l {self.location} --resource-type virtualMachines`)",
                provider=PROVIDER,
                code="InvalidVmSize",
            )
        return found

    def hourly_price_usd(self, instance_type: str, market: Market = "on-demand") -> float:
        if market == "spot" and f"{instance_type}:spot" in self.prices_usd_per_h:
            return self.prices_usd_per_h[f"{instance_type}:spot"]
        base = self.prices_usd_per_h.get(instance_type, ON_DEMAND_USD_PER_H.get(instance_type))
        if base is None:
            raise InvalidRequestError(
                f"azure: no price known for {instance_type!r}; pass prices_usd_per_h={{{instance_type!r}: ...}} "
                f"(known: {', '.join(sorted(ON_DEMAND_USD_PER_H)[:5])}, ...)",
                provider=PROVIDER,
            )
        return base * SPOT_PRICE_FRACTION if market == "spot" else base

    def poll_notices(self, timeout_s: float = 0.0) -> list[Notice]:
        # Plain VMs have no fleet-wide notice queue we consume: Azure announces evictions and maintenance to each
        # VM through its Scheduled Events endpoint, which cloud.azure.notices.ScheduledEventsSource polls on the
        # node. (Event Grid / Resource Health could fan them in, at the cost of another service to set up.)
        return []

    def check(self) -> list[CheckResult]:
        results: list[CheckResult] = []
        read = "Microsoft.Compute/virtualMachines/read"
        try:
            count = self._api.call(
                read,
                lambda: sum(1 for _ in self._client.virtual_machines.list(self.resource_group)),
                self.describe_budget,
            )
            results.append(CheckResult("credentials", True, "ARM accepted the token"))
            results.append(CheckResult(read, True, f"{count} VMs in {self.resource_group}"))
        except CredentialsError as err:
            return [CheckResult("credentials", False, str(err))]
        except CloudError as err:
            results.append(CheckResult("credentials", True, "ARM accepted the token"))
            results.append(CheckResult(read, False, str(err)))
        sizes_action = "Microsoft.Compute/locations/vmSizes/read"
        try:
            sizes = self.available_sizes()
            results.append(CheckResult(sizes_action, True, f"{len(sizes)} sizes in {self.location}"))
        except CloudError as err:
            results.append(CheckResult(sizes_action, False, str(err)))
        try:
            permissions = self._effective_permissions()
        except CloudError as err:
            results.append(CheckResult("Microsoft.Authorization/permissions/read", False, str(err)))
            return results
        for action in REQUIRED_ACTIONS:
            if action in ROLE_ASSIGNMENT_ACTIONS:
                continue  # needed on the vault, not on the resource group: below
            ok = action_allowed(action, permissions)
            results.append(
                CheckResult(action, ok, "granted" if ok else f"not granted on {self.resource_group}: {ROLE_HINT}")
            )
        results.extend(self._check_vault_grants())
        return results

    def _check_vault_grants(self) -> list[CheckResult]:
        """The role-assignment actions, on the vault's scope, where the provider assigns each VM's reader role."""
        readers = self._secret_readers
        if readers is None:
            return [CheckResult(action, True, f"not used: no key_vault_resource_id (or {KEY_VAULT_RESOURCE_ID_ENV}); "
                                "a launch whose hosts read a Key Vault secret is refused until one is given")
                    for action in ROLE_ASSIGNMENT_ACTIONS]
        try:
            permissions = self._effective_permissions(readers.vault_resource_id)
        except CloudError as err:
            return [CheckResult(f"Microsoft.Authorization/permissions/read (vault {readers.vault_name})", False,
                                str(err))]
        results: list[CheckResult] = []
        for action in ROLE_ASSIGNMENT_ACTIONS:
            ok = action_allowed(action, permissions)
            results.append(CheckResult(
                action, ok,
                f"granted on the vault {readers.vault_name}" if ok else
                f"not granted on the vault {readers.vault_name}: give the orchestrator's identity User Access "
                "Administrator, Owner or Role Based Access Control Administrator on the vault (docs/cloud-azure.md)",
            ))
        return results

    def _effective_permissions(self, scope: str | None = None) -> list[_Permission]:
        """The caller's permissions at `scope` (default: the resource group)."""
        from azure.core.rest import HttpRequest

        scope = scope or f"/subscriptions/{self.subscription_id}/resourceGroups/{self.resource_group}"
        url = f"{scope}/providers/Microsoft.Authorization/permissions"
        request = HttpRequest("GET", url, params={"api-version": PERMISSIONS_API_VERSION})

        def fetch() -> Any:
            response = self._client.send_request(request)
            response.raise_for_status()
            return response.json()

        payload = self._api.call(f"Microsoft.Authorization/permissions/read ({scope})", fetch, self.describe_budget)
        return [
            _Permission(tuple(p.get("actions") or ()), tuple(p.get("notActions") or ()))
            for p in payload.get("value", [])
        ]


# ------------------------------------------------------------------------------------------------ mapping helpers

def _network_profile(vm_name: str, subnet: str) -> dict[str, Any]:
    """One VM-managed NIC in `subnet`, deleted with the VM (terminate leaks nothing), with accelerated networking."""
    return {
        "networkApiVersion": NETWORK_API_VERSION,
        "networkInterfaceConfigurations": [
            {
                "name": f"{vm_name}-nic",
                "properties": {
                    "primary": True,
                    "deleteOption": "Delete",
                    "enableAcceleratedNetworking": True,
                    "ipConfigurations": [
                        {"name": "ipconfig1", "properties": {"primary": True, "subnet": {"id": subnet}}}
                    ],
                },
            }
        ],
    }


VM_NAME_RULE = "1-64 letters, digits, '.', '_' or '-', starting with a letter or digit, not ending with '.' or '-'"


def _is_vm_name(value: object) -> bool:
    return isinstance(value, str) and _VM_NAME.fullmatch(value) is not None


def _refuse_malformed(vm_names: Sequence[str], verb: str) -> None:
    malformed = [n for n in vm_names if not _is_vm_name(n)]
    if malformed:
        raise InvalidRequestError(
            f"azure: cannot {verb} {', '.join(map(repr, malformed))}: not VM names ({VM_NAME_RULE}); nothing was done",
            provider=PROVIDER,
            code="InvalidResourceName",
        )


def _text(value: object) -> str:
    # The SDK's enums mix in str, but str() of one is "EnumName.MEMBER": read its value.
    return str(getattr(value, "value", value) or "")


def _state(provisioning: str, power: str) -> InstanceState:
    if provisioning == "deleting":
        return "terminating"
    by_power: dict[str, InstanceState] = {
        "running": "running",
        "starting": "pending",
        "stopping": "stopping",
        "deallocating": "stopping",
        "deallocated": "stopped",
        # Powered off from inside the guest or by power_off: not running, but the host is still held and billed.
        "stopped": "stopped",
    }
    if power in by_power:
        return by_power[power]
    if provisioning in {"creating", "updating", ""}:
        return "pending"
    return "unknown"


def _health(provisioning: str, power: str, health_code: str) -> Health:
    if provisioning.startswith("failed"):
        return "impaired"
    if health_code == "healthstate/unhealthy":
        return "impaired"
    if provisioning in {"creating", "updating"} or power == "starting":
        return "initializing"
    if health_code == "healthstate/healthy" or (power == "running" and provisioning == "succeeded"):
        return "ok"
    return "unknown"


