"""Backups in Azure Blob Storage (`--backup-dir az://CONTAINER/PREFIX`), against Azurite's blob service over HTTP:
uploaded with the manifest last, pruned, downloaded and read back bit for bit, refused when the manifest names a
file outside the backup; and a job whose workers all die comes back from the container.

Azurite (npm's `azurite`) runs as a process of its own (tests/azurite.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from azure.storage.blob import BlobServiceClient, ContainerClient

from runtime.training.backup import (
    AZ_ACCOUNT_URL,
    AZ_CONNECTION_STRING,
    FORMAT,
    MANIFEST,
    AzureBlobMirror,
    BackupError,
    BackupSettings,
    BackupWriter,
    find_backup,
    has_backup,
    step_dir,
)
from tests.azurite import DEV_KEY, azurite_fixture
from tests.runtime.test_backup import backed_up_at_step_2, backups_round_trip, comes_back_from_the_store

CONTAINER = "tm-backups"


azurite = azurite_fixture(CONTAINER)


@pytest.fixture
def azure(azurite: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The SDK, here and in every process a job starts, points at Azurite's development account."""
    monkeypatch.setenv(AZ_CONNECTION_STRING, azurite)
    monkeypatch.delenv(AZ_ACCOUNT_URL, raising=False)
    return azurite


def _container() -> ContainerClient:
    return BlobServiceClient.from_connection_string(os.environ[AZ_CONNECTION_STRING]).get_container_client(CONTAINER)


def _names(prefix: str) -> list[str]:
    return sorted(_container().list_blob_names(name_starts_with=prefix))


def test_backups_go_to_the_container_the_newest_kept_and_come_back_bit_for_bit(azure: str, tmp_path: Path) -> None:
    url = f"az://{CONTAINER}/jobs/a"
    backups_round_trip(url, _names)
    mirror = AzureBlobMirror(url)
    assert mirror.steps() == [6, 9]
    older = mirror.download(6, tmp_path / "six")  # by step, into a folder of the caller's
    assert older.step == 6 and sorted(p.name for p in older.path.iterdir()) == sorted([*older.manifest["files"],
                                                                                        MANIFEST])
    mirror.prune(1)
    assert mirror.steps() == [9] and not any(step_dir(6) in n for n in _names("jobs/a/"))


def test_a_backup_without_its_manifest_is_not_there(azure: str) -> None:
    url = f"az://{CONTAINER}/jobs/b"
    backed_up_at_step_2(url)
    assert has_backup(url)
    _container().delete_blob(f"jobs/b/{step_dir(2)}/{MANIFEST}")  # an upload cut short
    assert f"jobs/b/{step_dir(2)}/.metadata" in _names("jobs/b/")
    assert not has_backup(url)
    with pytest.raises(BackupError, match="no complete backup under"):
        find_backup(url)


def test_a_manifest_naming_a_file_outside_the_backup_is_refused(azure: str, tmp_path: Path) -> None:
    manifest = {"format": FORMAT, "step": 5, "spec": [], "files": {"../x": {"bytes": 1, "sha256": "0" * 64}}}
    container = _container()
    container.upload_blob(f"jobs/c/{step_dir(5)}/{MANIFEST}", json.dumps(manifest).encode())
    container.upload_blob("jobs/c/x", b"!")
    mirror = AzureBlobMirror(f"az://{CONTAINER}/jobs/c")
    assert mirror.steps() == [5]

    with pytest.raises(BackupError, match=r"the manifest names '\.\./x', outside the backup"):
        mirror.download(5, tmp_path / "in" / "restore")
    assert not (tmp_path / "in" / "x").exists()


def test_a_container_that_does_not_exist_says_so_without_the_key(azure: str) -> None:
    with pytest.raises(BackupError) as raised:
        has_backup("az://no-such-container/x")
    message = str(raised.value)
    assert message.startswith("listing the backups in az://no-such-container/x: Azure Blob answered "
                              "ContainerNotFound; check that the container 'no-such-container' exists")
    assert DEV_KEY not in message and DEV_KEY[:8] not in message and "AccountKey" not in message


def test_without_an_account_the_error_says_what_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(AZ_CONNECTION_STRING, raising=False)
    monkeypatch.delenv(AZ_ACCOUNT_URL, raising=False)
    with pytest.raises(BackupError, match=f"set {AZ_CONNECTION_STRING}, or {AZ_ACCOUNT_URL}"):
        BackupWriter(BackupSettings(f"az://{CONTAINER}/x", 2), "job-d", [])
    monkeypatch.setenv(AZ_CONNECTION_STRING, f"AccountKey={DEV_KEY}")  # no account name or endpoint
    with pytest.raises(BackupError) as raised:
        find_backup(f"az://{CONTAINER}/x")
    assert f"{AZ_CONNECTION_STRING} is not a storage account's connection string" in str(raised.value)
    assert DEV_KEY not in str(raised.value)
    with pytest.raises(BackupError, match="az://CONTAINER or az://CONTAINER/PREFIX"):
        has_backup("az://")


@pytest.mark.untimed
def test_every_copy_lost_the_job_comes_back_from_the_container_bit_exact(azure: str) -> None:
    url = f"az://{CONTAINER}/jobs/ema"
    comes_back_from_the_store(url)
