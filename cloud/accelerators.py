"""Accelerators per instance type: how many GPUs one instance of a type has, which ones, and its fabric, read from
the provider's own instance-type data. `Provider.accelerators(instance_type)` answers with an `Accelerators`.

Where each provider reads it:

- AWS: `ec2:DescribeInstanceTypes` (`GpuInfo.Gpus[].Count`, `.Name`, `.MemoryInfo.SizeInMiB`;
  `NetworkInfo.EfaSupported`, `NetworkInfo.MaximumNetworkCards`), translated by `from_ec2_instance_type`.
  Trainium and Inferentia (`NeuronInfo`) are not counted: the agent gives each slot a GPU
  (`CUDA_VISIBLE_DEVICES`), and pins no Neuron core.
- Azure: the location's compute resource SKUs (`Microsoft.Compute/skus`, one list per location; capabilities
  `GPUs` and `RdmaEnabled`, the InfiniBand sizes), translated by `from_azure_sku`. ARM names no GPU model, so the
  kind is read from the size's name where it says (`Standard_ND96isr_H100_v5`: H100) and is None otherwise.
- local: no GPU (one CPU slot per instance) unless the provider is told a count per type.

A host runs one training process per accelerator (`Accelerators.slots`, what the bootstrap passes as
`trainmover agent --slots`); a type without a GPU gives one slot: the job trains on CPU (Gloo) there.

Lookups are cached per provider and type (`table_for(provider)`): a type's data does not change while a job runs,
and the flows ask for it at every launch. This module imports nothing of `cloud`, so `cloud.base` can name the
record in the provider interface.
"""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

Fabric = Literal["efa", "infiniband", "ethernet"]

# GPU models that Azure VM size names carry (https://learn.microsoft.com/azure/virtual-machines/sizes/overview):
# Standard_ND96isr_H100_v5, Standard_NC24ads_A100_v4, Standard_NC4as_T4_v3, Standard_ND96isr_MI300X_v5, ...
_AZURE_GPU_IN_NAME = re.compile(r"_(GB200|B200|H200|H100|A100|MI300X|L40S|A10|T4|V100)(?=_|$)", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class Accelerators:
    """What one instance of `instance_type` has for training, as its provider describes the type."""

    instance_type: str
    count: int = 0
    """GPUs per instance; 0 for a CPU type."""
    kind: str | None = None
    """The GPU model (H100, A100, A10G, ...) when the provider says; None when unknown or without GPUs."""
    memory_mib: int | None = None
    """Memory of one GPU in MiB, when the provider says."""
    efa: bool = False
    """AWS: the type takes Elastic Fabric Adapters (NCCL over libfabric; `LaunchRequest.efa`)."""
    network_cards: int = 1
    """AWS: network cards per instance (`MaximumNetworkCards`): with `efa`, one adapter each (p5.48xlarge: 32)."""
    infiniband: bool = False
    """Azure: the size has an RDMA InfiniBand network (`RdmaEnabled`, the ND sizes); NCCL uses it through IB verbs."""

    def __post_init__(self) -> None:
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 0:
            raise ValueError(f"{self.instance_type}: accelerator count must be an int >= 0, got {self.count!r}")
        if isinstance(self.network_cards, bool) or not isinstance(self.network_cards, int) or self.network_cards < 1:
            raise ValueError(f"{self.instance_type}: network_cards must be an int >= 1, got {self.network_cards!r}")

    @property
    def slots(self) -> int:
        """Training processes one host of this type runs: one per GPU, or one (CPU training) without a GPU."""
        return max(1, self.count)

    @property
    def fabric(self) -> Fabric:
        """The interconnect NCCL finds between hosts of this type."""
        return "efa" if self.efa else "infiniband" if self.infiniband else "ethernet"


def _int(value: object, default: int = 0) -> int:
    """A provider's number (int or numeric string); `default` for anything else."""
    try:
        return int(str(value)) if value is not None and not isinstance(value, bool) else default
    except ValueError:
        return default


def from_ec2_instance_type(described: Mapping[str, Any]) -> Accelerators:
    """One entry of `DescribeInstanceTypes`' `InstanceTypes` as an `Accelerators`
    (https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_InstanceTypeInfo.html)."""
    gpus = [g for g in (described.get("GpuInfo") or {}).get("Gpus") or () if isinstance(g, Mapping)]
    kinds = sorted({str(g["Name"]) for g in gpus if g.get("Name")})
    memories = {_int((g.get("MemoryInfo") or {}).get("SizeInMiB")) for g in gpus}
    network = described.get("NetworkInfo") or {}
    return Accelerators(
        instance_type=str(described.get("InstanceType", "")),
        count=sum(max(0, _int(g.get("Count"))) for g in gpus),
        kind="+".join(kinds) or None,
        memory_mib=memories.pop() if len(memories) == 1 and 0 not in memories else None,
        efa=bool(network.get("EfaSupported")),
        network_cards=max(1, _int(network.get("MaximumNetworkCards"), 1)),
    )


def from_azure_sku(name: str, capabilities: Mapping[str, str]) -> Accelerators:
    """One VM size of the location's resource SKUs (its `capabilities` as name -> value) as an `Accelerators`
    (https://learn.microsoft.com/rest/api/compute/resource-skus/list)."""
    count = max(0, _int(capabilities.get("GPUs")))
    named = _AZURE_GPU_IN_NAME.search(name) if count else None
    return Accelerators(
        instance_type=name,
        count=count,
        kind=named.group(1).upper() if named else None,
        infiniband=str(capabilities.get("RdmaEnabled", "")).lower() == "true",
    )


class AcceleratorTable:
    """The instance types one provider has looked up, each asked of the cloud once. Thread-safe: one lookup at a
    time, so concurrent launches of a new type ask once."""

    def __init__(self) -> None:
        self._known: dict[str, Accelerators] = {}
        self._lock = threading.Lock()

    def lookup(self, instance_type: str, load: Callable[[str], Iterable[Accelerators]]) -> Accelerators | None:
        """`instance_type`'s record: from the table, else from `load(instance_type)`, whose every record is kept
        (Azure lists a whole location at once). None when the provider does not know the type; that answer is
        not kept, so a later call asks again."""
        with self._lock:
            if instance_type not in self._known:
                for found in load(instance_type):
                    self._known.setdefault(found.instance_type, found)
            return self._known.get(instance_type)

    def __len__(self) -> int:
        with self._lock:
            return len(self._known)


_TABLES: weakref.WeakKeyDictionary[object, AcceleratorTable] = weakref.WeakKeyDictionary()
_TABLES_LOCK = threading.Lock()


def table_for(provider: object) -> AcceleratorTable:
    """`provider`'s own table, made on its first lookup and gone with the provider (so a provider needs no field
    of its own for it)."""
    with _TABLES_LOCK:
        table = _TABLES.get(provider)
        if table is None:
            table = _TABLES[provider] = AcceleratorTable()
        return table


__all__ = ["AcceleratorTable", "Accelerators", "Fabric", "from_azure_sku", "from_ec2_instance_type", "table_for"]
