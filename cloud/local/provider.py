"""The local provider: "instances" are bookkeeping slots on this machine, with the cloud's state machine.

It is the embedded default of the demo and the tests, so it behaves like a small, strict cloud: launches fill
slots, a parked (stopped) instance frees its slot, waking one when every slot is taken raises `CapacityError`,
and unknown ids, bad requests and impossible transitions raise the same `CloudError`s a real provider would.
No background thread runs: delayed transitions (pending -> running after `start_delay_s`, an interruption at a
notice's deadline) are resolved lazily whenever the provider is called.

Failure injection lives here, as torchft keeps its event injector in the library, so tests and the demo read
like scenarios::

    cloud = LocalProvider(slots=4)
    cloud.fail_next("start", CapacityError("no capacity"), times=2)   # the next two starts fail
    cloud.inject_notice(worker_id, "spot_interruption", lead_s=120)   # delivered by poll_notices
    cloud.mark_unhealthy(worker_id)                                   # health "impaired" until stop/start

Prices: a local instance costs what it would cost in the cloud, so the flows' cost reports mean something.
`LOCAL_PRICES_USD_PER_H` holds approximate on-demand list prices (us-east-1 / East US, for illustration only);
`prices_usd_per_h` overrides or extends it; a spot price is the `"TYPE:spot"` entry if given, else
`LOCAL_SPOT_FACTOR` times the on-demand price; an unknown type costs `LOCAL_DEFAULT_PRICE_USD_PER_H`.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal, get_args

from cloud.accelerators import Accelerators
from cloud.base import (
    JOB_TAG,
    ROLE_TAG,
    Capabilities,
    CapacityError,
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
    NoticeKind,
    Provider,
    Role,
    UnsupportedError,
    validate_role,
)
from cloud.bootstrap import AgentBootstrap, agent_bootstrap
from cloud.local.hosts import LocalHosts

Operation = Literal["launch", "start", "stop", "terminate"]

LOCAL_ZONE = "local"
# Enough for the demo's workers plus standbys on a 2-core laptop, and one per core on a bigger machine. Slots are
# bookkeeping, not processes: the runtime decides what actually runs in one.
DEFAULT_SLOTS_MIN = 8
# Approximate on-demand list prices in USD per hour (AWS us-east-1, Azure East US), for cost reports only.
LOCAL_PRICES_USD_PER_H: Mapping[str, float] = {
    "local": 1.0,
    "m5.large": 0.096,
    "c5.xlarge": 0.17,
    "g5.xlarge": 1.006,
    "g5.12xlarge": 5.672,
    "g6.xlarge": 0.805,
    "p3.2xlarge": 3.06,
    "p4d.24xlarge": 21.96,
    "p5.48xlarge": 55.04,
    "Standard_D4s_v5": 0.192,
    "Standard_NC6s_v3": 3.06,
    "Standard_NC24ads_A100_v4": 3.673,
    "Standard_ND96asr_v4": 27.197,
}
LOCAL_DEFAULT_PRICE_USD_PER_H = 1.0
LOCAL_SPOT_FACTOR = 0.3  # spot typically sells at a 60-90 % discount
# The longest single wait of poll_notices, like SQS long polling's 20 s cap: callers loop, nobody blocks for ever.
MAX_NOTICE_WAIT_S = 20.0
# Notices after whose deadline the cloud takes the instance away; the others only warn.
_INTERRUPTING: frozenset[NoticeKind] = frozenset({"spot_interruption", "eviction"})
_OPERATIONS: tuple[Operation, ...] = get_args(Operation)


@dataclass(slots=True)
class _Slot:
    """The provider's own, mutable view of one instance."""

    instance_id: str
    job_id: str
    role: Role
    instance_type: str
    market: Market
    state: InstanceState
    launched_at: float
    tags: dict[str, str]
    running_at: float | None = None  # when a pending instance becomes running
    impaired: bool = False
    bootstrap: AgentBootstrap | None = None  # what makes it a host of its job (with `hosts`)
    powered: bool = False  # its host was booted and not powered off since
    interrupt_at: float | None = None  # an interrupting notice's deadline

    @property
    def holds_capacity(self) -> bool:
        return self.state in ("pending", "running")


@dataclass(slots=True)
class _Injected:
    error: CloudError
    times: int


@dataclass(slots=True)
class _Failures:
    by_operation: dict[Operation, deque[_Injected]] = field(default_factory=dict)

    def take(self, operation: Operation) -> CloudError | None:
        queue = self.by_operation.get(operation)
        if not queue:
            return None
        head = queue[0]
        head.times -= 1
        if head.times <= 0:
            queue.popleft()
        return head.error


class LocalProvider(Provider):
    """Instances as slots on this machine. Thread-safe; every method returns at once (`poll_notices` waits at most
    its `timeout_s`, capped at `MAX_NOTICE_WAIT_S`).

    Args:
        slots: how many instances may be pending or running at once (stopped ones do not count). Default:
            `max(DEFAULT_SLOTS_MIN, os.cpu_count())`.
        prices_usd_per_h: prices by instance type (and `"TYPE:spot"`), over `LOCAL_PRICES_USD_PER_H`.
        start_delay_s: how long a launched or started instance stays `pending` before it is `running`.
        clock: epoch seconds; tests pass a fake one to move time without sleeping.
        hosts: where instances launched with a bootstrap run their job's agent (`cloud.local.hosts`): each is
            booted at launch and start, powered off at stop, terminate or interruption. None: instances are
            bookkeeping only, and a bootstrap is refused.
    """

    name = "local"

    def __init__(
        self,
        *,
        slots: int | None = None,
        prices_usd_per_h: Mapping[str, float] | None = None,
        start_delay_s: float = 0.0,
        clock: Callable[[], float] = time.time,
        hosts: LocalHosts | None = None,
    ) -> None:
        if slots is None:
            slots = max(DEFAULT_SLOTS_MIN, os.cpu_count() or 1)
        if slots < 1:
            raise InvalidRequestError(f"slots must be at least 1, got {slots}", provider=self.name)
        if not (math.isfinite(start_delay_s) and start_delay_s >= 0.0):
            raise InvalidRequestError(f"start_delay_s must be >= 0, got {start_delay_s}", provider=self.name)
        prices = dict(LOCAL_PRICES_USD_PER_H)
        for instance_type, price in (prices_usd_per_h or {}).items():
            if not (math.isfinite(price) and price >= 0.0):
                raise InvalidRequestError(
                    f"price of {instance_type!r} must be a finite number >= 0, got {price}", provider=self.name
                )
            prices[instance_type] = float(price)
        self.slots = slots
        self.start_delay_s = start_delay_s
        self.clock = clock
        self._prices = prices
        self._cond = threading.Condition()
        self._instances: dict[str, _Slot] = {}
        self._ids = itertools.count(1)
        self._notice_ids = itertools.count(1)
        self._notices: list[Notice] = []
        self._failures = _Failures()
        self.hosts = hosts

    def attach_hosts(self, hosts: LocalHosts) -> None:
        """Boot bootstrapped instances into `hosts` from now on (before the first such launch)."""
        with self._cond:
            if any(s.bootstrap is not None for s in self._instances.values()):
                raise InvalidRequestError("local: attach hosts before launching bootstrapped instances",
                                          provider=self.name)
            self.hosts = hosts

    def __repr__(self) -> str:
        return f"LocalProvider(slots={self.slots}, start_delay_s={self.start_delay_s})"

    # ------------------------------------------------------------------------------------------------ contract

    def capabilities(self) -> Capabilities:
        return Capabilities(
            provider=self.name,
            spot=True,
            park_on_demand=True,
            park_spot=True,
            placement_groups=False,
            capacity_reservations=False,
            notice_kinds=frozenset(get_args(NoticeKind)),
            spot_notice_s=120.0,
        )

    def launch(self, request: LaunchRequest) -> list[Instance]:
        with self._cond:
            self._raise_injected("launch")
            self._validate(request)
            now = self._resolve()
            free = self._free_slots()
            if request.count > free:
                raise CapacityError(
                    f"local: no capacity for {request.count} x {request.instance_type}: {free} of {self.slots} slots "
                    "free. Park (stop) or release instances, or create the provider with more slots",
                    provider=self.name,
                    code="InsufficientInstanceCapacity",
                )
            tags = {**request.tags, JOB_TAG: request.job_id, ROLE_TAG: request.role}
            launched = []
            for _ in range(request.count):
                slot = _Slot(
                    instance_id=f"local-{next(self._ids):06d}",
                    job_id=request.job_id,
                    role=request.role,
                    instance_type=request.instance_type,
                    market=request.market,
                    state="pending",
                    launched_at=now,
                    tags=dict(tags),
                    running_at=now + self.start_delay_s,
                    bootstrap=agent_bootstrap(request),
                )
                self._advance(slot, now)
                self._instances[slot.instance_id] = slot
                launched.append(slot)
            self._power()
            return [self._record(slot) for slot in launched]

    def stop(self, instance_ids: Sequence[str]) -> list[Instance]:
        with self._cond:
            self._raise_injected("stop")
            self._resolve()
            slots = self._lookup(instance_ids)
            self._refuse_terminated(slots, "stop (park)")
            for slot in slots:
                slot.state = "stopped"
                slot.running_at = None
            self._power()
            return [self._record(s) for s in slots]

    def start(self, instance_ids: Sequence[str]) -> list[Instance]:
        with self._cond:
            self._raise_injected("start")
            now = self._resolve()
            slots = self._lookup(instance_ids)
            self._refuse_terminated(slots, "start (wake)")
            waking = [s for s in slots if s.state == "stopped"]
            free = self._free_slots()
            if len(waking) > free:
                # All or nothing, so that a caller never holds half a wake-up it did not ask for.
                raise CapacityError(
                    f"local: cannot start {len(waking)} instance(s): {free} of {self.slots} slots free. Release "
                    "or park others, try again later, or fall back to another tier",
                    provider=self.name,
                    code="InsufficientInstanceCapacity",
                )
            for slot in waking:
                slot.state = "pending"
                slot.running_at = now + self.start_delay_s
                slot.impaired = False  # a start lands on a fresh host, as a stop/start does on EC2
                self._advance(slot, now)
            self._power()
            return [self._record(s) for s in slots]

    def terminate(self, instance_ids: Sequence[str]) -> None:
        with self._cond:
            self._raise_injected("terminate")
            self._resolve()
            for slot in self._lookup(instance_ids):
                slot.state = "terminated"
                slot.running_at = None
                slot.interrupt_at = None
            self._power()

    def describe(self, instance_ids: Sequence[str] | None = None, *, job_id: str | None = None) -> list[Instance]:
        with self._cond:
            self._resolve()
            if instance_ids is not None:
                chosen = self._lookup(instance_ids)
                if job_id is not None:
                    chosen = [s for s in chosen if s.job_id == job_id]
            else:
                chosen = [
                    s
                    for s in self._instances.values()
                    if s.state != "terminated" and (job_id is None or s.job_id == job_id)
                ]
            return [self._record(s) for s in chosen]

    def hourly_price_usd(self, instance_type: str, market: Market = "on-demand") -> float:
        if market not in get_args(Market):
            raise InvalidRequestError(f"market must be one of {get_args(Market)}, got {market!r}", provider=self.name)
        on_demand = self._prices.get(instance_type, LOCAL_DEFAULT_PRICE_USD_PER_H)
        if market == "spot":
            return self._prices.get(f"{instance_type}:spot", on_demand * LOCAL_SPOT_FACTOR)
        return on_demand

    accelerator_counts: Mapping[str, int] = MappingProxyType({})
    """GPUs per instance of each type, as `accelerators` reports them: none by default (this machine's instances
    are one CPU slot each, whatever their type's name); set it to try multi-slot hosts here, e.g.
    `cloud.accelerator_counts = {"p5.48xlarge": 2}`."""

    def accelerators(self, instance_type: str) -> Accelerators:
        # Nothing to ask of a cloud, so nothing to cache: a count set later applies to the next launch.
        return Accelerators(instance_type, count=self.accelerator_counts.get(instance_type, 0))

    def poll_notices(self, timeout_s: float = 0.0) -> list[Notice]:
        wait_s = min(max(0.0, timeout_s), MAX_NOTICE_WAIT_S) if math.isfinite(timeout_s) else MAX_NOTICE_WAIT_S
        with self._cond:
            self._cond.wait_for(lambda: bool(self._notices), timeout=wait_s)
            delivered, self._notices = self._notices, []
            return delivered

    def check(self) -> list[CheckResult]:
        with self._cond:
            self._resolve()
            free = self._free_slots()
            parked = sum(1 for s in self._instances.values() if s.state == "stopped")
        return [
            CheckResult("slots", True, f"{free} of {self.slots} free ({parked} parked instances hold none)"),
            CheckResult("state-machine", True, f"start delay {self.start_delay_s:g} s, resolved lazily, no threads"),
            CheckResult(
                "prices",
                True,
                f"{len(self._prices)} instance types priced; unknown types cost {LOCAL_DEFAULT_PRICE_USD_PER_H:g} "
                f"USD/h, spot x{LOCAL_SPOT_FACTOR:g}",
            ),
            CheckResult("notices", True, "all kinds, delivered by poll_notices when injected (inject_notice)"),
        ]

    # ------------------------------------------------------------------------------------------ failure injection

    def inject_notice(self, instance_id: str, kind: NoticeKind, lead_s: float = 120.0, detail: str = "") -> Notice:
        """Queue a notice for `poll_notices` as the cloud would send it, `lead_s` seconds before it acts.

        For `spot_interruption` and `eviction`, the cloud then acts: at the deadline the instance is terminated.
        """
        if kind not in get_args(NoticeKind):
            raise InvalidRequestError(
                f"unknown notice kind {kind!r}; choose one of {', '.join(get_args(NoticeKind))}", provider=self.name
            )
        if not (math.isfinite(lead_s) and lead_s >= 0.0):
            raise InvalidRequestError(f"lead_s must be >= 0, got {lead_s}", provider=self.name)
        with self._cond:
            now = self._resolve()
            (slot,) = self._lookup([instance_id])
            if slot.state == "terminated":
                raise InvalidRequestError(
                    f"local: {instance_id} is terminated; no notice can concern it", provider=self.name
                )
            notice = Notice(
                kind=kind,
                instance_id=instance_id,
                received_at=now,
                source=self.name,
                deadline_at=now + lead_s,
                event_id=f"local-notice-{next(self._notice_ids):06d}",
                detail=detail,
            )
            if kind in _INTERRUPTING:
                slot.interrupt_at = notice.deadline_at
            self._notices.append(notice)
            self._cond.notify_all()
            return notice

    def fail_next(self, operation: Operation, error: CloudError, times: int = 1) -> None:
        """Make the next `times` calls of `operation` raise `error` before doing anything (queued after earlier
        injections for the same operation)."""
        if operation not in _OPERATIONS:
            raise InvalidRequestError(f"operation must be one of {', '.join(_OPERATIONS)}, got {operation!r}")
        if not isinstance(error, CloudError):
            raise TypeError(f"error must be a CloudError, got {type(error).__name__}")
        if times < 1:
            raise InvalidRequestError(f"times must be at least 1, got {times}")
        with self._cond:
            self._failures.by_operation.setdefault(operation, deque()).append(_Injected(error, times))

    def mark_unhealthy(self, instance_id: str) -> Instance:
        """Report the instance's health as "impaired" (a failed status check) until it is stopped and started."""
        with self._cond:
            self._resolve()
            (slot,) = self._lookup([instance_id])
            if not slot.holds_capacity:
                raise InvalidRequestError(
                    f"local: {instance_id} is {slot.state}; only a pending or running instance can turn unhealthy",
                    provider=self.name,
                )
            slot.impaired = True
            return self._record(slot)

    def set_role(self, instance_id: str, role: Role) -> Instance:
        validate_role(role, provider=self.name)
        with self._cond:
            (slot,) = self._lookup([instance_id])
            self._refuse_terminated([slot], "retag")
            slot.role = role
            slot.tags[ROLE_TAG] = role
            return self._record(slot)

    def tags(self, instance_id: str) -> dict[str, str]:
        """The tags the instance was launched with, `trainmover:job` and `trainmover:role` included."""
        with self._cond:
            (slot,) = self._lookup([instance_id])
            return dict(slot.tags)

    # -------------------------------------------------------------------------------------------------- internals

    def _raise_injected(self, operation: Operation) -> None:
        error = self._failures.take(operation)
        if error is not None:
            # The same error object may be raised several times: start each from a clean traceback.
            raise error.with_traceback(None)

    def _validate(self, request: LaunchRequest) -> None:
        def bad(message: str) -> InvalidRequestError:
            return InvalidRequestError(f"local: {message}", provider=self.name)

        if not request.instance_type or not request.instance_type.strip():
            raise bad("instance_type must not be empty")
        if request.role not in get_args(Role):
            raise bad(f"role must be one of {get_args(Role)}, got {request.role!r}")
        if request.market not in get_args(Market):
            raise bad(f"market must be one of {get_args(Market)}, got {request.market!r}")
        if request.zone not in (None, LOCAL_ZONE):
            raise bad(f"this machine has one zone, {LOCAL_ZONE!r}; got zone {request.zone!r}")
        if request.placement_group is not None:
            raise UnsupportedError(
                "local: placement groups do not exist on this machine; launch without placement_group",
                provider=self.name,
            )
        if request.capacity_reservation is not None:
            raise UnsupportedError(
                "local: capacity reservations do not exist on this machine; launch without capacity_reservation",
                provider=self.name,
            )
        if request.network is not None:
            raise UnsupportedError(
                "local: security groups and placement groups do not exist on this machine; launch without network",
                provider=self.name,
            )
        if request.efa:
            raise UnsupportedError("local: no Elastic Fabric Adapter on this machine; launch without efa",
                                   provider=self.name)
        if request.bootstrap is not None and self.hosts is None:
            raise UnsupportedError(
                "local: this provider's instances run nothing: create it with hosts= (cloud.local.hosts) to boot "
                "bootstrapped instances into hosts of their job, or launch without bootstrap",
                provider=self.name,
            )
        spec = agent_bootstrap(request)
        if spec is not None and spec.secret.kind != "local-file":
            raise UnsupportedError(
                f"local: the bootstrap's secret is in {spec.secret.kind}, which a local host cannot "
                "read: store it with cloud.secrets.LocalFileStore",
                provider=self.name,
            )

    def _resolve(self) -> float:
        now = self.clock()
        for slot in self._instances.values():
            self._advance(slot, now)
        if self.hosts is not None:
            self._power()
        return now

    def _power(self) -> None:
        """Boot or power off the hosts of instances whose state changed: a launched or started instance with a
        bootstrap boots its agent, a stopped one is powered off, a terminated one is gone with its host. A host that
        dies on its own stays dead until its instance is stopped and started, as a crashed machine does."""
        if self.hosts is None:
            return
        for slot in self._instances.values():
            if slot.bootstrap is None or (slot.holds_capacity == slot.powered and slot.state != "terminated"):
                continue
            if slot.holds_capacity:
                self.hosts.boot(slot.instance_id, slot.bootstrap)
            elif slot.state == "terminated":
                self.hosts.remove(slot.instance_id)
                slot.bootstrap = None  # nothing left to power
            else:
                self.hosts.power_off(slot.instance_id)
            slot.powered = slot.holds_capacity

    @staticmethod
    def _advance(slot: _Slot, now: float) -> None:
        if slot.state == "terminated":
            return
        if slot.interrupt_at is not None and now >= slot.interrupt_at:
            slot.state, slot.running_at, slot.interrupt_at = "terminated", None, None
            return
        if slot.state == "pending" and slot.running_at is not None and now >= slot.running_at:
            slot.state, slot.running_at = "running", None

    def _free_slots(self) -> int:
        return self.slots - sum(1 for s in self._instances.values() if s.holds_capacity)

    def _lookup(self, instance_ids: Sequence[str]) -> list[_Slot]:
        if isinstance(instance_ids, str):
            raise InvalidRequestError(f"instance_ids must be a sequence of ids, not the string {instance_ids!r}")
        missing = [i for i in instance_ids if i not in self._instances]
        if missing:
            raise NotFoundError(
                f"local: no such instance(s): {', '.join(missing)}", provider=self.name, code="InvalidInstanceID"
            )
        return [self._instances[i] for i in dict.fromkeys(instance_ids)]

    def _refuse_terminated(self, slots: Sequence[_Slot], action: str) -> None:
        gone = [s.instance_id for s in slots if s.state == "terminated"]
        if gone:
            raise InvalidRequestError(
                f"local: cannot {action} terminated instance(s) {', '.join(gone)}: a terminated instance is gone "
                "for good; launch a new one",
                provider=self.name,
                code="IncorrectInstanceState",
            )

    def _record(self, slot: _Slot) -> Instance:
        health: Health
        if slot.state == "running":
            health = "impaired" if slot.impaired else "ok"
        elif slot.state == "pending":
            health = "initializing"
        else:
            health = "unknown"
        return Instance(
            instance_id=slot.instance_id,
            provider=self.name,
            job_id=slot.job_id,
            role=slot.role,
            instance_type=slot.instance_type,
            market=slot.market,
            state=slot.state,
            health=health,
            zone=LOCAL_ZONE,
            private_ip=self.hosts.address(slot.instance_id) if self.hosts is not None and slot.bootstrap is not None
            else "127.0.0.1",
            launched_at=slot.launched_at,
        )


__all__ = [
    "LOCAL_DEFAULT_PRICE_USD_PER_H",
    "LOCAL_PRICES_USD_PER_H",
    "LOCAL_SPOT_FACTOR",
    "LocalProvider",
    "Operation",
]
