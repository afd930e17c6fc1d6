"""An Azure job's hosts install the orchestrator's own TrainMover wheel and fetch the training script from the job's
blob container (`flows.hosts.BlobStaging`, `TrainingRun.artifact_container`), never TrainMover by name from a
package index; the release deletes what was staged. Against Azurite's blob service over HTTP (tests/azurite.py),
signed with its development account's key: the custom data of every launch carries read-only SAS URLs and the
SHA-256 of the wheel and the script; those URLs give exactly those files with no credentials, a URL whose signature
was changed gives nothing; each launch signs anew; after the release, or the sweep of a dead run, nothing of the job
is left in the container."""

from __future__ import annotations

import base64
import hashlib
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from azure.storage.blob import BlobServiceClient

from cloud.artifacts import AZ_CONNECTION_STRING, S3_PREFIX, build_wheel, sha256_of
from cloud.bootstrap import azure_custom_data, render_cloud_init
from tests.azurite import DEV_ACCOUNT, azurite_fixture
from tests.flows.cloud_runs import AZURE_LAUNCH
from tests.flows.test_staging import _fetches

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_mlp.py"
CONTAINER = "tm-staging"


azurite = azurite_fixture(CONTAINER)


@pytest.fixture
def container_url(azurite: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The SDK (here) signs with the development account's key; the staging container's URL."""
    monkeypatch.setenv(AZ_CONNECTION_STRING, azurite)
    return BlobServiceClient.from_connection_string(azurite).get_container_client(CONTAINER).url


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("dist"))


def _blobs(job: str) -> list[str]:
    service = BlobServiceClient.from_connection_string(os.environ[AZ_CONNECTION_STRING])
    return sorted(n for n in service.get_container_client(CONTAINER).list_blob_names() if f"/{job}/" in n)


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as r:
        body: bytes = r.read()
    return body


def _run(job: str, **fields: Any) -> Any:
    from flows.models import StandbyLimits, TrainingRun

    return TrainingRun(**{
        "job_id": job, "provider": "azure", "region": "eastus", "instance_type": "Standard_NC4as_T4_v3",
        "workers": 2, "standby": StandbyLimits(min_warm=1, max_warm=1, max_stopped=0),
        "script": "examples/train_mlp.py", "azure_subscription_id": "00000000-0000-0000-0000-000000000000",
        "azure_resource_group": "trainmover", **AZURE_LAUNCH, **fields,
    })


def _hosts(run: Any, workdir: Path, wheel: Path) -> Any:
    """The run's `JobHosts` as `job_hosts` makes them for Azure, with the job's secret in a local file instead of
    Key Vault (the staging is the subject here), and the module's wheel as the run's build."""
    from cloud.secrets import LocalFileStore
    from flows.hosts import BlobStaging, JobHosts

    staging = BlobStaging(run.job_id, run.artifact_container, run.artifact_prefix, workdir)
    (workdir / "wheel").mkdir(parents=True, exist_ok=True)
    (workdir / "wheel" / wheel.name).write_bytes(wheel.read_bytes())
    return JobHosts(LocalFileStore(workdir / "secrets"), "127.0.0.1", "trainmover==0", job_network=True,
                    staging=staging)


def test_an_azure_run_stages_its_own_wheel_and_script_for_its_hosts_and_the_release_deletes_them(
    container_url: str, wheel: Path, tmp_path: Path
) -> None:
    job = "staged-azure"
    run = _run(job, artifact_container=container_url)
    hosts = _hosts(run, tmp_path, wheel)
    digests = {wheel.name: sha256_of(wheel), SCRIPT.name: sha256_of(SCRIPT)}
    hosts.prepare(run, "s" * 64, SCRIPT)
    try:
        assert _blobs(job) == sorted(f"{S3_PREFIX}/{job}/{name}" for name in digests)
        seen = []
        for _ in range(2):  # two launches: each signs the staged files anew
            spec = hosts.launch_options()["bootstrap"]
            document = base64.b64decode(azure_custom_data(render_cloud_init(spec))).decode()
            fetches = _fetches(document)
            assert {name: sha for name, (_, sha) in fetches.items()} == digests
            assert "--no-index" in document and "trainmover==" not in document, "nothing installed by name"
            for name, (url, _) in fetches.items():
                assert f"/{DEV_ACCOUNT}/{CONTAINER}/{S3_PREFIX}/{job}/{name}?" in url
                assert "sig=" in url and "sp=r&" in url, "signed, for reading only"
                assert hashlib.sha256(_get(url)).hexdigest() == digests[name], "the URL gives the file, intact"
                forged = url.replace("sp=r", "sp=rw")  # the same URL asking for more than was signed
                with pytest.raises(urllib.error.HTTPError) as refused:
                    _get(forged)
                assert refused.value.code == 403
            seen.append({name: url for name, (url, _) in fetches.items()})
            hosts.staging.signer().ttl_s += 3600  # a later launch's URLs live to a later moment (same second here)
        assert seen[0] != seen[1], "signed anew for the second launch"
        assert repr(spec.wheel).count("sig=") == 0, "a SAS URL is never shown whole"
    finally:
        hosts.close()
    assert _blobs(job) == [], "released: nothing of the job is left in the container"
    assert not (tmp_path / "staging.json").exists()


def test_the_sweep_deletes_the_files_a_dead_azure_run_staged(container_url: str, wheel: Path, tmp_path: Path) -> None:
    from flows.hosts import delete_staged_files

    job = "dead-azure"
    hosts = _hosts(_run(job, artifact_container=container_url, artifact_prefix="team/jobs"), tmp_path, wheel)
    hosts.staging.stage(SCRIPT)  # the run died here: nothing released
    assert len(_blobs(job)) == 2 and (tmp_path / "staging.json").exists()
    said = delete_staged_files(tmp_path, job)
    assert said == f"2 staged file(s) deleted from {container_url}/team/jobs/{job}/", said
    assert _blobs(job) == [] and not (tmp_path / "staging.json").exists()


def test_a_container_the_credentials_cannot_write_stops_the_staging_naming_it(
    container_url: str, wheel: Path, tmp_path: Path
) -> None:
    from cloud.base import CloudError

    missing = container_url.rsplit("/", 1)[0] + "/no-such-container"
    hosts = _hosts(_run("nowhere", artifact_container=missing), tmp_path, wheel)
    with pytest.raises(CloudError, match=r"could not stage the job's wheel and script in .*/no-such-container/"
                                         r"trainmover-jobs/nowhere/: .*run\.artifact_container") as raised:
        hosts.staging.stage(SCRIPT)
    assert os.environ[AZ_CONNECTION_STRING] not in str(raised.value) and "AccountKey" not in str(raised.value)


@pytest.mark.parametrize(("fields", "says"), [
    ({"artifact_container": "https://a.blob.core.windows.net/Bad_Name"}, "invalid blob container URL"),
    ({"artifact_container": "https://a.blob.core.windows.net/team-artifacts?sig=x"}, "invalid blob container URL"),
    ({"artifact_container": "https://a.blob.core.windows.net/team-artifacts", "artifact_prefix": "a/../b"},
     "invalid blob name prefix"),
])
def test_a_staging_container_azure_would_misread_is_refused_at_submit(fields: dict[str, Any], says: str) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=says):
        _run("refused", **fields)


def test_a_container_on_an_aws_run_is_refused_at_submit() -> None:
    from pydantic import ValidationError

    from flows.models import TrainingRun
    from tests.flows.cloud_runs import AWS_LAUNCH

    fields: dict[str, Any] = {"job_id": "refused", "provider": "aws", "region": "us-east-1",
                              "instance_type": "g5.xlarge", "workers": 2, "script": "examples/train_mlp.py",
                              **AWS_LAUNCH, "artifact_container": "https://a.blob.core.windows.net/team-artifacts"}
    with pytest.raises(ValidationError, match="set it only with provider 'azure'"):
        TrainingRun(**fields)
