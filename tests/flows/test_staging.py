"""An AWS job's hosts install the orchestrator's own TrainMover wheel and fetch the training script from the job's S3
prefix (`flows.hosts.S3Staging`, `TrainingRun.artifact_bucket`), never TrainMover by name from a package index; the
release deletes what was staged. Against moto's server over HTTP (behind the recording proxy, as in
test_cloud_flow.py): the user data of every instance moto launched carries presigned URLs and SHA-256 digests of the
wheel and the script; those URLs give exactly those files, with no credentials, while the job runs; nothing of the
job is left in the bucket after the release, nor after the sweep releases a job whose run died.

The wheel is built once for the module (`cloud.artifacts.build_wheel`, for real); a run's own build copies it.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
import shlex
import shutil
import socket
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError

from cloud.artifacts import PROJECT_ROOT, S3_PREFIX, build_wheel, sha256_of
from tests.cloud.aws_servers import FaultProxy, PlacementGroups, fault_proxy, moto_server
from tests.flows.cloud_runs import AWS_LAUNCH

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_mlp.py"
REGION = "us-east-1"
BUCKET = "team-artifacts"
PROFILE = "trainmover-node-staging"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("dist"))


@pytest.fixture
def builds(wheel: Path, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Each run's own build (`flows.hosts.run_wheel`) gets the module's wheel, copied where the run builds it; the list
    holds every build a run asked for."""
    asked: list[Path] = []

    def build(out_dir: Path, project: Path = PROJECT_ROOT) -> Path:
        out_dir.mkdir(parents=True, exist_ok=True)
        asked.append(Path(shutil.copyfile(wheel, out_dir / wheel.name)))
        return asked[-1]

    monkeypatch.setattr("flows.hosts.build_wheel", build)
    return asked


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, FaultProxy]]:
    """moto's server behind the recording proxy (which answers the placement-group calls moto lacks), the SDK's
    standard chain pointed at the proxy by the environment, and the job's bucket and instance profile made."""
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    with moto_server() as url, fault_proxy(url) as proxy:
        PlacementGroups().install(proxy)
        for name, value in {
            "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "not-a-real-secret",
            "AWS_DEFAULT_REGION": REGION, "AWS_ENDPOINT_URL": proxy.url,
        }.items():
            monkeypatch.setenv(name, value)
        # moto's backends are the whole test process's: made once, and each test looks at its own job's keys only.
        with contextlib.suppress(ClientError):
            boto3.client("s3", endpoint_url=url, region_name=REGION).create_bucket(Bucket=BUCKET)
        with contextlib.suppress(ClientError):
            boto3.client("iam", endpoint_url=url, region_name=REGION).create_instance_profile(
                InstanceProfileName=PROFILE)
        yield url, proxy


def _keys(moto_url: str, job: str) -> list[str]:
    """The keys of `job`'s staged files in the bucket, whatever prefix they are under."""
    s3 = boto3.client("s3", endpoint_url=moto_url, region_name=REGION)
    return sorted(o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET).get("Contents", []) if f"/{job}/" in o["Key"])


def _fetches(user_data: str) -> dict[str, tuple[str, str]]:
    """What the installer in a cloud-init document fetches: file name -> (URL, SHA-256)."""
    config = json.loads(user_data.removeprefix("#cloud-config\n"))
    install = next(f["content"] for f in config["write_files"] if f["path"].endswith("/bin/install"))
    out = {}
    for line in install.splitlines():
        if line.startswith("tm_fetch "):
            _, url, sha256, dest = shlex.split(line)
            out[dest.rsplit("/", 1)[-1]] = (url, sha256)
    return out


def _get(url: str, moto_url: str) -> bytes:
    """GET a presigned URL with no credentials, straight from moto (the signed Host header kept: the proxy's)."""
    parts = urllib.parse.urlsplit(url)
    direct = parts._replace(netloc=urllib.parse.urlsplit(moto_url).netloc).geturl()
    with urllib.request.urlopen(urllib.request.Request(direct, headers={"Host": parts.netloc}), timeout=10) as r:
        body: bytes = r.read()
    return body


def _run(job: str, **fields: Any) -> Any:
    from flows.models import StandbyLimits, TrainingRun

    return TrainingRun(**{
        "job_id": job, "provider": "aws", "region": REGION, "instance_type": "g5.xlarge", "workers": 2,
        "standby": StandbyLimits(min_warm=1, max_warm=1, max_stopped=0), "script": "examples/train_mlp.py",
        **AWS_LAUNCH, "coordinator_address": "127.0.0.1", "instance_profile": PROFILE, **fields,
    })


@pytest.mark.usefixtures("prefect_harness")
def test_an_aws_run_stages_its_own_wheel_and_script_for_its_hosts_and_the_release_deletes_them(
    aws: tuple[str, FaultProxy], builds: list[Path], wheel: Path
) -> None:
    from flows.training import resilient_training

    url, proxy = aws
    job = "staged-flow"
    digests = {wheel.name: sha256_of(wheel), SCRIPT.name: sha256_of(SCRIPT)}
    at_launch: list[Any] = []

    def look(params: dict[str, Any]) -> bool:
        """At each launch, before moto sees it: what the bucket holds, and what the user data's URLs give."""
        if str(params.get("DryRun", "")).lower() != "true":
            try:
                fetched = {name: hashlib.sha256(_get(u, url)).hexdigest()
                           for name, (u, _) in _fetches(base64.b64decode(params["UserData"]).decode()).items()}
                at_launch.append((_keys(url, job), fetched))
            except Exception as exc:  # seen by the assertion below, not lost in the proxy's thread
                at_launch.append(repr(exc))
        return False  # never answered here: every launch goes on to moto

    proxy.fail("RunInstances", "Unused", status=500, times=1000, when=look)
    run = _run(job, hosts_wait_s=5, artifact_bucket=BUCKET)
    state = resilient_training(run=run, max_wall_s=120.0, return_state=True)
    assert state.is_failed(), state  # moto runs no instance: no agent joins (test_cloud_flow.py)
    with pytest.raises(RuntimeError, match=r"0 of 3 agents joined within 5 s"):
        state.result()

    # Every instance's user data, as moto keeps it: the staged wheel and script, each with its URL and digest.
    ec2 = boto3.client("ec2", endpoint_url=url, region_name=REGION)
    tagged = [{"Name": "tag:trainmover:job", "Values": [job]}]
    reservations = ec2.describe_instances(Filters=tagged)["Reservations"]
    instances = [i["InstanceId"] for r in reservations for i in r["Instances"]]
    assert len(instances) == 3
    for instance_id in instances:
        encoded = ec2.describe_instance_attribute(InstanceId=instance_id, Attribute="userData")["UserData"]["Value"]
        user_data = base64.b64decode(encoded).decode()
        fetches = _fetches(user_data)
        assert {name: sha for name, (_, sha) in fetches.items()} == digests
        for name, (u, _) in fetches.items():
            assert f"/{BUCKET}/{S3_PREFIX}/{job}/{name}?" in u and "Signature=" in u, "a presigned URL of the job's"
        assert "--no-index" in user_data and "trainmover==" not in user_data, "nothing installed by name"
        assert str(SCRIPT) in user_data, "the script lands at the path the coordinator runs"
    # While the job ran, the bucket held the two files and the URLs gave them, intact, to anyone holding the URL.
    staged = sorted(f"{S3_PREFIX}/{job}/{name}" for name in digests)
    assert at_launch and all(seen == (staged, digests) for seen in at_launch), at_launch
    assert len(builds) == 1, "one build per run"
    # Released: nothing of the job is left in the bucket.
    assert _keys(url, job) == []


def test_each_launch_signs_the_staged_files_anew_and_the_release_deletes_them(
    aws: tuple[str, FaultProxy], builds: list[Path], wheel: Path, tmp_path: Path
) -> None:
    from flows.hosts import STAGING_FILE, job_hosts
    from flows.training import make_provider

    url, _ = aws
    job = "staged-hosts"
    run = _run(job, artifact_bucket=BUCKET, artifact_prefix="ml/jobs")
    hosts = job_hosts(run, make_provider(run), tmp_path)
    assert hosts is not None and hosts.staging is not None
    hosts.prepare(run, "f" * 64, SCRIPT)
    assert _keys(url, job) == sorted([f"ml/jobs/{job}/{wheel.name}", f"ml/jobs/{job}/train_mlp.py"])
    assert json.loads((tmp_path / STAGING_FILE).read_text())["bucket"] == BUCKET, "for the sweep, if this run dies"
    for _ in range(2):
        spec = hosts.launch_options()["bootstrap"]
        assert spec.script == str(SCRIPT) and spec.script_file.name == SCRIPT.name
        for artifact, source in ((spec.wheel, wheel), (spec.script_file, SCRIPT)):
            assert _get(artifact.url, url) == source.read_bytes()
            assert artifact.sha256 == sha256_of(source)
    # Staging again builds nothing: the run's wheel is kept in its work directory.
    hosts.staging.stage(SCRIPT)
    assert len(builds) == 1

    hosts.close()
    assert _keys(url, job) == [] and not (tmp_path / STAGING_FILE).exists()
    hosts.close()  # a second release is harmless


def test_without_a_bucket_an_aws_run_installs_the_pinned_source_and_says_why_a_staged_wheel_is_safer(
    aws: tuple[str, FaultProxy], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from flows.hosts import job_hosts
    from flows.training import make_provider

    run = _run("pinned-only")
    with caplog.at_level(logging.WARNING, logger="trainmover.flows"):
        hosts = job_hosts(run, make_provider(run), tmp_path)
    assert hosts is not None and hosts.staging is None
    (warning,) = [r.getMessage() for r in caplog.records if "artifact_bucket" in r.getMessage()]
    assert "from the public package index" in warning and "SHA-256" in warning
    hosts.prepare(run, "f" * 64, SCRIPT)
    spec = hosts.launch_options()["bootstrap"]
    assert spec.wheel is None and spec.script_file is None and spec.source.startswith("trainmover==")
    hosts.close()


def test_a_bucket_that_does_not_exist_stops_the_run_before_any_launch_naming_it(
    aws: tuple[str, FaultProxy], builds: list[Path], tmp_path: Path
) -> None:
    from cloud.base import CloudError
    from flows.hosts import job_hosts
    from flows.training import make_provider

    _, proxy = aws
    run = _run("staged-nowhere", artifact_bucket="no-such-bucket")
    hosts = job_hosts(run, make_provider(run), tmp_path)
    assert hosts is not None
    with pytest.raises(CloudError, match=r"could not stage the job's wheel and script in "
                                         r"s3://no-such-bucket/trainmover-jobs/staged-nowhere/: .*NoSuchBucket"):
        hosts.prepare(run, "f" * 64, SCRIPT)
    hosts.close()  # what the supervisor's release does next: the secret goes, nothing else fails
    assert not proxy.seen("RunInstances")


@pytest.mark.parametrize(("fields", "says"), [
    ({"artifact_bucket": "Team_Artifacts"}, "invalid S3 bucket name"),
    ({"artifact_bucket": "ab"}, "invalid S3 bucket name"),
    ({"artifact_bucket": "team..artifacts"}, "invalid S3 bucket name"),
    ({"artifact_bucket": "192.168.10.12"}, "invalid S3 bucket name"),
    ({"artifact_bucket": "xn--team"}, "invalid S3 bucket name"),
    ({"artifact_bucket": "team-artifacts", "artifact_prefix": "jobs/*"}, "invalid S3 key prefix"),
    ({"artifact_bucket": "team-artifacts", "artifact_prefix": "/jobs"}, "invalid S3 key prefix"),
    ({"artifact_bucket": "team-artifacts", "artifact_prefix": "jobs/../other"}, "invalid S3 key prefix"),
    ({"artifact_bucket": "team-artifacts", "provider": "local", "region": None}, "only with provider 'aws'"),
])
def test_a_staging_place_that_s3_or_iam_would_misread_is_refused_at_submit(fields: dict[str, Any], says: str) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=says):
        _run("refused", **fields)
    assert _run("accepted", artifact_bucket="team.artifacts-1", artifact_prefix="ml/jobs_2").artifact_bucket


@pytest.mark.usefixtures("prefect_harness")
def test_the_sweep_deletes_the_files_a_dead_run_staged(
    aws: tuple[str, FaultProxy], builds: list[Path], tmp_path: Path
) -> None:
    from prefect import flow

    from flows.holdings import workdir_prefix
    from flows.hosts import STAGING_FILE, S3Staging
    from flows.jobrecord import JobRecord
    from flows.sweep import release_fleet

    url, _ = aws
    job = "staged-swept"
    workdir = tmp_path / f"{workdir_prefix(job)}dead"
    workdir.mkdir()
    S3Staging(job, BUCKET, S3_PREFIX, REGION, workdir).stage(SCRIPT)  # what the run did before it died
    assert len(_keys(url, job)) == 2
    record = JobRecord(job_id=job, flow_run_id=None, host=socket.gethostname(), workdir=str(workdir),
                       launcher_pid=0, store_host="127.0.0.1", store_port=0, secret_file=str(workdir / "job.secret"),
                       events=str(workdir / "events.jsonl"), provider="aws", region=REGION, on_instances=True)

    @flow(name="sweep-release-fleet")
    def release() -> list[str]:
        return release_fleet(record)

    assert release() == []
    assert _keys(url, job) == [] and not (workdir / STAGING_FILE).exists()
