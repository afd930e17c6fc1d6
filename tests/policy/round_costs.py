"""Standby costs with round numbers, shared by the policy scenarios that check arithmetic by hand."""

from __future__ import annotations

from collections.abc import Mapping

from policy.costs import StandbyCosts, TierCosts


def round_costs(lead_time_h: float, takeover_s: float, overrides: Mapping[str, object]) -> StandbyCosts:
    """One warm tier at 10 USD/h taking over in `takeover_s`; the job 1000 USD/h, a restart 1 h (so C_avoid = 1000 USD
    with an instant takeover), no replacement wait, no hysteresis nor hold; `overrides` replace any field."""
    fields: dict[str, object] = {
        "job_price_usd_per_h": 1000.0,
        "restart_downtime_s": 3600.0,
        "replacement_h": 0.0,  # an uncovered failure costs the restart alone: round numbers for hand arithmetic
        "lead_time_h": lead_time_h,
        "tiers": {"warm": TierCosts(price_usd_per_h=10.0, takeover_s=takeover_s)},
        "hysteresis": 0.0,
        "min_hold_s": 0.0,
    }
    fields.update(overrides)
    return StandbyCosts.model_validate(fields)
