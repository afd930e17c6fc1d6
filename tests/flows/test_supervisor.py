"""The supervisor without Prefect: a real local job, the policy steering standbys, real kills, and the release.

Scenario tests: each starts real worker processes through the runtime's launcher, drives them by the policy and
the drill, and checks what a user of the flow would see: interruptions covered, happenings announced, costs
reported, and no instance left behind.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import examples.train_mlp
from cloud.local import LocalProvider
from flows.drill import DegradingFeed, FailureDrill
from flows.models import StandbyLimits, TrainingRun
from flows.supervisor import Happening, Supervisor
from runtime.wire.event_records import GenerationStarted
from tests.flows.supervising import supervise

SCRIPT = Path(examples.train_mlp.__file__)
pytestmark = pytest.mark.slow


def test_the_policy_prewarms_for_a_degrading_node_and_a_parked_standby_covers_a_surprise(tmp_path: Path) -> None:
    run = TrainingRun(
        job_id="sup-drill",
        workers=2,
        job_nodes=512,
        steps=1500,
        script=str(SCRIPT),
        standby=StandbyLimits(min_warm=0, max_warm=2, max_stopped=1),
    )
    cloud = LocalProvider(slots=8)
    sup = Supervisor(run, cloud, tmp_path, feed=DegradingFeed(), policy_every_s=0.5, time_scale=3600.0)
    drill = FailureDrill(stage_timeout_s=60.0)
    try:
        sup.provision()
        seen = supervise(sup, SCRIPT, timeout_s=240.0, drill=drill)
    finally:
        released = sup.release()
    events = [h.event for h in seen]
    assert "trainmover.standby.parked" in events
    assert "trainmover.standby.prewarmed" in events
    assert events.index("trainmover.standby.prewarmed") < events.index("trainmover.node.failed")
    assert events.count("trainmover.standby.promoted") == 2, (drill.log, events)
    report = sup.report()
    assert report.exit_code == 0, report.message
    first, second = report.interruptions
    assert first.predicted and not second.predicted
    assert (first.tier, second.tier) == ("warm", "stopped")  # pre-warmed, then woken from the parked tier
    assert all(i.lost_time_s < run.restart_downtime_s for i in report.interruptions)
    assert report.restart_cost_usd > report.downtime_cost_usd
    assert report.standby_hours["warm"] > 0 and report.standby_hours["stopped"] > 0
    assert released and not [i for i in cloud.describe(job_id=run.job_id) if i.state != "terminated"]


def test_a_notice_moves_the_worker_before_its_node_goes(tmp_path: Path) -> None:
    run = TrainingRun(
        job_id="sup-notice",
        workers=2,
        steps=600,  # the move lands within the first 100 steps (about 70 in CI)
        script=str(SCRIPT),
        standby=StandbyLimits(min_warm=1, max_warm=1, max_stopped=0),
    )
    cloud = LocalProvider(slots=8)
    sup = Supervisor(run, cloud, tmp_path, policy_every_s=3600.0)
    try:
        sup.provision()
        sup.start(SCRIPT)
        deadline = time.monotonic() + 120.0
        seen: list[Happening] = []
        noticed = False
        while not sup.done():
            assert time.monotonic() < deadline, [h.event for h in seen]
            hs = sup.tick()
            seen += hs
            if not noticed and any(h.event == "trainmover.standby.ready" for h in seen):
                cloud.inject_notice(sup.workers[1], "spot_interruption", lead_s=120.0)
                noticed = True
            time.sleep(0.1)
    finally:
        sup.release()
    events = [h.event for h in seen]
    assert "trainmover.node.notice" in events and "trainmover.node.moved" in events, events
    report = sup.report()
    assert report.exit_code == 0 and len(report.interruptions) == 1
    assert report.interruptions[0].cause.startswith("planned_move:spot_interruption")


def test_release_terminates_everything_even_when_the_job_is_still_running(tmp_path: Path) -> None:
    run = TrainingRun(job_id="sup-release", workers=2, steps=100000, script=str(SCRIPT))
    cloud = LocalProvider(slots=8)
    sup = Supervisor(run, cloud, tmp_path)
    sup.provision()
    sup.start(SCRIPT)
    deadline = time.monotonic() + 60.0
    while not any(isinstance(e, GenerationStarted) for e in sup.events):
        assert time.monotonic() < deadline
        sup.tick()
        time.sleep(0.1)
    released = sup.release()
    assert len(released) == run.workers + run.standby.min_warm
    assert sup.job is not None and sup.job.poll() is not None
    assert not [i for i in cloud.describe(job_id=run.job_id) if i.state != "terminated"]
