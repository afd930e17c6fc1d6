"""Least privilege for one job on Azure: the custom role its credentials need, as data.

`trainmover cloud policy` prints it; docs/iam/trainmover-azure-role.json holds one example, and a test keeps that
file equal to what `azure_job_role` returns. RBAC cannot condition VM writes on tags, so the boundary is the
resource group the role is assigned on, which must hold nothing but TrainMover's VMs (docs/cloud-azure.md says why).

A pure function of typed inputs: nothing here calls a cloud or imports an SDK.
"""

from __future__ import annotations

import re
from typing import Any

from cloud.azure.provider import REQUIRED_ACTIONS  # no SDK import: the provider loads the SDK lazily
from cloud.base import InvalidRequestError

AZURE_ROLE_NAME = "TrainMover VM operator"
_SUBSCRIPTION = re.compile(r"[0-9a-fA-F]{8}-(?:[0-9a-fA-F]{4}-){3}[0-9a-fA-F]{12}")
_RESOURCE_GROUP = re.compile(r"[-\w._()]{0,89}[-\w_()]")


def azure_job_role(
    subscription_id: str = "<subscription-id>", resource_group: str = "<resource-group>"
) -> dict[str, Any]:
    """The custom role (a dict for `az role definition create`) with exactly the actions `AzureProvider` performs,
    assignable only on `resource_group`: a group dedicated to TrainMover's VMs (see docs/cloud-azure.md)."""
    placeholder = (subscription_id, resource_group) == ("<subscription-id>", "<resource-group>")
    if not placeholder:
        if not _SUBSCRIPTION.fullmatch(subscription_id):
            raise InvalidRequestError(f"azure: subscription id {subscription_id!r} is not a GUID", provider="azure")
        if not _RESOURCE_GROUP.fullmatch(resource_group):
            raise InvalidRequestError(
                f"azure: resource group {resource_group!r} is not a valid name (1-90 letters, digits, '-', '_', "
                "'.', '(', ')', not ending with '.')",
                provider="azure",
            )
    return {
        "Name": AZURE_ROLE_NAME,
        "IsCustom": True,
        "Description": (
            "Least privilege for cloud.azure.AzureProvider: create, park (deallocate), start, read and delete VMs "
            "with VM-managed NICs and OS disks, each job's own NSG, application security group and proximity "
            "placement group, list VM sizes, assign each VM's identity read access to its job's Key Vault secret "
            "(role assignments, which reach the vault only when it lies in this group: otherwise grant them on the "
            "vault, see docs/cloud-azure.md), and read the caller's own permissions (check). "
            "Assign it only on a resource group dedicated to TrainMover's VMs: Azure RBAC cannot limit these "
            "actions by tag, so the group is the boundary."
        ),
        "Actions": [*REQUIRED_ACTIONS, "Microsoft.Authorization/permissions/read"],
        "NotActions": [],
        "DataActions": [],
        "NotDataActions": [],
        "AssignableScopes": [f"/subscriptions/{subscription_id}/resourceGroups/{resource_group}"],
    }


__all__ = ["AZURE_ROLE_NAME", "azure_job_role"]
