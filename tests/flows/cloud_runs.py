"""What a cloud `TrainingRun` needs besides its provider and region: the fields a real launch sends (see
docs/cloud-aws.md and docs/cloud-azure.md). Shared by the flow tests that build cloud runs."""

from __future__ import annotations

AWS_LAUNCH = {"coordinator_address": "10.0.0.10", "image": "ami-12c6146b", "instance_profile": "trainmover-node"}
AZURE_LAUNCH = {"coordinator_address": "10.1.0.10", "image": "microsoft-dsvm:ubuntu-hpc:2204:latest",
                "key_vault_url": "https://trainmover-kv.vault.azure.net",
                "key_vault_resource_id": "/subscriptions/00000000-0000-0000-0000-000000000000/resourceGroups/"
                                         "trainmover/providers/Microsoft.KeyVault/vaults/trainmover-kv"}
