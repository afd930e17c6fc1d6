"""Backups in Azure Blob Storage (`--backup-dir az://CONTAINER/PREFIX`), against Azurite's blob service over HTTP:
uploaded with the manifest last, pruned, downloaded and read back bit for bit, refused when the manifest names a
file outside the backup; and a job whose workers all die comes back from the container.

Azurite (npm's `azurite`) runs as a process of its own: `azurite-blob` on PATH, else installed with npm into a
cache folder of this user's. Without it these tests fail, saying how to install it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
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
from tests.runtime.test_backup import backups_round_trip, comes_back_from_the_store, make, train

AZURITE_VERSION = "3.37.0"
AZURITE_DIR = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trainmover" / \
    f"azurite-{AZURITE_VERSION}"
"""Where the tests install Azurite with npm when `azurite-blob` is not on PATH."""
INSTALL = "install it with `npm install -g azurite` (Node.js's npm), or put azurite-blob on PATH"
DEV_ACCOUNT = "devstoreaccount1"
DEV_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
"""Azurite's well-known development account and key (https://learn.microsoft.com/azure/storage/common/storage-use-azurite)."""
CONTAINER = "tm-backups"
START_S = 60.0


def _azurite_blob() -> str:
    """The `azurite-blob` command: on PATH, else in AZURITE_DIR, installed there first if absent."""
    found = shutil.which("azurite-blob")
    if found is not None:
        return found
    command = AZURITE_DIR / "node_modules" / ".bin" / "azurite-blob"
    if command.exists():
        return str(command)
    npm = shutil.which("npm")
    if npm is None:
        pytest.fail(f"Azurite's azurite-blob is not on PATH and npm is not installed to fetch it: {INSTALL}")
    AZURITE_DIR.parent.mkdir(parents=True, exist_ok=True)
    # Installed beside, then renamed into place: another worker installing at the same time never sees half of it.
    staging = Path(tempfile.mkdtemp(prefix=f".{AZURITE_DIR.name}-", dir=AZURITE_DIR.parent))
    try:
        done = subprocess.run([npm, "install", "--prefix", str(staging), "--no-audit", "--no-fund", "--silent",
                               f"azurite@{AZURITE_VERSION}"], capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            pytest.fail(f"npm could not install azurite@{AZURITE_VERSION} into {AZURITE_DIR} "
                        f"({done.stderr.strip()[-500:]}): {INSTALL}")
        with contextlib.suppress(OSError):  # another worker's install got there first
            staging.rename(AZURITE_DIR)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return str(command)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for_port(port: int, process: subprocess.Popen[bytes], timeout_s: float) -> bool:
    """Whether `port` accepts a connection before `timeout_s` passes (False at once if `process` exits)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def azurite() -> Iterator[str]:
    """Azurite's blob service on a free port of 127.0.0.1 with one container, stopped afterwards; yields the
    connection string of its development account."""
    command = _azurite_blob()
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="tm-azurite-") as workspace:
        log_path = Path(workspace) / "azurite.log"
        with open(log_path, "wb") as log:
            t0 = time.monotonic()
            process = subprocess.Popen(
                [command, "--silent", "--inMemoryPersistence", "--disableTelemetry", "--skipApiVersionCheck",
                 "--blobHost", "127.0.0.1", "--blobPort", str(port)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=workspace)
        try:
            if not _wait_for_port(port, process, START_S):
                output = log_path.read_text(errors="replace").strip()[-1000:]
                pytest.fail(f"Azurite ({command}) did not answer on port {port} within {START_S:.0f} s (exit code "
                            f"{process.poll()}; its output: {output or 'none'}): {INSTALL}")
            print(f"Azurite's blob service answered in {time.monotonic() - t0:.2f} s")
            connection_string = (f"DefaultEndpointsProtocol=http;AccountName={DEV_ACCOUNT};AccountKey={DEV_KEY};"
                                 f"BlobEndpoint=http://127.0.0.1:{port}/{DEV_ACCOUNT};")
            BlobServiceClient.from_connection_string(connection_string).create_container(CONTAINER)
            yield connection_string
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)


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
    state, ema = make(0)
    writer = BackupWriter(BackupSettings(url, 2), "job-b", state.spec())
    train(state, ema, 1, 2)
    assert writer.after_commit(2, state) and writer.wait(60.0)
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
