"""Fixtures the cloud tests share: moto's server, the placement groups and the IAM policy simulator moto lacks, and
AWS settings that keep this machine's own AWS configuration out."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cloud.aws_servers import IamSimulator, PlacementGroups, moto_server


@pytest.fixture(scope="module")
def moto_url() -> Iterator[str]:
    """moto's server over HTTP, one per test module."""
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's server logs every request otherwise
    with moto_server() as url:
        yield url


@pytest.fixture(scope="module")
def placement_groups() -> PlacementGroups:
    """The region's placement groups (moto has none), behind every proxy of a module."""
    return PlacementGroups()


@pytest.fixture(scope="module")
def iam_simulator() -> IamSimulator:
    """IAM's policy simulator and STS's caller (moto has the one, not the other as AWS answers it), behind every
    proxy of a module that installs it."""
    return IamSimulator()


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Fake keys for the local server, as the CLI reads them; nothing of this machine's AWS setup leaks in."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.fixture
def vault(tmp_path: Path) -> Iterator[tuple[Any, Any]]:
    """A local Key Vault (tests.cloud.keyvault_server) and a store that reads and writes it: (server, store)."""
    from cloud.secrets import AzureKeyVaultStore
    from tests.cloud.keyvault_server import key_vault
    from tests.cloud.test_azure import FAST, FakeVaultCredential

    (tmp_path / "kv").mkdir()
    with key_vault(tmp_path / "kv") as (server, _):
        yield server, AzureKeyVaultStore(server.url, credential=FakeVaultCredential(server.tokens.issue()),
                                         budget=FAST, ssl_context=server.client_ssl_context())
