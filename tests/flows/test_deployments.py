"""prefect.yaml as Prefect itself reads it, and the parameter schema `prefect deploy` stores: no server needed.

The deployments have distinct names, the policy deployments a (paused) weekly schedule and the re-tune an example
automation, all accepted by Prefect's own loader; the schema of `resilient-training` carries the limits and the
descriptions that the UI form shows and the API enforces.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from prefect.cli.deploy._config import _load_deploy_configs_and_actions
from prefect.cli.deploy._schedules import _schedule_config_to_deployment_schedule
from prefect.cli.deploy._triggers import _initialize_deployment_triggers
from prefect.events.schemas.automations import AutomationCore
from prefect.flows import load_flow_from_entrypoint
from prefect.utilities.callables import parameter_schema
from rich.console import Console

from flows.demo import demo_run
from flows.drill import drill_refusal
from flows.models import StandbyLimits, TrainingRun
from flows.supervisor import RunReport
from flows.training import cost_markdown
from tests.flows.cloud_runs import AWS_LAUNCH
from tests.flows.test_e2e import commented_block, commented_variant

ROOT = Path(__file__).resolve().parents[2]


def deploy_configs() -> list[dict[str, Any]]:
    console = Console(record=True)
    configs, _ = _load_deploy_configs_and_actions(ROOT / "prefect.yaml", console=console)
    # The loader prints a validation error and goes on with no deployments; make that a failure here.
    assert configs, console.export_text()
    return configs


def test_prefects_loader_reads_four_deployments_with_distinct_names_schedules_and_an_automation() -> None:
    configs = {d["name"]: d for d in deploy_configs()}
    assert set(configs) == {"local-drill", "weekly-retrain", "weekly-retune", "sweep-unsupervised-jobs"}
    for name in ("weekly-retrain", "weekly-retune"):
        (schedule,) = [_schedule_config_to_deployment_schedule(s) for s in configs[name]["schedules"]]
        assert schedule["active"] is False and schedule["schedule"].cron.endswith("* * 1"), schedule
    (sweep,) = [_schedule_config_to_deployment_schedule(s) for s in configs["sweep-unsupervised-jobs"]["schedules"]]
    assert sweep["active"] is False and sweep["schedule"].cron == "*/10 * * * *"
    (trigger,) = _initialize_deployment_triggers("weekly-retune", configs["weekly-retune"]["triggers"])
    assert trigger.enabled is False and trigger.expect == {"trainmover.standby.promoted"}
    assert trigger.threshold > 1


def test_the_notify_on_failure_automation_in_prefect_yaml_is_one_prefect_accepts() -> None:
    automation = AutomationCore.model_validate(commented_block("notify-job-failed"))
    assert automation.trigger.expect == {"trainmover.job.failed"}  # type: ignore[union-attr]


def test_the_parameter_schema_carries_limits_and_descriptions() -> None:
    flow = load_flow_from_entrypoint(str(ROOT / "flows/training.py:resilient_training"))
    schema = parameter_schema(flow).model_dump()
    props = schema["properties"]
    assert all(p.get("description") for p in props.values()), props
    assert props["max_wall_s"]["exclusiveMinimum"] == 0 and props["max_wall_s"]["maximum"] == 365 * 86400
    assert props["time_scale"]["exclusiveMinimum"] == 0 and props["time_scale"]["maximum"] == 86400
    assert props["policy_every_s"]["minimum"] > 0
    assert "min_warm 0" in props["drill"]["description"]
    run = schema["definitions"]["TrainingRun"]["properties"]
    assert all(p.get("description") for p in run.values())
    assert "runtime/faults.py" in run["faults"]["description"]


DEMO = dict(time_scale=3600.0, policy_every_s=0.5)


@pytest.mark.parametrize(
    ("run", "scale", "needle"),
    [
        (TrainingRun(provider="aws", region="us-east-1", standby=StandbyLimits(min_warm=0), **AWS_LAUNCH), DEMO,
         "runs with run.provider 'local' only"),
        (TrainingRun(workers=1, standby=StandbyLimits(min_warm=0)), DEMO, "set run.workers to at least 2"),
        (TrainingRun(standby=StandbyLimits(min_warm=1)), DEMO, "set run.standby.min_warm to 0"),
        (TrainingRun(standby=StandbyLimits(min_warm=0, max_warm=0)), DEMO, "set run.standby.max_warm to 1"),
        (TrainingRun(standby=StandbyLimits(min_warm=0)), {**DEMO, "time_scale": 1.0}, "set time_scale to at least"),
        (TrainingRun(standby=StandbyLimits(min_warm=0)), {**DEMO, "policy_every_s": 60.0}, "policy_every_s=60"),
    ],
)
def test_a_drill_that_would_do_nothing_is_refused_with_what_to_change(
    run: TrainingRun, scale: dict[str, float], needle: str
) -> None:
    why = drill_refusal(run, **scale)
    assert why is not None and needle in why, why


def test_the_demo_and_the_local_deployment_are_drills_that_can_run() -> None:
    assert drill_refusal(demo_run(), **DEMO) is None
    (local,) = [d for d in deploy_configs() if d["name"] == "local-drill"]
    p = local["parameters"]
    assert p["drill"] is True
    assert drill_refusal(TrainingRun.model_validate(p["run"]), p["time_scale"], p["policy_every_s"]) is None


def report(**changes: Any) -> RunReport:
    base: dict[str, Any] = dict(
        job_id="j", exit_code=0, message="finished", wall_s=60.0, steps=100, interruptions=[],
        standby_hours={"warm": 2.0, "stopped": 1.0}, standby_cost_usd=110.0, downtime_s=0.1,
        downtime_cost_usd=0.01, ettr=0.99, restart_downtime_s=900.0, restart_cost_usd=12.0, restart_ettr=0.9,
        final_digest=None,
    )
    return RunReport(**{**base, **changes})


def test_costs_on_the_demos_scaled_clock_are_labelled_so() -> None:
    scaled = cost_markdown(report(), TrainingRun(), time_scale=3600.0)
    assert "standby cost (scaled clock)" in scaled and "**Scaled clock**" in scaled and "3600 times" in scaled
    real = cost_markdown(report(), TrainingRun(), time_scale=1.0)
    assert "scaled" not in real.lower()


SECRET_KEY = re.compile(r"secret|password|passwd|token|credential|access_key|api_key|private_key|client_id|tenant_id",
                        re.I)


def secret_job_variables(job_variables: Any, where: str = "job_variables") -> list[str]:
    """Every key of `job_variables` (nested: `env`, ...) that looks like a secret and holds a value. A
    `{{ prefect.blocks.* }}` reference counts: `prefect deploy` resolves it into the stored deployment."""
    found: list[str] = []
    if isinstance(job_variables, dict):
        for key, value in job_variables.items():
            if SECRET_KEY.search(str(key)) and value not in (None, ""):
                found.append(f"{where}.{key}")
            found += secret_job_variables(value, f"{where}.{key}")
    elif isinstance(job_variables, list):
        for i, value in enumerate(job_variables):
            found += secret_job_variables(value, f"{where}[{i}]")
    return found


def test_the_scan_finds_a_client_secret_in_job_variables_as_the_old_azure_variant_had_it() -> None:
    old = {"env": {"AZURE_CLIENT_ID": "{{ prefect.blocks.secret.azure-client-id }}", "AWS_DEFAULT_REGION": "x",
                   "AZURE_CLIENT_SECRET": "{{ prefect.blocks.secret.azure-client-secret }}"}}
    assert secret_job_variables(old) == ["job_variables.env.AZURE_CLIENT_ID", "job_variables.env.AZURE_CLIENT_SECRET"]


def test_no_deployment_in_prefect_yaml_carries_a_secret_in_its_job_variables() -> None:
    raw = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    deployments = [*deploy_configs(), commented_variant("aws"), commented_variant("azure")]
    pools = [*raw["definitions"]["work_pools"].values(), *(d.get("work_pool") or {} for d in deployments)]
    leaks = [f"{i}: {leak}" for i, pool in enumerate(pools) for leak in secret_job_variables(pool.get("job_variables"))]
    assert not leaks, leaks
    for variant in ("aws", "azure"):  # the cloud variants name a Secret block; the flow reads it when it runs
        assert commented_variant(variant)["parameters"]["credentials_block"] == f"trainmover-{variant}"


def test_the_docker_variant_builds_pushes_and_runs_its_deployments_in_the_image() -> None:
    """prefect.docker.yaml: Prefect's loader reads it; the image is built from the Dockerfile and pushed, and each
    deployment's work pool runs that image; the parameters are valid; the Dockerfile installs a pinned torch and
    every package of the project, and copies no secret or virtual environment."""
    console = Console(record=True)
    configs, actions = _load_deploy_configs_and_actions(ROOT / "prefect.docker.yaml", console=console)
    assert configs, console.export_text()
    (build,) = actions["build"]
    (push,) = actions["push"]
    built = build["prefect_docker.deployments.steps.build_docker_image"]
    assert built["id"] == "build-image" and built["dockerfile"] == "Dockerfile"
    assert push["prefect_docker.deployments.steps.push_docker_image"]["image_name"] == "{{ build-image.image_name }}"
    assert {d["name"] for d in configs} == {"docker-drill", "weekly-retune"}
    for d in configs:
        assert d["work_pool"]["name"] == "trainmover-docker"
        assert d["work_pool"]["job_variables"]["image"] == "{{ build-image.image }}"
        load_flow_from_entrypoint(str(ROOT / d["entrypoint"])).validate_parameters(d.get("parameters", {}))
        if "run" in d.get("parameters", {}):
            assert TrainingRun.model_validate(d["parameters"]["run"]).check_script(ROOT).is_file()
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert 'pip install "torch==${TORCH_VERSION}"' in dockerfile and "ARG TORCH_VERSION=2.13.0" in dockerfile
    copied = set(re.findall(r"^COPY (\S+)", dockerfile, re.M))
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file() and p.name != "tests"}
    assert packages <= copied, f"the image lacks {packages - copied}"
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored
