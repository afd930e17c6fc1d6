"""The deployments end to end, as a user runs them: a Prefect server, the local work pool, a worker, `prefect deploy`
from prefect.yaml, a run triggered with parameters, then what the user reads back (state, artifacts, events, the UI).

The run is a small local job on three "instances", each a host of its own (a network namespace running `trainmover
agent`; the coordinator runs in the flow), and rank 1's host dies whole at step 40 (no drill): the flow must
complete bit for bit, with one interruption covered by the warm standby's host and the lost instance replaced.
Then the production cases: a second run of a running job is refused; the flow-run process is SIGKILLed and the job
trains on; a new run of the job takes it over (re-attaches), and cancelling that run stops the job and reports; a
malformed faults plan is refused before a run exists; prefect.yaml's example automation, resumed, orders a re-tune
when five standbys are promoted; the UI renders the run, its interruption table, its training plot and the run form.
The fast tests need no server: prefect.yaml's parameters (also those of its commented cloud variants) are valid,
and bad parameters are refused before anything launches.
"""

from __future__ import annotations

import contextlib
import html
import json
import os
import re
import signal
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from prefect import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, FlowRunFilter, FlowRunFilterId
from prefect.client.schemas.objects import FlowRun
from prefect.events.filters import EventFilter, EventNameFilter, EventRelatedFilter
from prefect.exceptions import ParameterTypeError
from prefect.flows import Flow, load_flow_from_entrypoint

from flows import jobrecord
from flows.models import TrainingRun
from tests.flows.prefect_server import POOL, ROOT, PrefectStack, chromium, chromium_or_fail, poll
from tests.runtime.conftest import clean_digest

JOB = "e2e"
LOCAL_DEPLOYMENT = "local-drill"
E2E_PARAMS: dict[str, Any] = {
    "run": {
        "job_id": JOB,
        "workers": 2,
        "standby": {"min_warm": 1, "max_warm": 1, "max_stopped": 0},
        "steps": 150,
        "faults": "host:rank=1,step=40",
        "script": "examples/train_mlp.py",
        "hosts": "namespaces",
    },
    "drill": False,
    "time_scale": 1.0,
    "policy_every_s": 60.0,
    "max_wall_s": 150.0,
}
RUN_TIMEOUT_S = 240.0
FLOWS = {
    "flows/training.py:resilient_training",
    "flows/policy_flows.py:train_failure_model",
    "flows/policy_flows.py:tune_standby_policy",
    "flows/sweep.py:sweep_unsupervised_jobs",
}


def prefect_yaml() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "prefect.yaml").read_text())


def commented_block(name: str) -> Any:
    """The YAML between `# --- NAME ---` and `# --- end NAME ---` in prefect.yaml, as it reads uncommented."""
    text = (ROOT / "prefect.yaml").read_text()
    block = re.search(rf"^# --- {name} ---\n(.*?)^# --- end {name} ---", text, re.M | re.S)
    assert block, f"prefect.yaml has no commented {name} block"
    lines = [line.removeprefix("# ").removeprefix("#") for line in block.group(1).splitlines()]
    return yaml.safe_load("\n".join(lines))


def commented_variant(name: str) -> dict[str, Any]:
    """The commented deployment `name` of prefect.yaml, as it reads uncommented."""
    (deployment,) = commented_block(name)
    return dict(deployment)


# -- fast: no server ------------------------------------------------------------------------------------


def test_prefect_yaml_deploys_the_four_flows_on_the_local_pool_with_valid_defaults() -> None:
    deployments = prefect_yaml()["deployments"]
    assert {d["entrypoint"] for d in deployments} == FLOWS
    for d in deployments:
        assert d["work_pool"]["name"] == POOL
        flow: Flow[..., Any] = load_flow_from_entrypoint(str(ROOT / d["entrypoint"]))
        flow.validate_parameters(d.get("parameters", {}))
        if "run" in d["parameters"]:
            assert TrainingRun.model_validate(d["parameters"]["run"]).check_script(ROOT).is_file()


@pytest.mark.parametrize(("variant", "provider"), [("aws", "aws"), ("azure", "azure")])
def test_the_commented_cloud_variants_are_valid_deployments_once_uncommented(variant: str, provider: str) -> None:
    d = commented_variant(variant)
    assert d["entrypoint"] == "flows/training.py:resilient_training"
    assert d["work_pool"]["name"] == f"trainmover-{variant}"
    assert d["parameters"]["credentials_block"] == f"trainmover-{variant}"  # a block's name; the flow reads it
    run = TrainingRun.model_validate(d["parameters"]["run"])
    assert (run.provider, bool(run.region)) == (provider, True)
    load_flow_from_entrypoint(str(ROOT / d["entrypoint"])).validate_parameters(d["parameters"])


@pytest.mark.parametrize(
    ("run", "needle"),
    [
        ({"workers": -1}, "run.workers: Input should be greater than or equal to 1"),
        ({"provider": "gcp"}, "run.provider: Input should be 'local', 'aws' or 'azure'"),
    ],
)
def test_bad_parameters_are_refused_before_the_flow_starts(run: dict[str, Any], needle: str) -> None:
    flow: Flow[..., Any] = load_flow_from_entrypoint(str(ROOT / "flows/training.py:resilient_training"))
    with pytest.raises(ParameterTypeError) as info:
        flow.validate_parameters({"run": run})
    assert needle in str(info.value)


# -- slow: a real server, worker and deployment --------------------------------------------------------


@pytest.fixture(scope="module")
def stack(prefect_stack: PrefectStack) -> PrefectStack:
    """The session's server, pool and worker (tests/flows/conftest.py), with prefect.yaml's deployments."""
    t0 = time.monotonic()
    prefect_stack.cli("deploy", "--all")
    prefect_stack.timings["deploy_s"] = time.monotonic() - t0
    return prefect_stack


def trigger(stack: PrefectStack, params: dict[str, Any], check: bool = True) -> tuple[str | None, str]:
    done = stack.cli(
        "deployment", "run", f"resilient-training/{LOCAL_DEPLOYMENT}", "--params", json.dumps(params), check=check
    )
    found = re.search(r"UUID:\s*([0-9a-f-]{36})", done.stdout)
    return (found.group(1) if found else None), done.stdout + done.stderr


def flow_run_logs(flow_run_id: str) -> str:
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with get_client(sync_client=True) as client:
        of_run = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[uuid.UUID(flow_run_id)]))
        logs = client.read_logs(log_filter=of_run, limit=200)
    return "\n".join(log.message for log in logs)[-6000:]


@pytest.fixture(scope="module")
def e2e_run(stack: PrefectStack) -> Iterator[FlowRun]:
    """The e2e deployment run, waited for until it reaches a final state (bounded)."""
    t0 = time.monotonic()
    flow_run_id, out = trigger(stack, E2E_PARAMS)
    assert flow_run_id, f"no flow run id in the output of `prefect deployment run`:\n{out}"
    with stack.settings(), get_client(sync_client=True) as client:

        def final() -> FlowRun | None:
            fr = client.read_flow_run(uuid.UUID(flow_run_id))
            return fr if fr.state is not None and fr.state.is_final() else None

        try:
            fr = poll(f"flow run {flow_run_id} to finish", final, RUN_TIMEOUT_S, every_s=1.0)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\n{stack.diagnostics()}") from exc
    stack.timings["flow_run_s"] = time.monotonic() - t0
    yield fr


@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.parametrize(
    ("run", "needle"),
    [
        ({**E2E_PARAMS["run"], "workers": -1}, "Validation failed for field 'run.workers'"),
        ({**E2E_PARAMS["run"], "provider": "gcp"}, "Validation failed for field 'run.provider'"),
        ({**E2E_PARAMS["run"], "faults": "explode:rank=1"}, "Validation failed for field 'run.faults'"),
    ],
)
def test_a_deployment_run_with_bad_parameters_is_refused_and_nothing_runs(
    stack: PrefectStack, run: dict[str, Any], needle: str
) -> None:
    before = len(stack.api("POST", "/flow_runs/filter", {}))
    flow_run_id, out = trigger(stack, {**E2E_PARAMS, "run": run}, check=False)
    assert flow_run_id is None and needle in out, out
    assert len(stack.api("POST", "/flow_runs/filter", {})) == before


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_a_deployment_run_that_loses_a_host_completes_bit_exact_and_reports_the_interruption(
    stack: PrefectStack, e2e_run: FlowRun
) -> None:
    with stack.settings():
        assert e2e_run.state is not None and e2e_run.state.is_completed(), (
            f"flow run {e2e_run.name} ended {e2e_run.state}:\n{flow_run_logs(str(e2e_run.id))}\n{stack.diagnostics()}"
        )
        with get_client(sync_client=True) as client:
            of_run = FlowRunFilter(id=FlowRunFilterId(any_=[e2e_run.id]))
            artifacts = {
                a.key: a
                for a in client.read_artifacts(
                    artifact_filter=ArtifactFilter(
                        key=ArtifactFilterKey(any_=[f"{JOB}-interruptions", f"{JOB}-cost-report", f"{JOB}-progress",
                                                    f"{JOB}-timeline"])
                    ),
                    flow_run_filter=of_run,
                )
            }
            assert set(artifacts) == {f"{JOB}-interruptions", f"{JOB}-cost-report", f"{JOB}-progress",
                                      f"{JOB}-timeline"}
            plot = str(artifacts[f"{JOB}-timeline"].data)
            assert "data:image/png;base64," in plot and "1 interruption(s)" in plot, plot[:300]

            table = artifacts[f"{JOB}-interruptions"]
            rows = json.loads(table.data) if isinstance(table.data, str) else table.data
            assert table.type == "table" and isinstance(rows, list) and len(rows) == 1, rows
            (row,) = rows
            assert "lost" in row["cause"] and row["rank"] == 1 and row["step"] == 40 and row["tier"] == "warm", row
            assert 0 < row["lost_time_s"] < 30, row

            report = artifacts[f"{JOB}-cost-report"]
            assert report.type == "markdown"
            assert f"# Cost report: {JOB}" in str(report.data) and "| interruptions | 1 | 1 |" in str(report.data)

            wanted = {"trainmover.node.lost", "trainmover.node.failed", "trainmover.standby.promoted",
                      "trainmover.standby.ordered", "trainmover.job.finished"}
            related = f"prefect.flow-run.{e2e_run.id}"

            def events() -> list[Any] | None:
                only_this_run = EventFilter(
                    event=EventNameFilter(prefix=["trainmover."]), related=EventRelatedFilter(id=[related])
                )
                mine = client.read_events(filter=only_this_run, limit=50).events
                return mine if wanted <= {e.event for e in mine} else None

            try:
                mine = poll("the flow run's trainmover.* events", events, 30.0, every_s=0.5)
            except TimeoutError as exc:
                raise AssertionError(f"{exc}\n{flow_run_logs(str(e2e_run.id))}") from exc
    failed = next(e for e in mine if e.event == "trainmover.node.failed")
    promoted = next(e for e in mine if e.event == "trainmover.standby.promoted")
    lost = next(e for e in mine if e.event == "trainmover.node.lost")
    assert "lost" in failed.payload["cause"] and failed.resource["trainmover.job"] == JOB
    assert lost.payload["node"] == failed.payload["node"], (lost.payload, failed.payload)
    assert promoted.payload["rank"] == 1 and promoted.payload["step"] == 40
    finished = next(e for e in mine if e.event == "trainmover.job.finished")
    script = ROOT / str(E2E_PARAMS["run"]["script"])
    assert finished.payload["final_digest"] == clean_digest(2, int(E2E_PARAMS["run"]["steps"]), script), \
        "the run that lost a host must end bit for bit where the uninterrupted run ends"


def page_text(dom: str) -> str:
    """The visible text of a rendered page: no scripts, styles or tags; whitespace collapsed."""
    body = re.sub(r"<(script|style)\b.*?</\1>", " ", dom, flags=re.S | re.I)
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", body)).split())


def rendered(url: str, out_dir: Path, *needles: str, loads: int = 3) -> str:
    """The page's visible text once it shows every needle, loading it at most `loads` times. Chromium dumps the
    single-page UI when its virtual-time budget runs out, which on a loaded machine can come before the UI's
    fetches return (seen once beside two job tests: the dump held only the title, "Prefect Server")."""
    text = ""
    for _ in range(loads):
        text = page_text(chromium(url, out_dir))
        if all(n in text for n in needles):
            break
    return text


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_the_ui_shows_the_flow_run_and_its_interruption_table(
    stack: PrefectStack, e2e_run: FlowRun, tmp_path: Path
) -> None:
    chromium_or_fail()
    t0 = time.monotonic()
    run_page = f"{stack.url}/runs/flow-run/{e2e_run.id}"
    text = rendered(run_page, tmp_path, e2e_run.name, "Completed", "took rank 1")
    assert e2e_run.name in text and "Completed" in text, text[:3000]
    assert "lost (its agent" in text and "took rank 1" in text, text[:3000]  # the run's logs, the default tab

    # The V1 flow-run page resets ?tab= while the run loads; the V2 page opens its Artifacts tab (cards, no rows).
    cards = rendered(f"{stack.url}/v2/runs/flow-run/{e2e_run.id}?tab=Artifacts", tmp_path, f"{JOB}-interruptions",
                     f"{JOB}-cost-report")
    assert f"{JOB}-interruptions" in cards and f"{JOB}-cost-report" in cards, cards[:3000]

    # The artifact page renders the table itself.
    (artifact,) = stack.api("POST", "/artifacts/filter", {"artifacts": {"key": {"any_": [f"{JOB}-interruptions"]}}})
    artifact_page = f"{stack.url}/artifacts/artifact/{artifact['id']}"
    table = rendered(artifact_page, tmp_path, "lost_time_s", e2e_run.name)
    assert "lost_time_s" in table and "lost (its agent" in table and e2e_run.name in table, table[:3000]

    # The training plot's artifact renders the image; the deployment's run form shows the job's fields with help.
    (plot,) = stack.api("POST", "/artifacts/filter", {"artifacts": {"key": {"any_": [f"{JOB}-timeline"]}}})
    plot_page = f"{stack.url}/artifacts/artifact/{plot['id']}"
    assert "data:image/png;base64" in chromium(plot_page, tmp_path)
    (deployment,) = stack.api("POST", "/deployments/filter", {"deployments": {"name": {"any_": [LOCAL_DEPLOYMENT]}}})
    form_page = f"{stack.url}/deployments/deployment/{deployment['id']}/run"
    form = rendered(form_page, tmp_path, "Training ranks, one process each", "Failures to inject")
    assert "Training ranks, one process each" in form and "Failures to inject" in form, form[:3000]

    shots = {"e2e-flow-run.png": run_page, "e2e-interruptions.png": artifact_page, "e2e-timeline.png": plot_page,
             "e2e-run-form.png": form_page}
    keep = os.environ.get("TRAINMOVER_UI_SHOTS")  # a folder to keep them in (docs/figures holds the last ones)
    for name, url in shots.items():
        png = tmp_path / name
        chromium(url, tmp_path, screenshot=png)
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000, png
        if keep:
            Path(keep, name).write_bytes(png.read_bytes())
    stack.timings["browser_s"] = time.monotonic() - t0


def _job_processes(job_id: str) -> list[int]:
    """Pids whose command line names the job's work directory (the launcher: `--events /tmp/trainmover-<job>-...`)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if f"trainmover-{job_id}-".encode() in cmdline:
            pids.append(int(entry.name))
    return pids


def _flow_run_process(flow_run_id: str) -> int:
    """The pid of the flow run's own process: the topmost process whose environment names the flow run, other than
    the job's launcher (which inherits that environment in a session of its own, its parent gone once killed)."""
    marked = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if flow_run_id.encode() in (entry / "environ").read_bytes():
                    marked.add(int(entry.name))
            except OSError:
                continue
    tops = []
    for pid in marked:
        try:
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        try:
            launcher = b"trainmover.cli" in Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if ppid not in marked and not launcher:
            tops.append(pid)
    assert len(tops) == 1, f"flow run {flow_run_id}: processes {sorted(marked)}, topmost {tops}"
    return tops[0]


def _state(client: Any, flow_run_id: str) -> Any:
    return client.read_flow_run(uuid.UUID(flow_run_id)).state


def _final(client: Any, flow_run_id: str) -> FlowRun | None:
    fr = client.read_flow_run(uuid.UUID(flow_run_id))
    return fr if fr.state is not None and fr.state.is_final() else None


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_a_killed_flow_run_leaves_its_job_training_and_the_next_run_of_the_job_takes_it_over(
    stack: PrefectStack,
) -> None:
    """The issue's production case: a duplicate run of a running job is refused; the flow-run process is SIGKILLed
    (an OOM kill): the job trains on; a new run of the job re-attaches to it, and cancelling that run stops the job
    and reports."""
    job = "e2e-kill"
    params = {**E2E_PARAMS, "run": {**E2E_PARAMS["run"], "job_id": job, "steps": 1_000_000, "faults": None,
                                     "hosts": "orchestrator"}, "max_wall_s": 600.0}
    first, out = trigger(stack, params)
    assert first, out
    try:
        _kill_and_take_over(stack, params, job, first)
    finally:
        for pid in _job_processes(job):  # a failed check leaves no job training behind
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL) if os.getsid(pid) == pid else os.kill(pid, signal.SIGKILL)
        with stack.settings():
            jobrecord.forget(job)


def _kill_and_take_over(stack: PrefectStack, params: dict[str, Any], job: str, first: str) -> None:
    with stack.settings(), get_client(sync_client=True) as client:
        poll("the job to start", lambda: True if f"job {job} started" in flow_run_logs(first) else None,
             RUN_TIMEOUT_S, every_s=1.0)
        record = poll("the job's record", lambda: jobrecord.read(job), 30.0)
        assert record.flow_run_id == first and record.owner_lease

        # Pressing "Run" twice: refused before it launches anything; the first run's job goes on.
        second, out = trigger(stack, params)
        assert second, out
        done = poll("the duplicate run to end", lambda: _final(client, second), 120.0, every_s=1.0)
        assert done.state is not None and done.state.is_failed(), done.state
        # A run's state can turn final before its last log batch reaches the server (the log handler ships in the
        # background): the refusal is waited for, bounded.
        poll("the duplicate run's refusal in its logs",
             lambda: True if "is already running under another flow run" in flow_run_logs(second) else None, 30.0)
        assert record.launcher_alive() and _state(client, first).is_running()

        # The flow-run process is killed outright: the worker marks the run Crashed; the job trains on.
        os.kill(_flow_run_process(first), signal.SIGKILL)
        crashed = poll("the killed run to be marked", lambda: _final(client, first), 60.0, every_s=0.5)
        assert crashed.state is not None and crashed.state.is_crashed(), crashed.state
        assert record.launcher_alive(), "the job must outlive the flow run that started it"

        # A new run of the job takes it over (the dead run's hold released) and supervises the same launcher.
        third, out = trigger(stack, params)
        assert third, out
        poll("the new run to re-attach", lambda: True if f"re-attached to job {job}" in flow_run_logs(third) else None,
             RUN_TIMEOUT_S, every_s=1.0)
        poll("the re-attached launcher's pid in the logs",
             lambda: True if f"launcher pid {record.launcher_pid}" in flow_run_logs(third) else None, 30.0)
        renewed = poll("the new run's record", lambda: r if (r := jobrecord.read(job)) and r.flow_run_id == third
                       else None, 60.0)
        assert renewed.launcher_pid == record.launcher_pid and renewed.owner_lease != record.owner_lease

        # Cancelling it stops the job and still reports what ran, saying it was cancelled.
        stack.cli("flow-run", "cancel", third)
        fr = poll("the cancelled run to end", lambda: _final(client, third), 120.0, every_s=1.0)
        assert fr.state is not None and fr.state.is_cancelled(), fr.state
        of_run = FlowRunFilter(id=FlowRunFilterId(any_=[fr.id]))
        artifacts = {a.key: a for a in client.read_artifacts(flow_run_filter=of_run)}
        report = str(artifacts[f"{job}-cost-report"].data) if f"{job}-cost-report" in artifacts else ""
        assert "**The run was cancelled** after" in report, (sorted(artifacts), report)
        mine = EventRelatedFilter(id=[f"prefect.flow-run.{fr.id}"])
        names = ["trainmover.job.cancelled", "trainmover.job.reattached"]

        def events() -> dict[str, Any] | None:
            found = client.read_events(filter=EventFilter(event=EventNameFilter(name=names), related=mine), limit=10)
            by_name = {e.event: e for e in found.events}
            return by_name if set(by_name) == set(names) else None

        seen = poll("the run's re-attached and cancelled events", events, 30.0)
        assert seen["trainmover.job.cancelled"].resource["trainmover.job"] == job
        assert seen["trainmover.job.reattached"].payload["previous_flow_run"] == first
        assert jobrecord.read(job) is None, "a released job leaves no record"
    poll("the job's processes to exit", lambda: True if not _job_processes(job) else None, 60.0)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_example_automation_runs_the_retune_deployment_when_standbys_are_promoted_often(
    stack: PrefectStack,
) -> None:
    """prefect.yaml's trigger, deployed disabled, resumed as a user would; five promotions arrive as events."""
    name = "trainmover-retune-on-frequent-promotions"
    automations = stack.api("POST", "/automations/filter", {"automations": {"name": {"any_": [name]}}})
    assert len(automations) == 1 and automations[0]["enabled"] is False, automations
    (deployment,) = stack.api("POST", "/deployments/filter", {"deployments": {"name": {"any_": ["weekly-retune"]}}})
    before = {r["id"] for r in stack.api("POST", "/flow_runs/filter",
                                         {"deployments": {"id": {"any_": [deployment["id"]]}}})}
    stack.cli("automation", "resume", name)
    try:
        now = datetime.now(UTC).isoformat()
        stack.api("POST", "/events", [
            {"id": str(uuid.uuid4()), "occurred": now, "event": "trainmover.standby.promoted",
             "resource": {"prefect.resource.id": f"trainmover.rank.{rank}", "trainmover.job": "automation-check"},
             "payload": {"rank": rank}}
            for rank in range(5)
        ])

        def started() -> list[dict[str, Any]] | None:
            runs = stack.api("POST", "/flow_runs/filter", {"deployments": {"id": {"any_": [deployment["id"]]}}})
            new = [r for r in runs if r["id"] not in before]
            return new or None

        (run,) = poll("the automation's flow run of weekly-retune", started, 60.0, every_s=0.5)
    finally:
        stack.cli("automation", "pause", name)
    stack.cli("flow-run", "cancel", run["id"], check=False)  # the check is that it was ordered; no re-tune here
    with stack.settings(), get_client(sync_client=True) as client:
        poll("the re-tune run to end", lambda: _final(client, run["id"]), 120.0, every_s=1.0)
