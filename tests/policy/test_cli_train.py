"""Scenarios for `trainmover policy train|evaluate` and `generate --json`, on tiny fleets so they stay fast."""

from __future__ import annotations

import csv
import json
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
import skops.io as sio
from sklearn.linear_model import LogisticRegression

from policy import pipeline
from policy.costs import NODE_PRICE_USD_PER_H, StandbyCosts
from policy.features import DEFAULT_HORIZON_H
from policy.pipeline import PolicyVerdict
from policy.predictor import FailurePredictor
from policy.synthetic import SyntheticFleetConfig
from trainmover.cli import main

TINY = ["--nodes", "24", "--days", "30"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A model trained the way a user would, through the CLI, and its JSON report."""
    out = tmp_path_factory.mktemp("model")
    model, report = out / "model.skops", out / "train.json"
    argv = ["policy", "train", "--seeds", "1,2", *TINY, "--max-iter", "10", "--out", str(model), "--json", str(report)]
    assert main(argv) == 0
    return model, report


class _Stop(Exception):
    """Raised by a stand-in for `evaluate_fleet` once it has seen what the CLI passed it."""


def _expect_usage_error(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) == 1
    assert "Traceback" not in err


def test_train_writes_a_model_that_loads_and_a_report(trained: tuple[Path, Path]) -> None:
    model_path, report_path = trained
    model = FailurePredictor.load(model_path)
    assert model.max_iter == 10
    assert model.predict_proba(np.zeros((1, model.n_features_in_))).shape == (1, 2)
    report = json.loads(report_path.read_text())
    assert report["seeds"] == [1, 2]
    assert report["rows"] > report["positives"] > 0
    assert 0 < report["features_s"] < 300 and 0 < report["fit_s"] < 300, "the report times both stages"
    assert report["model"] == str(model_path)
    expected = {"nodes": 24, "days": 30.0, "horizon_h": DEFAULT_HORIZON_H, "max_iter": 10}
    assert {k: report["parameters"][k] for k in expected} == expected


def test_train_prints_rows_positives_timings_and_where_it_wrote(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "m.skops"
    assert main(["policy", "train", "--seeds", "3", *TINY, "--max-iter", "5", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    for word in ("rows", "positive", "features", "fit", str(out)):
        assert word in printed
    assert out.is_file()


def test_train_passes_the_calibration_flags_to_the_fleets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: list[SyntheticFleetConfig] = []

    def spy(configs: list[SyntheticFleetConfig], **_: object) -> None:
        seen.extend(configs)
        raise _Stop

    monkeypatch.setattr(pipeline, "train_predictor", spy)
    argv = ["policy", "train", "--seeds", "4,5", *TINY, "--out", str(tmp_path / "m.skops")]
    with pytest.raises(_Stop):
        main([*argv, "--precursor-fraction", "0.9", "--false-alarms-per-node-year", "0.5"])
    assert [c.seed for c in seen] == [4, 5]
    assert {(c.n_nodes, c.precursor_fraction, c.false_alarms_per_node_year) for c in seen} == {(24, 0.9, 0.5)}


def test_evaluate_prints_metrics_table_verdict_and_writes_json(
    trained: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "eval.json"
    argv = ["policy", "evaluate", "--model", str(trained[0]), "--seed", "9001", "--nodes", "48", "--days", "30"]
    assert main([*argv, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    for scorer in ("predictor", "rule", "logistic"):
        assert any(line.startswith(scorer) for line in printed.splitlines())
    assert "pr_auc" in printed and "brier" in printed and "mean_lead_h" in printed
    assert "usd/useful_h" in printed and "oracle" in printed  # the policy table
    verdict_line = printed.strip().splitlines()[-1]
    assert verdict_line.startswith("learned: ")
    for part in ("USD/useful h at ETTR", "vs best static", "ratio", "oracle", "regret"):
        assert part in verdict_line
    report = json.loads(out.read_text())
    assert report["seed"] == 9001
    assert set(report["verdict"]) == {f.name for f in fields(PolicyVerdict)}
    assert {"learned", "oracle", "no-standby"} <= {p["name"] for p in report["policies"]}
    assert set(report["prediction"]) >= {"predictor", "rule", "logistic"}


def test_evaluate_prices_the_job_as_the_whole_fleet_unless_told(
    trained: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[StandbyCosts] = []

    def spy(model: FailurePredictor, config: object, costs: StandbyCosts, **_: object) -> None:
        seen.append(costs)
        raise _Stop

    monkeypatch.setattr(pipeline, "evaluate_fleet", spy)
    argv = ["policy", "evaluate", "--model", str(trained[0]), "--nodes", "48", "--lead-time-h", "2"]
    for extra in ([], ["--job-price-usd-per-h", "1234"]):
        with pytest.raises(_Stop):
            main([*argv, *extra])
    assert seen[0].job_price_usd_per_h == pytest.approx(48 * NODE_PRICE_USD_PER_H)
    assert seen[1].job_price_usd_per_h == 1234.0
    assert seen[0].lead_time_h == seen[1].lead_time_h == 2.0


def test_generate_json_summarises_what_it_wrote(tmp_path: Path) -> None:
    out, summary = tmp_path / "syn.csv", tmp_path / "syn.json"
    argv = ["policy", "generate", "--nodes", "32", "--days", "90", "--seed", "2", "--out", str(out)]
    assert main([*argv, "--json", str(summary)]) == 0
    report = json.loads(summary.read_text())
    with out.open(newline="", encoding="utf-8") as f:
        rows = [r for r in csv.reader(f) if r and not r[0].startswith("#")]
    assert report["faults"] == len(rows) - 1  # minus the header
    assert report["faults"] > 0
    assert (report["nodes"], report["days"], report["seed"], report["path"]) == (32, 90.0, 2, str(out))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train", "--seeds", "1,x", "--out", "m.skops"], "--seeds 1,x"),
        (["train", "--seeds", "1,1", "--out", "m.skops"], "--seeds 1,1"),
        (["train", "--seeds", "-1", "--out", "m.skops"], "--seeds"),
        (["train", "--seeds", "1", "--nodes", "0", "--out", "m.skops"], "--nodes 0"),
        (["train", "--seeds", "1", "--days", "0", "--out", "m.skops"], "--days 0"),
        (["train", "--seeds", "1", "--days", "-3", "--out", "m.skops"], "--days -3"),
        (["train", "--seeds", "1", "--max-iter", "0", "--out", "m.skops"], "--max-iter"),
        (["train", "--seeds", "1", "--precursor-fraction", "1.5", "--out", "m.skops"], "--precursor-fraction"),
        (["evaluate", "--model", "/nonexistent/model.skops"], "no such file"),
        (["evaluate", "--model", "m.skops", "--nodes", "0"], "--nodes 0"),
        (["evaluate", "--model", "m.skops", "--days", "0"], "--days 0"),
    ],
)
def test_bad_input_exits_2_with_one_clear_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _expect_usage_error(["policy", *argv], message, capsys)


def test_train_on_a_fleet_without_faults_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["policy", "train", "--seeds", "1", "--nodes", "1", "--days", "1", "--out", str(tmp_path / "m.skops")]
    _expect_usage_error(argv, "--seeds", capsys)
    assert not (tmp_path / "m.skops").exists()


@pytest.mark.parametrize("content", [b"not a model\n", b""], ids=["text", "empty"])
def test_evaluate_refuses_a_file_that_is_not_a_model(
    content: bytes, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bogus = tmp_path / "bogus.skops"
    bogus.write_bytes(content)
    _expect_usage_error(["policy", "evaluate", "--model", str(bogus), *TINY], "not a model file", capsys)


def test_evaluate_refuses_a_skops_file_of_another_estimator(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = tmp_path / "other.skops"
    sio.dump(LogisticRegression().fit(np.eye(2), [0, 1]), other)
    _expect_usage_error(["policy", "evaluate", "--model", str(other), *TINY], f"--model {other}", capsys)


def test_evaluate_rejects_a_non_positive_multiplier(
    trained: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["policy", "evaluate", "--model", str(trained[0]), *TINY, "--multiplier", "0"]
    _expect_usage_error(argv, "--multiplier", capsys)


def test_train_records_its_horizon_in_the_model(tmp_path: Path) -> None:
    out = tmp_path / "m.skops"
    argv = ["policy", "train", "--seeds", "3", *TINY, "--max-iter", "5", "--horizon-h", "4", "--out", str(out)]
    assert main(argv) == 0
    assert FailurePredictor.load(out).horizon_h == 4.0


def test_evaluate_scores_with_the_models_own_horizon(
    trained: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[float] = []

    def spy(model: FailurePredictor, *args: object, horizon_h: float | None = None, **kw: object) -> None:
        seen.append(pipeline.model_horizon(model, horizon_h))
        raise _Stop

    monkeypatch.setattr(pipeline, "evaluate_fleet", spy)
    with pytest.raises(_Stop):
        main(["policy", "evaluate", "--model", str(trained[0]), *TINY])
    assert seen == [DEFAULT_HORIZON_H]


def test_evaluate_refuses_a_horizon_other_than_the_models(
    trained: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["policy", "evaluate", "--model", str(trained[0]), *TINY, "--horizon-h", "24"]
    _expect_usage_error(argv, "predicts faults within", capsys)


def test_evaluate_refuses_a_model_fitted_on_other_features(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(0)
    old = tmp_path / "old.skops"
    FailurePredictor(max_iter=3, horizon_h=2.0).fit(rng.normal(size=(400, 5)), np.arange(400) % 7 == 0).save(old)
    _expect_usage_error(["policy", "evaluate", "--model", str(old), *TINY], "retrain it with", capsys)


def test_a_model_without_a_horizon_is_refused_by_the_policy_loader(tmp_path: Path) -> None:
    from policy.features import FEATURE_NAMES
    from policy.predictor import IncompatibleModelError, load_policy_model

    rng = np.random.default_rng(0)
    path = tmp_path / "no-horizon.skops"
    X = rng.normal(size=(400, len(FEATURE_NAMES)))
    FailurePredictor(max_iter=3).fit(X, np.arange(400) % 7 == 0).save(path)
    with pytest.raises(IncompatibleModelError, match="label horizon"):
        load_policy_model(path)
