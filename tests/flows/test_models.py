"""TrainingRun: the UI form of a resilient training run refuses bad parameters before anything launches."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from flows.models import StandbyLimits, TrainingRun, describe_error
from tests.flows.cloud_runs import AWS_LAUNCH
from tests.runtime.fresh import loaded_by

ROOT = Path(__file__).resolve().parents[2]


def refused(**fields: object) -> str:
    with pytest.raises(ValidationError) as info:
        TrainingRun.model_validate(fields)
    return describe_error(info.value)


def test_the_defaults_describe_the_local_demo_and_its_script_exists() -> None:
    run = TrainingRun()
    assert (run.provider, run.workers, run.standby.min_warm) == ("local", 2, 1)
    assert run.check_script(ROOT).is_file()


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"workers": -1}, "workers: Input should be greater than or equal to 1"),
        ({"provider": "gcp"}, "provider: Input should be 'local', 'aws' or 'azure'"),
        ({"standby": {"max_warm": -2}}, "standby.max_warm"),
        ({"standby": {"min_warm": 3, "max_warm": 1}}, "min_warm=3 exceeds max_warm=1"),
        ({"provider": "aws"}, "needs a region"),
        ({"provider": "azure", "region": "eastus"}, "azure_subscription_id and azure_resource_group"),
        ({"provider": "aws", "region": "us-east-1", "market": "spot", **AWS_LAUNCH},
         "cannot park (stop) one-time spot"),
        ({"provider": "aws", "region": "us-east-1"}, "needs coordinator_address, image, instance_profile"),
        ({"provider": "azure", "region": "eastus", "azure_subscription_id": "s", "azure_resource_group": "g",
          "image": "a:b:c:d"}, "needs coordinator_address, key_vault_url, key_vault_resource_id"),
        ({"provider": "aws", "region": "us-east-1", "hosts": "namespaces", **AWS_LAUNCH}, "is for the local provider"),
        ({"trainmover_source": "trainmover>=0.1"}, "trainmover_source: "),
        ({"hosts_wait_s": 1}, "hosts_wait_s"),
        ({"job_id": "Bad_Name"}, "job_id 'Bad_Name' must be"),
        ({"policy_model": "/nonexistent/model.skops"}, "name a stored model ('latest' or its key)"),
        ({"hazard_multiplier": 0}, "hazard_multiplier"),
        ({"surprise": 1}, "surprise: Extra inputs are not permitted"),
        ({"faults": "explode:rank=1"}, "faults: fault 'explode:rank=1': 'explode' is not an action"),
        ({"faults": "kill:rank=1,step=soon"}, "faults: fault 'kill:rank=1,step=soon': step takes a whole number"),
        ({"faults": "kill:rank=1;corrupt:phase=exchange"}, "corrupt applies to phase=handoff_send only"),
        ({"faults": "kill:rank=2,step=5"}, "faults name rank(s) [2], but the job has ranks 0-1 only"),
    ],
)
def test_bad_parameters_are_refused_with_the_field_named(fields: dict[str, object], needle: str) -> None:
    assert needle in refused(**fields)


@pytest.mark.parametrize(
    ("plan", "wrong"),
    [
        ("explode:rank=1", "fault 'explode:rank=1': 'explode' is not an action (the action must be one of kill, "),
        ("kill:rank=one", "fault 'kill:rank=one': rank takes a whole number, not 'one'"),
        ("kill:rank=1;stop:rank=0,phase=nowhere", "fault 'stop:rank=0,phase=nowhere': 'nowhere' is not a phase (one "
         "of before_exchange, "),
        ("kill:rank=1,color=red", "fault 'kill:rank=1,color=red': 'color' is not a key (keys: phase, step, "),
        ("kill:rank", "fault 'kill:rank': 'rank' is not key=value"),
        ("kill:role=", "fault 'kill:role=': role takes a name of letters, digits, '_', '.' and '-', not ''"),
        ("kill:rank=1\nstop:rank=0", "fault 'kill:rank=1\\nstop:rank=0': rank takes a whole number, not "
         "'1\\nstop:rank=0'"),  # a line break for a ';'; shown escaped, on one line
    ],
)
def test_a_malformed_faults_plan_is_refused_in_one_sentence_with_the_wrong_part_and_a_plan_written_right(
    plan: str, wrong: str
) -> None:
    message = refused(faults=plan)
    assert message.startswith(f"faults: {wrong}"), message
    assert message.endswith("; write faults as ACTION:key=value,... separated by ';', e.g. "
                            "'kill:rank=1,step=8;stop:rank=0,step=20'"), message
    assert "\n" not in message and len(message) < 300 and "[ \\t]" not in message, message  # no pattern dumped


def test_a_faults_plan_the_runtime_accepts_is_kept_and_a_blank_one_is_none() -> None:
    assert TrainingRun(faults="kill:rank=1,step=40").faults == "kill:rank=1,step=40"
    assert TrainingRun(faults="  ").faults is None


def test_a_script_that_does_not_exist_is_refused_before_launch(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        TrainingRun(script="no_such_script.py").check_script(tmp_path)


def test_costs_follow_the_run_prices_and_offer_only_allowed_tiers() -> None:
    run = TrainingRun(workers=64, node_price_usd_per_h=50.0, standby=StandbyLimits(max_stopped=0, max_hot=0))
    c = run.costs()
    assert c.job_price_usd_per_h == pytest.approx(3200.0)
    assert set(c.tiers) == {"warm"}
    assert c.tiers["warm"].price_usd_per_h == 50.0
    assert set(TrainingRun(standby=StandbyLimits(max_hot=2)).costs().tiers) == {"stopped", "warm", "hot"}


def test_the_json_schema_has_a_description_for_every_field() -> None:
    schema = TrainingRun.model_json_schema()
    assert all("description" in p for p in schema["properties"].values())


def test_flows_models_import_no_prefect_torch_or_cloud_sdk() -> None:
    assert loaded_by("import flows.models", ["prefect", "torch", "boto3", "azure", "sklearn"]) == []


def test_caps_below_the_runs_own_minimums_are_refused_at_submit() -> None:
    standby = {"min_warm": 1, "max_warm": 2}
    why = refused(workers=2, standby=standby, max_instances=2)
    assert why.startswith("run: max_instances=2 refuses the run's own minimum, 2 worker instance(s) and "
                          "standby.min_warm=1 warm standby(s): the job would hold 3 instances"), why
    assert "raise run.max_instances, or lower workers or standby.min_warm" in why
    why = refused(workers=2, standby=standby, node_price_usd_per_h=10.0, max_spend_usd=25.0)
    assert "max_spend_usd=25.00 refuses" in why and "would reach 30.00 USD" in why, why
    assert "max_instances" in refused(max_instances=0) and "max_spend_usd" in refused(max_spend_usd=-1)
    ok = TrainingRun(workers=2, standby=StandbyLimits(**standby), node_price_usd_per_h=10.0, max_instances=3,
                     max_spend_usd=30.0)
    assert (ok.max_instances, ok.max_spend_usd) == (3, 30.0)
    # On instances a host runs several ranks, known only at provisioning: submit refuses only what no host can fit.
    assert TrainingRun(workers=4, hosts="processes", standby=StandbyLimits(**standby), max_instances=2).on_instances
