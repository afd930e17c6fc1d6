"""The per-job network boundary on EC2: the job's own security group and cluster placement group.

`AwsJobNetwork.ensure` gives a launch the ids it needs: on the job's first launch it creates a security group whose
only ingress rules admit the job's ports from the group itself (a self-referencing rule: only instances in the group
reach them, no CIDR, never 0.0.0.0/0), and a cluster placement group; later launches (replacements, a restarted
orchestrator) find both by their `trainmover:job` tag and reuse them. `AwsJobNetwork.release` deletes them once the
job's instances are gone: EC2 refuses to delete a group that an instance, or its network interface, still uses.

Every call goes through the provider's `_AwsApi` (passed in as `Ec2Calls`), so errors are already `CloudError`s.
https://docs.aws.amazon.com/vpc/latest/userguide/security-group-rules.html#security-group-referencing
https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/placement-strategies.html#placement-groups-cluster
"""

from __future__ import annotations

import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from cloud.base import (
    JOB_TAG,
    CloudError,
    InvalidRequestError,
    JobNetwork,
    ReleaseSteps,
    RetryBudget,
    UnsupportedError,
    validate_job_id,
)

log = logging.getLogger(__name__)

# EC2 answers these while a terminated instance's network interface is still detaching, or an instance is still in
# the placement group: the deletion succeeds once they are gone, so they are waited out (within a deadline).
_STILL_IN_USE = frozenset({"DependencyViolation", "InvalidPlacementGroup.InUse"})
_ALREADY_GONE = frozenset({"InvalidGroup.NotFound", "InvalidPlacementGroup.Unknown"})
_LIVE_GROUP_STATES = ("pending", "available")

# One rule's atom: (protocol, first port, last port, source), source "sg:<id>", "cidr:<block>" or "prefix:<id>".
_Atom = tuple[str, int, int, str]


class Ec2Calls(Protocol):
    """What this module needs of `cloud.aws.client.AwsApi`: one translated, retried call."""

    def call(self, service: str, operation: str, budget: RetryBudget, **params: Any) -> dict[str, Any]: ...


@dataclass(frozen=True, slots=True)
class JobPlacement:
    """Where a launch of the job goes: its security group and, with cluster placement, its placement group."""

    security_group_id: str
    placement_group: str | None


def job_resource_name(job_id: str) -> str:
    """The name of the job's security group and placement group: `trainmover-<job>` (job ids are already made of
    characters both allow; a long id is shortened with a hash so that two jobs never share a name)."""
    validate_job_id(job_id, provider="aws")
    safe = re.sub(r"[^A-Za-z0-9._-]", "-", job_id)
    if len(safe) > 48:
        safe = f"{safe[:39]}-{uuid.uuid5(uuid.NAMESPACE_URL, job_id).hex[:8]}"
    return f"trainmover-{safe}"


def ingress_permissions(group_id: str, network: JobNetwork) -> list[dict[str, Any]]:
    """The security group's whole ingress: TCP on each of the network's port ranges, from the group itself."""
    labels: dict[tuple[int, int], list[str]] = {}
    for label, span in (
        ("store", (network.store_port, network.store_port)),
        ("agent", (network.agent_port, network.agent_port)),
        ("data", network.data_ports),
    ):
        labels.setdefault(span, []).append(label)
    return [
        {
            "IpProtocol": "tcp",
            "FromPort": first,
            "ToPort": last,
            "UserIdGroupPairs": [
                {"GroupId": group_id, "Description": f"trainmover {'/'.join(labels[(first, last)])} from the job"}
            ],
        }
        for first, last in network.tcp_port_ranges()
    ]


def rule_atoms(permissions: Sequence[Mapping[str, Any]]) -> set[_Atom]:
    """EC2 IpPermissions as a set of single rules, so that two listings compare whatever their grouping."""
    atoms: set[_Atom] = set()
    for perm in permissions:
        protocol = str(perm.get("IpProtocol", ""))
        first, last = int(perm.get("FromPort", -1)), int(perm.get("ToPort", -1))
        for pair in perm.get("UserIdGroupPairs") or []:
            atoms.add((protocol, first, last, f"sg:{pair.get('GroupId')}"))
        for block in perm.get("IpRanges") or []:
            atoms.add((protocol, first, last, f"cidr:{block.get('CidrIp')}"))
        for block in perm.get("Ipv6Ranges") or []:
            atoms.add((protocol, first, last, f"cidr:{block.get('CidrIpv6')}"))
        for prefix in perm.get("PrefixListIds") or []:
            atoms.add((protocol, first, last, f"prefix:{prefix.get('PrefixListId')}"))
    return atoms


def _unsupported(err: CloudError) -> bool:
    """The endpoint does not implement the call at all (`cloud.aws.client` makes that an UnsupportedError)."""
    return isinstance(err, UnsupportedError)


def _tags_of(raw: Mapping[str, Any]) -> dict[str, str]:
    return {str(t.get("Key")): str(t.get("Value")) for t in raw.get("Tags") or []}


def _job_filter(job_id: str) -> list[dict[str, Any]]:
    return [{"Name": f"tag:{JOB_TAG}", "Values": [job_id]}]


class AwsJobNetwork:
    """Each job's security group (one per VPC) and cluster placement group in one region.

    Thread-safe: two launches of one job in parallel create one group, not two.
    """

    def __init__(self, api: Ec2Calls, *, mutate_budget: RetryBudget, describe_budget: RetryBudget) -> None:
        self._api = api
        self.mutate_budget = mutate_budget
        self.describe_budget = describe_budget
        self._lock = threading.Lock()
        # (job, VPC id or "" for the default VPC) -> (group id, the network its rules were last checked against)
        self._groups: dict[tuple[str, str], tuple[str, JobNetwork]] = {}
        self._placements: dict[str, str] = {}  # job -> placement group name

    # ensure -------------------------------------------------------------------------------------------------------

    def ensure(self, job_id: str, network: JobNetwork, *, subnet: str | None) -> JobPlacement:
        """The job's security group in the subnet's VPC (the default VPC without a subnet) and, with
        `network.cluster_placement`, its placement group; each created when the job has none yet."""
        with self._lock:
            vpc_id = self._vpc_of(subnet) if subnet else None
            group_id, created = self._security_group(job_id, network, vpc_id)
            try:
                placement = self._placement_group(job_id) if network.cluster_placement else None
            except CloudError as err:
                if created:
                    # The launch fails: a group made by it alone would be left with nothing in it.
                    self._groups.pop((job_id, vpc_id or ""), None)
                    self._delete_group_now(group_id)
                if _unsupported(err):
                    raise UnsupportedError(
                        f"aws: this endpoint has no cluster placement groups ({err.code}): launch with "
                        "JobNetwork(cluster_placement=False), or use an endpoint that has them"
                        + (f"; the security group {group_id} made for this launch was deleted" if created else ""),
                        provider="aws", code=err.code,
                    ) from err
                raise
        return JobPlacement(group_id, placement)

    def _vpc_of(self, subnet: str) -> str:
        # A security group belongs to one VPC and an instance can only use the groups of its subnet's VPC.
        [found] = self._api.call("ec2", "describe_subnets", self.describe_budget, SubnetIds=[subnet])["Subnets"]
        return str(found["VpcId"])

    def _security_group(self, job_id: str, network: JobNetwork, vpc_id: str | None) -> tuple[str, bool]:
        """The job's group id, and whether this call created it."""
        key = (job_id, vpc_id or "")
        created = False
        cached = self._groups.get(key)
        if cached is not None:
            group_id, checked = cached
            if checked != network:
                [current] = self._api.call(
                    "ec2", "describe_security_groups", self.describe_budget, GroupIds=[group_id]
                )["SecurityGroups"]
                self._reconcile(group_id, network, current.get("IpPermissions") or [])
        else:
            existing = self._find_groups(job_id, vpc_id)
            if existing:
                group_id = str(existing[0]["GroupId"])
                self._reconcile(group_id, network, existing[0].get("IpPermissions") or [])
            else:
                group_id, created = self._create_group(job_id, network, vpc_id), True
        self._groups[key] = (group_id, network)
        return group_id, created

    def _find_groups(self, job_id: str, vpc_id: str | None) -> list[dict[str, Any]]:
        filters = _job_filter(job_id)
        if vpc_id:
            filters.append({"Name": "vpc-id", "Values": [vpc_id]})
        groups: list[dict[str, Any]] = []
        params: dict[str, Any] = {"Filters": filters}
        while True:
            page = self._api.call("ec2", "describe_security_groups", self.describe_budget, **params)
            # The tag filter asked for this job; only exact tag values count all the same (job ids hold no wildcard,
            # and nothing a filter returns is trusted to be ours).
            groups += [g for g in page.get("SecurityGroups", []) if _tags_of(g).get(JOB_TAG) == job_id]
            if not page.get("NextToken"):
                return groups
            params["NextToken"] = page["NextToken"]

    def _create_group(self, job_id: str, network: JobNetwork, vpc_id: str | None) -> str:
        params: dict[str, Any] = {
            "GroupName": job_resource_name(job_id),
            # EC2 allows only a-z, A-Z, 0-9, spaces and ._-:/()#,@[]+=&;{}!$* in descriptions.
            "Description": f"TrainMover job {job_id} - ingress only from the hosts of the job",
            "TagSpecifications": [{"ResourceType": "security-group", "Tags": [{"Key": JOB_TAG, "Value": job_id}]}],
        }
        if vpc_id:
            params["VpcId"] = vpc_id
        group_id = str(self._api.call("ec2", "create_security_group", self.mutate_budget, **params)["GroupId"])
        try:
            self._api.call(
                "ec2",
                "authorize_security_group_ingress",
                self.mutate_budget,
                GroupId=group_id,
                IpPermissions=ingress_permissions(group_id, network),
            )
        except CloudError:
            # A group without its rules would be found by the next launch and silently admit nothing: remove it.
            self._delete_group_now(group_id)
            raise
        log.info("aws: created security group %s for job %s (ports %s)", group_id, job_id, network.tcp_port_ranges())
        return group_id

    def _reconcile(self, group_id: str, network: JobNetwork, permissions: Sequence[Mapping[str, Any]]) -> None:
        """Refuse a group that admits more than `network` asks for; add the rules it lacks (a previous process may
        have stopped between creating the group and authorizing its rules)."""
        intended = rule_atoms(ingress_permissions(group_id, network))
        present = rule_atoms(permissions)
        extra = present - intended
        if extra:
            raise InvalidRequestError(
                f"aws: the job's security group {group_id} admits more than this launch's network asks for "
                f"({sorted(extra)}): launch with the network the job started with, or release the job first",
                provider="aws",
                code="InvalidNetwork",
            )
        missing = intended - present
        if missing:
            wanted = [p for p in ingress_permissions(group_id, network) if rule_atoms([p]) <= missing]
            self._api.call(
                "ec2", "authorize_security_group_ingress", self.mutate_budget, GroupId=group_id, IpPermissions=wanted
            )

    def _placement_group(self, job_id: str) -> str:
        name = self._placements.get(job_id)
        if name is not None:
            return name
        found = self._find_placement_groups(job_id)
        if found:
            name = found[0]
        else:
            name = job_resource_name(job_id)
            self._api.call(
                "ec2",
                "create_placement_group",
                self.mutate_budget,
                GroupName=name,
                Strategy="cluster",
                TagSpecifications=[{"ResourceType": "placement-group", "Tags": [{"Key": JOB_TAG, "Value": job_id}]}],
            )
            log.info("aws: created cluster placement group %s for job %s", name, job_id)
        self._placements[job_id] = name
        return name

    def _find_placement_groups(self, job_id: str) -> list[str]:
        page = self._api.call("ec2", "describe_placement_groups", self.describe_budget, Filters=_job_filter(job_id))
        return [
            str(g["GroupName"])
            for g in page.get("PlacementGroups", [])
            if _tags_of(g).get(JOB_TAG) == job_id and g.get("State", "available") in _LIVE_GROUP_STATES
        ]

    # release ------------------------------------------------------------------------------------------------------

    def release(
        self,
        job_id: str,
        *,
        instances_gone: Callable[[], bool],
        timeout_s: float,
        poll_s: float = 5.0,
        sleep: Callable[[float], None] = time.sleep,
        steps: ReleaseSteps | None = None,
    ) -> list[str]:
        """Delete the job's security groups and placement group once `instances_gone()`, each recorded in `steps`
        ("security group sg-...", "placement group trainmover-..."); returns what could not be deleted (empty when
        everything was, or nothing was there). A group still in use after `timeout_s` is one of those. Nothing of
        another job is ever touched."""
        steps = steps if steps is not None else ReleaseSteps()
        left: list[str] = []
        with self._lock:
            self._groups = {k: v for k, v in self._groups.items() if k[0] != job_id}
            self._placements.pop(job_id, None)
        groups: list[str] = []
        placements: list[str] = []
        try:
            groups = [str(g["GroupId"]) for g in self._find_groups(job_id, None)]
        except CloudError as err:
            steps.fail("the job's security groups", err)
            left.append("security groups")
        try:
            placements = self._find_placement_groups(job_id)
        except CloudError as err:
            if not _unsupported(err):  # an endpoint without placement groups: the job cannot have one
                steps.fail("the job's placement group", err)
                left.append("placement group")
        deletions = [(f"security group {g}", "delete_security_group", "GroupId", g) for g in groups]
        deletions += [(f"placement group {n}", "delete_placement_group", "GroupName", n) for n in placements]
        if deletions:
            deadline = time.monotonic() + timeout_s
            try:
                while not instances_gone():
                    if time.monotonic() >= deadline:
                        raise CloudError(f"aws: still in use after {timeout_s:.0f} s: EC2 still lists the job's "
                                         "instances", provider="aws", code="DependencyViolation")
                    sleep(poll_s)
            except CloudError as err:
                for what, *_ in deletions:
                    steps.fail(what, err)
                return left + [name for *_, name in deletions]
            for what, operation, key, name in deletions:
                failed = len(steps.failed)
                steps.run(what, lambda operation=operation, key=key, name=name: self._delete_when_free(  # type: ignore[misc]
                    operation, {key: name}, deadline, timeout_s, poll_s, sleep))
                if len(steps.failed) > failed:
                    left.append(name)
        return left

    def _delete_when_free(
        self,
        operation: str,
        params: dict[str, Any],
        deadline: float,
        timeout_s: float,
        poll_s: float,
        sleep: Callable[[float], None],
    ) -> bool:
        """True when deleted, False when already gone; a CloudError when EC2 refuses (still in use at the
        deadline)."""
        while True:
            try:
                self._api.call("ec2", operation, self.mutate_budget, **params)
                return True
            except CloudError as err:
                if err.code in _ALREADY_GONE or (err.code or "").endswith("NotFound"):
                    return False
                if err.code not in _STILL_IN_USE:
                    raise
                if time.monotonic() >= deadline:
                    raise CloudError(
                        f"aws: still in use after {timeout_s:.0f} s ({err.code}): EC2 has not let go of the job's "
                        "instances yet", provider="aws", code=err.code,
                    ) from err
            sleep(poll_s)

    def _delete_group_now(self, group_id: str) -> None:
        try:
            self._api.call("ec2", "delete_security_group", self.mutate_budget, GroupId=group_id)
        except CloudError as err:
            log.warning("aws: could not remove the incomplete security group %s (%s); delete it by hand", group_id, err)


__all__ = ["AwsJobNetwork", "Ec2Calls", "JobPlacement", "ingress_permissions", "job_resource_name", "rule_atoms"]
