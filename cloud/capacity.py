"""Capacity fallback: wake a parked standby, or launch one, when the cloud has no capacity for the first choice.

This module owns the order in which alternatives are tried (docs/cloud.md, "Capacity fallback") and nothing else.
It is provider-independent: it calls only `Provider.start`, `Provider.launch` and `Provider.terminate`, and reads
only `CapacityError` (AWS InsufficientInstanceCapacity and friends, Azure AllocationFailed / ZonalAllocationFailed,
mapped by each provider). The order:

1. the first choice: wake the parked standby (`start`), or, with no standby, launch the request as given;
2. the same instance type in each other zone of `Fallbacks.zones` (another zone of the same region);
3. each type of `Fallbacks.instance_types` (the same accelerator, caller-given) in the request's zone;
4. a fresh on-demand launch of the request's type in its zone: a spot request, or a parked standby that would not
   wake, ends on on-demand (skipped when step 1 already was exactly that launch).

Launches in steps 2-3 keep the request's market; steps 2-4 launch outside the request's capacity reservation or
Capacity Block, which holds one type in one zone. Only a `CapacityError` moves on to the next step; any other error
(quota, permission, an invalid request) is raised at once, because the next step would meet it too. When a
replacement runs, the parked standby is terminated (`Fallbacks.release_parked`), since it would keep billing its
disk. `plan_fallback` is the order as a pure function; `wake_or_replace` and `launch_with_fallback` run it and
return a `CapacityOutcome` listing every attempt and why it failed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from cloud.base import CapacityError, CloudError, Instance, InvalidRequestError, LaunchRequest, Market, Provider

Step = Literal["wake", "request", "zone", "type", "on-demand"]


@dataclass(frozen=True, slots=True)
class Fallbacks:
    """What a caller allows when the first choice has no capacity."""

    zones: tuple[str, ...] = ()
    """Other zones of the request's region the job may run in (a cluster placement group or a zonal disk may
    forbid it: then leave this empty)."""
    instance_types: tuple[str, ...] = ()
    """Other instance types with the same accelerator, in order of preference (e.g. p5.48xlarge, p5e.48xlarge)."""
    on_demand: bool = True
    """End on a fresh on-demand launch of the request's type in its zone."""
    release_parked: bool = True
    """Terminate the parked standby once a replacement was launched for it."""

    def __post_init__(self) -> None:
        for label, values in (("zones", self.zones), ("instance_types", self.instance_types)):
            if isinstance(values, str) or not all(isinstance(v, str) and v for v in values):
                raise InvalidRequestError(
                    f"capacity fallback: {label} must be a sequence of non-empty names, got {values!r}",
                    code="InvalidFallback",
                )
            object.__setattr__(self, label, tuple(values))


@dataclass(frozen=True, slots=True)
class Candidate:
    """One step of a fallback plan: wake the standby, or launch `instance_type` in `zone` on `market`."""

    step: Step
    instance_type: str
    zone: str | None
    market: Market


@dataclass(frozen=True, slots=True)
class Attempt:
    """One call made while falling back, and how it ended."""

    candidate: Candidate
    ok: bool
    error_code: str | None = None
    """The cloud's error code of a failed attempt, e.g. "InsufficientInstanceCapacity" or "AllocationFailed"."""
    detail: str = ""


@dataclass(frozen=True, slots=True)
class CapacityOutcome:
    """What `wake_or_replace` / `launch_with_fallback` did, and why: every attempt, in order."""

    attempts: tuple[Attempt, ...]
    instances: tuple[Instance, ...] = ()
    """The woken standby or the launched replacement; empty when every step lacked capacity."""
    released: tuple[str, ...] = ()
    """The parked standby's id when it was terminated after a replacement ran."""
    release_error: str | None = None
    """Why terminating the parked standby failed (the replacement runs regardless; release it by hand)."""

    @property
    def succeeded(self) -> bool:
        return bool(self.instances)

    @property
    def step(self) -> Step | None:
        """The step that got capacity, None when none did."""
        return next((a.candidate.step for a in self.attempts if a.ok), None)

    def summary(self) -> str:
        """One line for a log or a UI table: each attempt and its result."""
        parts = []
        for a in self.attempts:
            c = a.candidate
            where = f"{c.instance_type}@{c.zone or 'any zone'} {c.market}"
            parts.append(f"{c.step} {where}: {'ok' if a.ok else a.error_code or 'failed'}")
        return "; ".join(parts) if parts else "nothing tried"


def plan_fallback(request: LaunchRequest, fallbacks: Fallbacks, *, waking: bool) -> tuple[Candidate, ...]:
    """The candidates in the documented order, without duplicates (pure: no provider call)."""
    first = Candidate("wake" if waking else "request", request.instance_type, request.zone, request.market)
    plan = [first]
    plan += [
        Candidate("zone", request.instance_type, zone, request.market)
        for zone in fallbacks.zones
        if zone != request.zone
    ]
    plan += [
        Candidate("type", t, request.zone, request.market)
        for t in fallbacks.instance_types
        if t != request.instance_type
    ]
    if fallbacks.on_demand:
        plan.append(Candidate("on-demand", request.instance_type, request.zone, "on-demand"))
    seen: set[tuple[str, str | None, Market]] = set()
    unique: list[Candidate] = []
    for c in plan:
        key = (c.instance_type, c.zone, c.market)
        if c.step != "wake" and key in seen:
            continue
        if c.step != "wake":
            seen.add(key)
        unique.append(c)
    return tuple(unique)


def wake_or_replace(
    provider: Provider, instance_id: str, request: LaunchRequest, fallbacks: Fallbacks | None = None
) -> CapacityOutcome:
    """Wake the parked standby `instance_id`; when the cloud has no capacity for it, launch a replacement in the
    documented order. `request` describes the standby (its job, role, type, zone, image, ...) with `count=1`."""
    if request.count != 1:
        raise InvalidRequestError(
            f"capacity fallback: a standby is replaced by one instance, so the request's count must be 1, got "
            f"{request.count}",
            code="InvalidFallback",
        )
    fallbacks = fallbacks or Fallbacks()
    return _run(provider, plan_fallback(request, fallbacks, waking=True), request, instance_id, fallbacks)


def launch_with_fallback(
    provider: Provider, request: LaunchRequest, fallbacks: Fallbacks | None = None
) -> CapacityOutcome:
    """Launch `request`; when the cloud has no capacity for it, try the fallbacks in the documented order."""
    fallbacks = fallbacks or Fallbacks()
    return _run(provider, plan_fallback(request, fallbacks, waking=False), request, None, fallbacks)


def _run(
    provider: Provider,
    plan: Sequence[Candidate],
    request: LaunchRequest,
    parked_id: str | None,
    fallbacks: Fallbacks,
) -> CapacityOutcome:
    attempts: list[Attempt] = []
    for candidate in plan:
        try:
            if candidate.step == "wake" and parked_id is not None:
                instances = provider.start([parked_id])
            else:
                # A reservation (or Capacity Block) holds one type in one zone: the fallbacks launch outside it.
                kept = {} if candidate.step in ("wake", "request") else {"capacity_reservation": None,
                                                                          "capacity_block": False}
                instances = provider.launch(
                    dataclasses.replace(
                        request, instance_type=candidate.instance_type, zone=candidate.zone, market=candidate.market,
                        **kept,  # type: ignore[arg-type]
                    )
                )
        except CapacityError as err:  # an outcome: try the next candidate
            attempts.append(Attempt(candidate, ok=False, error_code=err.code, detail=str(err)))
            continue
        attempts.append(Attempt(candidate, ok=True))
        released: tuple[str, ...] = ()
        release_error: str | None = None
        if parked_id is not None and candidate.step != "wake" and fallbacks.release_parked:
            try:
                provider.terminate([parked_id])
                released = (parked_id,)
            except CloudError as err:  # the replacement runs; losing it to a failed cleanup would be worse
                release_error = str(err)
        return CapacityOutcome(tuple(attempts), tuple(instances), released, release_error)
    return CapacityOutcome(tuple(attempts))
