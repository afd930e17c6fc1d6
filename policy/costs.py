"""Prices and downtimes that the standby decision weighs: one place for the cost owner's knobs.

Every default lives in the constants block below, with the source or assumption behind it, so that a cost owner
can see at a glance what a plan was priced with.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

TierName = Literal["stopped", "warm", "hot"]
TIER_NAMES: tuple[TierName, ...] = ("stopped", "warm", "hot")

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
# Takeover downtime per covered failure: stopped = instance start + warm-up (minutes), warm = join a new
# generation and fetch state (seconds), hot = state already mirrored (sub-second, rounded up to 1 s).
STOPPED_TAKEOVER_S = 180.0
WARM_TAKEOVER_S = 5.0
HOT_TAKEOVER_S = 1.0
# Uncovered failure: checkpoint-restart, i.e. relaunch + reload + work lost since the last checkpoint.
RESTART_DOWNTIME_S = 900.0
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


def default_tiers() -> dict[TierName, TierCosts]:
    """The three tiers of DESIGN.md priced with the defaults above."""
    return {
        "stopped": TierCosts(price_usd_per_h=STOPPED_STORAGE_USD_PER_H, takeover_s=STOPPED_TAKEOVER_S),
        "warm": TierCosts(price_usd_per_h=NODE_PRICE_USD_PER_H, takeover_s=WARM_TAKEOVER_S),
        "hot": TierCosts(price_usd_per_h=NODE_PRICE_USD_PER_H + HOT_EXTRA_USD_PER_H, takeover_s=HOT_TAKEOVER_S),
    }


class StandbyCosts(BaseModel):
    """The cost owner's knobs for the standby decision."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    job_price_usd_per_h: float = Field(
        default=DEFAULT_JOB_NODES * NODE_PRICE_USD_PER_H,
        description="Price of the whole job per hour; every second of downtime wastes all of it, USD per hour.",
        gt=0.0,
        le=10_000_000.0,
    )
    restart_downtime_s: float = Field(
        default=RESTART_DOWNTIME_S,
        description="Downtime of a failure that no standby covers (checkpoint-restart plus lost work), seconds.",
        ge=0.0,
        le=604_800.0,
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
        max_length=3,
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
            if tier.takeover_s >= self.restart_downtime_s:
                raise ValueError(
                    f"tier {name!r}: takeover_s={tier.takeover_s} is not below restart_downtime_s="
                    f"{self.restart_downtime_s}, so such a standby would never save time; lower its takeover_s "
                    "or leave the tier out"
                )
        return self

    def avoided_usd(self, tier: TierName) -> float:
        """C_avoid: the downtime cost, in USD, that one standby of `tier` avoids per covered failure."""
        saved_h = (self.restart_downtime_s - self.tiers[tier].takeover_s) / 3600.0
        return saved_h * self.job_price_usd_per_h

    def threshold(self, tier: TierName) -> float:
        """c_t * L / C_avoid_t: the failure probability above which one more standby of `tier` pays for itself."""
        return self.tiers[tier].price_usd_per_h * self.lead_time_h / self.avoided_usd(tier)
