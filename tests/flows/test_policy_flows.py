"""The cost owner's flows on Prefect's real engine (the test harness): artifacts, events, Variables."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.usefixtures("prefect_harness")


def _artifact(key: str) -> Any:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
    assert found, f"no artifact {key!r}"
    return found[0]


def test_tune_standby_policy_recommends_a_setting_above_the_floor_from_a_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tempfile

    from prefect.variables import Variable

    from flows.policy_flows import MIN_ETTR_VARIABLE, tune_standby_policy

    Variable.set(MIN_ETTR_VARIABLE, 0.995, overwrite=True)
    cwd, scratch = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir(), scratch.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    out = tune_standby_policy(trace="infinitehbd")
    assert out["recommended"]["ettr"] >= 0.995
    md = _artifact("standby-recommendation")
    assert "Standby policy recommendation" in md.data and "data:image/png;base64" in md.data
    assert _artifact("standby-frontier").type == "table"
    # The plot lives in its artifact: nothing written where the worker runs, its temporary directory gone.
    assert list(cwd.iterdir()) == [] and list(scratch.iterdir()) == []


def test_tune_refuses_a_csv_trace_without_the_fleet_size(tmp_path: Path) -> None:
    from flows.policy_flows import tune_standby_policy

    csv = tmp_path / "t.csv"
    csv.write_text("node_id,start_h,end_h,cause\nn1,1.0,2.0,x\n")
    with pytest.raises(ValueError, match="needs `nodes`"):
        tune_standby_policy(trace=str(csv), plot_path=str(tmp_path / "p.png"))


def test_train_failure_model_saves_a_loadable_model_and_scores_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flows.policy_flows import TrainingData, train_failure_model
    from policy.features import FEATURE_NAMES
    from policy.predictor import FailurePredictor

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    data = TrainingData(seeds=(11,), eval_seed=12, nodes=24, days=30.0, max_iter=10)
    out = train_failure_model(data=data)
    # No path given: a new time-stamped file in the user's data directory, none in the working directory.
    path = Path(out["model_path"])
    assert path.parent == tmp_path / "data" / "trainmover" / "models" and path.name.startswith("failure-model-")
    assert list(cwd.iterdir()) == []
    assert FailurePredictor.load(path).predict_proba([[0.0] * len(FEATURE_NAMES)]).shape == (1, 2)
    assert out["train"]["rows"] > 1000
    assert set(out["evaluation"]["verdict"]) >= {"cost_ratio", "best_static"}
    assert _artifact("failure-model-scores").type == "table"
    # The training flow loads that model for its policy (skops, trusted types only).
    from flows.models import TrainingRun
    from flows.training import load_scorer

    scorer = load_scorer(TrainingRun(policy_model=str(path)))
    # And by "latest": the model the flow stored under its versioned key, checked against the key's digest.
    assert out["model_key"].startswith("failure-model/v")
    assert load_scorer(TrainingRun(policy_model="latest")) is not None
    assert scorer is not None and isinstance(scorer.model, FailurePredictor)
    assert scorer.horizon_h == FailurePredictor.load(path).horizon_h  # the horizon the model was trained with


def test_the_training_flow_refuses_a_model_from_an_older_feature_set(tmp_path: Path) -> None:
    import numpy as np

    from flows.models import TrainingRun
    from flows.training import load_scorer
    from policy.predictor import FailurePredictor, IncompatibleModelError

    old = tmp_path / "old.skops"
    rng = np.random.default_rng(0)
    FailurePredictor(max_iter=3, horizon_h=2.0).fit(rng.normal(size=(400, 21)), np.arange(400) % 7 == 0).save(old)
    with pytest.raises(IncompatibleModelError, match="retrain it with `trainmover policy train"):
        load_scorer(TrainingRun(policy_model=str(old)))


def test_training_on_the_evaluation_seed_is_refused(tmp_path: Path) -> None:
    from flows.policy_flows import TrainingData, train_failure_model

    with pytest.raises(ValueError, match="never trained on"):
        train_failure_model(data=TrainingData(seeds=(5,), eval_seed=5, nodes=24, days=30.0), model_path="x")
