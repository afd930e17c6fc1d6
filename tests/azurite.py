"""Azurite's blob service (npm's `azurite`), started by the tests that need Azure Blob Storage: backups
(tests/runtime/test_backup_azure.py) and the staging of a job's files (tests/flows/test_staging_azure.py).

`azurite-blob` on PATH, else installed with npm into a cache folder of this user's. Without it these tests fail,
saying how to install it."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from azure.storage.blob import BlobServiceClient

from tests.servers import stop

AZURITE_VERSION = "3.37.0"
AZURITE_DIR = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trainmover" / \
    f"azurite-{AZURITE_VERSION}"
"""Where the tests install Azurite with npm when `azurite-blob` is not on PATH."""
INSTALL = "install it with `npm install -g azurite` (Node.js's npm), or put azurite-blob on PATH"
DEV_ACCOUNT = "devstoreaccount1"
DEV_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
"""Azurite's well-known development account and key (https://learn.microsoft.com/azure/storage/common/storage-use-azurite)."""
START_S = 60.0


def azurite_blob() -> str:
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, process: subprocess.Popen[bytes], timeout_s: float) -> bool:
    """Whether `port` accepts a connection before `timeout_s` passes (False at once if `process` exits)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.05)
    return False



@contextlib.contextmanager
def azurite_service(*containers: str, oauth_tls: tuple[Path, Path] | None = None) -> Iterator[str]:
    """Azurite's blob service on a free port of 127.0.0.1 with `containers` made, stopped afterwards; yields the
    connection string of its development account.

    `oauth_tls` (certificate, key): HTTPS with that certificate, and Azure AD bearer tokens accepted beside the
    account key (`--oauth basic`: a token's audience, issuer and lifetime are checked, not its signature), which is
    what Get User Delegation Key needs. The clients must then trust the certificate (`connection_verify`)."""

    command = azurite_blob()
    port = free_port()
    tls = ["--oauth", "basic", "--cert", str(oauth_tls[0]), "--key", str(oauth_tls[1])] if oauth_tls else []
    scheme = "https" if oauth_tls else "http"
    with tempfile.TemporaryDirectory(prefix="tm-azurite-") as workspace:
        log_path = Path(workspace) / "azurite.log"
        with open(log_path, "wb") as log:
            t0 = time.monotonic()
            process = subprocess.Popen(
                [command, "--silent", "--inMemoryPersistence", "--disableTelemetry", "--skipApiVersionCheck",
                 "--blobHost", "127.0.0.1", "--blobPort", str(port), *tls],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=workspace)
        try:
            if not wait_for_port(port, process, START_S):
                output = log_path.read_text(errors="replace").strip()[-1000:]
                pytest.fail(f"Azurite ({command}) did not answer on port {port} within {START_S:.0f} s (exit code "
                            f"{process.poll()}; its output: {output or 'none'}): {INSTALL}")
            print(f"Azurite's blob service answered in {time.monotonic() - t0:.2f} s")
            connection_string = (f"DefaultEndpointsProtocol={scheme};AccountName={DEV_ACCOUNT};AccountKey={DEV_KEY};"
                                 f"BlobEndpoint={scheme}://127.0.0.1:{port}/{DEV_ACCOUNT};")
            verify = {"connection_verify": str(oauth_tls[0])} if oauth_tls else {}
            service = BlobServiceClient.from_connection_string(connection_string, **verify)
            for name in containers:
                service.create_container(name)
            yield connection_string
        finally:
            stop(process)


def azurite_fixture(container: str) -> Any:
    """A test module's `azurite` fixture (`azurite = azurite_fixture(CONTAINER)`): Azurite's blob service with
    `container` made, started once for the module; it yields the development account's connection string."""

    @pytest.fixture(scope="module")
    def azurite() -> Iterator[str]:
        with azurite_service(container) as connection_string:
            yield connection_string

    return azurite
