"""Stored failure models: versioned keys, "latest", digests checked before anything loads a model (fast, no
server: the default storage is a LocalFileSystem block under $XDG_DATA_HOME)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from flows.model_store import LATEST, ModelStoreError, fetch_model, is_model_key, models_dir, resolve_key, save_model
from flows.models import TrainingRun


@pytest.fixture(autouse=True)
def data_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    return tmp_path / "data"


def _model(tmp_path: Path, content: bytes) -> Path:
    path = tmp_path / "model.skops"
    path.write_bytes(content)
    return path


def test_each_model_gets_a_versioned_key_and_latest_follows_the_newest(tmp_path: Path) -> None:
    first = save_model(_model(tmp_path, b"first"), now=datetime(2026, 12, 1, 3, tzinfo=UTC))
    second = save_model(_model(tmp_path, b"second"), now=datetime(2026, 12, 8, 3, tzinfo=UTC))
    assert first.startswith("failure-model/v20261201T030000Z-") and first.endswith(".skops") and first != second
    assert is_model_key(first) and is_model_key("latest") and not is_model_key("model.skops")
    assert resolve_key("latest") == second
    assert fetch_model("latest", cache=tmp_path / "cache").read_bytes() == b"second"
    assert fetch_model(first, cache=tmp_path / "cache").read_bytes() == b"first", "older versions stay"
    assert (models_dir() / first).is_file() and (models_dir() / LATEST).read_text() == second


def test_a_stored_model_changed_behind_its_key_is_refused_before_loading(tmp_path: Path) -> None:
    key = save_model(_model(tmp_path, b"genuine"))
    (models_dir() / key).write_bytes(b"swapped: a pickle bomb")
    with pytest.raises(ModelStoreError, match="does not match its digest"):
        fetch_model(key, cache=tmp_path / "cache")
    assert not (tmp_path / "cache" / Path(key).name).exists()


def test_unresolvable_references_are_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelStoreError, match="run the train-failure-model flow first"):
        resolve_key("latest")
    with pytest.raises(ModelStoreError, match="not a model key"):
        resolve_key("failure-model/../../etc/passwd")
    with pytest.raises(ModelStoreError, match="is not in the storage"):
        fetch_model("failure-model/v20261201T030000Z-0123456789ab.skops")
    (models_dir() / LATEST).parent.mkdir(parents=True)
    (models_dir() / LATEST).write_text("../../outside.skops")
    with pytest.raises(ModelStoreError, match="not a model key"):
        resolve_key("latest")


def test_a_training_run_names_a_stored_model_by_key_or_latest_and_a_missing_file_is_refused() -> None:
    assert TrainingRun(policy_model="latest").policy_model == "latest"
    assert TrainingRun(policy_model="failure-model/v20261201T030000Z-0123456789ab.skops").policy_model
    with pytest.raises(ValueError, match="name a stored model"):
        TrainingRun(policy_model="/nonexistent/model.skops")
    with pytest.raises(ValueError, match="model_storage_block"):
        TrainingRun(model_storage_block="Not A Block!")
