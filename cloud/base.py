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
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeVar

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
    capacity_reservation: str | None = None  # AWS capacity reservation id; Azure capacity reservation group id
    zone: str | None = None
    subnet: str | None = None
    user_data: str | None = None
    tags: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.count < 1:
            raise InvalidRequestError(f"count must be at least 1, got {self.count}")
        if not self.job_id:
            raise InvalidRequestError("job_id must not be empty: it tags every instance so that none is leaked")


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
    def terminate(self, instance_ids: Sequence[str]) -> None:
        """Release for good. Terminating an already-gone instance is not an error."""

    @abc.abstractmethod
    def describe(self, instance_ids: Sequence[str] | None = None, *, job_id: str | None = None) -> list[Instance]:
        """Instances by id, or every instance of `job_id` that is not terminated."""

    @abc.abstractmethod
    def hourly_price_usd(self, instance_type: str, market: Market = "on-demand") -> float:
        """The hourly price of one instance (list price; the spot price where the cloud publishes one)."""

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
        """Terminate every instance tagged with `job_id`; returns their ids. The flows call it in `finally`."""
        ids = [i.instance_id for i in self.describe(job_id=job_id) if i.state not in ("terminated", "terminating")]
        if ids:
            self.terminate(ids)
        return ids


class NoticeSource(abc.ABC):
    """A per-instance notice endpoint (AWS instance metadata, Azure Scheduled Events), polled on the node."""

    @abc.abstractmethod
    def poll(self) -> list[Notice]:
        """The notices pending now (empty when none); bounded by the source's own HTTP timeout."""
