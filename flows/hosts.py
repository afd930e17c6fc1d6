"""How a job's instances become its hosts (`TrainingRun.on_instances`): the flow's machine runs the coordinator
alone (`trainmover coordinator`), and every instance the job launches boots `trainmover agent` and joins it.

`JobHosts` holds what that takes, made once per run by `job_hosts`:

- where the job's secret goes, for the hosts to fetch with their own identity (never in user-data): SSM Parameter
  Store (SecureString) on AWS, Key Vault on Azure, a mode-600 file on this machine for local hosts;
- the address the coordinator listens on, which the hosts reach: `TrainingRun.coordinator_address` in the cloud,
  the local hosts' own (127.0.0.1, or the namespaces' bridge);
- what the hosts install: with `run.artifact_bucket` (AWS) or `run.artifact_container` (Azure), this orchestrator's
  own TrainMover wheel (built once per run in its work directory) and the training script, staged under the job's
  S3 prefix with presigned URLs, or in the job's blob container with read-only SAS URLs, and their SHA-256
  (`S3Staging`, `BlobStaging`, cloud.artifacts); otherwise the pinned TrainMover source, from the package index;
- (AWS) the job's own security group and cluster placement group (`cloud.base.JobNetwork`);
- how many training processes each host runs (`slots`): one per accelerator of the run's instance type, as its
  provider describes the type (`Provider.accelerators`, cloud.accelerators), 1 on a CPU type. A run of `workers`
  ranks then needs `hosts_for(workers, slots)` worker hosts, and each standby host holds `slots` standbys.

`JobHosts.prepare` stores the secret, stages the job's files and fixes the ports; `launch_options` is what every
`LaunchRequest` of the job then carries (the bootstrap, its URLs signed anew, the network); `placement` is where
the coordinator waits for them; `close` deletes the secret and the staged files and removes local hosts. The
supervisor (`flows.supervisor`) calls them in that order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import json
import logging
import math
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from cloud.artifacts import (
    AZ_CONNECTION_STRING,
    Artifact,
    BlobSigner,
    build_wheel,
    delete_blobs,
    delete_s3,
    parse_container_url,
    presign_s3,
    sign_blobs,
    stage_blob,
    stage_s3,
)
from cloud.base import DESCRIBE, MUTATE, CloudError, InvalidRequestError, JobNetwork, Provider
from cloud.bootstrap import MAX_SLOTS, AgentBootstrap
from cloud.local.hosts import LocalHosts, NamespaceHosts, ProcessHosts
from cloud.secrets import JobSecretStore, LocalFileStore, SecretRef
from flows.models import TrainingRun
from runtime.client import Placement

log = logging.getLogger("trainmover.flows")


def installed_source() -> str:
    """This machine's TrainMover, pinned: what every host installs unless the run names another."""
    try:
        return f"trainmover=={importlib.metadata.version('trainmover')}"
    except importlib.metadata.PackageNotFoundError:
        return "trainmover==0.1.0"


def free_port(address: str) -> int:
    """A TCP port free on `address` now (the coordinator binds it a moment later)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


def host_slots(run: TrainingRun, provider: Provider) -> int:
    """Training processes per host of `run`: one per accelerator of `run.instance_type` (the provider's own
    instance-type data), 1 on a CPU type. Every host of a job boots with the same `--slots`, so each of
    `run.fallback_instance_types` must have as many; InvalidRequestError, before anything launches, otherwise."""
    found = provider.accelerators(run.instance_type)
    if found.slots > MAX_SLOTS:
        raise InvalidRequestError(
            f"{run.instance_type} has {found.count} accelerators per instance; a host runs at most {MAX_SLOTS} "
            "processes: pick a smaller type", provider=provider.name, code="InvalidSlots",
        )
    for other in run.fallback_instance_types:
        theirs = provider.accelerators(other)
        if theirs.slots != found.slots:
            raise InvalidRequestError(
                f"fallback instance type {other} has {theirs.count} accelerator(s) per instance and "
                f"{run.instance_type} {found.count}: every host of a job runs as many training processes "
                "(`trainmover agent --slots`), so list fallback types with the same accelerators",
                provider=provider.name, code="InvalidFallback",
            )
    if run.provider == "aws" and found.efa and not run.efa:
        log.warning("%s takes Elastic Fabric Adapters but run.efa is off: NCCL between its hosts runs over TCP; "
                    "set efa: true (and a subnet) for GPUDirect RDMA", run.instance_type)
    return found.slots


def hosts_for(ranks: int, slots: int) -> int:
    """Hosts of `slots` slots each that hold `ranks` processes: a run of 16 ranks on 8-GPU hosts needs 2, of 12
    needs 2 as well (the last host's 4 free slots stay free unless the standby hosts are full)."""
    if ranks < 0 or slots < 1:
        raise ValueError(f"hosts_for needs ranks >= 0 and slots >= 1, got {ranks} and {slots}")
    return math.ceil(ranks / slots)


STAGING_FILE = "staging.json"
"""Where a job's files are staged, in its work directory: written before the first upload, so that the sweep
(`flows.sweep`) finds them after the run that staged them died; removed once they are deleted."""
STAGING_VERSION = 1
WHEEL_DIR = "wheel"
"""The run's wheel, in its work directory: built once per run (`run_wheel`)."""


def run_wheel(workdir: Path) -> Path:
    """This orchestrator's TrainMover wheel (cloud.artifacts.build_wheel), built once per run in its work directory."""
    built = sorted((workdir / WHEEL_DIR).glob("trainmover-*.whl"))
    return built[0] if len(built) == 1 else build_wheel(workdir / WHEEL_DIR)


class _S3Calls:
    """The S3 calls `cloud.artifacts` makes, through the one boto3 adapter (`cloud.aws.client.AwsApi`): each error a
    `CloudError`, each call retried within a named budget."""

    def __init__(self, api: Any) -> None:
        self._api = api

    def put_object(self, **params: Any) -> dict[str, Any]:
        body: Any = params.get("Body")
        if hasattr(body, "read"):
            params["Body"] = body.read()  # bytes: a retried call sends the whole file again, not the rest of a stream
        result: dict[str, Any] = self._api.call("s3", "put_object", MUTATE, **params)
        return result

    def generate_presigned_url(self, operation: str, **params: Any) -> str:
        url: str = self._api.client("s3").generate_presigned_url(operation, **params)  # signed here, no request
        return url

    def list_objects_v2(self, **params: Any) -> dict[str, Any]:
        result: dict[str, Any] = self._api.call("s3", "list_objects_v2", DESCRIBE, **params)
        return result

    def delete_object(self, **params: Any) -> dict[str, Any]:
        result: dict[str, Any] = self._api.call("s3", "delete_object", MUTATE, **params)
        return result


@dataclass(slots=True)
class S3Staging:
    """AWS, `run.artifact_bucket`: the job's TrainMover wheel and training script, staged under
    `s3://bucket/prefix/JOB/` for its hosts (cloud.artifacts). The hosts fetch them over presigned URLs, with no
    AWS permission of their own, and check their SHA-256; the orchestrator's credentials put, sign and delete."""

    job_id: str
    bucket: str
    prefix: str
    region: str
    workdir: Path
    """The run's work directory: the wheel is built there once per run, and the staging record kept there."""
    session: Any = None
    """A boto3 session (a credentials block's), or None for the SDK's standard chain."""
    _calls: _S3Calls | None = None

    def s3(self) -> _S3Calls:
        if self._calls is None:
            from cloud.aws.client import AwsApi

            self._calls = _S3Calls(AwsApi(self.region, self.session, None))
        return self._calls

    @property
    def location(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}/{self.job_id}/"

    def stage(self, script: Path) -> tuple[Artifact, Artifact]:
        """Upload the run's wheel and `script` under the job's prefix; their artifacts (URLs signed now)."""
        wheel = run_wheel(self.workdir)
        record = {"version": STAGING_VERSION, "job_id": self.job_id, "bucket": self.bucket, "prefix": self.prefix,
                  "region": self.region}
        (self.workdir / STAGING_FILE).write_text(json.dumps(record))
        try:
            staged = stage_s3([wheel, script], job_id=self.job_id, bucket=self.bucket, prefix=self.prefix,
                              client=self.s3())
        except CloudError as exc:  # the same kind (a denial stays a denial), saying which setting it was
            raise type(exc)(f"could not stage the job's wheel and script in {self.location}: {exc} "
                            f"(run.artifact_bucket must be a bucket in {self.region} these credentials may write "
                            "to: docs/cloud-aws.md)", provider="aws", code=exc.code) from exc
        log.info("job %s: staged %s in %s", self.job_id, ", ".join(a.name for a in staged), self.location)
        return staged[0], staged[1]

    def resign(self, artifacts: tuple[Artifact, ...]) -> list[Artifact]:
        """The staged files with URLs signed now, for a launch later than the first (cloud.artifacts.presign_s3)."""
        return presign_s3(artifacts, job_id=self.job_id, bucket=self.bucket, prefix=self.prefix, client=self.s3())

    def delete(self) -> int:
        """Delete every staged file of the job (a partial upload's, and those of a run of the job before this one,
        included); how many there were."""
        deleted = delete_s3(job_id=self.job_id, bucket=self.bucket, prefix=self.prefix, client=self.s3())
        (self.workdir / STAGING_FILE).unlink(missing_ok=True)
        return deleted


T = TypeVar("T")


def _blob_call(what: str, call: Callable[[], T]) -> T:
    """`call()`, its Azure SDK error a CloudError that says what could not be done (never the request's URL: it may
    carry a signature)."""
    from azure.core.exceptions import AzureError

    try:
        return call()
    except AzureError as exc:
        reason = getattr(exc, "reason", None) or type(exc).__name__
        raise CloudError(f"could not {what}: {reason} (run.artifact_container must be a container these credentials "
                         "may write to: docs/cloud-azure.md)", provider="azure", code=type(exc).__name__) from None


@dataclass(slots=True)
class BlobStaging:
    """Azure, `run.artifact_container`: the job's TrainMover wheel and training script, staged as blobs
    `prefix/JOB/NAME` of the container for its hosts (cloud.artifacts). The hosts fetch them over read-only SAS URLs,
    with no Azure permission of their own, and check their SHA-256; the orchestrator's credentials upload, sign and
    delete: `AZURE_STORAGE_CONNECTION_STRING` when set (its account key signs), else `credential` (Azure AD: a user
    delegation key signs, which needs a data role on the account such as Storage Blob Data Contributor)."""

    job_id: str
    container_url: str
    prefix: str
    workdir: Path
    credential: Any = None
    _signer: BlobSigner | None = None

    def signer(self) -> BlobSigner:
        if self._signer is None:
            from azure.storage.blob import BlobServiceClient, ContainerClient

            account_url, container = parse_container_url(self.container_url, self.prefix)
            connection_string = os.environ.get(AZ_CONNECTION_STRING, "")
            if connection_string:
                try:
                    client = BlobServiceClient.from_connection_string(connection_string).get_container_client(container)
                except ValueError:  # its message is not repeated: it may quote the string
                    raise InvalidRequestError(f"{AZ_CONNECTION_STRING} is not a storage account's connection string",
                                              provider="azure", code="InvalidArtifact") from None
                if client.url.rstrip("/") != self.container_url.rstrip("/"):
                    raise InvalidRequestError(
                        f"{AZ_CONNECTION_STRING} names another account than run.artifact_container "
                        f"{self.container_url}: unset it, or stage in a container of its account",
                        provider="azure", code="InvalidArtifact")
            else:
                if self.credential is None:
                    from azure.identity import DefaultAzureCredential

                    self.credential = DefaultAzureCredential()
                client = ContainerClient(account_url, container, credential=self.credential)
            self._signer = BlobSigner(client)
        return self._signer

    @property
    def location(self) -> str:
        return f"{self.container_url.rstrip('/')}/{self.prefix}/{self.job_id}/"

    def stage(self, script: Path) -> tuple[Artifact, Artifact]:
        """Upload the run's wheel and `script` under the job's prefix; their artifacts (URLs signed now)."""
        wheel = run_wheel(self.workdir)
        record = {"version": STAGING_VERSION, "job_id": self.job_id, "container_url": self.container_url,
                  "prefix": self.prefix}
        (self.workdir / STAGING_FILE).write_text(json.dumps(record))
        staged = _blob_call(f"stage the job's wheel and script in {self.location}", lambda: stage_blob(
            [wheel, script], job_id=self.job_id, prefix=self.prefix, signer=self.signer()))
        log.info("job %s: staged %s in %s", self.job_id, ", ".join(a.name for a in staged), self.location)
        return staged[0], staged[1]

    def resign(self, artifacts: tuple[Artifact, ...]) -> list[Artifact]:
        """The staged files with URLs signed now (cloud.artifacts.sign_blobs)."""
        return _blob_call(f"sign the staged files in {self.location}", lambda: sign_blobs(
            artifacts, job_id=self.job_id, prefix=self.prefix, signer=self.signer()))

    def delete(self) -> int:
        """Delete every staged file of the job; how many there were."""
        deleted = _blob_call(f"delete the staged files in {self.location}", lambda: delete_blobs(
            job_id=self.job_id, prefix=self.prefix, container=self.signer().container))
        (self.workdir / STAGING_FILE).unlink(missing_ok=True)
        return deleted


def delete_staged_files(workdir: Path, job_id: str, session: Any = None, credential: Any = None) -> str:
    """The sweep's part: delete the files a run of `job_id` staged, as its staging record in `workdir` names them;
    what was done, in words. Never raises."""
    path = Path(workdir) / STAGING_FILE
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return "no staged files recorded"
    except (OSError, ValueError) as exc:
        return f"staged files not deleted: unreadable staging record {path} ({exc})"
    if not isinstance(record, dict) or record.get("version") != STAGING_VERSION or record.get("job_id") != job_id:
        return f"staged files not deleted: {path} is not a staging record of job {job_id}"
    staging: S3Staging | BlobStaging
    try:
        if "container_url" in record:
            staging = BlobStaging(job_id, str(record["container_url"]), str(record["prefix"]), Path(workdir),
                                  credential=credential)
        else:
            staging = S3Staging(job_id, str(record["bucket"]), str(record["prefix"]), str(record["region"]),
                                Path(workdir), session=session)
    except KeyError as exc:
        return f"staged files not deleted: {path} lacks {exc}"
    try:
        return f"{staging.delete()} staged file(s) deleted from {staging.location}"
    except (CloudError, OSError) as exc:
        return f"could not delete the staged files in {staging.location}: {exc}"


@dataclass(slots=True)
class JobHosts:
    """What makes a job's instances its hosts (see the module docstring)."""

    store: JobSecretStore
    coordinator_host: str
    source: str
    job_network: bool = False
    local_hosts: LocalHosts | None = None
    slots: int = 1
    """Training processes per host (`host_slots`): every instance boots `trainmover agent --slots` this."""
    secret_ref: SecretRef | None = None
    store_port: int = 0
    agent_port: int = 0
    bootstrap: AgentBootstrap | None = None
    network: JobNetwork | None = field(default=None)
    staging: S3Staging | BlobStaging | None = None
    """With `run.artifact_bucket` (AWS) or `run.artifact_container` (Azure): where the job's wheel and script are
    staged; None: the hosts install `source` from the package index."""

    def prepare(self, run: TrainingRun, secret: str, script: Path) -> None:
        """Store the job's secret where its hosts fetch it, stage the job's wheel and script (`staging`) and fix the
        coordinator's ports (before any launch)."""
        self.secret_ref = self.store.put(run.job_id, secret)
        wheel = script_file = None
        if self.staging is not None:
            wheel, script_file = self.staging.stage(script.resolve())
        self.store_port = free_port(self.coordinator_host)  # the coordinator listens on this machine's address
        self.agent_port = free_port(self.coordinator_host)
        self.bootstrap = AgentBootstrap(
            job_id=run.job_id,
            coordinator_host=self.coordinator_host,
            agent_port=self.agent_port,
            slots=self.slots,
            source=self.source,
            secret=self.secret_ref,
            script=str(script.resolve()),
            script_args=tuple(run.script_args),
            efa=run.efa,
            notices=run.provider if run.provider in ("aws", "azure") else None,
            wheel=wheel,
            script_file=script_file,
            orphan_deallocate=run.provider == "azure",
        )
        if self.job_network:
            self.network = JobNetwork(
                store_port=self.store_port, agent_port=self.agent_port, cluster_placement=run.cluster_placement
            )

    def launch_options(self) -> dict[str, Any]:
        """The `LaunchRequest` fields every launch of the job carries. Staged files' URLs are signed anew for each
        launch: a replacement launched a day later, or after the credentials that signed the first URLs expired,
        still fetches them."""
        assert self.bootstrap is not None, "prepare() first"
        spec = self.bootstrap
        if self.staging is not None and spec.wheel is not None and spec.script_file is not None:
            wheel, script_file = self.staging.resign((spec.wheel, spec.script_file))
            self.bootstrap = dataclasses.replace(spec, wheel=wheel, script_file=script_file)
        return {"bootstrap": self.bootstrap, "network": self.network, "efa": self.bootstrap.efa}

    def placement(self, run: TrainingRun, *, agents: int) -> Placement:
        """Where the job's coordinator waits for its `agents` instances' agents (runtime.client)."""
        return Placement(job_id=run.job_id, agents=agents, host=self.coordinator_host, port=self.store_port,
                         agent_port=self.agent_port, agents_wait_s=run.hosts_wait_s)

    def close(self) -> None:
        """Delete the job's secret and its staged files, and remove local hosts. Never raises: it runs while a job is
        released."""
        ref = self.secret_ref
        if ref is not None:
            try:
                self.store.delete(ref)
                self.secret_ref = None
            except CloudError as exc:
                log.warning("could not delete the job's secret (%s): %s", ref.kind, exc)
        if self.staging is not None:  # also after a re-attach: the job's prefix, whichever run staged there
            try:
                self.staging.delete()
            except (CloudError, OSError) as exc:
                log.warning("could not delete the staged files of job %s (delete %s by hand): %s",
                            self.staging.job_id, self.staging.location, exc)
        if self.local_hosts is not None:
            with contextlib.suppress(Exception):
                self.local_hosts.close()


def job_hosts(run: TrainingRun, provider: Provider, workdir: Path, provider_options: dict[str, Any] | None = None
              ) -> JobHosts | None:
    """The run's `JobHosts`, or None when the job runs on the flow's machine (`hosts='orchestrator'`). For local
    hosts it attaches them to the provider (which then boots every bootstrapped instance into one). Every host runs
    `host_slots(run, provider)` training processes."""
    if not run.on_instances:
        return None
    options = provider_options or {}
    slots = host_slots(run, provider)  # before anything is made: a type the provider refuses stops the run here
    if run.provider == "local":
        from cloud.local import LocalProvider

        assert isinstance(provider, LocalProvider)
        logs = Path(workdir) / "hosts"
        hosts: LocalHosts = NamespaceHosts(logs) if run.hosts == "namespaces" else ProcessHosts(logs)
        provider.attach_hosts(hosts)
        return JobHosts(LocalFileStore(Path(workdir) / "secrets"), hosts.coordinator_host,
                        run.trainmover_source or installed_source(), local_hosts=hosts, slots=slots)
    assert run.coordinator_address is not None  # TrainingRun checks it for the clouds
    source = run.trainmover_source or installed_source()
    if run.provider == "aws":
        from cloud.secrets import AwsParameterStore

        assert run.region is not None
        store: JobSecretStore = AwsParameterStore(run.region, session=options.get("session"))
        staging = None
        if run.artifact_bucket is not None:
            staging = S3Staging(run.job_id, run.artifact_bucket, run.artifact_prefix, run.region, Path(workdir),
                                session=options.get("session"))
        else:
            log.warning(
                "job %s: every host installs %s from the public package index, trusting whoever publishes that name "
                "there (it runs as root on every host), and fails where the index is unreachable; set "
                "run.artifact_bucket to an S3 bucket of yours and the hosts install this orchestrator's own wheel "
                "instead, fetched over presigned URLs with its SHA-256 checked (docs/cloud-bootstrap.md)",
                run.job_id, source)
        return JobHosts(store, run.coordinator_address, source, job_network=True, slots=slots, staging=staging)
    from cloud.secrets import AzureKeyVaultStore

    assert run.key_vault_url is not None
    credential = options.get("credential")
    if credential is None:
        from azure.identity import DefaultAzureCredential

        credential = DefaultAzureCredential()
    blobs = None
    if run.artifact_container is not None:
        blobs = BlobStaging(run.job_id, run.artifact_container, run.artifact_prefix, Path(workdir),
                            credential=credential)
    else:
        log.warning(
            "job %s: every host installs %s from the public package index, trusting whoever publishes that name "
            "there (it runs as root on every host), and fails where the index is unreachable; set "
            "run.artifact_container to a blob container of yours and the hosts install this orchestrator's own "
            "wheel instead, fetched over read-only SAS URLs with its SHA-256 checked (docs/cloud-bootstrap.md)",
            run.job_id, source)
    return JobHosts(AzureKeyVaultStore(run.key_vault_url, credential=credential), run.coordinator_address, source,
                    job_network=True, slots=slots, staging=blobs)


@dataclass(slots=True)
class NoticeWiring:
    """AWS: the job's EventBridge rules and SQS queue (`cloud.aws.ensure_notice_queue`), given to the provider so that
    its `poll_notices` reads them; `close` deletes them. Empty elsewhere (local notices come from the provider itself;
    Azure announces evictions to each VM only, through its Scheduled Events, which the hosts' agents watch)."""

    job_id: str | None = None
    region: str | None = None
    session: Any = None

    def close(self) -> None:
        """Delete the rules and the queue. Never raises: it runs while a job is released."""
        if self.job_id is None or self.region is None:
            return
        from cloud.aws import delete_notice_queue

        try:
            delete_notice_queue(self.job_id, region=self.region, session=self.session)
            self.job_id = None
        except CloudError as exc:
            log.warning("could not delete the notice queue of job %s: %s", self.job_id, exc)


def notice_wiring(run: TrainingRun, provider: Provider, provider_options: dict[str, Any] | None = None
                  ) -> NoticeWiring:
    """The run's notice wiring: on AWS with `notice_queue`, the queue and rules are made now (idempotent) and the
    provider reads them from then on."""
    if run.provider != "aws" or not run.notice_queue:
        return NoticeWiring()
    from cloud.aws import AwsProvider, ensure_notice_queue

    assert run.region is not None and isinstance(provider, AwsProvider)
    session = (provider_options or {}).get("session")
    provider.notice_queue_url = ensure_notice_queue(run.job_id, region=run.region, session=session)
    provider.notice_job_id = run.job_id
    return NoticeWiring(run.job_id, run.region, session)


__all__ = ["STAGING_FILE", "BlobStaging", "JobHosts", "NoticeWiring", "S3Staging", "delete_staged_files", "free_port",
           "host_slots", "hosts_for", "installed_source", "job_hosts", "notice_wiring"]
