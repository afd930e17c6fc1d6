"""Prices and downtimes that the standby decision weighs: one place for the cost owner's knobs.

Every default lives in the constants block below, with the source or assumption behind it, so that a cost owner
can see at a glance what a plan was priced with.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

TierName = Literal["stopped", "warm", "hot", "spot"]
TIER_NAMES: tuple[TierName, ...] = ("stopped", "warm", "hot", "spot")
DEFAULT_TIER_NAMES: tuple[TierName, ...] = ("stopped", "warm", "hot")
"""The tiers offered unless the cost owner adds spot (`--tiers stopped,warm,hot,spot`)."""

# --- Defaults (assumptions, not measurements) -------------------------------------------------------------------
# AWS p5.48xlarge (8x H100) on-demand list price in us-east-1, USD per hour, after AWS's June 2025 cut of up to
# 45% on P4/P5 (it was 98.32); the same figure as cloud/aws.py's price table.
NODE_PRICE_USD_PER_H = 55.04
# A job of 64 such nodes (512 GPUs); the whole job idles while one node is being replaced.
DEFAULT_JOB_NODES = 64
# A stopped instance pays only for its EBS volumes (root + image/cache, ~2-4 TB gp3 at 0.08 USD/GB-month),
# rounded up to 0.5 USD/h.
STOPPED_STORAGE_USD_PER_H = 0.5
# A hot standby mirrors the training state every step: full price plus an assumed 1 USD/h for the extra traffic.
HOT_EXTRA_USD_PER_H = 1.0
# Takeover downtime per covered failure: warm = join a new generation and fetch state (seconds), hot = state
# already mirrored (sub-second, rounded up to 1 s). Stopped = StartInstances on a parked instance (EC2 promises no
# bound; minutes for a large GPU instance), GPU driver and fabric-manager start, container start, state fetch: an
# assumed 10 minutes (the 3 minutes assumed before issue 13 were optimistic).
STOPPED_TAKEOVER_S = 600.0
WARM_TAKEOVER_S = 5.0
HOT_TAKEOVER_S = 1.0
# A stopped instance holds no capacity: starting it can fail with InsufficientInstanceCapacity (EC2 API,
# StateReason "Server.InsufficientInstanceCapacity"), common for scarce GPU types. No public rate exists for P5:
# an assumed 10%; measure your own start-failure rate and pass it. The failure then costs an uncovered failure.
STOPPED_WAKE_FAILURE_PROB = 0.1
# Or reserve the capacity: an EC2 On-Demand Capacity Reservation is billed at the on-demand rate whether an
# instance runs in it or not (AWS, "Capacity Reservation pricing and billing"), so a reserved stopped standby
# costs a whole node plus its volumes and never fails to wake.
StoppedCapacity = Literal["unreserved", "reserved"]
DEFAULT_STOPPED_CAPACITY: StoppedCapacity = "unreserved"
# A spot standby: a running instance (a warm standby: same takeover) bought on the spot market. Its price is an
# assumption: 35% of on-demand (the synthetic fleets' spot_price_ratio; p5 spot prices vary by zone and hour, and
# `cloud.aws`'s hourly_price_usd(t, "spot") reads the real one from DescribeSpotPriceHistory). The provider may
# reclaim it at any time; its rate is an assumption from the AWS Spot Instance Advisor's buckets of monthly
# interruption frequency (<5%, 5-10%, 10-15%, 15-20%, >20%): the top bucket, >20% a month, taken at 20%, i.e.
# -ln(0.8) / 730 h = 3.1e-4 per hour (no public figure for p5 was checked here; use the Advisor's bucket for your
# instance type and region). A reclaimed spot standby is gone until its replacement arrives one lead time later.
SPOT_PRICE_RATIO = 0.35
SPOT_INTERRUPTIONS_PER_H = -math.log(1 - 0.20) / 730.0
# Uncovered failure: checkpoint-restart, i.e. relaunch + reload + work lost since the last checkpoint, an
# assumption for a large job (the recovery bench measures 34 s for a 629 MB model on 2 CPU workers, without a
# lost node to replace) ...
RESTART_DOWNTIME_S = 900.0
# ... after a replacement host is there: the job cannot relaunch on a node it lost. The wait is the replenishment
# lead time L (`StandbyCosts.replacement_h`, None = L) unless the cost owner says otherwise.
# Replenishment lead time L: how long it takes to obtain a fresh node after one is consumed.
LEAD_TIME_H = 0.5
HYSTERESIS = 0.2
MIN_HOLD_S = 600.0
# -----------------------------------------------------------------------------------------------------------------


class TierCosts(BaseModel):
    """What one standby of a tier costs to keep and how long it takes to take over a failed node's rank."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    price_usd_per_h: float = Field(
        description="Hourly price of keeping one standby in this tier, USD per hour.", ge=0.0, le=100_000.0
    )
    takeover_s: float = Field(
        description="Downtime of the whole job per failure that a standby of this tier covers, seconds.",
        ge=0.0,
        le=86_400.0,
    )
    wake_failure_prob: float = Field(
        default=0.0,
        description="Probability that taking over fails (a stopped instance that cannot start for lack of "
        "capacity); the failure then also costs an uncovered failure's downtime.",
        ge=0.0,
        le=1.0,
    )
    interruptions_per_h: float = Field(
        default=0.0,
        description="Rate at which the provider reclaims a standby of this tier (spot), per hour; a reclaimed "
        "standby is gone until a replacement arrives one lead time later.",
        ge=0.0,
        le=1000.0,
    )


def spot_tier(
    node_price_usd_per_h: float = NODE_PRICE_USD_PER_H,
    price_ratio: float = SPOT_PRICE_RATIO,
    interruptions_per_h: float = SPOT_INTERRUPTIONS_PER_H,
) -> TierCosts:
    """A spot standby: a running instance (a warm standby's takeover) at `price_ratio` x the on-demand price,
    reclaimed at `interruptions_per_h` (defaults: the assumptions above)."""
    return TierCosts(
        price_usd_per_h=price_ratio * node_price_usd_per_h,
        takeover_s=WARM_TAKEOVER_S,
        interruptions_per_h=interruptions_per_h,
    )


def default_tiers(
    node_price_usd_per_h: float = NODE_PRICE_USD_PER_H, stopped_capacity: StoppedCapacity = DEFAULT_STOPPED_CAPACITY
) -> dict[TierName, TierCosts]:
    """The three tiers of DESIGN.md priced with the defaults above, for a node of `node_price_usd_per_h`.

    `stopped_capacity` is the cost owner's choice for the stopped tier: "unreserved" (pay only for the volumes,
    and risk `STOPPED_WAKE_FAILURE_PROB` that it cannot start) or "reserved" (a capacity reservation at the node
    price, and it always starts).
    """
    reserved = stopped_capacity == "reserved"
    return {
        "stopped": TierCosts(
            price_usd_per_h=STOPPED_STORAGE_USD_PER_H + (node_price_usd_per_h if reserved else 0.0),
            takeover_s=STOPPED_TAKEOVER_S,
            wake_failure_prob=0.0 if reserved else STOPPED_WAKE_FAILURE_PROB,
        ),
        "warm": TierCosts(price_usd_per_h=node_price_usd_per_h, takeover_s=WARM_TAKEOVER_S),
        "hot": TierCosts(price_usd_per_h=node_price_usd_per_h + HOT_EXTRA_USD_PER_H, takeover_s=HOT_TAKEOVER_S),
    }


class StandbyCosts(BaseModel):
    """The cost owner's knobs for the standby decision."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    job_price_usd_per_h: float = Field(
        default=DEFAULT_JOB_NODES * NODE_PRICE_USD_PER_H,
        description="Price of the whole job per hour; every second of downtime wastes all of it, USD per hour.",
        gt=0.0,
        le=1_000_000_000.0,  # a million nodes at 1,000 USD/h
    )
    restart_downtime_s: float = Field(
        default=RESTART_DOWNTIME_S,
        description="Downtime of a failure that no standby covers (checkpoint-restart plus lost work), seconds, "
        "once a replacement host is there (see replacement_h).",
        ge=0.0,
        le=604_800.0,
    )
    replacement_h: float | None = Field(
        default=None,
        description="Hours an uncovered failure waits for a replacement host before the restart can begin; none "
        "means the lead time L. 0 for a job that can restart on fewer nodes.",
        ge=0.0,
        le=168.0,
    )
    shrink_s: float | None = Field(
        default=None,
        description="A job that shrinks when no standby is left (trainmover run --shrink, data-parallel): an "
        "uncovered failure costs this many seconds of whole-job downtime (the survivors go on at once, one node "
        "fewer), plus one node's share of the job's throughput until a fresh node arrives (the lead time L) and "
        "the job grows back onto it, instead of a restart; none: the job restarts from its checkpoint.",
        ge=0.0,
        le=3600.0,
    )
    shrink_replica_nodes: int = Field(
        default=1,
        description="With shrink_s: the nodes a shrink leaves out per lost node, the size of one data-parallel "
        "replica (1 for a purely data-parallel job; a sharded job could only drop a whole replica group).",
        ge=1,
        le=1_000_000,
    )
    lead_time_h: float = Field(
        default=LEAD_TIME_H,
        description="Replenishment lead time L: hours to obtain a fresh node; failure probabilities refer to it.",
        gt=0.0,
        le=168.0,
    )
    tiers: dict[TierName, TierCosts] = Field(
        default_factory=default_tiers,
        description="Price and takeover time of each tier offered; a tier left out is never used.",
        min_length=1,
        max_length=4,
    )
    budget_usd_per_h: float | None = Field(
        default=None,
        description="Cap on the hourly cost of all standbys together, USD per hour; none means no cap.",
        ge=0.0,
        le=10_000_000.0,
    )
    hysteresis: float = Field(
        default=HYSTERESIS,
        description="A standby is released only once its failure probability falls below (1 - hysteresis) "
        "times its threshold; growing is immediate.",
        ge=0.0,
        le=0.95,
    )
    min_hold_s: float = Field(
        default=MIN_HOLD_S,
        description="No standby is released within this many seconds of the last change to the fleet.",
        ge=0.0,
        le=86_400.0,
    )

    @model_validator(mode="after")
    def _tiers_save_time(self) -> StandbyCosts:
        for name, tier in self.tiers.items():
            if self.expected_takeover_s(name) >= self.uncovered_downtime_s:
                raise ValueError(
                    f"tier {name!r}: takeover_s={tier.takeover_s} with wake_failure_prob={tier.wake_failure_prob} "
                    f"is not below an uncovered failure's {self.uncovered_downtime_s:g} s (restart_downtime_s + "
                    "replacement_h), so such a standby would never save time; lower its takeover_s or leave the "
                    "tier out"
                )
        return self

    @property
    def uncovered_downtime_s(self) -> float:
        """Downtime of a failure no standby covers: wait for a replacement host, then checkpoint-restart."""
        replacement_h = self.lead_time_h if self.replacement_h is None else self.replacement_h
        return self.restart_downtime_s + replacement_h * 3600.0

    def uncovered_cost_s(self, job_nodes: int) -> float:
        """What a failure no standby covers costs a job of `job_nodes` nodes, in seconds of whole-job time: a
        shrink until a fresh node arrives (`shrink_s`, plus the share of the throughput of the replica left out,
        `shrink_replica_nodes` / `job_nodes`, for the lead time L) where the job can shrink and that is cheaper,
        else the restart."""
        if self.shrink_s is None or job_nodes <= self.shrink_replica_nodes:
            return self.uncovered_downtime_s
        share = self.shrink_replica_nodes / job_nodes
        return min(self.uncovered_downtime_s, self.shrink_s + self.lead_time_h * 3600.0 * share)

    def expected_takeover_s(self, tier: TierName) -> float:
        """Expected downtime of a failure a standby of `tier` takes: its takeover, plus an uncovered failure's
        downtime in the cases where it fails to wake."""
        t = self.tiers[tier]
        return t.takeover_s + t.wake_failure_prob * self.uncovered_downtime_s

    def availability(self, tier: TierName) -> float:
        """Share of the time a standby of `tier` is there: a reclaimed one (rate r) is back a lead time L later,
        so up Exp(1/r), down L: 1 / (1 + r L); 1 for a tier that is never reclaimed."""
        return 1.0 / (1.0 + self.tiers[tier].interruptions_per_h * self.lead_time_h)

    def avoided_usd(self, tier: TierName) -> float:
        """C_avoid: the downtime cost, in USD, that one standby of `tier` avoids per failure it is held for
        (expected: a spot standby is there only `availability` of the time)."""
        saved_h = (self.uncovered_downtime_s - self.expected_takeover_s(tier)) / 3600.0
        return self.availability(tier) * saved_h * self.job_price_usd_per_h

    def threshold(self, tier: TierName) -> float:
        """c_t * L / C_avoid_t: the failure probability above which one more standby of `tier` pays for itself."""
        return self.tiers[tier].price_usd_per_h * self.lead_time_h / self.avoided_usd(tier)


@dataclass(frozen=True, slots=True)
class RunBill:
    """What one run's standbys and interruptions cost, beside the same failures under checkpoint-restart."""

    standby_hours: dict[str, float]
    """Hours held per tier."""
    standby_cost_usd: float
    downtime_s: float
    downtime_cost_usd: float
    ettr: float
    """Effective training time ratio: the share of the run's wall time spent training."""
    restart_downtime_s: float
    """What the same failures would have cost under checkpoint-restart: one restart each (`restart_downtime_s`)."""
    restart_cost_usd: float
    restart_ettr: float


def bill_run(
    costs: StandbyCosts,
    prices_usd_per_h: Mapping[str, float],
    standby_hours: Mapping[str, float],
    downtimes_s: Sequence[float],
    wall_s: float,
) -> RunBill:
    """Price a run: standbys held `standby_hours` per tier at `prices_usd_per_h`, each interruption's downtime at
    the job's hourly price, over `wall_s` seconds of run (downtime included). Under checkpoint-restart every
    interruption would have cost `costs.restart_downtime_s` and the run would have been that much longer."""
    missing = sorted(t for t, h in standby_hours.items() if h > 0 and t not in prices_usd_per_h)
    if missing:
        raise ValueError(f"no price for the standby tier(s) {', '.join(missing)} held by the run")
    usd_per_s = costs.job_price_usd_per_h / 3600.0
    downtime_s = float(sum(downtimes_s))
    restart_s = len(downtimes_s) * costs.restart_downtime_s
    useful_s = max(0.0, wall_s - downtime_s)
    return RunBill(
        standby_hours=dict(standby_hours),
        standby_cost_usd=sum(h * prices_usd_per_h.get(t, 0.0) for t, h in standby_hours.items()),
        downtime_s=downtime_s,
        downtime_cost_usd=downtime_s * usd_per_s,
        ettr=useful_s / wall_s if wall_s > 0 else 0.0,
        restart_downtime_s=restart_s,
        restart_cost_usd=restart_s * usd_per_s,
        restart_ettr=useful_s / (useful_s + restart_s) if wall_s > 0 else 0.0,
    )
