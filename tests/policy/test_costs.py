"""`policy.costs.bill_run`: a run's bill beside checkpoint-restart's, by hand-checked arithmetic."""

from __future__ import annotations

import pytest

from policy.costs import StandbyCosts, bill_run, default_tiers


def test_a_run_is_billed_its_standbys_and_downtime_beside_checkpoint_restart() -> None:
    costs = StandbyCosts(job_price_usd_per_h=3600.0, restart_downtime_s=900.0)  # 1 USD per second of downtime
    prices = {t: c.price_usd_per_h for t, c in default_tiers(10.0).items()}
    bill = bill_run(costs, prices, {"warm": 2.0, "stopped": 4.0}, [3.0, 7.0], wall_s=1000.0)
    assert bill.standby_cost_usd == pytest.approx(2.0 * 10.0 + 4.0 * prices["stopped"])
    assert (bill.downtime_s, bill.downtime_cost_usd) == (10.0, pytest.approx(10.0))
    assert bill.ettr == pytest.approx(990.0 / 1000.0)
    assert (bill.restart_downtime_s, bill.restart_cost_usd) == (1800.0, pytest.approx(1800.0))
    # The same useful time, 990 s, with 1,800 s of restarts instead.
    assert bill.restart_ettr == pytest.approx(990.0 / 2790.0)


def test_no_interruption_and_no_time() -> None:
    bill = bill_run(StandbyCosts(), {"warm": 1.0}, {"warm": 0.0}, [], wall_s=0.0)
    assert (bill.ettr, bill.restart_ettr, bill.restart_downtime_s, bill.standby_cost_usd) == (0.0, 0.0, 0.0, 0.0)
    assert bill_run(StandbyCosts(), {}, {}, [], wall_s=60.0).ettr == 1.0


def test_a_tier_without_a_price_is_refused() -> None:
    with pytest.raises(ValueError, match="no price for the standby tier"):
        bill_run(StandbyCosts(), {"warm": 1.0}, {"stopped": 1.0}, [], wall_s=60.0)
