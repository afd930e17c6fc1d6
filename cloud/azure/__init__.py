"""Azure: VMs behind the `cloud.base.Provider` interface (docs/cloud-azure.md).

- `cloud.azure.provider`: `AzureProvider`, standbys as tagged VMs, parked by deallocate/start;
- `cloud.azure.client`: `AzureApi`, the one Azure SDK adapter (the clients, bounded long-running operations, and
  the translation of SDK errors);
- `cloud.azure.network`: a job's own network security group, application security group and proximity placement
  group;
- `cloud.azure.notices`: Scheduled Events on the VM (`ScheduledEventsSource`);
- `cloud.azure.iam`: the least-privilege custom role of one job (`azure_job_role`);
- `cloud.azure.secrets`: the job's secret in Key Vault, read with the VM's managed identity;
- `cloud.azure.identities`: the role assignment per VM that lets its identity read that secret (`SecretReaders`).

Importing it loads no SDK: the Azure SDK is imported when an `AzureProvider` is made.
"""

from cloud.azure.provider import ON_DEMAND_USD_PER_H, REQUIRED_ACTIONS, TAG_LIMITS, AzureProvider, action_allowed

__all__ = ["ON_DEMAND_USD_PER_H", "REQUIRED_ACTIONS", "TAG_LIMITS", "AzureProvider", "action_allowed"]
