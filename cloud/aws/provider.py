"""The AWS EC2 provider: standbys as tagged EC2 instances, parked by stop/start, warned via EventBridge and SQS.

Every boto3 call goes through `cloud.aws.client.AwsApi` (the one boto3 adapter, which also turns botocore errors
into the `CloudError` hierarchy); nothing here sees a botocore exception. boto3 is imported lazily, so importing
`cloud.aws` works without it. docs/cloud-aws.md explains the mapping to EC2 and the IAM policy
(docs/iam/trainmover-aws-policy.json) that lists exactly the actions called here.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from cloud.accelerators import Accelerators, from_ec2_instance_type, table_for
from cloud.aws.client import AwsApi, api_name, did_you_mean
from cloud.aws.iam import AwsJobScope
from cloud.aws.network import AwsJobNetwork
from cloud.aws.notices import (
    NoticeEvent,
    NoticeQueue,
    Refusal,
    event_refusal,
    parse_event,
)
from cloud.aws.secrets import delete_job_secrets
from cloud.aws.simulation import simulate_job_permissions
from cloud.base import (
    DESCRIBE,
    JOB_TAG,
    MUTATE,
    ROLE_TAG,
    Capabilities,
    CheckResult,
    CloudError,
    Health,
    Instance,
    InstanceState,
    InvalidRequestError,
    LaunchRequest,
    Market,
    NotFoundError,
    Notice,
    PermissionDeniedError,
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
from cloud.bootstrap import agent_bootstrap, render_cloud_init

if TYPE_CHECKING:
    import boto3

log = logging.getLogger("cloud.aws")  # the name users configure, as before the move to cloud/aws/

# On-demand list prices, USD per hour, Linux, us-east-1. Source: https://aws.amazon.com/ec2/pricing/on-demand/
# (AWS price list), as listed in mid-2025, after AWS's June 2025 cut of P4/P5 prices. Other regions differ by up
# to ~30 %, and prices change: pass `prices_usd_per_h` to use yours.
ON_DEMAND_USD_PER_H: Mapping[str, float] = {
    "p5.48xlarge": 55.04,
    "p4de.24xlarge": 27.45,
    "p4d.24xlarge": 21.96,
    "g6.xlarge": 0.8048,
    "g6.2xlarge": 0.9776,
    "g6.4xlarge": 1.3232,
    "g6.8xlarge": 2.0144,
    "g6.12xlarge": 4.6016,
    "g6.16xlarge": 3.3968,
    "g6.24xlarge": 6.6752,
    "g6.48xlarge": 13.3504,
    "g5.xlarge": 1.006,
    "g5.2xlarge": 1.212,
    "g5.4xlarge": 1.624,
    "g5.8xlarge": 2.448,
    "g5.12xlarge": 5.672,
    "g5.16xlarge": 4.096,
    "g5.24xlarge": 8.144,
    "g5.48xlarge": 16.288,
    "t3.micro": 0.0104,
    "t3.medium": 0.0416,
    "m5.large": 0.096,
    "m5.xlarge": 0.192,
    "m7i.large": 0.1008,
    "c5.xlarge": 0.17,
    "c7i.large": 0.08925,
}

_AWS_STATES: Mapping[str, InstanceState] = {
    "pending": "pending",
    "running": "running",
    "stopping": "stopping",
    "stopped": "stopped",
    "shutting-down": "terminating",
    "terminated": "terminated",
}
_LIVE_STATES = ("pending", "running", "stopping", "stopped", "shutting-down")
# EC2 instance ids: "i-" and 8 (older) or 17 hex digits. AWS refuses a whole TerminateInstances call when one id
# is malformed (InvalidInstanceID.Malformed), so ids are checked before any call.
_INSTANCE_ID = re.compile(r"i-(?:[0-9a-f]{8}|[0-9a-f]{17})")
_CAPACITY_RESERVATION_ID = re.compile(r"cr-[0-9a-f]{8}(?:[0-9a-f]{9})?")
_RESOURCE_GROUP_ARN = re.compile(r"arn:aws[a-z-]*:resource-groups:[a-z0-9-]+:\d{12}:group/[A-Za-z0-9_.-]{1,300}")
_ACCOUNT_ID = re.compile(r"\d{12}")
# https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/Using_Tags.html#tag-restrictions
TAG_LIMITS = TagLimits(
    "aws",
    max_tags=50,
    max_key_len=128,
    max_value_len=256,
    reserved_key_prefixes=("aws:",),
    doc="https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/Using_Tags.html#tag-restrictions",
)
# IMDSv2 only (session tokens; blocks SSRF-style reads of the instance role's credentials); a hop limit of 2 lets
# a container on the instance reach it. The IAM policy (cloud.aws.iam) refuses launches without HttpTokens=required.
METADATA_OPTIONS: Mapping[str, Any] = {
    "HttpTokens": "required",
    "HttpEndpoint": "enabled",
    "HttpPutResponseHopLimit": 2,
}
# EC2 answers NotFound for an id that never existed; a placeholder lets check() dry-run without an instance.
_PLACEHOLDER_INSTANCE = "i-00000000000000000"
_PLACEHOLDER_IMAGE = "ami-00000000000000000"  # the simulation's launch image when the provider has none


class AwsProvider(Provider):
    """TrainMover's instances in one AWS region.

    Every instance carries the tags `trainmover:job` and `trainmover:role` (on the instance and its volumes), so a
    job's fleet is found, and released, by tag. Spot instances are one-time requests: AWS cannot stop those, so
    `stop` refuses them before calling AWS (see `capabilities`).
    """

    name = "aws"

    def __init__(
        self,
        region: str,
        *,
        session: boto3.Session | None = None,
        endpoint_url: str | None = None,
        notice_queue_url: str | None = None,
        image: str | None = None,
        subnet: str | None = None,
        security_groups: Sequence[str] = (),
        instance_profile: str | None = None,
        prices_usd_per_h: Mapping[str, float] | None = None,
        mutate_budget: RetryBudget = MUTATE,
        describe_budget: RetryBudget = DESCRIBE,
        notice_job_id: str | None = None,
        account_id: str | None = None,
        network_release_timeout_s: float = 600.0,
    ) -> None:
        if notice_job_id is not None:
            validate_job_id(notice_job_id, provider="aws")
        if account_id is not None and not _ACCOUNT_ID.fullmatch(account_id):
            raise InvalidRequestError(f"aws: account_id {account_id!r} is not 12 digits", provider="aws")
        if not network_release_timeout_s >= 0:
            raise InvalidRequestError(
                f"aws: network_release_timeout_s must be >= 0, got {network_release_timeout_s}", provider="aws"
            )
        self.region = region
        self.notice_queue_url = notice_queue_url
        # The job whose queue `notice_queue_url` is: only notices for its own instances are returned.
        self.notice_job_id = notice_job_id
        self.account_id = account_id  # the job's account; asked of STS on the first poll when not given
        self.network_release_timeout_s = network_release_timeout_s
        self.image = image
        self.subnet = subnet
        self.security_groups = tuple(security_groups)
        # The node role's instance profile (name or ARN); launching with it needs iam:PassRole on that role only.
        self.instance_profile = instance_profile
        self.prices_usd_per_h = dict(prices_usd_per_h or {})
        self.mutate_budget = mutate_budget
        self.describe_budget = describe_budget
        self._api = AwsApi(region, session, endpoint_url)
        self._session, self._endpoint_url = session, endpoint_url  # for the job's notice queue and secret
        self._network = AwsJobNetwork(self._api, mutate_budget=mutate_budget, describe_budget=describe_budget)
        self._known_types: dict[str, int] = {}  # type -> EFA interfaces it takes (0: no EFA)
        self._seen_events: deque[str] = deque(maxlen=4096)
        self._warned_no_queue = False
        self._dropped: Counter[str] = Counter()
        self._dropped_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"AwsProvider(region={self.region!r}, notice_queue_url={self.notice_queue_url!r})"

    def capabilities(self) -> Capabilities:
        return Capabilities(
            provider="aws",
            spot=True,
            park_on_demand=True,
            park_spot=False,  # AWS stops only persistent spot requests; we launch one-time ones
            placement_groups=True,
            capacity_reservations=True,
            notice_kinds=frozenset({"spot_interruption", "rebalance_recommendation", "scheduled_maintenance"}),
            spot_notice_s=120.0,
            job_network=True,
        )

    # launch -------------------------------------------------------------------------------------------------

    def launch(self, request: LaunchRequest) -> list[Instance]:
        validate_tags(request.tags, TAG_LIMITS)
        user_data = self._user_data(request)
        self._check_instance_type(request.instance_type)
        image = self._check_launch(request)
        params = self._run_params(request, image)
        self._add_network(request, params)
        if user_data:
            params["UserData"] = user_data  # boto3 base64-encodes it
        response = self._api.call("ec2", "run_instances", self.mutate_budget, **params)
        return [self._instance(raw, "unknown") for raw in response.get("Instances", [])]

    def _check_launch(self, request: LaunchRequest) -> str:
        """The AMI to launch; InvalidRequestError, before any call, for what EC2 would refuse (or misplace)."""
        if request.efa and not self._known_types[request.instance_type]:
            raise InvalidRequestError(
                f"aws: {request.instance_type} has no Elastic Fabric Adapter: launch without efa, or use a type that "
                "has one (p5.48xlarge, p4d.24xlarge, g6.48xlarge; `aws ec2 describe-instance-types --filters "
                "Name=network-info.efa-supported,Values=true`)",
                provider="aws", code="InvalidEfa",
            )
        image = request.image or self.image
        if not image:
            raise InvalidRequestError(
                "aws: no AMI to launch: pass image='ami-...' to AwsProvider or set LaunchRequest.image",
                provider="aws",
            )
        reservation = request.capacity_reservation
        if reservation is not None and not (_CAPACITY_RESERVATION_ID.fullmatch(reservation)
                                            or _RESOURCE_GROUP_ARN.fullmatch(reservation)):
            raise InvalidRequestError(
                f"aws: capacity_reservation {reservation!r} is neither a reservation id (cr-0123456789abcdef0) nor a "
                "capacity reservation group's ARN (arn:aws:resource-groups:REGION:ACCOUNT:group/NAME)",
                provider="aws", code="InvalidCapacityReservation",
            )
        if request.capacity_block and not (reservation or "").startswith("cr-"):
            raise InvalidRequestError(
                "aws: a Capacity Block is one reservation: give its id (cr-...), not a group", provider="aws",
                code="InvalidCapacityReservation",
            )
        if request.market == "spot" and request.capacity_reservation:
            raise InvalidRequestError(
                "aws: a capacity reservation holds on-demand capacity; launch with market='on-demand' to use "
                f"{request.capacity_reservation}",
                provider="aws",
            )
        return image

    def _run_params(self, request: LaunchRequest, image: str) -> dict[str, Any]:
        """RunInstances' parameters: tags, IMDSv2, instance profile, placement, market and capacity reservation."""
        tags = [
            {"Key": k, "Value": v} for k, v in {**request.tags, JOB_TAG: request.job_id, ROLE_TAG: request.role}.items()
        ]
        params: dict[str, Any] = {
            "ImageId": image,
            "InstanceType": request.instance_type,
            "MinCount": request.count,
            "MaxCount": request.count,
            # One token for all attempts: when a retried RunInstances reaches AWS twice (a timeout after AWS
            # acted), AWS returns the first launch instead of launching again.
            # https://docs.aws.amazon.com/ec2/latest/devguide/ec2-api-idempotency.html
            "ClientToken": uuid.uuid4().hex,
            "TagSpecifications": [
                {"ResourceType": "instance", "Tags": tags},
                {"ResourceType": "volume", "Tags": tags},
            ],
            "MetadataOptions": dict(METADATA_OPTIONS),
        }
        params.update(self._profile_param())
        placement = {}
        if request.placement_group:
            placement["GroupName"] = request.placement_group
        if request.zone:
            placement["AvailabilityZone"] = request.zone
        if placement:
            params["Placement"] = placement
        if request.market == "spot":
            params["InstanceMarketOptions"] = {
                "MarketType": "spot",
                "SpotOptions": {"SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"},
            }
        if request.bootstrap is not None and request.bootstrap.powers_off_when_orphaned:
            # The host's dead-man's switch powers it off from inside (cloud.bootstrap): make that a termination, so
            # an orphaned host stops billing instead of waiting, stopped, with its volume.
            params["InstanceInitiatedShutdownBehavior"] = "terminate"
        if request.capacity_reservation:
            target = ("CapacityReservationResourceGroupArn" if request.capacity_reservation.startswith("arn:")
                      else "CapacityReservationId")
            params["CapacityReservationSpecification"] = {
                "CapacityReservationTarget": {target: request.capacity_reservation}
            }
            if request.capacity_block:
                # https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/capacity-blocks-launch.html
                params["InstanceMarketOptions"] = {"MarketType": "capacity-block"}
        return params

    def _add_network(self, request: LaunchRequest, params: dict[str, Any]) -> None:
        """The subnet and security groups (the job's own, created on its first launch), or one EFA per network card."""
        subnet = request.subnet or self.subnet
        if subnet:
            params["SubnetId"] = subnet
        security_groups = list(self.security_groups)
        if request.network is not None:
            # Created on the job's first launch, found by tag afterwards: replacements join the same group and
            # placement group as the hosts they replace.
            job_placement = self._network.ensure(request.job_id, request.network, subnet=subnet)
            security_groups.append(job_placement.security_group_id)
            if job_placement.placement_group is not None:
                params["Placement"] = {**params.get("Placement", {}), "GroupName": job_placement.placement_group}
        if request.efa:
            # One EFA per network card: card 0's is the primary interface, the others attach at device index 1.
            # https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-acc-inst-types.html
            if not subnet:
                raise InvalidRequestError("aws: EFA interfaces need a subnet: pass subnet= to AwsProvider",
                                          provider="aws", code="InvalidEfa")
            params.pop("SubnetId", None)
            params["NetworkInterfaces"] = [
                {"DeviceIndex": 0 if card == 0 else 1, "NetworkCardIndex": card, "InterfaceType": "efa",
                 "SubnetId": subnet, "DeleteOnTermination": True, **({"Groups": security_groups} if security_groups
                                                                      else {})}
                for card in range(self._known_types[request.instance_type])
            ]
        elif security_groups:
            params["SecurityGroupIds"] = security_groups

    def _user_data(self, request: LaunchRequest) -> str | None:
        """The instance's user-data: the rendered bootstrap (which names the job's secret, never holds it), or the
        request's own user_data. Checked before any call: a host that could not fetch its secret would boot, bill,
        and never join."""
        spec = agent_bootstrap(request)
        if spec is None:
            return request.user_data
        if not spec.secret.kind.startswith("aws-"):
            raise InvalidRequestError(
                f"aws: the bootstrap's secret is in {spec.secret.kind}: an EC2 instance fetches it with its instance "
                "role, from Secrets Manager or SSM Parameter Store (cloud.secrets.AwsSecretsManagerStore or "
                "AwsParameterStore)",
                provider="aws",
                code="InvalidBootstrap",
            )
        if not self.instance_profile:
            raise InvalidRequestError(
                "aws: a bootstrapped instance fetches the job's secret with its instance role: pass "
                "instance_profile=<the node role's instance profile> to AwsProvider (the role the secret's store "
                "lets read it: docs/cloud-aws.md)",
                provider="aws",
                code="InvalidBootstrap",
            )
        return render_cloud_init(spec)

    def _profile_param(self) -> dict[str, Any]:
        if not self.instance_profile:
            return {}
        key = "Arn" if self.instance_profile.startswith("arn:") else "Name"
        return {"IamInstanceProfile": {key: self.instance_profile}}

    def _check_instance_type(self, instance_type: str) -> None:
        # moto launches any type string; real AWS refuses an unknown one only at RunInstances, after the quota and
        # capacity checks. Asking DescribeInstanceTypes first gives one clear error before anything launches.
        if instance_type in self._known_types:
            return
        try:
            found = self._api.call("ec2", "describe_instance_types", self.describe_budget,
                                   InstanceTypes=[instance_type])
        except InvalidRequestError as err:
            hint = did_you_mean(instance_type, ON_DEMAND_USD_PER_H)
            raise InvalidRequestError(
                f"aws {self.region}: unknown instance type {instance_type!r}: {hint}GPU types include p5.48xlarge, "
                "p4d.24xlarge, g6.12xlarge (`aws ec2 describe-instance-types` lists them)",
                provider="aws",
                code=err.code,
            ) from err
        described: list[dict[str, Any]] = found.get("InstanceTypes", [])
        network: dict[str, Any] = (described[0] if described else {}).get("NetworkInfo", {})
        efa = network.get("EfaInfo", {}).get("MaximumEfaInterfaces", 0) if network.get("EfaSupported") else 0
        self._known_types[instance_type] = min(int(efa), int(network.get("MaximumNetworkCards", efa) or efa))

    # park / wake / release --------------------------------------------------------------------------------------

    def stop(self, instance_ids: Sequence[str]) -> list[Instance]:
        ids = list(instance_ids)
        if not ids:
            return []
        _refuse_malformed(ids, "stop")
        spot = [i.instance_id for i in self.describe(ids) if i.market == "spot"]
        if spot:
            # moto stops a one-time spot instance; real AWS refuses (UnsupportedOperation). Refusing here keeps
            # both the same and says why. https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/how-spot-instances-work.html
            raise UnsupportedError(
                f"aws: cannot park spot instances {spot}: AWS stops only persistent spot requests and TrainMover "
                "launches one-time ones. Terminate them instead, and park on-demand standbys.",
                provider="aws",
                code="UnsupportedOperation",
            )
        self._api.call("ec2", "stop_instances", self.mutate_budget, InstanceIds=ids)
        return self.describe(ids)

    def start(self, instance_ids: Sequence[str]) -> list[Instance]:
        ids = list(instance_ids)
        if not ids:
            return []
        _refuse_malformed(ids, "start")
        self._api.call("ec2", "start_instances", self.mutate_budget, InstanceIds=ids)
        return self.describe(ids)

    def set_role(self, instance_id: str, role: Role) -> Instance:
        validate_role(role, provider="aws")
        _refuse_malformed([instance_id], "retag")
        # Only the role tag: the job's policy (cloud.aws.iam) allows CreateTags on its own instances for this key alone.
        self._api.call(
            "ec2", "create_tags", self.mutate_budget, Resources=[instance_id], Tags=[{"Key": ROLE_TAG, "Value": role}]
        )
        [instance] = self.describe([instance_id])
        return instance

    def terminate(self, instance_ids: Sequence[str]) -> None:
        malformed = [i for i in instance_ids if not _is_instance_id(i)]
        # One malformed id makes AWS refuse the whole call: release every well-formed one, then report the rest.
        self._terminate([i for i in instance_ids if _is_instance_id(i)])
        if malformed:
            raise InvalidRequestError(
                f"aws: not EC2 instance ids (expected 'i-' and 8 or 17 hex digits): {', '.join(map(repr, malformed))}; "
                "every other id of the call was terminated",
                provider="aws",
                code="InvalidInstanceID.Malformed",
            )

    def release_job(self, job_id: str) -> list[str]:
        """Terminate the job's instances, then delete its security group and placement group (`LaunchRequest.network`)
        once EC2 shows none of its instances (EC2 refuses to delete a group still in use): waits at most
        `network_release_timeout_s`; what is still there then is logged, and a later `release_job` deletes it.
        `release_all` also deletes the job's notice queue, rules and secret."""
        ids = self._terminate_job_instances(job_id)
        left = self._release_network(job_id, ReleaseSteps())
        if left:
            log.warning("aws: job %s: could not delete %s yet; run release again to delete them", job_id,
                        ", ".join(left))
        return ids

    def release_resources(self, job_id: str, steps: ReleaseSteps, *, instances_terminated: bool) -> None:
        """After the instances: the job's security group and placement group; its EventBridge rules and SQS notice
        queue (`ensure_notice_queue`); its secret (`cloud.aws.secrets.delete_job_secrets`: the SSM parameter and
        the Secrets Manager secret under their default names)."""
        if instances_terminated:
            self._release_network(job_id, steps)
        else:
            steps.fail("the job's security group and placement group", "kept: its instances were not terminated")
        NoticeQueue(job_id, region=self.region, session=self._session, endpoint_url=self._endpoint_url,
                    budget=self.mutate_budget).release(steps)
        delete_job_secrets(job_id, steps, region=self.region, session=self._session,
                           endpoint_url=self._endpoint_url, budget=self.mutate_budget)

    def _release_network(self, job_id: str, steps: ReleaseSteps) -> list[str]:
        return self._network.release(
            job_id,
            instances_gone=lambda: not self.describe(job_id=job_id),
            timeout_s=self.network_release_timeout_s,
            steps=steps,
        )

    def _terminate(self, ids: list[str]) -> None:
        if not ids:
            return
        try:
            self._api.call("ec2", "terminate_instances", self.mutate_budget, InstanceIds=ids)
        except NotFoundError:
            # One unknown id fails the whole call; terminate the others one by one so that none is leaked.
            for instance_id in ids:
                try:
                    self._api.call("ec2", "terminate_instances", self.mutate_budget, InstanceIds=[instance_id])
                except NotFoundError:
                    log.info("aws: %s is already gone", instance_id)

    # describe ---------------------------------------------------------------------------------------------------

    def describe(self, instance_ids: Sequence[str] | None = None, *, job_id: str | None = None) -> list[Instance]:
        if instance_ids is None and job_id is None:
            raise InvalidRequestError("aws: describe needs instance_ids or job_id", provider="aws")
        params: dict[str, Any] = {}
        if instance_ids is not None:
            if not instance_ids:
                return []
            _refuse_malformed(list(instance_ids), "describe")
            params["InstanceIds"] = list(instance_ids)
        if job_id is not None:
            validate_job_id(job_id, provider="aws")
            params["Filters"] = [
                {"Name": f"tag:{JOB_TAG}", "Values": [job_id]},
                {"Name": "instance-state-name", "Values": list(_LIVE_STATES)},
            ]
        raws: list[dict[str, Any]] = []
        while True:
            page = self._api.call("ec2", "describe_instances", self.describe_budget, **params)
            raws += [i for r in page.get("Reservations", []) for i in r.get("Instances", [])]
            if not page.get("NextToken"):
                break
            params["NextToken"] = page["NextToken"]
        if job_id is not None:
            # The tag filter above already asked for this job; keep only exact matches all the same, so that no
            # filter semantics (EC2's `*` and `?` wildcards) can hand us another job's instances to act on.
            raws = [raw for raw in raws if _tags_of(raw).get(JOB_TAG) == job_id]
        health = self._health([raw["InstanceId"] for raw in raws if raw.get("State", {}).get("Name") == "running"])
        return [self._instance(raw, health.get(raw["InstanceId"], "unknown")) for raw in raws]

    def _health(self, running_ids: list[str]) -> dict[str, Health]:
        health: dict[str, Health] = {}
        for start in range(0, len(running_ids), 100):  # DescribeInstanceStatus takes at most 100 ids
            params: dict[str, Any] = {"InstanceIds": running_ids[start : start + 100], "IncludeAllInstances": True}
            while True:
                page = self._api.call("ec2", "describe_instance_status", self.describe_budget, **params)
                for status in page.get("InstanceStatuses", []):
                    health[status["InstanceId"]] = _health_of(status)
                if not page.get("NextToken"):
                    break
                params["NextToken"] = page["NextToken"]
        return health

    def _instance(self, raw: Mapping[str, Any], health: Health) -> Instance:
        tags = _tags_of(raw)
        role: Role = "standby" if tags.get(ROLE_TAG) == "standby" else "worker"
        launched = raw.get("LaunchTime")
        return Instance(
            instance_id=raw["InstanceId"],
            provider="aws",
            job_id=tags.get(JOB_TAG, ""),
            role=role,
            instance_type=raw.get("InstanceType", ""),
            market="spot" if raw.get("InstanceLifecycle") == "spot" else "on-demand",
            state=_AWS_STATES.get(raw.get("State", {}).get("Name", ""), "unknown"),
            health=health,
            zone=(raw.get("Placement") or {}).get("AvailabilityZone"),
            private_ip=raw.get("PrivateIpAddress"),
            launched_at=launched.timestamp() if isinstance(launched, datetime) else None,
        )

    # accelerators -------------------------------------------------------------------------------------------

    def accelerators(self, instance_type: str) -> Accelerators:
        """The type's GPUs and EFA support from `DescribeInstanceTypes` (cloud.accelerators), once per type."""

        def unknown(code: str | None) -> InvalidRequestError:
            return InvalidRequestError(
                f"aws {self.region}: unknown instance type {instance_type!r}: "
                f"{did_you_mean(instance_type, ON_DEMAND_USD_PER_H)}GPU types include p5.48xlarge, p4d.24xlarge, "
                "g6.12xlarge (`aws ec2 describe-instance-types` lists them)",
                provider="aws", code=code,
            )

        def load(name: str) -> list[Accelerators]:
            try:
                found = self._api.call("ec2", "describe_instance_types", self.describe_budget, InstanceTypes=[name])
            except InvalidRequestError as err:
                raise unknown(err.code) from err
            return [from_ec2_instance_type(described) for described in found.get("InstanceTypes", [])]

        found = table_for(self).lookup(instance_type, load)
        if found is None:
            raise unknown("InvalidInstanceType")
        return found

    # prices -------------------------------------------------------------------------------------------------

    def hourly_price_usd(self, instance_type: str, market: Market = "on-demand") -> float:
        if market == "spot":
            spot = self._spot_price_usd(instance_type)
            if spot is not None:
                return spot
            on_demand = self._list_price_usd(instance_type)
            log.warning(
                "aws %s: no spot price history for %s; using its on-demand list price %.4f USD/h as an upper bound",
                self.region,
                instance_type,
                on_demand,
            )
            return on_demand
        return self._list_price_usd(instance_type)

    def _list_price_usd(self, instance_type: str) -> float:
        price = self.prices_usd_per_h.get(instance_type, ON_DEMAND_USD_PER_H.get(instance_type))
        if price is None:
            raise InvalidRequestError(
                f"aws: no on-demand price known for {instance_type!r}: pass "
                f"prices_usd_per_h={{{instance_type!r}: <USD per hour>}} to AwsProvider",
                provider="aws",
            )
        return price

    def _spot_price_usd(self, instance_type: str) -> float | None:
        """The latest spot price per zone, highest across zones (a launch without a zone may land in any)."""
        latest: dict[str, tuple[datetime, float]] = {}
        params: dict[str, Any] = {
            "InstanceTypes": [instance_type],
            "ProductDescriptions": ["Linux/UNIX"],
            # StartTime=now asks for the price in force now, one entry per zone.
            # https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_DescribeSpotPriceHistory.html
            "StartTime": datetime.now(UTC),
        }
        for _page in range(10):
            page = self._api.call("ec2", "describe_spot_price_history", self.describe_budget, **params)
            for entry in page.get("SpotPriceHistory", []):
                if entry.get("InstanceType") != instance_type:
                    continue
                zone, when, price = entry.get("AvailabilityZone", ""), entry["Timestamp"], float(entry["SpotPrice"])
                if zone not in latest or when > latest[zone][0]:
                    latest[zone] = (when, price)
            if not page.get("NextToken"):
                break
            params["NextToken"] = page["NextToken"]
        return max(price for _, price in latest.values()) if latest else None

    # notices ------------------------------------------------------------------------------------------------

    def poll_notices(self, timeout_s: float = 0.0) -> list[Notice]:
        """The job's notices from its queue. Every message is checked before it can move anything (`event_refusal`:
        the AWS service that sends that kind of event, the job's account, this region; then the instance must carry
        the job's tag); one that fails is deleted, logged once (its id and why, never its body) and counted in
        `dropped_notice_counts`."""
        if not self.notice_queue_url:
            if not self._warned_no_queue:
                log.warning("aws: no notice_queue_url, so no fleet-wide notices; create one with ensure_notice_queue()")
                self._warned_no_queue = True
            return []
        if self.notice_job_id is None:
            raise InvalidRequestError(
                "aws: pass notice_job_id=<the job> with notice_queue_url: a notice moves a host only once its "
                "instance is checked to be the job's",
                provider="aws",
            )
        account_id = self._job_account()
        deadline = time.monotonic() + timeout_s
        notices: list[Notice] = []
        received = False
        for _batch in range(20):  # bounds a call even when a busy queue never drains
            remaining = deadline - time.monotonic()
            # SQS long polling waits whole seconds, 20 at most; once something arrived (even messages that were
            # then dropped), only drain what is there.
            wait_s = 0 if received or remaining < 1 else min(20, int(remaining))
            response = self._api.call(
                "sqs",
                "receive_message",
                self.describe_budget,
                QueueUrl=self.notice_queue_url,
                MaxNumberOfMessages=10,
                WaitTimeSeconds=wait_s,
            )
            messages = response.get("Messages", [])
            if not messages:
                if received or remaining < 1:
                    break
                continue
            received = True
            notices += self._checked_notices(messages, self.notice_job_id, account_id)
            self._delete_messages(messages)
        return notices

    def dropped_notice_counts(self) -> dict[str, int]:
        """Queue messages dropped so far, by the check they failed: malformed, kind, source, account, region,
        instance."""
        with self._dropped_lock:
            return dict(self._dropped)

    def _job_account(self) -> str:
        if self.account_id is None:
            identity = self._api.call("sts", "get_caller_identity", self.describe_budget)
            self.account_id = str(identity["Account"])
        return self.account_id

    def _checked_notices(self, messages: Sequence[Mapping[str, Any]], job_id: str, account_id: str) -> list[Notice]:
        received_at = time.time()
        passed: list[tuple[str, NoticeEvent]] = []
        for message in messages:
            message_id = str(message.get("MessageId", "?"))
            try:
                event = parse_event(str(message.get("Body", "")), received_at=received_at)
            except ValueError as err:
                self._drop(message_id, Refusal("malformed", str(err)))
                continue
            refusal = event_refusal(event, account_id=account_id, region=self.region)
            if refusal is not None:
                self._drop(message_id, refusal)
                continue
            passed.append((message_id, event))
        ours = self._instances_of_job({n.instance_id for _, event in passed for n in event.notices}, job_id)
        notices: list[Notice] = []
        for message_id, event in passed:
            kept = [n for n in event.notices if n.instance_id in ours]
            if not kept:
                others = sorted({n.instance_id for n in event.notices})
                shown = ", ".join(i[:24] for i in others[:5]) + (" ..." if len(others) > 5 else "")
                self._drop(message_id, Refusal("instance", f"no instance of job {job_id} among {shown}"))
                continue
            for notice in kept:
                # EventBridge delivers at least once: the same event may arrive twice.
                if notice.event_id is not None and notice.event_id in self._seen_events:
                    continue
                if notice.event_id is not None:
                    self._seen_events.append(notice.event_id)
                notices.append(notice)
        return notices

    def _instances_of_job(self, instance_ids: set[str], job_id: str) -> set[str]:
        """Which of `instance_ids` carry the job's tag (in any state). A filter, not InstanceIds: an id EC2 does not
        know (another account's, a forged one) is simply not returned, instead of failing the whole call."""
        wanted = sorted(i for i in instance_ids if _is_instance_id(i))
        ours: set[str] = set()
        for start in range(0, len(wanted), 100):
            params: dict[str, Any] = {
                "Filters": [
                    {"Name": "instance-id", "Values": wanted[start : start + 100]},
                    {"Name": f"tag:{JOB_TAG}", "Values": [job_id]},
                ]
            }
            while True:
                page = self._api.call("ec2", "describe_instances", self.describe_budget, **params)
                ours |= {
                    str(raw["InstanceId"])
                    for reservation in page.get("Reservations", [])
                    for raw in reservation.get("Instances", [])
                    if _tags_of(raw).get(JOB_TAG) == job_id
                }
                if not page.get("NextToken"):
                    break
                params["NextToken"] = page["NextToken"]
        return ours

    def _drop(self, message_id: str, refusal: Refusal) -> None:
        with self._dropped_lock:
            self._dropped[refusal.check] += 1
        detail = refusal.detail if len(refusal.detail) <= 300 else f"{refusal.detail[:297]}..."
        log.warning("aws: dropped notice message %s (%s check): %s", message_id[:64], refusal.check, detail)

    def _delete_messages(self, messages: Sequence[Mapping[str, Any]]) -> None:
        entries = [{"Id": str(n), "ReceiptHandle": m["ReceiptHandle"]} for n, m in enumerate(messages)]
        response = self._api.call(
            "sqs", "delete_message_batch", self.mutate_budget, QueueUrl=self.notice_queue_url, Entries=entries
        )
        for failed in response.get("Failed", []):
            log.warning("aws: could not delete notice message %s: %s", failed.get("Id"), failed.get("Code"))

    # check --------------------------------------------------------------------------------------------------

    def check(
        self,
        instance_type: str = "t3.micro",
        *,
        job_id: str = "trainmover-check",
        node_role_arn: str | None = None,
        artifact_bucket: str | None = None,
    ) -> list[CheckResult]:
        """Credentials, then each EC2 permission the provider uses (DryRun for mutating calls), then every permission
        of the job's policy through IAM's policy simulator (cloud.aws.simulation); creates nothing.

        `instance_type` and `job_id` are what the dry runs and the simulation ask for: with a per-job policy
        (cloud.aws.iam), pass the job and a type that the policy allows. `node_role_arn` (the instances' role, which
        a launch passes) and `artifact_bucket` (where the flows stage the job's files) add iam:PassRole and S3 to the
        simulation. A simulated action that a dry run also checked is named "ACTION (simulated)".
        """
        validate_job_id(job_id, provider="aws")
        scope = AwsJobScope(  # validated before anything is sent
            job_id=job_id,
            regions=(self.region,),
            images=(self.image or _PLACEHOLDER_IMAGE,),
            instance_types=(instance_type,),
            node_role_arn=node_role_arn,
            artifact_bucket=artifact_bucket,
        )
        try:
            identity = self._api.call("sts", "get_caller_identity", self.describe_budget)
        except CloudError as err:
            return [CheckResult("credentials", False, str(err))]
        results = [CheckResult("credentials", True, f"account {identity.get('Account')} as {identity.get('Arn')}")]

        job_tag = [{"Key": JOB_TAG, "Value": job_id}, {"Key": ROLE_TAG, "Value": "standby"}]
        if self.image:
            launch: dict[str, Any] = {
                "ImageId": self.image,
                "InstanceType": instance_type,
                "MinCount": 1,
                "MaxCount": 1,
                # The policy allows RunInstances only with the job tag: the dry run must carry it too.
                "TagSpecifications": [
                    {"ResourceType": "instance", "Tags": job_tag},
                    {"ResourceType": "volume", "Tags": job_tag},
                ],
                "MetadataOptions": dict(METADATA_OPTIONS),
                **self._profile_param(),
            }
            if self.subnet:
                launch["SubnetId"] = self.subnet
            if self.security_groups:
                launch["SecurityGroupIds"] = list(self.security_groups)
            results.append(self._check_dry_run("run_instances", launch))
        else:
            results.append(
                CheckResult("ec2:RunInstances", False, "not verified: pass image='ami-...' so the dry run is complete")
            )

        # A tagged instance of ours makes the dry runs exact (the policy's tag conditions apply to it); with none,
        # a placeholder id checks the action alone.
        target, exact = self._check_target(job_id)
        for operation in ("start_instances", "stop_instances", "terminate_instances"):
            results.append(self._check_dry_run(operation, {"InstanceIds": [target]}, exact=exact))
        # Only the role tag: the policy lets an instance be re-tagged but never moved to another job.
        role_tag = [{"Key": ROLE_TAG, "Value": "standby"}]
        results.append(self._check_dry_run("create_tags", {"Resources": [target], "Tags": role_tag}, exact=exact))

        reads: list[tuple[str, str, dict[str, Any]]] = [
            ("ec2", "describe_instances", {"MaxResults": 5}),
            ("ec2", "describe_instance_status", {"MaxResults": 5}),
            ("ec2", "describe_instance_types", {"InstanceTypes": [instance_type]}),
            ("ec2", "describe_spot_price_history", {"InstanceTypes": [instance_type], "MaxResults": 5}),
        ]
        if self.notice_queue_url:
            reads.append(
                ("sqs", "get_queue_attributes", {"QueueUrl": self.notice_queue_url, "AttributeNames": ["QueueArn"]})
            )
        for service, operation, params in reads:
            name = f"{service}:{api_name(operation)}"
            try:
                self._api.call(service, operation, self.describe_budget, **params)
            except CloudError as err:
                results.append(CheckResult(name, False, str(err)))
            else:
                results.append(CheckResult(name, True, "allowed"))
        account = str(identity.get("Account", ""))
        if _ACCOUNT_ID.fullmatch(account):
            scope = dataclasses.replace(scope, account_id=account)
        checked = {r.name for r in results}
        for result in simulate_job_permissions(self._api, str(identity.get("Arn", "")), scope, self.describe_budget):
            if result.name in checked:
                result = CheckResult(f"{result.name} (simulated)", result.ok, result.detail)
            results.append(result)
        return results

    def _check_target(self, job_id: str) -> tuple[str, bool]:
        try:
            page = self._api.call(
                "ec2",
                "describe_instances",
                self.describe_budget,
                Filters=[
                    {"Name": f"tag:{JOB_TAG}", "Values": [job_id]},
                    {"Name": "instance-state-name", "Values": list(_LIVE_STATES)},
                ],
                MaxResults=5,
            )
        except CloudError:
            return _PLACEHOLDER_INSTANCE, False
        for reservation in page.get("Reservations", []):
            for raw in reservation.get("Instances", []):
                if _tags_of(raw).get(JOB_TAG) == job_id:
                    return str(raw["InstanceId"]), True
        return _PLACEHOLDER_INSTANCE, False

    def _check_dry_run(self, operation: str, params: dict[str, Any], *, exact: bool = True) -> CheckResult:
        name = f"ec2:{api_name(operation)}"
        try:
            self._api.dry_run(operation, **params)
        except PermissionDeniedError as err:
            if not exact:
                return CheckResult(
                    name,
                    False,
                    f"{err} Checked on a placeholder instance without the {JOB_TAG} tag: if the policy requires that "
                    "tag, run check again (with the job's id) while one of the job's instances exists.",
                )
            return CheckResult(name, False, str(err))
        except (NotFoundError, InvalidRequestError) as err:
            if not exact:
                return CheckResult(name, True, f"not denied (checked on a placeholder instance: {err.code})")
            return CheckResult(name, False, f"not verified: {err}")
        except CloudError as err:
            return CheckResult(name, False, f"not verified: {err}")
        detail = "allowed (dry run)" if exact else "allowed (dry run on a placeholder instance)"
        return CheckResult(name, True, detail)


def _tags_of(raw: Mapping[str, Any]) -> dict[str, str]:
    return {str(t.get("Key")): str(t.get("Value")) for t in raw.get("Tags") or []}


def _is_instance_id(value: object) -> bool:
    return isinstance(value, str) and _INSTANCE_ID.fullmatch(value) is not None


def _refuse_malformed(ids: Sequence[str], verb: str) -> None:
    malformed = [i for i in ids if not _is_instance_id(i)]
    if malformed:
        raise InvalidRequestError(
            f"aws: cannot {verb} {', '.join(map(repr, malformed))}: not EC2 instance ids (expected 'i-' and 8 or 17 "
            "hex digits); nothing was done",
            provider="aws",
            code="InvalidInstanceID.Malformed",
        )


def _health_of(status: Mapping[str, Any]) -> Health:
    checks = {(status.get(k) or {}).get("Status", "") for k in ("InstanceStatus", "SystemStatus")}
    if "impaired" in checks:
        return "impaired"
    if "initializing" in checks:
        return "initializing"
    if checks == {"ok"}:
        return "ok"
    return "unknown"


