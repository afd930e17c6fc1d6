"""Where trained failure models live between flows: versioned keys in a Prefect storage block, and "latest".

`train_failure_model` stores each model it trains under a key of its own,
`failure-model/v<UTC time>-<sha256[:12]>.skops` (never overwritten: a scheduled re-training never replaces the model
a running job uses), and then points `failure-model/latest` at it. `resilient_training` finds its model by that key,
by "latest", or by a file path (`TrainingRun.policy_model`).

The storage is any Prefect `WritableFileSystem` block saved under a name (`TrainingRun.model_storage_block`, the
flows' `storage_block`): an S3 bucket (prefect-aws `S3Bucket`), an Azure Blob container (prefect-azure), or
`RemoteFileSystem(basepath="s3://bucket/prefix")`, so that a job on another worker host finds the model. Without a
block it is `LocalFileSystem` at `$XDG_DATA_HOME/trainmover/models` on the worker host.

A model read back is checked against the digest in its key before anything loads it, and loaded only through
`policy.predictor.load_policy_model` (skops with the project's trusted types): a model swapped in the storage is
refused, never unpickled.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

PREFIX = "failure-model"
LATEST = f"{PREFIX}/latest"
_KEY = re.compile(rf"{PREFIX}/v(\d{{8}}T\d{{6}}Z)-([0-9a-f]{{12}})\.skops")


class ModelStoreError(ValueError):
    """A model reference that cannot be resolved: one message saying what to do."""


def models_dir() -> Path:
    """The default storage: `$XDG_DATA_HOME/trainmover/models` (~/.local/share/trainmover/models)."""
    data = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data) / "trainmover" / "models"


def is_model_key(ref: str) -> bool:
    """Whether `ref` names a stored model (a versioned key or "latest") rather than a file."""
    return ref == "latest" or _KEY.fullmatch(ref) is not None


def _storage(block_name: str | None) -> Any:
    from prefect.filesystems import LocalFileSystem, WritableFileSystem

    if block_name is None:
        return LocalFileSystem(basepath=str(models_dir()))
    try:
        block = WritableFileSystem.load(block_name)
    except ValueError as exc:
        raise ModelStoreError(
            f"no storage block named {block_name!r}: save one (for example S3Bucket or RemoteFileSystem) under that "
            f"name, or leave the storage block empty for the worker host's disk ({exc})"
        ) from None
    return block


def new_key(data: bytes, now: datetime | None = None) -> str:
    """The versioned key of a model file's bytes, at `now`."""
    return f"{PREFIX}/v{(now or datetime.now(UTC)):%Y%m%dT%H%M%SZ}-{hashlib.sha256(data).hexdigest()[:12]}.skops"


def save_model(path: Path, block_name: str | None = None, now: datetime | None = None) -> str:
    """Store the model file at `path` under a new versioned key, then point "latest" at it; returns the key."""
    data = Path(path).read_bytes()
    storage = _storage(block_name)
    key = new_key(data, now)
    storage.write_path(key, data)
    storage.write_path(LATEST, key.encode())
    return key


def resolve_key(ref: str, block_name: str | None = None) -> str:
    """The versioned key `ref` names ("latest" is followed)."""
    if ref != "latest":
        if not _KEY.fullmatch(ref):
            raise ModelStoreError(f"{ref!r} is not a model key ({PREFIX}/v<time>-<digest>.skops) nor 'latest'")
        return ref
    try:
        key = _storage(block_name).read_path(LATEST).decode().strip()
    except (FileNotFoundError, ValueError, OSError):
        raise ModelStoreError(
            "no model stored yet ('latest' points nowhere): run the train-failure-model flow first"
        ) from None
    if not _KEY.fullmatch(key):
        raise ModelStoreError(f"{LATEST} holds {key[:80]!r}, not a model key: store a model again")
    return key


def fetch_model(ref: str, block_name: str | None = None, cache: Path | None = None) -> Path:
    """A local file holding the model `ref` names (a key or "latest"), its bytes checked against the key's digest."""
    key = resolve_key(ref, block_name)
    try:
        data = _storage(block_name).read_path(key)
    except (FileNotFoundError, ValueError, OSError):
        raise ModelStoreError(f"model {key} is not in the storage: train one, or name another key") from None
    digest = _KEY.fullmatch(key).group(2)  # type: ignore[union-attr]
    if hashlib.sha256(data).hexdigest()[:12] != digest:
        raise ModelStoreError(f"model {key} does not match its digest: the stored file was changed; refusing it")
    directory = cache or Path(tempfile.gettempdir()) / "trainmover-models"
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    local = directory / Path(key).name
    local.write_bytes(data)
    return local


__all__ = ["LATEST", "ModelStoreError", "fetch_model", "is_model_key", "models_dir", "new_key", "resolve_key",
           "save_model"]
