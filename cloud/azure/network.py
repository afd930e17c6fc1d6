"""A job's own network boundary on Azure (`LaunchRequest.network`): what `cloud.azure.AzureProvider` makes once per
job, reuses for every launch of it, and deletes after its VMs.

- an **application security group** (ASG) `tm-<job>-asg`: every NIC of the job's VMs joins it, so "the job's hosts"
  is one name in a rule, whatever their addresses;
- a **network security group** (NSG) `tm-<job>-nsg` on every NIC of the job: inbound TCP on the coordinator's
  store and agent ports and the data ports is allowed from the job's ASG to the job's ASG (priority 100); every
  other inbound packet from the virtual network is denied (priority 4000), so neither another job nor another VM of
  the network reaches the job's ports. Outbound is Azure's default (the agents reach the coordinator). With
  `ssh_from` (off by default) a jump host may reach every host of the job on TCP 22: priority 200, from a CIDR or an
  application security group (the bastion's);
- a **proximity placement group** `tm-<job>-ppg` (`JobNetwork.cluster_placement`): the job's VMs close together in
  one datacenter, replacements included.

All three carry the job's tag. `release` deletes them once the VMs are gone (ARM refuses to delete what a NIC still
references). InfiniBand between VMs needs one scale set or availability set, which standalone VMs are not: the
boundary above is Ethernet (accelerated networking).
"""

from __future__ import annotations

import ipaddress
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cloud.base import JOB_TAG, CloudError, InvalidRequestError, JobNetwork, NotFoundError, ReleaseSteps

log = logging.getLogger(__name__)

JOB_PORTS_RULE = "trainmover-job-ports"
JOB_PORTS_PRIORITY = 100
DENY_VNET_RULE = "trainmover-deny-vnet-inbound"
DENY_VNET_PRIORITY = 4000
JUMP_HOST_SSH_RULE = "trainmover-jump-host-ssh"
JUMP_HOST_SSH_PRIORITY = 200
_ASG_ID = re.compile(r"/subscriptions/[^/]+/resourceGroups/[^/]+/providers/Microsoft\.Network/"
                     r"applicationSecurityGroups/[^/]+", re.IGNORECASE)


def check_ssh_from(ssh_from: str) -> str:
    """`ssh_from` once checked: an IPv4/IPv6 CIDR (a bastion's address or subnet) or an application security group's
    resource id. Anything wider than a /16 (or an IPv6 /48) is refused: SSH from the internet is not a jump host."""
    if _ASG_ID.fullmatch(ssh_from):
        return ssh_from
    try:
        network = ipaddress.ip_network(ssh_from, strict=True)
    except ValueError:
        network = None
    if network is None or network.prefixlen < (16 if network.version == 4 else 48):
        raise InvalidRequestError(
            f"azure: ssh_from {ssh_from!r} is neither a CIDR of at most a /16 (IPv6: /48), such as '10.0.9.4/32' "
            "(the jump host), nor an application security group's resource id "
            "(/subscriptions/<sub>/resourceGroups/<group>/providers/Microsoft.Network/applicationSecurityGroups/<name>)",
            provider="azure",
            code="InvalidSshSource",
        )
    return str(network)


@dataclass(frozen=True, slots=True)
class AzurePlacement:
    """The job's boundary as its VMs reference it (resource ids)."""

    asg_id: str
    nsg_id: str
    ppg_id: str | None


def job_network_names(job_id: str) -> dict[str, str]:
    """The names of a job's ASG, NSG and proximity placement group (letters, digits, '-', within ARM's limits)."""
    slug = re.sub(r"[^A-Za-z0-9-]", "-", job_id)[:60].strip("-") or "job"
    return {"asg": f"tm-{slug}-asg", "nsg": f"tm-{slug}-nsg", "ppg": f"tm-{slug}-ppg"}


def security_rules(asg_id: str, network: JobNetwork, ssh_from: str | None = None) -> list[dict[str, Any]]:
    """The NSG's rules for `network` (ARM's JSON shape): the job's ports from the job's hosts, SSH from `ssh_from`
    (a jump host: a CIDR or an ASG id, see `check_ssh_from`) when given, nothing else from the virtual network."""
    ports = [f"{lo}" if lo == hi else f"{lo}-{hi}" for lo, hi in network.tcp_port_ranges()]
    ssh: list[dict[str, Any]] = []
    if ssh_from is not None:
        source: dict[str, Any] = (
            {"sourceApplicationSecurityGroups": [{"id": ssh_from}]} if _ASG_ID.fullmatch(ssh_from)
            else {"sourceAddressPrefix": check_ssh_from(ssh_from)}
        )
        ssh.append({
            "name": JUMP_HOST_SSH_RULE,
            "properties": {
                "description": "TrainMover: SSH to the job's hosts from the jump host only",
                "protocol": "Tcp", "access": "Allow", "direction": "Inbound", "priority": JUMP_HOST_SSH_PRIORITY,
                "sourcePortRange": "*", "destinationPortRange": "22",
                "destinationApplicationSecurityGroups": [{"id": asg_id}], **source,
            },
        })
    return [
        *ssh,
        {
            "name": JOB_PORTS_RULE,
            "properties": {
                "description": "TrainMover: the coordinator's and the data ports, between the job's hosts only",
                "protocol": "Tcp", "access": "Allow", "direction": "Inbound", "priority": JOB_PORTS_PRIORITY,
                "sourcePortRange": "*", "destinationPortRanges": ports,
                "sourceApplicationSecurityGroups": [{"id": asg_id}],
                "destinationApplicationSecurityGroups": [{"id": asg_id}],
            },
        },
        {
            "name": DENY_VNET_RULE,
            "properties": {
                "description": "TrainMover: nothing else of the virtual network reaches the job's hosts",
                "protocol": "*", "access": "Deny", "direction": "Inbound", "priority": DENY_VNET_PRIORITY,
                "sourceAddressPrefix": "VirtualNetwork", "sourcePortRange": "*",
                "destinationAddressPrefix": "*", "destinationPortRange": "*",
            },
        },
    ]


class AzureJobNetwork:
    """Makes, finds and deletes jobs' boundaries in one resource group (see the module docstring). `call(action,
    fn)` runs one ARM call under the provider's retry budget with its error mapping; `network` is an
    azure-mgmt-network client, `compute` an azure-mgmt-compute client; `wait(poller, action)` waits for a
    long-running operation. `ssh_from` (default: none) admits SSH from a jump host to every host of each job."""

    def __init__(self, *, resource_group: str, location: str, call: Callable[[str, Callable[[], Any]], Any],
                 network: Callable[[], Any], compute: Any, wait: Callable[[Any, str], Any], subscription_id: str,
                 ssh_from: str | None = None) -> None:
        self.ssh_from = None if ssh_from is None else check_ssh_from(ssh_from)
        self.resource_group = resource_group
        self.location = location
        self._call = call
        self._network = network
        self._compute = compute
        self._wait = wait
        self._subscription_id = subscription_id
        self._made: dict[str, AzurePlacement] = {}

    def _id(self, provider_type: str, name: str) -> str:
        return (f"/subscriptions/{self._subscription_id}/resourceGroups/{self.resource_group}/providers/"
                f"{provider_type}/{name}")

    def ensure(self, job_id: str, network: JobNetwork) -> AzurePlacement:
        """The job's boundary, made on its first launch (idempotent PUTs: a restarted orchestrator reuses it)."""
        made = self._made.get(job_id)
        if made is not None and (made.ppg_id is not None) == network.cluster_placement:
            return made
        names = job_network_names(job_id)
        tags = {JOB_TAG: job_id}
        client = self._network()
        asg_id = self._id("Microsoft.Network/applicationSecurityGroups", names["asg"])
        self._wait(self._call(
            f"Microsoft.Network/applicationSecurityGroups/write ({names['asg']})",
            lambda: client.application_security_groups.begin_create_or_update(
                self.resource_group, names["asg"], {"location": self.location, "tags": tags}),
        ), f"create {names['asg']}")
        self._wait(self._call(
            f"Microsoft.Network/networkSecurityGroups/write ({names['nsg']})",
            lambda: client.network_security_groups.begin_create_or_update(
                self.resource_group, names["nsg"],
                {"location": self.location, "tags": tags,
                 "properties": {"securityRules": security_rules(asg_id, network, self.ssh_from)}}),
        ), f"create {names['nsg']}")
        ppg_id = None
        if network.cluster_placement:
            from azure.mgmt.compute.models import ProximityPlacementGroup

            self._call(
                f"Microsoft.Compute/proximityPlacementGroups/write ({names['ppg']})",
                lambda: self._compute.proximity_placement_groups.create_or_update(
                    self.resource_group, names["ppg"],
                    ProximityPlacementGroup({"location": self.location, "tags": tags,
                                             "properties": {"proximityPlacementGroupType": "Standard"}})),
            )
            ppg_id = self._id("Microsoft.Compute/proximityPlacementGroups", names["ppg"])
        placement = AzurePlacement(asg_id, self._id("Microsoft.Network/networkSecurityGroups", names["nsg"]), ppg_id)
        self._made[job_id] = placement
        log.info("azure: job %s has its own NSG %s, ASG %s%s", job_id, names["nsg"], names["asg"],
                 f" and proximity placement group {names['ppg']}" if ppg_id else "")
        return placement

    def release(self, job_id: str, steps: ReleaseSteps | None = None) -> list[str]:
        """Delete the job's NSG, ASG and proximity placement group (after its VMs: ARM refuses to delete what a NIC
        references), each recorded in `steps`; returns what could not be deleted, each with why. Each is read
        first: one that does not exist (a job launched without cluster placement has no proximity placement group)
        is skipped quietly, and one whose tag names another job (two job ids can share a name) is left alone."""
        steps = steps if steps is not None else ReleaseSteps()
        names = job_network_names(job_id)
        try:
            client = self._network()
        except CloudError as err:  # azure-mgmt-network missing: no launch of this installation made a boundary
            steps.skip("the job's NSG, ASG and proximity placement group", str(err))
            return []
        compute = self._compute
        parts: list[tuple[str, str, Any, bool]] = [
            ("network security group", names["nsg"], client.network_security_groups, True),
            ("application security group", names["asg"], client.application_security_groups, True),
            ("proximity placement group", names["ppg"], compute.proximity_placement_groups, False),
        ]
        failed = len(steps.failed)
        for kind, name, operations, long_running in parts:
            steps.run(f"{kind} {name}", lambda name=name, operations=operations, long_running=long_running:  # type: ignore[misc]
                      self._delete_if_the_jobs(job_id, name, operations, long_running))
        left = steps.failed[failed:]
        if not left:
            self._made.pop(job_id, None)
        return list(left)

    def _delete_if_the_jobs(self, job_id: str, name: str, operations: Any, long_running: bool) -> bool:
        """Delete one resource of the job's boundary; False when there is none (or it is another job's)."""
        try:
            found = self._call(f"read {name}", lambda: operations.get(self.resource_group, name))
        except NotFoundError:
            return False
        owner = (getattr(found, "tags", None) or {}).get(JOB_TAG)
        if owner != job_id:
            log.info("azure: %s is not job %s's (its %s tag is %r): left alone", name, job_id, JOB_TAG, owner)
            return False
        if long_running:
            self._wait(self._call(f"delete {name}", lambda: operations.begin_delete(self.resource_group, name)),
                       f"delete {name}")
        else:
            self._call(f"delete {name}", lambda: operations.delete(self.resource_group, name))
        return True


__all__ = ["AzureJobNetwork", "AzurePlacement", "check_ssh_from", "job_network_names", "security_rules"]
