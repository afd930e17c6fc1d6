"""The deployments end to end, as a user runs them: a Prefect server, the local work pool, a worker, `prefect deploy`
from prefect.yaml, a run triggered with parameters, then what the user reads back (state, artifacts, events, the UI).

The run is a small local job on three "instances", each a host of its own (a network namespace running `trainmover
agent`; the coordinator runs in the flow), and rank 1's host dies whole at step 40 (no drill): the flow must
complete bit for bit, with one interruption covered by the warm standby's host and the lost instance replaced.
The fast tests need no server: prefect.yaml's parameters (also those of its commented cloud variants) are valid,
and bad parameters are refused before anything launches.
"""

from __future__ import annotations

import html
import json
import re
import time
import uuid
from collections.abc import Iterator
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


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_the_ui_shows_the_flow_run_and_its_interruption_table(
    stack: PrefectStack, e2e_run: FlowRun, tmp_path: Path
) -> None:
    chromium_or_fail()
    t0 = time.monotonic()
    run_page = f"{stack.url}/runs/flow-run/{e2e_run.id}"
    text = page_text(chromium(run_page, tmp_path))
    assert e2e_run.name in text and "Completed" in text, text[:3000]
    assert "lost (its agent" in text and "took rank 1" in text, text[:3000]  # the run's logs, the default tab

    # The V1 flow-run page resets ?tab= while the run loads; the V2 page opens its Artifacts tab (cards, no rows).
    cards = page_text(chromium(f"{stack.url}/v2/runs/flow-run/{e2e_run.id}?tab=Artifacts", tmp_path))
    assert f"{JOB}-interruptions" in cards and f"{JOB}-cost-report" in cards, cards[:3000]

    # The artifact page renders the table itself.
    (artifact,) = stack.api("POST", "/artifacts/filter", {"artifacts": {"key": {"any_": [f"{JOB}-interruptions"]}}})
    artifact_page = f"{stack.url}/artifacts/artifact/{artifact['id']}"
    table = page_text(chromium(artifact_page, tmp_path))
    assert "lost_time_s" in table and "lost (its agent" in table and e2e_run.name in table, table[:3000]

    for name, url in (("e2e-flow-run.png", run_page), ("e2e-interruptions.png", artifact_page)):
        png = tmp_path / name
        chromium(url, tmp_path, screenshot=png)
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000, png
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


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_a_cancelled_run_stops_its_job_and_releases_every_instance(stack: PrefectStack) -> None:
    job = "e2e-cancel"
    params = {**E2E_PARAMS, "run": {**E2E_PARAMS["run"], "job_id": job, "steps": 1_000_000, "faults": None},
              "max_wall_s": 600.0}
    flow_run_id, out = trigger(stack, params)
    assert flow_run_id, out
    with stack.settings(), get_client(sync_client=True) as client:
        poll("the job to start", lambda: True if f"job {job} started" in flow_run_logs(flow_run_id) else None,
             RUN_TIMEOUT_S, every_s=1.0)
        assert _job_processes(job), "the job's launcher should be running"
        stack.cli("flow-run", "cancel", flow_run_id)

        def final() -> FlowRun | None:
            fr = client.read_flow_run(uuid.UUID(flow_run_id))
            return fr if fr.state is not None and fr.state.is_final() else None

        fr = poll("the cancelled run to end", final, 120.0, every_s=1.0)
        assert fr.state is not None and fr.state.is_cancelled(), fr.state
        poll("the release line", lambda: True if f"of job {job}" in flow_run_logs(flow_run_id) else None, 60.0)
        assert "released 3 instance(s)" in flow_run_logs(flow_run_id)

        # A cancelled run still reports what ran until then, and says it was cancelled.
        of_run = FlowRunFilter(id=FlowRunFilterId(any_=[fr.id]))
        artifacts = {a.key: a for a in client.read_artifacts(flow_run_filter=of_run)}
        report = str(artifacts[f"{job}-cost-report"].data) if f"{job}-cost-report" in artifacts else ""
        assert "**The run was cancelled** after" in report, (sorted(artifacts), report)
        cancelled = EventFilter(
            event=EventNameFilter(name=["trainmover.job.cancelled"]),
            related=EventRelatedFilter(id=[f"prefect.flow-run.{fr.id}"]),
        )
        event = poll("the trainmover.job.cancelled event",
                     lambda: next(iter(client.read_events(filter=cancelled, limit=5).events), None), 30.0)
        assert event.resource["trainmover.job"] == job and event.payload["reason"], event
    poll("the job's processes to exit", lambda: True if not _job_processes(job) else None, 60.0)
