"""The provider contract: typed records in and out, what each cloud can do, and the domain errors.

Every provider (local processes, AWS EC2, Azure VMs) implements `Provider`. Nothing beyond a provider's own
module ever sees a raw SDK dict or exception: SDK responses become `Instance` / `Notice` records and SDK errors
become the `CloudError` hierarchy below, raised `from` the original.

A standby instance lives in one of three tiers (see DESIGN.md): *stopped* (parked: stopped on AWS, deallocated on
Azure, so only its disk bills), *warm* and *hot* (both running). `stop` parks, `start` wakes.
"""

from __future__ import annotations

import abc
import random
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, TypeVar, get_args
from urllib.parse import urlsplit

if TYPE_CHECKING:  # for the annotation only: at run time base imports nothing of cloud
    from cloud.accelerators import Accelerators

Role = Literal["worker", "standby"]
Market = Literal["on-demand", "spot"]
InstanceState = Literal["pending", "running", "stopping", "stopped", "terminating", "terminated", "unknown"]
Health = Literal["ok", "impaired", "initializing", "unknown"]
NoticeKind = Literal[
    "spot_interruption",  # AWS: 2 minutes before a spot instance is stopped or terminated
    "rebalance_recommendation",  # AWS: a spot instance is at elevated risk; usually well before the 2-minute notice
    "scheduled_maintenance",  # AWS scheduled events; Azure Freeze / Reboot / Redeploy
    "predicted_host_failure",  # a provider's (or our predictor's) warning that the host is degrading
    "eviction",  # Azure Preempt (spot eviction, 30 s) or Terminate
]

JOB_TAG = "trainmover:job"
ROLE_TAG = "trainmover:role"

# A job id is a tag value matched exactly, part of instance names and of notice queue names. EC2 tag filters treat
# `*` and `?` as wildcards (`--job '*'` would match every job), so only characters that are literal everywhere.
JOB_ID_MAX_LEN = 63
_JOB_ID = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._-]{{0,{JOB_ID_MAX_LEN - 1}}}")
JOB_ID_RULE = (
    f"1-{JOB_ID_MAX_LEN} letters, digits, '.', '_' or '-', starting with a letter or digit "
    "(no wildcards such as '*' or '?': the id is matched exactly against the trainmover:job tag)"
)


def validate_job_id(job_id: object, *, provider: str | None = None) -> str:
    """`job_id` itself when it is a valid job id; InvalidRequestError naming the allowed characters otherwise."""
    if not isinstance(job_id, str) or not _JOB_ID.fullmatch(job_id):
        where = f"{provider}: " if provider else ""
        raise InvalidRequestError(
            f"{where}invalid job id {job_id!r}: use {JOB_ID_RULE}", provider=provider, code="InvalidJobId"
        )
    return job_id


def validate_role(role: object, *, provider: str | None = None) -> Role:
    """`role` itself when it is a Role; InvalidRequestError naming the roles otherwise (Literal types are not
    checked at run time, and a typo would become a tag value in the cloud)."""
    if role not in get_args(Role):
        where = f"{provider}: " if provider else ""
        raise InvalidRequestError(
            f"{where}invalid role {role!r}: use one of {', '.join(get_args(Role))}",
            provider=provider,
            code="InvalidRole",
        )
    return role  # type: ignore[return-value]


def validate_endpoint_url(url: str | None, *, provider: str, example: str) -> str | None:
    """`url` itself when it is None or an absolute http(s) URL; one clear InvalidRequestError otherwise (the SDKs
    raise a bare ValueError deep inside client construction, or fail later as an unreachable host)."""
    if url is None:
        return None
    try:
        parts = urlsplit(url)
        _ = parts.port  # raises ValueError when the port is not a number in 0-65535
        valid = parts.scheme in ("http", "https") and bool(parts.hostname)
    except ValueError:  # e.g. an unclosed IPv6 bracket
        valid = False
    if not valid:
        raise InvalidRequestError(
            f"{provider}: invalid endpoint URL {url!r}: give an absolute http(s) URL such as {example}, or leave it "
            "out to use the cloud's own endpoint",
            provider=provider,
            code="InvalidEndpointUrl",
        )
    return url


@dataclass(frozen=True, slots=True)
class TagLimits:
    """One cloud's limits on resource tags, checked before any call so that a bad tag is one clear message
    instead of a refusal half-way through a launch."""

    provider: str
    max_tags: int  # per resource, the provider's own two tags included
    max_key_len: int
    max_value_len: int
    reserved_key_prefixes: tuple[str, ...] = ()  # compared case-insensitively
    forbidden_key_chars: str = ""
    doc: str = ""  # where the cloud documents these limits


def validate_tags(tags: Mapping[str, str], limits: TagLimits) -> None:
    """InvalidRequestError listing every tag of `tags` (a request's own tags) that `limits` refuse."""
    problems: list[str] = []
    own = limits.max_tags - 2
    if len(tags) > own:
        problems.append(f"{len(tags)} tags, at most {own} allowed ({JOB_TAG} and {ROLE_TAG} are added to them)")
    for key, value in tags.items():
        if not isinstance(key, str) or not key:
            problems.append(f"tag key {key!r} must be a non-empty string")
            continue
        shown = key if len(key) <= 40 else f"{key[:37]}..."
        if key in (JOB_TAG, ROLE_TAG):
            problems.append(f"tag key {key!r} is set by the provider from the request's job_id and role")
        if len(key) > limits.max_key_len:
            problems.append(f"tag key {shown!r} has {len(key)} characters, at most {limits.max_key_len} allowed")
        reserved = next((p for p in limits.reserved_key_prefixes if key.lower().startswith(p)), None)
        if reserved is not None:
            problems.append(f"tag key {shown!r} starts with {reserved!r}, which is reserved")
        bad = sorted({c for c in key if c in limits.forbidden_key_chars})
        if bad:
            problems.append(f"tag key {shown!r} contains {' '.join(bad)}, which tag keys may not")
        if not isinstance(value, str):
            problems.append(f"tag {shown!r}: the value must be a string, got {type(value).__name__}")
        elif len(value) > limits.max_value_len:
            problems.append(
                f"tag {shown!r}: the value has {len(value)} characters, at most {limits.max_value_len} allowed"
            )
    if problems:
        see = f" (see {limits.doc})" if limits.doc else ""
        raise InvalidRequestError(
            f"{limits.provider}: invalid tags: {'; '.join(problems)}{see}", provider=limits.provider, code="InvalidTag"
        )


# The kernel's default ephemeral range (net.ipv4.ip_local_port_range): where Gloo/NCCL pairs and the TLS handoff
# listen unless a host narrows it (docs/multihost.md, "Ports, for a security group").
EPHEMERAL_PORTS = (32768, 60999)


def _is_port(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 65535


@dataclass(frozen=True, slots=True)
class JobNetwork:
    """The job's own network boundary, created by the provider once per job and reused for every launch of it.

    AWS: a security group tagged with the job whose only ingress rules admit, from the same group, TCP on
    `store_port`, `agent_port` and `data_ports`; and, with `cluster_placement`, a cluster placement group. Both are
    deleted by `release_job` once the job's instances are gone. See docs/cloud-aws.md.
    """

    store_port: int
    """The coordinator's `--port` (the job's store): every training process and the orchestrator connect to it."""
    agent_port: int
    """The coordinator's `--agent-port`: every host's agent connects to it."""
    data_ports: tuple[int, int] = EPHEMERAL_PORTS
    """The first and last port (inclusive) of the runtime's data plane between hosts: Gloo/NCCL pairs and the TLS
    handoff listen on ephemeral ports, so this is the hosts' `net.ipv4.ip_local_port_range`."""
    cluster_placement: bool = True
    """Also launch every instance of the job into one cluster placement group (low latency, one zone)."""

    def __post_init__(self) -> None:
        for label, port in (("store_port", self.store_port), ("agent_port", self.agent_port)):
            if not _is_port(port):
                raise InvalidRequestError(
                    f"network: {label} must be a TCP port 1-65535, got {port!r}", code="InvalidPort"
                )
        ports = tuple(self.data_ports) if isinstance(self.data_ports, tuple | list) else ()
        if len(ports) != 2 or not all(_is_port(p) for p in ports) or ports[0] > ports[1]:
            raise InvalidRequestError(
                f"network: data_ports must be (first, last) TCP ports with first <= last, got {self.data_ports!r}; "
                f"the kernel's default ephemeral range is {EPHEMERAL_PORTS}",
                code="InvalidPort",
            )
        object.__setattr__(self, "data_ports", (int(ports[0]), int(ports[1])))
        if not isinstance(self.cluster_placement, bool):
            raise InvalidRequestError(
                f"network: cluster_placement must be True or False, got {self.cluster_placement!r}",
                code="InvalidNetwork",
            )

    def tcp_port_ranges(self) -> tuple[tuple[int, int], ...]:
        """The (first, last) TCP port ranges the job's hosts accept from each other, sorted, without duplicates."""
        return tuple(sorted({(self.store_port, self.store_port), (self.agent_port, self.agent_port), self.data_ports}))


@dataclass(frozen=True, slots=True)
class LaunchRequest:
    """What to launch. Tags `trainmover:job` and `trainmover:role` are always added by the provider."""

    job_id: str
    role: Role
    instance_type: str
    count: int = 1
    market: Market = "on-demand"
    image: str | None = None  # AMI id, Azure image reference "publisher:offer:sku:version", ignored locally
    placement_group: str | None = None  # AWS cluster placement group; Azure proximity placement group id
    capacity_reservation: str | None = None
    """AWS: a capacity reservation id (`cr-...`, a Capacity Block's included) or a capacity reservation resource
    group's ARN (`arn:aws:resource-groups:REGION:ACCOUNT:group/NAME`); Azure: a capacity reservation group id."""
    capacity_block: bool = False
    """AWS: `capacity_reservation` is a Capacity Block for ML: launch into it with the `capacity-block` market
    (on-demand requests only; the block's end time ends its instances, so plan replacements before it)."""
    zone: str | None = None
    subnet: str | None = None
    user_data: str | None = None
    """A raw cloud-init document or script (EC2 user-data; Azure customData). Never put a secret in it: anyone
    allowed to read the instance's attributes can read it. Prefer `bootstrap`."""
    tags: Mapping[str, str] = field(default_factory=dict)
    bootstrap: HostBootstrap | None = None
    """Make each instance a host of the job: the provider renders `cloud.bootstrap.render_cloud_init(bootstrap)`
    into the instance's user-data (EC2) or `osProfile.customData` (Azure), with the identity that fetches the job's
    secret (the instance profile on AWS, a system-assigned managed identity on Azure). The document carries only
    the secret's `SecretRef`. Excludes `user_data`."""
    network: JobNetwork | None = None
    """Launch into the job's own security group (and cluster placement group), created on the job's first launch and
    reused for replacements; deleted by `release_job`. AWS and Azure (`Capabilities.job_network`); excludes
    `placement_group` when `network.cluster_placement` is set."""
    efa: bool = False
    """AWS: give each instance an Elastic Fabric Adapter on every network card its type has (p5.48xlarge: 32,
    p4d.24xlarge: 4), for NCCL over libfabric (the bootstrap's agent then runs with FI_PROVIDER=efa). A type without
    EFA is refused before anything launches; other providers refuse the flag."""

    def __post_init__(self) -> None:
        if self.count < 1:
            raise InvalidRequestError(f"count must be at least 1, got {self.count}")
        if self.capacity_block and not self.capacity_reservation:
            raise InvalidRequestError(
                "capacity_block needs capacity_reservation=<the block's reservation id, cr-...>",
                code="InvalidCapacityReservation",
            )
        if not isinstance(self.efa, bool):
            raise InvalidRequestError(f"efa must be True or False, got {self.efa!r}", code="InvalidEfa")
        if not self.job_id:
            raise InvalidRequestError("job_id must not be empty: it tags every instance so that none is leaked")
        validate_job_id(self.job_id)
        validate_role(self.role)
        if self.market not in get_args(Market):
            raise InvalidRequestError(
                f"invalid market {self.market!r}: use one of {', '.join(get_args(Market))}", code="InvalidMarket"
            )
        if self.bootstrap is not None:
            if not isinstance(self.bootstrap, HostBootstrap):
                raise InvalidRequestError(
                    f"bootstrap must be a cloud.bootstrap.AgentBootstrap, got {type(self.bootstrap).__name__}",
                    code="InvalidBootstrap",
                )
            self.bootstrap.check_launch(self)
        if self.network is not None:
            if not isinstance(self.network, JobNetwork):
                raise InvalidRequestError(
                    f"network must be a cloud.base.JobNetwork, got {type(self.network).__name__}", code="InvalidNetwork"
                )
            if self.network.cluster_placement and self.placement_group:
                raise InvalidRequestError(
                    f"give placement_group={self.placement_group!r} or network.cluster_placement, not both: the job's "
                    "network already puts every instance into the job's own cluster placement group",
                    code="InvalidNetwork",
                )


class HostBootstrap(abc.ABC):
    """What makes a launched instance a host of its job: `cloud.bootstrap.AgentBootstrap` is the one kind. It is
    declared here so that `LaunchRequest` can hold and check one while this module imports nothing of `cloud`."""

    __slots__ = ()

    @abc.abstractmethod
    def check_launch(self, request: LaunchRequest) -> None:
        """InvalidRequestError when `request` cannot launch hosts with this bootstrap (another job, user_data too,
        a different efa, one fixed address or head for several instances)."""

    @property
    def powers_off_when_orphaned(self) -> bool:
        """Whether the host powers itself off when its job's coordinator is gone (a dead-man's switch): the
        provider then makes an OS shutdown end the instance's bill."""
        return False


@dataclass(frozen=True, slots=True)
class Instance:
    """One instance as the provider last saw it."""

    instance_id: str
    provider: str
    job_id: str
    role: Role
    instance_type: str
    market: Market
    state: InstanceState
    health: Health = "unknown"
    zone: str | None = None
    private_ip: str | None = None
    launched_at: float | None = None  # epoch seconds

    @property
    def running(self) -> bool:
        return self.state == "running"

    @property
    def parked(self) -> bool:
        return self.state == "stopped"


@dataclass(frozen=True, slots=True)
class Notice:
    """An early warning that an instance will go away or be disturbed."""

    kind: NoticeKind
    instance_id: str
    received_at: float  # epoch seconds, when we saw it
    source: str  # "imds", "eventbridge", "scheduled-events", "local", ...
    deadline_at: float | None = None  # epoch seconds when the provider acts, if it said
    event_id: str | None = None  # the provider's id, for de-duplication and acknowledgement
    detail: str = ""

    @property
    def lead_s(self) -> float | None:
        """Seconds between receiving the notice and the provider acting; None if the provider gave no time."""
        return None if self.deadline_at is None else self.deadline_at - self.received_at


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a provider can do, said up front so that callers never learn it from a failed call."""

    provider: str
    spot: bool
    park_on_demand: bool  # stop/start (AWS) or deallocate/start (Azure) of on-demand instances
    park_spot: bool  # AWS: only persistent spot requests can stop; one-time spot cannot. Azure: deallocate works
    placement_groups: bool
    capacity_reservations: bool
    notice_kinds: frozenset[NoticeKind]
    spot_notice_s: float | None  # 120 on AWS, 30 on Azure, None where there is no spot
    job_network: bool = False  # creates a per-job security group / placement group from `LaunchRequest.network`

    def can_park(self, market: Market) -> bool:
        return self.park_spot if market == "spot" else self.park_on_demand


@dataclass(frozen=True, slots=True)
class CheckResult:
    """One verified permission or precondition of `Provider.check`."""

    name: str  # e.g. "ec2:RunInstances", "credentials", "Microsoft.Compute/virtualMachines/write"
    ok: bool
    detail: str = ""


# ---------------------------------------------------------------------------------------------------------- errors


class CloudError(Exception):
    """Base of every error a provider raises. `transient` errors may be retried; the others may not."""

    transient = False

    def __init__(self, message: str, *, provider: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.provider = provider
        self.code = code  # the SDK's error code, e.g. "InsufficientInstanceCapacity"


class CredentialsError(CloudError):
    """No credentials, or the credentials were refused. The message says how to provide them."""


class PermissionDeniedError(CloudError):
    """The credentials work but lack a permission. The message names it (see docs/cloud.md for the policy)."""


class QuotaError(CloudError):
    """An account limit (vCPU quota, instance limit) stops the request; raising the quota is a human's job."""


class CapacityError(CloudError):
    """The cloud has no capacity for this type/zone now. A first-class outcome: fall back (other zone, type, tier,
    or shrink); it is not retried automatically."""


class NotFoundError(CloudError):
    """The instance, image, region or resource group does not exist."""


class InvalidRequestError(CloudError):
    """The request is malformed: unknown instance type or region, a negative count, an unsupported combination."""


class UnsupportedError(CloudError):
    """The provider cannot do this at all (see `Capabilities`), e.g. parking a one-time spot instance on AWS."""


class ThrottledError(CloudError):
    """The API rate limit was hit. Transient."""

    transient = True


class ServiceUnavailableError(CloudError):
    """The cloud API failed on its side (5xx, timeouts). Transient."""

    transient = True


# ---------------------------------------------------------------------------------------------------------- retries

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RetryBudget:
    """A named, bounded retry budget with exponential backoff and full jitter."""

    name: str
    attempts: int = 5
    base_delay_s: float = 0.5
    max_delay_s: float = 20.0
    deadline_s: float = 120.0

    def delay_s(self, attempt: int, rng: random.Random | None = None) -> float:
        cap = min(self.max_delay_s, self.base_delay_s * (2**attempt))
        return (rng or random).uniform(0.0, cap)


MUTATE = RetryBudget("mutate", attempts=5, base_delay_s=0.5, max_delay_s=20.0, deadline_s=120.0)
DESCRIBE = RetryBudget("describe", attempts=8, base_delay_s=0.25, max_delay_s=10.0, deadline_s=60.0)


def with_retries(
    call: Callable[[], T],
    budget: RetryBudget,
    *,
    sleep: Callable[[float], None] = time.sleep,
    on_retry: Callable[[CloudError, int, float], None] | None = None,
) -> T:
    """Run `call`, retrying only `CloudError`s whose `transient` is true, within `budget`'s attempts and deadline.

    The last error is re-raised when the budget is spent; non-transient errors are raised at once.
    """
    started = time.monotonic()
    attempt = 0
    while True:
        try:
            return call()
        except CloudError as err:
            attempt += 1
            if not err.transient or attempt >= budget.attempts:
                raise
            delay = budget.delay_s(attempt)
            if time.monotonic() - started + delay > budget.deadline_s:
                raise
            if on_retry is not None:
                on_retry(err, attempt, delay)
            sleep(delay)


# ---------------------------------------------------------------------------------------------------------- release


@dataclass(frozen=True, slots=True)
class JobRelease:
    """What `Provider.release_all` did for one job. Each resource is named "<kind> <name>" (`security group
    sg-0123...`, `SQS queue trainmover-notices-llm-7b`); secret values never appear."""

    provider: str
    job_id: str
    instances: tuple[str, ...] = ()
    """The instances terminated by this call."""
    deleted: tuple[str, ...] = ()
    """Every other resource this call deleted."""
    failed: tuple[str, ...] = ()
    """Each deletion that failed, with why ("<kind> <name> (<error>)"); the others still ran."""
    not_looked_for: tuple[str, ...] = ()
    """What this provider could not look for, with why (an Azure provider given no Key Vault)."""

    @property
    def complete(self) -> bool:
        """True when no deletion failed (a resource that was already gone is no failure)."""
        return not self.failed

    def summary(self) -> str:
        """One line: what was deleted, or that nothing was left."""
        where = f"{self.provider}: job {self.job_id}"
        if not self.instances and not self.deleted:
            done = "nothing to release (no resource of the job was left)" if self.complete else "nothing released"
        else:
            done = f"terminated {len(self.instances)} instance(s) and deleted {len(self.deleted)} other resource(s)"
        return f"{where}: {done}"

    def failure(self) -> str:
        """One line naming every deletion that failed, and what to do; "" when none did."""
        if self.complete:
            return ""
        return (
            f"{self.provider}: job {self.job_id}: could not delete {len(self.failed)} resource(s): "
            f"{'; '.join(self.failed)}. Everything else was released; fix the cause and run the release again "
            "(it deletes only what is left)"
        )


class ReleaseSteps:
    """The deletions of one release, run one after another: a step returns True when it deleted something and
    False when there was nothing to delete; a `CloudError` is recorded with the step's name and the next step still
    runs (a programming error still raises)."""

    def __init__(self) -> None:
        self.deleted: list[str] = []
        self.failed: list[str] = []
        self.not_looked_for: list[str] = []

    def run(self, what: str, delete: Callable[[], bool], *, if_denied: str | None = None) -> bool:
        """Run one deletion of `what` ("<kind> <name>"); True when it deleted it. With `if_denied` (why these
        credentials may lack the permission, e.g. "an administrator manages it"), a PermissionDeniedError records
        `what` as not looked for, not as a failure."""
        try:
            done = delete()
        except PermissionDeniedError as err:
            if if_denied is None:
                self.fail(what, err)
            else:
                self.skip(what, f"not allowed ({err.code}): {if_denied}")
            return False
        except CloudError as err:
            self.fail(what, err)
            return False
        if done:
            self.deleted.append(what)
        return done

    def fail(self, what: str, why: CloudError | str) -> None:
        self.failed.append(f"{what} ({' '.join(str(why).split())})")

    def skip(self, what: str, why: str) -> None:
        self.not_looked_for.append(f"{what}: {why}")

    def report(self, provider: str, job_id: str, instances: Sequence[str]) -> JobRelease:
        return JobRelease(provider, job_id, tuple(instances), tuple(self.deleted), tuple(self.failed),
                          tuple(self.not_looked_for))


# ---------------------------------------------------------------------------------------------------------- provider


class Provider(abc.ABC):
    """A fleet of instances on one cloud (or this machine), tagged by job and role.

    Every method is bounded in time; mutating methods return the instances as the provider saw them after the
    call (not necessarily in their final state: use `wait_for_state`).
    """

    name: str = "abstract"

    @abc.abstractmethod
    def capabilities(self) -> Capabilities: ...

    @abc.abstractmethod
    def launch(self, request: LaunchRequest) -> list[Instance]:
        """Launch `request.count` instances. Raises CapacityError / QuotaError / InvalidRequestError; launches
        nothing (or terminates what it launched) when it raises."""

    @abc.abstractmethod
    def stop(self, instance_ids: Sequence[str]) -> list[Instance]:
        """Park: stop (AWS) or deallocate (Azure). UnsupportedError where the capability is missing."""

    @abc.abstractmethod
    def start(self, instance_ids: Sequence[str]) -> list[Instance]:
        """Wake parked instances. CapacityError (e.g. InsufficientInstanceCapacity) is a normal outcome."""

    @abc.abstractmethod
    def set_role(self, instance_id: str, role: Role) -> Instance:
        """Retag one instance of a job with `role` (its `trainmover:role` tag): a promoted standby becomes a
        worker, so that describe, the policy and the bill see the fleet as it is. Only the role tag changes; an
        instance never moves to another job. Returns the instance as the provider saw it after the call."""

    @abc.abstractmethod
    def terminate(self, instance_ids: Sequence[str]) -> None:
        """Release for good. Terminating an already-gone instance is not an error."""

    @abc.abstractmethod
    def describe(self, instance_ids: Sequence[str] | None = None, *, job_id: str | None = None) -> list[Instance]:
        """Instances by id, or every instance of `job_id` that is not terminated."""

    @abc.abstractmethod
    def hourly_price_usd(self, instance_type: str, market: Market = "on-demand") -> float:
        """The hourly price of one instance (list price; the spot price where the cloud publishes one)."""

    @abc.abstractmethod
    def accelerators(self, instance_type: str) -> Accelerators:
        """What one instance of `instance_type` has for training (`cloud.accelerators`): its GPUs, their kind, its
        fabric (EFA, InfiniBand), from the provider's own instance-type data, looked up once per type. A type
        without a GPU has count 0 (one CPU slot). InvalidRequestError for a type the provider does not know."""

    @abc.abstractmethod
    def poll_notices(self, timeout_s: float = 0.0) -> list[Notice]:
        """Fleet-wide notices seen since the last call (AWS: EventBridge via SQS; Azure: none fleet-wide, the
        per-VM Scheduled Events watcher delivers them). Waits at most `timeout_s` for the first one."""

    @abc.abstractmethod
    def check(self) -> list[CheckResult]:
        """Verify credentials and permissions without creating anything (EC2 DryRun, ARM reads)."""

    # Helpers shared by every provider -----------------------------------------------------------------------

    def wait_for_state(
        self,
        instance_ids: Sequence[str],
        states: Iterable[InstanceState],
        *,
        timeout_s: float = 600.0,
        poll_s: float = 2.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> list[Instance]:
        """Poll `describe` until every instance is in one of `states`; TimeoutError names the laggards."""
        wanted = set(states)
        deadline = time.monotonic() + timeout_s
        while True:
            seen = self.describe(instance_ids)
            if len(seen) == len(instance_ids) and all(i.state in wanted for i in seen):
                return seen
            if time.monotonic() >= deadline:
                lagging = {i.instance_id: i.state for i in seen if i.state not in wanted}
                raise TimeoutError(f"{self.name}: instances not {sorted(wanted)} after {timeout_s:.0f} s: {lagging}")
            sleep(poll_s)

    def release_job(self, job_id: str) -> list[str]:
        """Terminate every instance tagged with `job_id` (and, where the provider made one, delete the job's
        network); returns the instances' ids. The flows call it in `finally`. `release_all` deletes the rest too."""
        return self._terminate_job_instances(job_id)

    def _terminate_job_instances(self, job_id: str) -> list[str]:
        validate_job_id(job_id, provider=self.name)
        # The provider filtered by tag already; checking the tag again here means no filter quirk of a cloud can
        # ever turn one job's release into another job's outage.
        ids = [
            i.instance_id
            for i in self.describe(job_id=job_id)
            if i.job_id == job_id and i.state not in ("terminated", "terminating")
        ]
        if ids:
            self.terminate(ids)
        return ids

    def release_all(self, job_id: str) -> JobRelease:
        """Delete every resource of the job: its instances, then whatever else its launches and the flows made in
        this cloud (`release_resources`: network, notice queue, secret). Idempotent: a second call deletes nothing
        and its `JobRelease` says so. A resource already gone is no error; a deletion that fails is recorded in
        `JobRelease.failed` and the others still run. What `trainmover cloud release` and the sweep flow call."""
        validate_job_id(job_id, provider=self.name)
        steps = ReleaseSteps()
        instances: list[str] = []
        try:
            instances = self._terminate_job_instances(job_id)
        except CloudError as err:
            steps.fail("the job's instances", err)
        self.release_resources(job_id, steps, instances_terminated=not steps.failed)
        return steps.report(self.name, job_id, instances)

    def release_resources(self, job_id: str, steps: ReleaseSteps, *, instances_terminated: bool) -> None:
        """Delete what the job has in this cloud besides its instances, recording each deletion in `steps`.
        `instances_terminated` is False when terminating them failed (what they still use must then stay).
        Nothing by default: a provider that makes more for a job overrides it."""
        return None


class NoticeSource(abc.ABC):
    """A per-instance notice endpoint (AWS instance metadata, Azure Scheduled Events), polled on the node."""

    @abc.abstractmethod
    def poll(self) -> list[Notice]:
        """The notices pending now (empty when none); bounded by the source's own HTTP timeout."""
