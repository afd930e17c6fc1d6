"""`resilient_training`: the Prefect flow that runs a training job with standbys, from provisioning to release.

The flow body is a short sequence: validate, provision, start, supervise until the job ends, report, release.
What happens in between (policy decisions, promotions, replacement orders, notices) is `flows.supervisor`; the
flow announces each happening as a Prefect event named `trainmover.<resource>.<action>` (automations can hang on
them) and a line in the run's log, keeps a progress artifact, and ends with a table artifact of every
interruption and a markdown cost report. Every instance the flow launched is released in `finally`, also when
the run fails or is cancelled.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any
from uuid import UUID

from prefect import flow, get_run_logger, task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE
from prefect.events import emit_event

from cloud.base import Provider
from flows.drill import DegradingFeed, FailureDrill
from flows.models import TrainingRun
from flows.supervisor import Happening, RunReport, Supervisor
from policy.online import OnlineScorer

TICK_S = 0.2


@task(cache_policy=NO_CACHE)
def validate_run(run: TrainingRun, root: str = ".") -> str:
    """Refuse a run whose script does not exist, before anything is launched."""
    return str(run.check_script(root))


def make_provider(run: TrainingRun) -> Provider:
    from cloud.registry import make_provider as registry

    if run.provider == "local":
        return registry("local")
    if run.provider == "aws":
        return registry("aws", region=run.region)
    return registry(
        "azure",
        subscription_id=run.azure_subscription_id,
        resource_group=run.azure_resource_group,
        location=run.region,
    )


def load_scorer(run: TrainingRun) -> OnlineScorer | None:
    """The policy's scorer with the run's trained FailurePredictor (skops, trusted types only); None: the rule."""
    if run.policy_model is None:
        return None
    from policy.predictor import load_policy_model

    model = load_policy_model(run.policy_model)  # checks that it records its horizon
    assert model.horizon_h is not None
    # The node ids are set at provisioning; the scorer is re-keyed then (Supervisor.provision).
    return OnlineScorer(["pending"], model=model, horizon_h=model.horizon_h)


def announce(h: Happening, job_id: str) -> None:
    get_run_logger().info(h.message)
    emit_event(
        event=h.event,
        resource={"prefect.resource.id": h.resource, "trainmover.job": job_id},
        payload=h.payload,
    )


def interruption_rows(report: RunReport) -> list[dict[str, Any]]:
    return [
        {
            "cause": i.cause,
            "rank": i.rank,
            "from": i.old_process,
            "to": i.new_process,
            "step": i.step,
            "predicted": "yes" if i.predicted else "no",
            "tier": i.tier,
            "detect_s": round(i.detect_s, 3),
            "reconfigure_s": round(i.reconfigure_s, 3),
            "handoff_s": round(i.handoff_s, 3),
            "replay_s": round(i.replay_s, 3),
            "lost_time_s": round(i.lost_time_s, 3),
        }
        for i in report.interruptions
    ]


def cost_markdown(report: RunReport, run: TrainingRun) -> str:
    n = len(report.interruptions)
    saved = report.restart_cost_usd - report.downtime_cost_usd
    lines = [
        f"# Cost report: {report.job_id}",
        "",
        f"{run.workers} workers on {run.provider} ({run.instance_type}), priced as "
        f"{run.job_nodes or run.workers} nodes at {run.node_price_usd_per_h:.2f} USD/h.",
        "",
        "| | TrainMover | checkpoint-restart |",
        "| --- | ---: | ---: |",
        f"| interruptions | {n} | {n} |",
        f"| downtime | {report.downtime_s:.2f} s | {report.restart_downtime_s:.0f} s |",
        f"| downtime cost | {report.downtime_cost_usd:.2f} USD | {report.restart_cost_usd:.2f} USD |",
        f"| ETTR | {report.ettr:.5f} | {report.restart_ettr:.5f} |",
        f"| standby hours (warm / stopped) | {report.standby_hours['warm']:.2f} / "
        f"{report.standby_hours['stopped']:.2f} | 0 |",
        f"| standby cost | {report.standby_cost_usd:.2f} USD | 0 |",
        "",
        f"Downtime avoided: {report.restart_downtime_s - report.downtime_s:.0f} s, worth {saved:.2f} USD, "
        f"for {report.standby_cost_usd:.2f} USD of standbys.",
    ]
    return "\n".join(lines)


@flow(name="resilient-training", log_prints=False)
def resilient_training(
    run: TrainingRun = TrainingRun(),  # noqa: B008 - a pydantic default is how Prefect renders the form
    drill: bool = False,
    time_scale: float = 1.0,
    policy_every_s: float = 60.0,
    max_wall_s: float = 30 * 86400.0,
) -> dict[str, Any]:
    """Run `run.script` with standbys on `run.provider`, steer them by the failure policy, report what it cost.

    `drill=True` adds the demo's scripted telemetry (one node degrades) and kills (a predicted failure, then an
    unpredicted one); `time_scale` maps wall seconds to telemetry time (the demo runs a day in a minute).
    """
    logger = get_run_logger()
    script = Path(validate_run(run))
    scorer = load_scorer(run)  # a model file that this version cannot use is refused before anything launches
    provider = make_provider(run)
    workdir = Path(tempfile.mkdtemp(prefix=f"trainmover-{run.job_id}-"))
    sup = Supervisor(
        run,
        provider,
        workdir,
        feed=DegradingFeed() if drill else None,
        scorer=scorer,
        policy_every_s=policy_every_s,
        time_scale=time_scale,
    )
    chaos = FailureDrill() if drill else None
    progress = create_progress_artifact(0.0, key=f"{run.job_id}-progress", description="Training steps committed")
    assert isinstance(progress, UUID)  # a sync flow gets the id, not a coroutine
    deadline = time.monotonic() + max_wall_s
    try:
        for h in sup.provision():
            announce(h, run.job_id)
        sup.start(script)
        logger.info("job %s started: %d workers, events in %s", run.job_id, run.workers, sup.events_path)
        shown = -1.0
        while not sup.done():
            seen = len(sup.events)
            happenings = sup.tick()
            if chaos is not None:
                happenings += chaos.observe(happenings, sup.events[seen:])
            for h in happenings:
                announce(h, run.job_id)
            step = sup.committed_step()
            if run.steps and step is not None and step / run.steps - shown >= 0.05:
                shown = step / run.steps
                update_progress_artifact(progress, min(100.0, 100.0 * shown))
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {run.job_id} ran past max_wall_s={max_wall_s:.0f} s")
            time.sleep(TICK_S)
        update_progress_artifact(progress, 100.0 if sup.proc and sup.proc.returncode == 0 else shown * 100)
        report = sup.report()
        rows = interruption_rows(report)
        create_table_artifact(
            rows or [{"cause": "none", "lost_time_s": 0.0}],
            key=f"{run.job_id}-interruptions",
            description="Every interruption: what failed, which tier covered it, and what it cost in seconds",
        )
        create_markdown_artifact(
            cost_markdown(report, run),
            key=f"{run.job_id}-cost-report",
            description="Standby cost against downtime avoided",
        )
        if report.exit_code != 0:
            raise RuntimeError(f"training failed: {report.message}")
        summary = asdict(report)
        summary["drill"] = chaos.log if chaos else []
        return summary
    finally:
        released = sup.release()
        logger.info("released %d instance(s) of job %s", len(released), run.job_id)
