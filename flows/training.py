"""`resilient_training`: the Prefect flow that runs a training job with standbys, from provisioning to release.

The flow body is a short sequence of tasks, one per phase, so the run's graph shows where a job is: check,
provision, start, supervise (until the job ends), report, release. Bad parameters are refused before the first:
limits and choices by the parameter schema (the UI form and the API refuse them before a flow run exists), what
needs code (the faults plan, cross-field checks) by Prefect's validation of `TrainingRun` as the run starts, and
what needs the worker's disk or the drill's envelope by the `check` task.
What happens in between (policy decisions, promotions, replacement orders, notices) is `flows.supervisor`; the
flow announces each happening as a Prefect event named `trainmover.<resource>.<action>` (automations can hang on
them) and a line in the run's log, keeps a progress artifact, and ends with a table artifact of every
interruption and a markdown cost report. Every instance the flow launched is released in `finally`, also when
the run fails or is cancelled, and the run's temporary directory is removed.

A run that does not finish still reports: after the release, the cost report of what ran until then, and a
`trainmover.job.failed`, `.cancelled` or `.crashed` event with the reason (`flows.endings`); a flow-run process
killed outright is reported by the crash and cancellation hooks, from the job's holdings record. A job has one owner:
a second run of a running job id is refused before it launches anything (`flows.ownership`).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import asdict, replace
from datetime import UTC
from pathlib import Path
from typing import Annotated, Any
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
from pydantic import Field

from cloud.base import Provider
from flows import jobrecord
from flows.credentials import BLOCK_NAME_PATTERN, load_credentials, provider_options
from flows.drill import DegradingFeed, FailureDrill, drill_refusal
from flows.endings import Ending, ending_of, record_what_was_left, server_state
from flows.holdings import workdir_prefix
from flows.hosts import job_hosts, notice_wiring
from flows.jobrecord import JobRecord
from flows.models import TrainingRun
from flows.ownership import owning
from flows.supervisor import EVENT_PREFIX, CapReached, Happening, RunReport, Supervisor
from flows.timeline import interruptions_of, markdown_image, plot_timeline
from policy.online import OnlineScorer
from runtime.wire.event_records import JobFailed

TICK_S = 0.2
MAX_WALL_S = 365 * 86400.0


@task(name="check", cache_policy=NO_CACHE)
def check_run(
    run: TrainingRun, drill: bool = False, time_scale: float = 1.0, policy_every_s: float = 60.0, root: str = "."
) -> str:
    """Refuse, before anything is launched, what only the worker can check: the script on its disk, and a drill
    whose settings would let it do nothing. Returns the script's path."""
    if drill and (why := drill_refusal(run, time_scale, policy_every_s)) is not None:
        raise ValueError(f"drill refused: {why}")
    return str(run.check_script(root))


def make_provider(run: TrainingRun, options: dict[str, Any] | None = None) -> Provider:
    """The run's provider, with what its launches need (image, subnet, security groups, instance profile); with
    `options` (`provider_options` of a credentials block) its SDK uses those credentials, else its standard chain."""
    from cloud.registry import make_provider as registry

    if run.provider == "local":
        return registry("local")
    options = options or {}
    if run.provider == "aws":
        return registry("aws", region=run.region, image=run.image, subnet=run.subnet,
                        security_groups=run.security_groups, instance_profile=run.instance_profile, **options)
    return registry(
        "azure",
        subscription_id=run.azure_subscription_id,
        resource_group=run.azure_resource_group,
        location=run.region,
        image=run.image,
        subnet_id=run.subnet,
        key_vault_resource_id=run.key_vault_resource_id,
        **options,
    )


def load_scorer(run: TrainingRun) -> OnlineScorer | None:
    """The policy's scorer with the run's trained FailurePredictor (skops, trusted types only); None: the rule."""
    if run.policy_model is None:
        return None
    from flows.model_store import fetch_model, is_model_key
    from policy.predictor import load_policy_model

    path = fetch_model(run.policy_model, run.model_storage_block) if is_model_key(run.policy_model) \
        else run.policy_model  # a stored model: fetched and checked against its key's digest first
    model = load_policy_model(path)  # checks that it records its horizon
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


def cost_markdown(report: RunReport, run: TrainingRun, time_scale: float = 1.0, ending: Ending | None = None,
                  nodes: int | None = None) -> str:
    n = len(report.interruptions)
    saved = report.restart_cost_usd - report.downtime_cost_usd
    scaled = time_scale != 1.0
    clock = " (scaled clock)" if scaled else ""
    lines = [f"# Cost report: {report.job_id}", ""]
    if ending is not None:
        lines += [
            f"**The run {ending.verb}** after {report.steps} committed step(s): {ending.reason}",
            "",
            "The figures cover what ran until then.",
            "",
        ]
    lines += [
        f"{run.workers} workers on {run.provider} ({run.instance_type}), priced as "
        f"{run.job_nodes or nodes or run.workers} nodes at {run.node_price_usd_per_h:.2f} USD/h.",
        "",
        "| | TrainMover | checkpoint-restart |",
        "| --- | ---: | ---: |",
        f"| interruptions | {n} | {n} |",
        f"| downtime | {report.downtime_s:.2f} s | {report.restart_downtime_s:.0f} s |",
        f"| downtime cost | {report.downtime_cost_usd:.2f} USD | {report.restart_cost_usd:.2f} USD |",
        f"| ETTR{clock} | {report.ettr:.5f} | {report.restart_ettr:.5f} |",
        f"| standby hours (warm / stopped){clock} | {report.standby_hours['warm']:.2f} / "
        f"{report.standby_hours['stopped']:.2f} | 0 |",
        f"| standby cost{clock} | {report.standby_cost_usd:.2f} USD | 0 |",
        "",
        f"Downtime avoided: {report.restart_downtime_s - report.downtime_s:.0f} s, worth {saved:.2f} USD, "
        f"for {report.standby_cost_usd:.2f} USD of standbys.",
    ]
    if scaled:
        lines += [
            "",
            f"**Scaled clock**: this run's telemetry clock ran {time_scale:g} times wall time (one wall second stood "
            f"for {time_scale / 3600.0:g} h), as in the demo. Standby hours, their cost and ETTR are on that clock; "
            "downtimes are the wall seconds measured, priced at the job's hourly price. Not a bill.",
        ]
    return "\n".join(lines)


@task(name="provision", cache_policy=NO_CACHE)
def provision(sup: Supervisor, script: Path) -> None:
    """Launch the workers' instances and the standbys the limits hold from the start (on instances: each boots
    the job's agent, and the job's secret is stored for them first). Workers a cap refuses fail the run here,
    before anything is launched, after announcing it (`trainmover.job.cap_reached`)."""
    try:
        happenings = sup.provision(script)
    except CapReached as exc:
        announce(exc.happening, sup.run.job_id)
        raise
    for h in happenings:
        announce(h, sup.run.job_id)


@task(name="start", cache_policy=NO_CACHE)
def start(sup: Supervisor, script: Path) -> None:
    """Start the runtime's launcher (and its coordinator) for the job."""
    sup.start(script)
    get_run_logger().info("job %s started: %d workers, events in %s", sup.run.job_id, sup.run.workers, sup.events_path)


@task(name="reattach", cache_policy=NO_CACHE)
def reattach(sup: Supervisor, record: JobRecord) -> None:
    """Take over a job whose supervising run died: its launcher, store, events and instances (flows.jobrecord)."""
    for h in sup.attach(record):
        announce(h, sup.run.job_id)


@task(name="supervise", cache_policy=NO_CACHE)
def supervise(
    sup: Supervisor, chaos: FailureDrill | None, progress: UUID, max_wall_s: float, credentials_block: str | None = None
) -> RunReport:
    """Steer the job until it ends: policy decisions, promotions, notices, replacements; the drill's kills. Its
    record (flows.jobrecord) is refreshed every HEARTBEAT_S, so that a job nobody supervises any more is found."""
    run = sup.run
    deadline = time.monotonic() + max_wall_s
    shown = -1.0
    beat_due = 0.0
    while not sup.done():
        if time.monotonic() >= beat_due and (record := sup.job_record(credentials_block)) is not None:
            jobrecord.publish(record)
            beat_due = time.monotonic() + jobrecord.HEARTBEAT_S
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
    update_progress_artifact(progress, 100.0 if sup.job and sup.job.returncode == 0 else max(shown, 0.0) * 100)
    return sup.report()


@task(name="report", cache_policy=NO_CACHE)
def publish_report(report: RunReport, run: TrainingRun, time_scale: float, sup: Supervisor | None = None) -> None:
    """The interruptions table, the cost report and the run's plot, as artifacts of the run."""
    publish_artifacts(report, run, time_scale, nodes=sup.nodes if sup is not None else None)
    if sup is not None:
        publish_timeline(sup)


def publish_timeline(sup: Supervisor) -> None:
    """The run's plot: steps per second with each interruption marked, and the standbys by tier over time."""
    with tempfile.TemporaryDirectory(prefix="trainmover-timeline-") as scratch:
        png = Path(scratch) / "timeline.png"
        title = f"{sup.run.job_id}: throughput and interruptions"
        marks = interruptions_of(sup.events)
        if not plot_timeline(sup.timeline.samples, marks, png, title):
            return
        create_markdown_artifact(
            f"# {sup.run.job_id}: the run over time\n\n{markdown_image(png, 'throughput and standbys over time')}"
            f"\n\n{len(marks)} interruption(s), each a red line (rank and cause); below, the warm and parked "
            "standbys the policy held.",
            key=f"{sup.run.job_id}-timeline",
            description="Throughput with the interruptions marked; standbys by tier over time",
        )


def publish_artifacts(report: RunReport, run: TrainingRun, time_scale: float, ending: Ending | None = None,
                      nodes: int | None = None) -> None:
    create_table_artifact(
        interruption_rows(report) or [{"cause": "none", "lost_time_s": 0.0}],
        key=f"{run.job_id}-interruptions",
        description="Every interruption: what failed, which tier covered it, and what it cost in seconds",
    )
    create_markdown_artifact(
        cost_markdown(report, run, time_scale, ending, nodes),
        key=f"{run.job_id}-cost-report",
        description="Standby cost against downtime avoided"
        + (" (scaled clock)" if time_scale != 1.0 else "")
        + (f"; the run {ending.verb} midway" if ending is not None else ""),
    )


def conclude(sup: Supervisor, run: TrainingRun, ending: Ending, time_scale: float, published: bool) -> None:
    """A run that did not finish, after its release: the cost report of what ran until then (unless the job's own
    report is out already) and the job's ending event. Called directly, not as tasks: while a cancellation is under
    way no task may start. Never raises: the run's own error is what its state must show."""
    logger = get_run_logger()
    try:
        report = replace(sup.report(), message=ending.reason)
        if not published:
            publish_artifacts(report, run, time_scale, ending, sup.nodes)
            publish_timeline(sup)
        # The job's own failure was announced as it happened (the coordinator's job_failed), with its reason.
        if not (ending.kind == "failed" and any(isinstance(e, JobFailed) for e in sup.events)):
            announce(
                Happening(
                    ending.event,
                    f"{EVENT_PREFIX}.job.{run.job_id}",
                    f"training {ending.kind}: {ending.reason}",
                    {"reason": ending.reason, "steps": report.steps, "interruptions": len(report.interruptions)},
                ),
                run.job_id,
            )
    except Exception:
        logger.warning("could not report what job %s did before the run %s", run.job_id, ending.verb, exc_info=True)


@task(name="release", cache_policy=NO_CACHE)
def release(sup: Supervisor) -> list[str]:
    """Stop the job if it still runs and terminate every instance it launched."""
    released = sup.release()
    get_run_logger().info("released %d instance(s) of job %s", len(released), sup.run.job_id)
    return released


def job_log_tail(workdir: Path, lines: int = 20) -> str:
    """The last lines the job's launcher wrote, kept in the run's log before its directory goes."""
    try:
        return "\n".join((workdir / "job.log").read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def flow_run_name() -> str:
    """`<job_id>-<UTC start>`: the runs of a job sort together in the UI, each told apart by when it started."""
    from prefect.runtime import flow_run

    run = flow_run.parameters.get("run")
    job_id = run.job_id if isinstance(run, TrainingRun) else "trainmover"
    return f"{job_id}-{flow_run.scheduled_start_time.astimezone(UTC):%Y%m%d-%H%M%S}"


def release_everything(sup: Supervisor) -> None:
    """The release task, or, when it cannot run or fails (a cancellation under way), the supervisor's release
    directly: the fleet must go either way."""
    try:
        release(sup)
    except BaseException:
        get_run_logger().warning("the release task did not finish; releasing job %s directly", sup.run.job_id)
        sup.release()
        raise


def current_flow_run_id() -> UUID:
    from prefect.runtime import flow_run

    return UUID(flow_run.id)


@flow(
    name="resilient-training",
    flow_run_name=flow_run_name,
    log_prints=False,
    on_crashed=[record_what_was_left],
    on_cancellation=[record_what_was_left],
)
def resilient_training(
    run: TrainingRun = TrainingRun(),  # noqa: B008 - a pydantic default is how Prefect renders the form
    drill: bool = False,
    time_scale: Annotated[float, Field(gt=0, le=86_400)] = 1.0,
    policy_every_s: Annotated[float, Field(ge=TICK_S, le=86_400)] = 60.0,
    max_wall_s: Annotated[float, Field(gt=0, le=MAX_WALL_S)] = 30 * 86400.0,
    credentials_block: Annotated[str | None, Field(pattern=BLOCK_NAME_PATTERN, max_length=128)] = None,
) -> dict[str, Any]:
    """Run `run.script` with standbys on `run.provider`, steer them by the failure policy, report what it cost.

    Args:
        run: The job: where it runs, what it trains, its standby limits and prices, failures to inject. One
            run at a time per run.job_id: a second run of a job that is running is refused before it launches.
        drill: The demo's failure drill, on this machine only: one node's telemetry degrades, the policy
            pre-warms a standby, the drill SIGKILLs that worker, then another one unannounced. Needs
            run.provider 'local', 2 or more workers, run.standby.min_warm 0 and max_warm 1 or more, and a clock
            fast enough for its stages (the demo's time_scale 3600 and policy_every_s 0.5); other settings are
            refused before anything launches, with what to change.
        time_scale: Telemetry seconds per wall second, 0 to 86400, for the drill: the policy's clock, and the
            standby hours and ETTR of the cost report, run this much faster (the demo: 3600, a wall second stands
            for an hour). A run that is not a drill runs and is billed on the wall clock (1), whatever this says.
        policy_every_s: Wall seconds between standby-policy decisions, 0.2 to 86400.
        max_wall_s: Wall-clock limit of the run in seconds, up to 365 days; past it the job is stopped, the run
            fails and every instance is released.
        credentials_block: Name of a Prefect Secret block holding the cloud credentials as a JSON object (AWS:
            aws_access_key_id, aws_secret_access_key; Azure: tenant_id, client_id, client_secret), or of an
            existing prefect-aws AwsCredentials / prefect-azure AzureContainerInstanceCredentials or
            AzureBlobStorageCredentials block, read when the run starts and given to the cloud SDK only. Empty:
            the SDK's standard chain (the worker host's instance profile or managed identity, ~/.aws, az login).
            See docs/flows.md.
    """
    logger = get_run_logger()
    script = Path(check_run(run, drill, time_scale, policy_every_s))
    if not drill and time_scale != 1.0:  # e.g. drill turned off on the drill's deployment, which sets 3600
        logger.warning("time_scale=%g is the drill's clock; this run is not a drill, so its policy and its cost "
                       "report run on the wall clock", time_scale)
        time_scale = 1.0  # else a few minutes of one standby would be billed as hundreds of hours
    scorer = load_scorer(run)  # a model file that this version cannot use is refused before anything launches
    # In the flow body, not a task: the values are no task's input; a missing block is refused before any launch.
    credentials = load_credentials(credentials_block, run.provider) if credentials_block else None
    options = provider_options(credentials, run.region) if credentials is not None else {}
    del credentials
    flow_run_id = current_flow_run_id()
    with owning(run.job_id, flow_run_id) as lease:  # a second run of a live job is refused here, before any launch
        provider = make_provider(run, options)  # a provider the cloud refuses is refused before anything is made
        notices = notice_wiring(run, provider, options)  # AWS: the job's EventBridge rules and SQS queue
        progress = create_progress_artifact(0.0, key=f"{run.job_id}-progress", description="Training steps committed")
        assert isinstance(progress, UUID)  # a sync flow gets the id, not a coroutine
        workdir = Path(tempfile.mkdtemp(prefix=workdir_prefix(run.job_id)))
        try:  # on instances: where the job's secret goes, where the coordinator listens, what each instance boots
            hosts = job_hosts(run, provider, workdir, options)
        except BaseException:
            notices.close()
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        del options
        sup = Supervisor(
            run,
            provider,
            workdir,
            feed=DegradingFeed() if drill else None,
            scorer=scorer,
            policy_every_s=policy_every_s,
            time_scale=time_scale,
            owner=str(flow_run_id),
            hosts=hosts,
            owner_lease=str(lease),
        )
        chaos = FailureDrill() if drill else None
        ending: Ending | None = None
        published = False
        previous = jobrecord.read(run.job_id)
        try:
            if previous is not None and previous.flow_run_id != str(flow_run_id) and previous.launcher_alive():
                reattach(sup, previous)  # the job outlived the run that started it: supervise it, start nothing
            else:
                if previous is not None:  # its launcher is gone: whatever it left is released before a new fleet
                    logger.warning("job %s was left by flow run %s; releasing %s before starting it again", run.job_id,
                                   previous.flow_run_id, provider.release_job(run.job_id) or "nothing")
                provision(sup, script)
                start(sup, script)
            report = supervise(sup, chaos, progress, max_wall_s, credentials_block)
            publish_report(report, run, time_scale, sup)
            published = True
            if report.exit_code != 0:
                raise RuntimeError(f"training failed: {report.message}")
            summary = asdict(report)
            summary["drill"] = chaos.log if chaos else []
            return summary
        except BaseException as exc:
            # Only the server tells Prefect's cancelling SIGTERM from another one.
            ending = ending_of(exc, None if isinstance(exc, Exception) else server_state())
            if tail := job_log_tail(workdir):
                logger.warning("the job's last log lines:\n%s", tail)
            raise
        finally:
            try:
                release_everything(sup)
                notices.close()
                jobrecord.forget(run.job_id)  # released: nothing of the job is left to find
            finally:
                if ending is not None:  # after the release: the fleet goes before anything is reported
                    conclude(sup, run, ending, time_scale, published)
                shutil.rmtree(workdir, ignore_errors=True)
                if sup.workdir != workdir:  # a re-attached job's directory, left by the run that died
                    shutil.rmtree(sup.workdir, ignore_errors=True)
