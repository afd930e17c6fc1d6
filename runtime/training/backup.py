"""Persistent backups: the last resort when no process holds the training state any more.

Recovery never reads a backup while some member holds the state (a replica hands it over from memory). A backup is
for the extreme case, every copy lost at once, and for starting a new job where an old one stopped
(`trainmover run --resume-from`).

**Writing** (`BackupWriter`, in rank 0 of a data-parallel job, whose replica is the whole state): every
`every` committed steps, the state (`TrainingState.tensors()` and its JSON metadata, exactly what a handoff
moves) is staged to host memory and written by torch's distributed checkpoint (`dcp.async_save`, one process,
a thread): training goes on while the files are written. The copy is taken at the commit, so the backup is the
state as of that step. When the write is complete, the thread hashes every file, writes `manifest.json` (the
step, the model's spec, the metadata, each file's size and SHA-256) and renames the folder from
`.tmp-step-…` to `step-000000123` in one `rename`: a folder named `step-*` is always complete. Only the newest
`keep` are kept. A backup still being written when the next one is due makes the next one skipped (counted),
never waited for.

**Reading** (`newest_backup`, `load_backup`): the newest folder whose manifest parses; its spec must equal the
model's (else `BackupError` naming the difference); every file's digest is checked before a byte is parsed; the
checkpoint's index (`.metadata`, a pickle written by torch) is read by an unpickler that admits only the classes
torch's checkpoint metadata is made of, and every entry must be a tensor (a byte entry would be `torch.load`-ed
without `weights_only`: refused). Tensors are read in place with `weights_only=True`, then the metadata is applied
as after a handoff (`TrainingState.apply_meta`). Data and random numbers are addressed by step, so training
resumed at the backup's step replays exactly what the lost run did after it.

**Object stores** (`remote_mirror`): a `--backup-dir` of `s3://BUCKET/PREFIX` (`S3Mirror`, boto3) or
`az://CONTAINER/PREFIX` (`AzureBlobMirror`, the Azure SDK) is written locally as above, into a staging folder,
then uploaded with its manifest last; pruning deletes a backup's manifest first. A backup there is complete exactly
when its manifest is; a restore downloads the chosen one into a folder of its own process and reads it as a local
one. Both stores share those rules (`ObjectStoreMirror`); each supplies five calls and turns its SDK's errors into
a `BackupError` that names the location and never a key.
"""

from __future__ import annotations

import abc
import hashlib
import json
import logging
import os
import pickle
import shutil
import tempfile
import threading
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from runtime.training.state import StateMeta, StateMismatchError, TrainingState, local_shard, spec_difference
from runtime.wire.protocol import BackupRecord

if TYPE_CHECKING:
    from azure.storage.blob import ContainerClient

log = logging.getLogger("trainmover.runtime")
# One process writes and reads each backup (`no_dist`), on purpose: torch's checkpoint warns that it assumes so.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                        category=UserWarning)

FORMAT = 1
MANIFEST = "manifest.json"
PREFIX = "step-"
TMP_PREFIX = ".tmp-step-"


class BackupError(RuntimeError):
    """A backup that cannot be used (missing, corrupt, or of another model); the message says what to do."""


@dataclass(frozen=True, slots=True)
class BackupSettings:
    """Where and how often rank 0 writes backups."""

    directory: str
    every: int
    """Committed steps between backups."""
    keep: int = 3
    """How many of the newest backups are kept."""

    def __post_init__(self) -> None:
        if not self.directory:
            raise ValueError("the backup directory must be named")
        if self.every < 1:
            raise ValueError(f"backups are written every N steps with N at least 1, got {self.every}")
        if self.keep < 1:
            raise ValueError(f"at least one backup must be kept, got keep={self.keep}")


@dataclass(frozen=True, slots=True)
class Backup:
    """A complete backup on disk (its manifest parsed, its files not yet checked)."""

    path: Path
    step: int
    manifest: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Shards:
    """A sharded job's backup: this rank, the group torch's collective save runs on, the folder's name for this
    generation (the same in every rank), and the mesh it was written on (a restore needs the same one)."""

    rank: int
    group: Any
    tag: str
    layout: dict[str, Any]


def _write_json(path: Path, value: Any) -> None:
    with open(path, "w") as f:
        json.dump(value, f)
        f.flush()
        os.fsync(f.fileno())


def step_dir(step: int) -> str:
    return f"{PREFIX}{step:09d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class BackupWriter:
    """Rank 0's periodic, asynchronous backups (see the module docstring). Main thread: `after_commit`; the
    write, the digests, the manifest and the rename run in torch's checkpoint thread."""

    def __init__(self, settings: BackupSettings, job_id: str, spec: list[Any]) -> None:
        self.settings = settings
        self.remote = remote_mirror(settings.directory)
        """Where finished backups go when `directory` is an s3:// or az:// URL (written locally first)."""
        self.root = _staging(settings.directory) if self.remote is not None else Path(settings.directory)
        self.job_id = job_id
        self.spec = spec
        self.skipped = 0
        """Backups not started because the previous one was still being written."""
        self.failed = 0
        self._busy = threading.Event()
        self._finished: list[BackupRecord] = []
        self._lock = threading.Lock()
        self._pending: Any = None
        self.last_started: int | None = None
        """The step of the last backup started."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise BackupError(
                f"cannot create the backup directory {self.root}: {exc}; pass a writable --backup-dir") from None

    def due(self, step: int) -> bool:
        return step % self.settings.every == 0

    def after_commit(self, step: int, state: TrainingState, shards: Shards | None = None) -> bool:
        """Start the backup of `step` if one is due and none is being written; returns whether one started.

        `shards`: a sharded job's backup, which every rank of the job starts at the same step (its callers wait
        for the previous one to end instead of skipping, so that all ranks enter torch's collective save
        together): each rank writes its shards and its own metadata, rank 0 the index and the manifest."""
        if not self.due(step):
            return False
        if self._busy.is_set():
            self.skipped += 1
            log.warning("backup of step %d skipped: the previous one is still being written", step)
            return False
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter

        self._busy.set()
        self.last_started = step
        t0 = time.perf_counter()
        meta = state.meta(step).to_json()
        if shards is None:
            tensors = {key: t.detach() for key, t in state.tensors()}
            tmp = self.root / f"{TMP_PREFIX}{step:09d}-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
        else:  # whole DTensors: torch's checkpoint writes each rank's shards, and a replicated one once
            tensors = {key: t.detach() for key, t in state.tensors(local=False)}
            tmp = self.root / f"{TMP_PREFIX}{step:09d}-{shards.tag}"
        try:
            if shards is not None:
                tmp.mkdir(parents=True, exist_ok=True)
                _write_json(tmp / f"meta-{shards.rank}.json", meta)  # before the save: complete when rank 0's is
            # A thread writes (torch's default): the call returns a Future once the copy is staged.
            future = cast(Future, dcp.async_save(
                tensors, storage_writer=FileSystemWriter(tmp, sync_files=True),
                process_group=None if shards is None else shards.group, no_dist=shards is None))
        except Exception as exc:
            self._busy.clear()
            self.failed += 1
            log.warning("backup of step %d not started: %s", step, exc)
            return False
        stage_s = time.perf_counter() - t0
        state_bytes = sum(local_shard(t).numel() * t.element_size() for t in tensors.values())
        del tensors  # the staged copy is the checkpoint's now
        self._pending = future
        if shards is not None and shards.rank != 0:
            future.add_done_callback(lambda f: self._shard_written(f, step))
        else:
            manifest_meta = meta if shards is None else None
            layout = None if shards is None else shards.layout
            future.add_done_callback(
                lambda f: self._complete(f, step, tmp, manifest_meta, layout, state_bytes, stage_s, t0))
        return True

    def _shard_written(self, future: Any, step: int) -> None:
        try:
            future.result()
        except Exception as exc:
            self.failed += 1
            log.warning("backup of step %d failed: %s", step, exc)
        finally:
            self._busy.clear()

    def _complete(self, future: Any, step: int, tmp: Path, meta: dict[str, Any] | None,
                  layout: dict[str, Any] | None, state_bytes: int, stage_s: float, t0: float) -> None:
        try:
            future.result()  # in a sharded job: every rank's shards are written (torch's save ends collectively)
            files: dict[str, dict[str, Any]] = {}
            for path in sorted(tmp.iterdir()):
                files[path.name] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
            manifest = {"format": FORMAT, "job_id": self.job_id, "step": step, "created": time.time(),
                        "torch": torch.__version__, "state_bytes": state_bytes,
                        "spec": self.spec, "meta": meta, "layout": layout, "files": files}
            _write_json(tmp / MANIFEST, manifest)
            _fsync_dir(tmp)
            final = self.root / step_dir(step)
            if final.exists():  # the same step written again (a job resumed from it): the new one replaces it
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(self.root)
            where = str(final)
            if self.remote is not None:
                self.remote.upload(final, step)
                where = f"{self.remote.url}/{step_dir(step)}"
            done = BackupRecord(step, where, sum(int(v["bytes"]) for v in files.values()), stage_s,
                                time.perf_counter() - t0 - stage_s)
            with self._lock:  # complete: reported before the housekeeping
                self._finished.append(done)
            if self.remote is not None:
                self.remote.prune(self.settings.keep)
            self._prune(1 if self.remote is not None else self.settings.keep)  # staged: only the newest kept
        except Exception as exc:  # a full disk, a removed folder, a peer lost: the job trains on, without it
            self.failed += 1
            log.warning("backup of step %d failed: %s", step, exc)
            shutil.rmtree(tmp, ignore_errors=True)
        finally:
            self._busy.clear()

    @property
    def busy(self) -> bool:
        """A backup is being written."""
        return self._busy.is_set()

    def _prune(self, keep: int) -> None:
        backups = sorted(p for p in self.root.iterdir() if p.name.startswith(PREFIX) and p.is_dir())
        for old in backups[:-keep]:
            shutil.rmtree(old, ignore_errors=True)

    def finished(self) -> list[BackupRecord]:
        """The backups completed since the last call."""
        with self._lock:
            out, self._finished = self._finished, []
        return out

    def wait(self, timeout_s: float) -> bool:
        """Wait (bounded) for the backup being written; whether none is left."""
        future = self._pending
        if future is None:
            return True
        try:
            future.result(timeout=timeout_s)
        except Exception as exc:
            log.debug("waiting for the last backup: %s", exc)
        deadline = time.monotonic() + timeout_s
        while self._busy.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._busy.is_set()


# -- reading -------------------------------------------------------------------------------------------------
def _parse_manifest(raw: Any) -> dict[str, Any] | None:
    if not isinstance(raw, dict) or raw.get("format") != FORMAT or not isinstance(raw.get("step"), int) \
            or not isinstance(raw.get("files"), dict) or not isinstance(raw.get("spec"), list):
        return None
    return raw


def _manifest(path: Path) -> dict[str, Any] | None:
    try:
        return _parse_manifest(json.loads((path / MANIFEST).read_text()))
    except (OSError, ValueError):
        return None


def find_backup(where: str | Path, step: int | None = None) -> Backup:
    """The backup at `where`: a `step-*` folder, or the newest complete one (or the one of `step`) in a backup
    directory or under an `s3://` or `az://` prefix (downloaded first into a folder of this process's)."""
    mirror = remote_mirror(str(where))
    if mirror is not None:
        steps = mirror.steps()
        if step is None and not steps:
            raise BackupError(f"no complete backup under {where}: name the prefix given to --backup-dir")
        chosen = steps[-1] if step is None else step
        return mirror.download(chosen, _restore_cache() / step_dir(chosen))
    path = Path(where)
    if (path / MANIFEST).exists():
        manifest = _manifest(path)
        if manifest is None:
            raise BackupError(f"{path / MANIFEST} is not a TrainMover backup manifest (format {FORMAT}); "
                              "name a folder written by --backup-dir")
        if step is not None and manifest["step"] != step:
            raise BackupError(f"{path} holds step {manifest['step']}, not step {step}")
        return Backup(path, manifest["step"], manifest)
    if step is not None:
        return find_backup(path / step_dir(step))
    newest = newest_backup(path)
    if newest is None:
        raise BackupError(f"no complete backup in {path}: name a directory given to --backup-dir, or one of its "
                          "step-* folders")
    return newest


def has_backup(directory: str) -> bool:
    """Whether `directory` (or an `s3://` or `az://` prefix) holds a complete backup."""
    return bool(backup_steps(directory))


def backup_steps(directory: str) -> list[int]:
    """The steps of the complete backups in `directory` (or under an `s3://` or `az://` prefix), oldest first."""
    mirror = remote_mirror(directory)
    if mirror is not None:
        return mirror.steps()
    root = Path(directory)
    if not root.is_dir():
        return []
    return sorted(int(p.name[len(PREFIX):]) for p in root.iterdir()
                  if p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit() and _manifest(p) is not None)


def newest_backup(directory: str | Path) -> Backup | None:
    """The newest backup in `directory` whose manifest parses (its files are checked when it is loaded)."""
    root = Path(directory)
    if not root.is_dir():
        return None
    for path in sorted((p for p in root.iterdir() if p.name.startswith(PREFIX)), reverse=True):
        manifest = _manifest(path)
        if manifest is not None:
            return Backup(path, manifest["step"], manifest)
    return None


# -- object storage ------------------------------------------------------------------------------------------
S3_SCHEME = "s3://"
AZ_SCHEME = "az://"
AZ_CONNECTION_STRING = "AZURE_STORAGE_CONNECTION_STRING"
AZ_ACCOUNT_URL = "AZURE_STORAGE_ACCOUNT_URL"
_AZ_CREDENTIALS = (f"{AZ_CONNECTION_STRING}, or {AZ_ACCOUNT_URL} with a credential DefaultAzureCredential finds: a "
                   "managed identity, AZURE_CLIENT_ID/AZURE_TENANT_ID/AZURE_CLIENT_SECRET, or `az login`")


def is_remote(directory: str | Path | None) -> bool:
    """Whether `directory` names an object store (`s3://` or `az://`) rather than a directory."""
    return str(directory or "").startswith((S3_SCHEME, AZ_SCHEME))


def remote_mirror(url: str) -> ObjectStoreMirror | None:
    """The object store `url` names (`s3://BUCKET/PREFIX`, `az://CONTAINER/PREFIX`), or None for a directory."""
    if url.startswith(S3_SCHEME):
        return S3Mirror(url)
    if url.startswith(AZ_SCHEME):
        return AzureBlobMirror(url)
    return None


def _staging(url: str) -> Path:
    """Where backups for `url` are written before they are uploaded (one per URL on this host)."""
    return Path(tempfile.gettempdir()) / "trainmover-backups" / hashlib.sha256(url.encode()).hexdigest()[:16]


def _restore_cache() -> Path:
    """Where this process downloads the backup it restores (replaced at its next download)."""
    path = Path(tempfile.gettempdir()) / "trainmover-backups" / f"restore-{os.getpid()}"
    shutil.rmtree(path, ignore_errors=True)
    return path


class ObjectStoreMirror(abc.ABC):
    """Backups under `PREFIX/step-000000123/` of an object store. The rules live here, once: a backup is uploaded
    with its `manifest.json` last, so it is complete exactly when its manifest is there; only those are listed; a
    download checks the manifest and refuses a name outside the backup; pruning deletes the manifest first. A store
    supplies the five calls below and `_error`, which turns its SDK's errors into a `BackupError`."""

    def __init__(self, url: str, prefix: str) -> None:
        self.url = url.rstrip("/")
        self.prefix = f"{prefix.strip('/')}/" if prefix.strip("/") else ""

    @abc.abstractmethod
    def _put(self, key: str, path: Path) -> None:
        """Upload the file `path` as `key`, replacing any object there."""

    @abc.abstractmethod
    def _list(self, prefix: str) -> list[str]:
        """Every key that starts with `prefix`."""

    @abc.abstractmethod
    def _read(self, key: str) -> bytes:
        """The object `key`."""

    @abc.abstractmethod
    def _fetch(self, key: str, path: Path) -> None:
        """Download the object `key` into the file `path`."""

    @abc.abstractmethod
    def _delete(self, keys: list[str]) -> None:
        """Delete `keys`, in their order."""

    @abc.abstractmethod
    def _error(self, what: str, exc: Exception) -> BackupError | None:
        """`exc` as one BackupError naming `self.url` and what to check (never a key), if it is the store's own
        error; None for anything else (a programming error, raised as it is)."""

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:
            error = self._error(what, exc)
            if error is None:
                raise
            raise error from None

    def _key(self, step: int, name: str = "") -> str:
        return f"{self.prefix}{step_dir(step)}/{name}"

    def upload(self, folder: Path, step: int) -> None:
        names = sorted(p.name for p in folder.iterdir() if p.name != MANIFEST)
        for name in [*names, MANIFEST]:  # the manifest last: its presence says the backup is complete
            self._call("uploading a backup to", self._put, self._key(step, name), folder / name)

    def steps(self) -> list[int]:
        """Steps of the complete backups (those with a manifest), oldest first."""
        found = set()
        for key in self._call("listing the backups in", self._list, self.prefix + PREFIX):
            folder, _, name = key[len(self.prefix):].partition("/")
            number = folder[len(PREFIX):]
            if name == MANIFEST and number.isdigit():
                found.add(int(number))
        return sorted(found)

    def download(self, step: int, into: Path) -> Backup:
        raw = self._call("reading a backup's manifest in", self._read, self._key(step, MANIFEST))
        try:
            manifest = _parse_manifest(json.loads(raw))
        except ValueError:
            manifest = None
        if manifest is None or manifest["step"] != step:
            raise BackupError(f"{self.url}/{step_dir(step)}/{MANIFEST} is not a TrainMover backup manifest")
        into.mkdir(parents=True, exist_ok=True)
        for name in manifest["files"]:
            if "/" in name or name.startswith(".."):
                raise BackupError(f"{self.url}/{step_dir(step)}: the manifest names {name!r}, outside the backup")
            self._call("downloading a backup from", self._fetch, self._key(step, name), into / name)
        _write_json(into / MANIFEST, manifest)
        return Backup(into, step, manifest)

    def prune(self, keep: int) -> None:
        for old in self.steps()[:-keep]:
            keys = self._call("pruning the backups in", self._list, self._key(old))
            manifest = [k for k in keys if k.endswith("/" + MANIFEST)]
            # The manifest first: a backup half deleted is no longer complete.
            for batch in (manifest, [k for k in keys if k not in manifest]):
                if batch:
                    self._call("pruning the backups in", self._delete, batch)


class S3Mirror(ObjectStoreMirror):
    """Backups in S3 (or any endpoint of its API: `AWS_ENDPOINT_URL_S3`), through boto3 with the default
    credential chain."""

    def __init__(self, url: str) -> None:
        bucket, _, prefix = url[len(S3_SCHEME):].partition("/")
        if not bucket:
            raise BackupError(f"{url!r}: an S3 backup location is s3://BUCKET or s3://BUCKET/PREFIX")
        try:
            import boto3
            from botocore.config import Config
        except ImportError:
            raise BackupError("backups to s3:// need boto3: pip install 'trainmover[aws]'") from None
        super().__init__(url, prefix)
        self.bucket = bucket
        self.client = boto3.client("s3", config=Config(retries={"mode": "standard", "max_attempts": 5}))

    def _error(self, what: str, exc: Exception) -> BackupError | None:
        from botocore.exceptions import BotoCoreError, ClientError

        if isinstance(exc, ClientError):
            code = exc.response.get("Error", {}).get("Code", "error")
            return BackupError(f"{what} {self.url}: S3 answered {code}; check the bucket and this host's credentials "
                               "(the default AWS chain)")
        if isinstance(exc, BotoCoreError):
            return BackupError(f"{what} {self.url}: {type(exc).__name__}; check the endpoint and this host's "
                               "credentials (the default AWS chain)")
        return None

    def _put(self, key: str, path: Path) -> None:
        self.client.upload_file(str(path), self.bucket, key)  # multipart when large, retried

    def _list(self, prefix: str) -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return [obj["Key"] for page in pages for obj in page.get("Contents", [])]

    def _read(self, key: str) -> bytes:
        return cast(bytes, self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read())

    def _fetch(self, key: str, path: Path) -> None:
        self.client.download_file(self.bucket, key, str(path))

    def _delete(self, keys: list[str]) -> None:
        for first in range(0, len(keys), 1000):  # S3 deletes at most 1000 objects a request
            self.client.delete_objects(Bucket=self.bucket,
                                       Delete={"Objects": [{"Key": k} for k in keys[first:first + 1000]]})


class AzureBlobMirror(ObjectStoreMirror):
    """Backups in an Azure Blob Storage container (`az://CONTAINER/PREFIX`), through the Azure SDK
    (azure-storage-blob). The account: `AZURE_STORAGE_CONNECTION_STRING` if set, else `AZURE_STORAGE_ACCOUNT_URL`
    (https://ACCOUNT.blob.core.windows.net) with `DefaultAzureCredential`."""

    _CONCURRENCY = 4
    """Blocks of one blob sent or received at once (the SDK splits a large blob into blocks)."""
    _RETRIES = 4
    """Retries of a request the SDK deems worth retrying (no answer, 408, 5xx, no token from the credential),
    after waits of about 1, 3, 5 and 9 s. The SDK's default waits 15 s first, about 90 s in all for an unreachable
    endpoint."""

    def __init__(self, url: str) -> None:
        container, _, prefix = url[len(AZ_SCHEME):].partition("/")
        if not container:
            raise BackupError(f"{url!r}: an Azure Blob backup location is az://CONTAINER or az://CONTAINER/PREFIX")
        try:
            from azure.storage.blob import BlobServiceClient, ExponentialRetry
        except ImportError:
            raise BackupError("backups to az:// need azure-storage-blob: pip install 'trainmover[azure]'") from None
        super().__init__(url, prefix)
        connection_string = os.environ.get(AZ_CONNECTION_STRING, "")
        account_url = os.environ.get(AZ_ACCOUNT_URL, "")
        retry = ExponentialRetry(initial_backoff=1, increment_base=2, retry_total=self._RETRIES, random_jitter_range=1)
        if connection_string:
            try:
                service = BlobServiceClient.from_connection_string(connection_string, retry_policy=retry)
            except ValueError:  # its message is not repeated: it may quote the string
                raise BackupError(f"{AZ_CONNECTION_STRING} is not a storage account's connection string: copy it "
                                  "from the account's access keys, or unset it and set "
                                  f"{AZ_ACCOUNT_URL}") from None
        elif account_url:
            try:
                from azure.identity import DefaultAzureCredential
            except ImportError:
                raise BackupError(f"backups to az:// with {AZ_ACCOUNT_URL} need azure-identity: pip install "
                                  "'trainmover[azure]'") from None
            try:
                service = BlobServiceClient(account_url, credential=DefaultAzureCredential(), retry_policy=retry)
            except ValueError:
                raise BackupError(f"{AZ_ACCOUNT_URL} is not a blob endpoint: set it to "
                                  "https://ACCOUNT.blob.core.windows.net") from None
        else:
            raise BackupError(f"backups to az:// need the storage account: set {AZ_CONNECTION_STRING}, or "
                              f"{AZ_ACCOUNT_URL} (https://ACCOUNT.blob.core.windows.net) with a credential "
                              "DefaultAzureCredential finds (a managed identity, "
                              "AZURE_CLIENT_ID/AZURE_TENANT_ID/AZURE_CLIENT_SECRET, or `az login`)")
        self.container_name = container
        self.container: ContainerClient = service.get_container_client(container)

    def _error(self, what: str, exc: Exception) -> BackupError | None:
        from azure.core.exceptions import AzureError, HttpResponseError

        if isinstance(exc, HttpResponseError) and exc.status_code is not None:
            code = getattr(exc, "error_code", None) or exc.status_code
            return BackupError(f"{what} {self.url}: Azure Blob answered {getattr(code, 'value', code)}; check that "
                               f"the container {self.container_name!r} exists and this host's credentials "
                               f"({_AZ_CREDENTIALS})")
        if isinstance(exc, AzureError):  # no answer: unreachable, or no credential found
            return BackupError(f"{what} {self.url}: {type(exc).__name__}; check the account's endpoint and this "
                               f"host's credentials ({_AZ_CREDENTIALS})")
        return None

    def _put(self, key: str, path: Path) -> None:
        with open(path, "rb") as f:
            self.container.upload_blob(key, f, overwrite=True, max_concurrency=self._CONCURRENCY)

    def _list(self, prefix: str) -> list[str]:
        return list(self.container.list_blob_names(name_starts_with=prefix))

    def _read(self, key: str) -> bytes:
        return cast(bytes, self.container.download_blob(key).readall())

    def _fetch(self, key: str, path: Path) -> None:
        with open(path, "wb") as f:
            self.container.download_blob(key, max_concurrency=self._CONCURRENCY).readinto(f)

    def _delete(self, keys: list[str]) -> None:
        for key in keys:  # one by one, in order: the manifest's deletion ends before the files' begin
            self.container.delete_blob(key)


_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only what torch's checkpoint index is made of (and torch's dtypes): no other callable can run."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise BackupError(f"the backup's checkpoint index names {module}.{name}, which a checkpoint index never "
                          "holds: the backup was tampered with; resume from another one")


def _read_index(path: Path) -> Any:
    """The checkpoint's index (`.metadata`, a pickle written by torch), read with `_MetadataUnpickler`; every
    entry must be a tensor."""
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    try:
        with open(path / ".metadata", "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except BackupError:
        raise
    except Exception as exc:
        raise BackupError(f"the backup's checkpoint index in {path} cannot be read ({exc}); resume from another "
                          "one") from None
    if not isinstance(metadata, Metadata):
        raise BackupError("the backup's checkpoint index is not torch's checkpoint metadata")
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise BackupError(f"the backup's entry {key!r} is not a tensor; TrainMover writes tensors only")
    return metadata


def _safe_reader(path: Path, metadata: Any) -> Any:
    """torch's file reader, handed the index `_read_index` already read (it never unpickles anything itself)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(path)


def verify_backup(backup: Backup) -> None:
    """Every file the manifest lists has its size and digest; nothing else is read."""
    files = backup.manifest["files"]
    if ".metadata" not in files:
        raise BackupError(f"{backup.path}: the manifest lists no checkpoint index; the backup is incomplete")
    for name, entry in files.items():
        path = backup.path / name
        if "/" in name or name.startswith(".."):
            raise BackupError(f"{backup.path}: the manifest names {name!r}, outside the backup's folder")
        if not path.is_file() or path.stat().st_size != entry.get("bytes") or _sha256(path) != entry.get("sha256"):
            raise BackupError(f"{path} does not match its digest in the manifest: the backup is damaged. Resume "
                              "from an older one (name its step-* folder), or delete this one")


def load_backup(backup: Backup, state: TrainingState, shards: Shards | None = None) -> int:
    """Load `backup` into `state` in place; returns its step. Refuses another model's backup, or a damaged one.

    `shards`: a sharded job's restore (every rank at once, over `shards.group`, on the mesh it was written on)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner

    difference = spec_difference(state.spec(), backup.manifest["spec"], "this script", "the backup")
    if difference is not None:
        raise BackupError(f"the backup at {backup.path} was written by another model or optimizer: {difference}")
    layout = backup.manifest.get("layout")
    if shards is not None and layout != shards.layout:
        raise BackupError(f"the backup at {backup.path} was written on {_layout(layout)}, this job runs on "
                          f"{_layout(shards.layout)}: resume a sharded backup on the mesh it was written on")
    if shards is None and layout is not None:
        raise BackupError(f"the backup at {backup.path} is a sharded job's ({_layout(layout)}); resume it with the "
                          "same mesh, from a sharded job")
    verify_backup(backup)
    index = _read_index(backup.path)
    try:
        if shards is None:
            meta = StateMeta.from_json(backup.manifest["meta"])
            targets = dict(state.prepare_receive(meta))
        else:
            name = f"meta-{shards.rank}.json"
            if name not in backup.manifest["files"]:
                raise BackupError(f"{backup.path} holds no metadata for rank {shards.rank}; the backup is incomplete")
            meta = StateMeta.from_json(json.loads((backup.path / name).read_text()))
            receiving = dict(state.prepare_receive(meta))  # shapes the optimizer's state like the backup's
            targets = {k: t for k, t in state.tensors(local=False) if not k.startswith("extra.")}
            targets.update({k: t for k, t in receiving.items() if k.startswith("extra.")})
    except (StateMismatchError, ValueError) as exc:
        raise BackupError(f"the backup at {backup.path} does not fit this script's state: {exc}") from None

    class TensorsOnly(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            raise BackupError("the backup holds a non-tensor entry; TrainMover writes tensors only")

    dcp.load(targets, storage_reader=_safe_reader(backup.path, index), planner=TensorsOnly(),
             process_group=None if shards is None else shards.group, no_dist=shards is None)
    state.apply_meta(meta)
    return backup.step


def _layout(layout: dict[str, Any] | None) -> str:
    if layout is None:
        return "a data-parallel job"
    return " x ".join(f"{n} {k}" for n, k in zip(layout.get("shape", []), layout.get("names", []), strict=False))


__all__ = [
    "AzureBlobMirror",
    "Backup",
    "BackupError",
    "BackupSettings",
    "BackupWriter",
    "ObjectStoreMirror",
    "S3Mirror",
    "Shards",
    "find_backup",
    "has_backup",
    "is_remote",
    "load_backup",
    "newest_backup",
    "remote_mirror",
    "step_dir",
    "verify_backup",
]
