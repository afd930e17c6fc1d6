"""The job's code on its hosts, from a source the job controls.

A host must not install TrainMover by name from a public index (a name anyone could claim would run as root on every
host), and the training script must not have to be baked into the image. So the orchestrator builds the wheel of
the TrainMover it runs itself (`build_wheel`), stages it with the training script where only the job's credentials
can write (`stage`: the job's S3 prefix, its Azure Blob container, or a directory every local host reads), and puts
each file's SHA-256 into the host's bootstrap beside a time-limited URL (an S3 presigned URL, a blob SAS URL, or
`file://`). The host fetches each file, retrying, and refuses it unless its digest matches, before anything of it
runs (`render_fetch`). The installer then installs the wheel from that file, without any index.

`Artifact` is the record the bootstrap carries; URLs are signed for `URL_TTL_S` (a host fetches at its first boot;
a replacement launched later gets a bootstrap signed then).
"""

from __future__ import annotations

import hashlib
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import urlparse

from cloud.base import InvalidRequestError, validate_job_id

URL_TTL_S = 12 * 3600
"""How long a staged file's URL works: long enough for a launch's slowest boot, short enough to be worthless later."""
FETCH_ATTEMPTS = 5
_SHA256 = re.compile(r"[0-9a-f]{64}")
_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}")
PROJECT_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True, slots=True)
class Artifact:
    """One file a host fetches: its name there, where from, and the digest it must have."""

    name: str
    """File name on the host (a wheel keeps its own: pip reads the version from it)."""
    url: str
    """https (presigned or SAS), http (a local mirror) or file:// (hosts sharing this machine's file system)."""
    sha256: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _FILE_NAME.fullmatch(self.name) or self.name in (".", ".."):
            raise InvalidRequestError(f"invalid artifact name {self.name!r}: give a plain file name",
                                      code="InvalidArtifact")
        scheme = urlparse(self.url).scheme if isinstance(self.url, str) else ""
        if scheme not in ("https", "http", "file") or any(c in self.url for c in "\0\n\r"):
            raise InvalidRequestError(f"invalid URL for {self.name}: give an https, http or file URL",
                                      code="InvalidArtifact")
        if not isinstance(self.sha256, str) or not _SHA256.fullmatch(self.sha256):
            raise InvalidRequestError(f"invalid SHA-256 for {self.name}: give 64 lowercase hex digits",
                                      code="InvalidArtifact")

    def __repr__(self) -> str:  # a signed URL is a credential for a while: never shown whole
        return f"Artifact({self.name!r}, {urlparse(self.url).scheme}://..., sha256={self.sha256[:12]}...)"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def build_wheel(out_dir: Path, project: Path = PROJECT_ROOT) -> Path:
    """The wheel of the TrainMover source at `project` (this one by default), built without network access (the
    build backend is the environment's own) and without dependencies."""
    if not (project / "pyproject.toml").is_file():
        raise InvalidRequestError(f"{project} holds no pyproject.toml: give the TrainMover source tree to build, or a "
                                  "wheel", code="InvalidArtifact")
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tm-wheel-") as tmp:
        # From a clean copy: setuptools builds in the tree it is given, and a build/ left there from an older
        # version would ship modules deleted since.
        source = Path(tmp) / "src"
        shutil.copytree(project, source, ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "node_modules", ".*_cache", ".pytest-tiers"))
        done = subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-input", "-q",
             "--disable-pip-version-check", "-w", tmp, str(source)],
            capture_output=True, text=True, timeout=600, check=False)
        wheels = sorted(Path(tmp).glob("trainmover-*.whl"))
        if done.returncode != 0 or len(wheels) != 1:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise InvalidRequestError(f"building the TrainMover wheel from {project} failed: {' / '.join(tail)}",
                                      code="WheelBuildFailed")
        target = out_dir / wheels[0].name
        target.write_bytes(wheels[0].read_bytes())
    return target


def _checked(files: Iterable[Path]) -> list[Path]:
    out = []
    for f in files:
        if not f.is_file():
            raise InvalidRequestError(f"{f} is not a file: nothing to stage", code="InvalidArtifact")
        if not _FILE_NAME.fullmatch(f.name):
            raise InvalidRequestError(f"{f.name!r}: a staged file needs a plain name (letters, digits, . _ + -)",
                                      code="InvalidArtifact")
        out.append(f)
    if len({f.name for f in out}) != len(out):
        raise InvalidRequestError("two staged files have the same name", code="InvalidArtifact")
    return out


def stage_local(files: Sequence[Path], directory: Path) -> list[Artifact]:
    """Copy `files` into `directory` (mode 0644 files in a 0755 directory) and give their `file://` artifacts: for
    hosts that share this machine's file system (local processes, network-namespace hosts)."""
    directory.mkdir(parents=True, exist_ok=True)
    out = []
    for f in _checked(files):
        target = directory / f.name
        target.write_bytes(f.read_bytes())
        target.chmod(0o644)
        out.append(Artifact(f.name, target.resolve().as_uri(), sha256_of(target)))
    return out


S3_PREFIX = "trainmover-jobs"
"""The default key prefix: a job's files are staged under `s3://BUCKET/trainmover-jobs/JOB/`."""
# https://docs.aws.amazon.com/AmazonS3/latest/userguide/bucketnamingrules.html (general purpose buckets)
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_BUCKET_RESERVED = (("xn--", "sthree-", "amzn-s3-demo-"), ("-s3alias", "--ol-s3", ".mrap", "--x-s3", "--table-s3"))
# Plain segments only: no IAM wildcard (`*`, `?`) can widen the job's grant on `PREFIX/JOB/*`, no `..` or `//`.
_PREFIX_SEGMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def validate_s3_location(bucket: str, prefix: str = S3_PREFIX) -> None:
    """InvalidRequestError unless `bucket` is a valid S3 bucket name (S3's naming rules) and `prefix` a key prefix
    of plain `/`-separated segments (letters, digits, `.`, `_`, `-`; at most 200 characters)."""
    if not isinstance(bucket, str) or not _BUCKET.fullmatch(bucket) or ".." in bucket \
            or re.fullmatch(r"\d+\.\d+\.\d+\.\d+", bucket) \
            or bucket.startswith(_BUCKET_RESERVED[0]) or bucket.endswith(_BUCKET_RESERVED[1]):
        raise InvalidRequestError(
            f"invalid S3 bucket name {bucket!r}: 3-63 lower-case letters, digits, '.' or '-', starting and ending "
            "with a letter or digit, not an IP address (S3's bucket naming rules)", code="InvalidArtifact")
    if not isinstance(prefix, str) or len(prefix) > 200 \
            or not all(_PREFIX_SEGMENT.fullmatch(part) for part in prefix.split("/")):
        raise InvalidRequestError(
            f"invalid S3 key prefix {prefix!r}: give segments of letters, digits, '.', '_' or '-' separated by '/', "
            f"without a leading or trailing '/' or wildcards (e.g. {S3_PREFIX!r})", code="InvalidArtifact")


def s3_key(prefix: str, job_id: str, name: str) -> str:
    return "/".join(p for p in (prefix.strip("/"), job_id, name) if p)


def _upload(files: Sequence[Path], job_id: str, prefix: str, put: Callable[[str, BinaryIO, str], None],
            url: Callable[[str], str]) -> list[Artifact]:
    """Each of `files` stored as `prefix/job_id/NAME` by `put(key, body, sha256)`, with the URL `url(key)` gives:
    what `stage_s3` and `stage_blob` share."""
    validate_job_id(job_id)
    out = []
    for f in _checked(files):
        key = s3_key(prefix, job_id, f.name)
        digest = sha256_of(f)
        with open(f, "rb") as body:
            put(key, body, digest)
        out.append(Artifact(f.name, url(key), digest))
    return out


def _presigned_get(client: Any, bucket: str, key: str, ttl_s: int) -> str:
    """A presigned GET URL of `bucket`/`key`, good for `ttl_s`."""
    return client.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": key}, ExpiresIn=ttl_s)


def stage_s3(files: Sequence[Path], *, job_id: str, bucket: str, prefix: str = S3_PREFIX,
             client: Any, ttl_s: int = URL_TTL_S) -> list[Artifact]:
    """Upload `files` under `s3://bucket/prefix/job_id/` and give presigned GET URLs (`ttl_s`): a host fetches them
    with no AWS credentials of its own. `client`: a boto3 S3 client (the job's credentials)."""

    def put(key: str, body: BinaryIO, digest: str) -> None:
        client.put_object(Bucket=bucket, Key=key, Body=body, Metadata={"sha256": digest})

    return _upload(files, job_id, prefix, put, lambda key: _presigned_get(client, bucket, key, ttl_s))


def presign_s3(artifacts: Sequence[Artifact], *, job_id: str, bucket: str, prefix: str = S3_PREFIX,
               client: Any, ttl_s: int = URL_TTL_S) -> list[Artifact]:
    """The same staged files with URLs signed now (nothing is uploaded again): for a host launched after the first
    URLs' `ttl_s`, or after the credentials that signed them expired (a URL signed by a role's session dies with
    it)."""
    validate_job_id(job_id)
    return [Artifact(a.name, _presigned_get(client, bucket, s3_key(prefix, job_id, a.name), ttl_s), a.sha256)
            for a in artifacts]


def delete_s3(*, job_id: str, bucket: str, prefix: str = S3_PREFIX, client: Any) -> int:
    """Delete every staged file of `job_id`; returns how many."""
    validate_job_id(job_id)
    listing = client.list_objects_v2(Bucket=bucket, Prefix=s3_key(prefix, job_id, "") + "/")
    keys = [o["Key"] for o in listing.get("Contents", [])]
    for key in keys:
        client.delete_object(Bucket=bucket, Key=key)
    return len(keys)


AZ_CONNECTION_STRING = "AZURE_STORAGE_CONNECTION_STRING"
"""The Azure SDK's variable for a storage account's connection string (its account key signs SAS URLs)."""
# https://learn.microsoft.com/rest/api/storageservices/naming-and-referencing-containers--blobs--and-metadata
_CONTAINER = re.compile(r"[a-z0-9](?!.*--)[a-z0-9-]{1,61}[a-z0-9]")


def parse_container_url(url: str, prefix: str = S3_PREFIX) -> tuple[str, str]:
    """(account URL, container) of a blob container's URL (`https://ACCOUNT.blob.core.windows.net/CONTAINER`, or
    an emulator's `http://HOST:PORT/ACCOUNT/CONTAINER`); InvalidRequestError unless it is one, with a container name
    Azure accepts, and `prefix` a plain blob-name prefix (as `validate_s3_location` says)."""
    parsed = urlparse(url) if isinstance(url, str) else None
    path = parsed.path.rstrip("/") if parsed is not None else ""
    account, _, container = path.rpartition("/")
    if parsed is None or parsed.scheme not in ("https", "http") or not parsed.hostname or parsed.query \
            or parsed.fragment or parsed.username or not _CONTAINER.fullmatch(container):
        raise InvalidRequestError(
            f"invalid blob container URL {url!r}: give https://ACCOUNT.blob.core.windows.net/CONTAINER, the container "
            "3-63 lower-case letters, digits or single dashes, starting and ending with a letter or digit",
            code="InvalidArtifact")
    if not isinstance(prefix, str) or len(prefix) > 200 \
            or not all(_PREFIX_SEGMENT.fullmatch(part) for part in prefix.split("/")):
        raise InvalidRequestError(
            f"invalid blob name prefix {prefix!r}: give segments of letters, digits, '.', '_' or '-' separated by '/', "
            f"without a leading or trailing '/' (e.g. {S3_PREFIX!r})", code="InvalidArtifact")
    return f"{parsed.scheme}://{parsed.netloc}{account}", container


class BlobSigner:
    """Read-only SAS URLs for one container's blobs, signed with what the orchestrator's credentials allow: the
    account key when it has one (a connection string's), else a user delegation key from Azure AD (which the
    credentials' identity may get when it has a data role on the account, such as Storage Blob Data Contributor)."""

    def __init__(self, container: Any, ttl_s: int = URL_TTL_S) -> None:
        """`container`: an azure-storage-blob ContainerClient (the job's credentials)."""
        self.container = container
        self.ttl_s = ttl_s
        self._delegation: tuple[Any, float] | None = None

    def url(self, name: str) -> str:
        import datetime
        import time
        from urllib.parse import quote

        from azure.storage.blob import BlobSasPermissions, generate_blob_sas

        now = datetime.datetime.now(datetime.UTC)
        start, expiry = now - datetime.timedelta(minutes=5), now + datetime.timedelta(seconds=self.ttl_s)
        key = getattr(self.container.credential, "account_key", None)
        if key is not None:
            signed = {"account_key": key}
        else:  # one delegation key serves every URL signed within its first half
            if self._delegation is None or time.monotonic() > self._delegation[1]:
                service = self.container._get_blob_service_client()  # the same account and credentials
                delegation = service.get_user_delegation_key(start, expiry + datetime.timedelta(seconds=self.ttl_s))
                self._delegation = (delegation, time.monotonic() + self.ttl_s)
            signed = {"user_delegation_key": self._delegation[0]}
        sas = generate_blob_sas(self.container.account_name, self.container.container_name, name,
                                permission=BlobSasPermissions(read=True), start=start, expiry=expiry, **signed)
        return f"{self.container.url.rstrip('/')}/{quote(name)}?{sas}"


def stage_blob(files: Sequence[Path], *, job_id: str, prefix: str = S3_PREFIX, signer: BlobSigner) -> list[Artifact]:
    """Upload `files` as blobs `prefix/job_id/NAME` of the signer's container (overwriting a run's before) and give
    read-only SAS URLs (`BlobSigner`): a host fetches them with no Azure credentials of its own."""

    def put(name: str, body: BinaryIO, digest: str) -> None:
        signer.container.upload_blob(name, body, overwrite=True, metadata={"sha256": digest})

    return _upload(files, job_id, prefix, put, signer.url)


def sign_blobs(artifacts: Sequence[Artifact], *, job_id: str, prefix: str = S3_PREFIX,
               signer: BlobSigner) -> list[Artifact]:
    """The same staged blobs with SAS URLs signed now (nothing is uploaded again): for a host launched later."""
    validate_job_id(job_id)
    return [Artifact(a.name, signer.url(s3_key(prefix, job_id, a.name)), a.sha256) for a in artifacts]


def delete_blobs(*, job_id: str, prefix: str = S3_PREFIX, container: Any) -> int:
    """Delete every staged blob of `job_id` from `container` (a ContainerClient); returns how many."""
    validate_job_id(job_id)
    names = list(container.list_blob_names(name_starts_with=s3_key(prefix, job_id, "") + "/"))
    for name in names:
        container.delete_blob(name)
    return len(names)


def render_fetch(artifacts: Sequence[Artifact], directory: str, *, attempts: int = FETCH_ATTEMPTS,
                 backoff_s: int = 5) -> list[str]:
    """Bash lines that fetch each artifact into `directory`, up to `attempts` times each (waiting `backoff_s` x the
    attempt between them), and refuse a file whose SHA-256 differs (it is deleted, never run or installed). Under
    `set -e` the script stops at the first file that could not be fetched intact, saying so."""
    lines = [
        f"mkdir -p {shlex.quote(directory)}",
        "tm_fetch() {  # URL SHA256 DEST",
        "  local attempt got",
        f"  for attempt in $(seq 1 {attempts}); do",
        '    rm -f "$3.part"',
        '    if curl -fsSL --connect-timeout 10 --max-time 600 -o "$3.part" "$1"; then',
        "      got=\"$(sha256sum \"$3.part\" | cut -d' ' -f1)\"",
        '      if [ "$got" = "$2" ]; then mv "$3.part" "$3"; return 0; fi',
        '      echo "trainmover: $(basename "$3") has SHA-256 $got, the job expects $2: refused" >&2',
        "    fi",
        '    rm -f "$3.part"',
        f'    if [ "$attempt" -lt {attempts} ]; then sleep $((attempt * {backoff_s})); fi',
        "  done",
        f'  echo "trainmover: could not fetch $(basename "$3") intact in {attempts} attempts" >&2',
        "  return 1",
        "}",
    ]
    for a in artifacts:
        lines.append(f"tm_fetch {shlex.quote(a.url)} {a.sha256} {shlex.quote(directory + '/' + a.name)}")
    return lines


BAKED_PYTHON = "/opt/trainmover/python/bin/python"
"""The Python environment a baked image carries when its base had none with the job's torch (cloud.image)."""
PYTHONS = (BAKED_PYTHON, "/opt/conda/envs/pytorch/bin/python", "/opt/conda/bin/python",
           "/anaconda/envs/azureml_py310_sdkv2/bin/python", "python3.13", "python3.12", "python3.11", "python3")
"""Where the image's Python is looked for, first found first: a baked image's own (cloud.image), the Deep Learning
AMI's conda environment (torch lives there), a conda base, the Azure DSVM's, then the system's."""


def render_python_select(pythons: Sequence[str] = PYTHONS, minimum: tuple[int, int] = (3, 11), *,
                         torch_version: str | None = None, required: bool = True) -> list[str]:
    """Bash lines that set `tm_python` to the first of `pythons` that exists, is at least `minimum` and imports
    torch (of `torch_version`, local tag aside, when given), or exit 1 naming what each candidate lacked; with
    `required` False, leave `tm_python` empty instead."""
    want = f"{minimum[0]}.{minimum[1]}"
    pinned = (f"; v = torch.__version__.split('+')[0]; assert v == {torch_version!r}, 'torch ' + v"
              if torch_version else "")
    check = (f"import sys; assert sys.version_info >= {minimum!r}, sys.version.split()[0]; "
             f"import torch{pinned}  # noqa")
    lines = [
        'tm_python=""',
        'tm_tried=""',
        f"for candidate in {' '.join(shlex.quote(p) for p in pythons)}; do",
        '  command -v "$candidate" >/dev/null 2>&1 || continue',
        f'  if why="$("$candidate" -c {shlex.quote(check)} 2>&1)"; then',
        '    tm_python="$(command -v "$candidate")"',
        "    break",
        "  fi",
        '  tm_tried="$tm_tried $candidate ($(echo "$why" | tail -n 1))"',
        "done",
    ]
    if required:
        lines += [
            'if [ -z "$tm_python" ]; then',
            f'  echo "trainmover: this image has no Python {want}+ with torch installed '
            f'(tried:${{tm_tried:- none found}}): use an image with one (docs/cloud-bootstrap.md, the image '
            'contract)" >&2',
            "  exit 1",
            "fi",
        ]
    return lines


__all__ = [
    "AZ_CONNECTION_STRING",
    "BAKED_PYTHON",
    "PYTHONS",
    "S3_PREFIX",
    "URL_TTL_S",
    "Artifact",
    "BlobSigner",
    "build_wheel",
    "delete_blobs",
    "delete_s3",
    "parse_container_url",
    "presign_s3",
    "render_fetch",
    "render_python_select",
    "sha256_of",
    "sign_blobs",
    "stage_blob",
    "stage_local",
    "stage_s3",
    "validate_s3_location",
]
