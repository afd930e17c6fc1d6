"""The job's secret, shared by every cloud: where it lives (`SecretRef`), the store interface (`JobSecretStore`),
the default names, and the redaction of secret values from logs.

The stores themselves live with their cloud: `cloud.aws.secrets` (Secrets Manager, SSM Parameter Store),
`cloud.azure.secrets` (Key Vault), `cloud.local.secrets` (a file); `cloud.secrets` fetches a secret on a host and
re-exports them all. A `SecretRef` says where a secret lives, never its value; it is all the bootstrap carries.
Secret values never appear in messages, logs or reprs: botocore logs request parameters and response bodies at
DEBUG, so every value a store handles is redacted from botocore's loggers (`remember_secret`).
"""

from __future__ import annotations

import abc
import contextlib
import hashlib
import logging
import os
import re
import threading
import urllib.parse
from dataclasses import dataclass
from typing import Literal, get_args

from cloud.base import InvalidRequestError, validate_job_id

SecretKind = Literal["aws-secretsmanager", "aws-ssm", "azure-keyvault", "local-file"]

MIN_SECRET_CHARS = 32  # runtime.wire.auth's minimum; cloud/ may not import runtime, so it is checked again here

AWS_REGION = re.compile(r"[a-z]{2}(?:-[a-z]+)+-\d{1,2}")
_SM_NAME = re.compile(r"[A-Za-z0-9/_+=.@-]{1,512}")
_SM_ARN = re.compile(r"arn:aws[a-z-]*:secretsmanager:([a-z0-9-]+):\d{12}:secret:[A-Za-z0-9/_+=.@-]{1,512}")
_SSM_NAME = re.compile(r"/[A-Za-z0-9_./-]{1,1010}")
KEY_VAULT_SECRET_NAME = re.compile(r"[0-9A-Za-z-]{1,127}")
GUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")


# ---------------------------------------------------------------------------------------------------- redaction


class _Redactor(logging.Filter):
    """Replaces every secret value this process handed to a store with `[redacted]` in the records of the loggers
    it is attached to. botocore logs a request's parameters (`botocore.endpoint`) and a response's body
    (`botocore.parsers`) at DEBUG, SecretString and Value included."""

    LOGGERS = ("botocore.endpoint", "botocore.parsers", "urllib3.connectionpool")

    def __init__(self) -> None:
        super().__init__()
        self._values: set[str] = set()
        self._lock = threading.Lock()
        self._attached = False

    def remember(self, value: str) -> None:
        with self._lock:
            self._values.add(value)
            if not self._attached:
                for name in self.LOGGERS:
                    logging.getLogger(name).addFilter(self)
                self._attached = True

    def filter(self, record: logging.LogRecord) -> bool:
        with self._lock:
            values = tuple(self._values)
        if not values:
            return True
        try:
            text = record.getMessage()
        except Exception:  # a malformed record is the logging module's to report, not ours
            return True
        if any(v in text for v in values):
            for v in values:
                text = text.replace(v, "[redacted]")
            record.msg, record.args = text, None
        return True


_REDACTOR = _Redactor()


def check_secret_value(secret: str) -> str:
    """`secret` itself when it is long enough for runtime.wire.auth; remembered for redaction."""
    if not isinstance(secret, str) or len(secret.strip()) < MIN_SECRET_CHARS or any(c.isspace() for c in secret):
        raise InvalidRequestError(
            f"the job secret must be at least {MIN_SECRET_CHARS} printable characters without spaces (for example "
            "python -c 'import secrets; print(secrets.token_hex(32))')",
            code="InvalidSecret",
        )
    _REDACTOR.remember(secret)
    return secret

def remember_secret(value: str) -> None:
    """Redact `value` from botocore's and urllib3's log records from now on (a value read from or given to a store)."""
    _REDACTOR.remember(value)


# ---------------------------------------------------------------------------------------------------- where


@dataclass(frozen=True, slots=True)
class SecretRef:
    """Where a job's secret lives: everything a host needs to fetch it with its own identity, never the value."""

    kind: SecretKind
    name: str
    """Secrets Manager: the secret's ARN (or name); SSM: the parameter name (`/trainmover/JOB/job-secret`);
    Key Vault: the secret's URL without a version (`https://VAULT.vault.azure.net/secrets/NAME`); local-file: the
    absolute path of a file only its owner can read, on a filesystem every local host shares (the local provider)."""
    region: str | None = None
    """AWS: the region of the secret (taken from a Secrets Manager ARN when not given). Azure: unused."""
    identity_client_id: str | None = None
    """Azure: the client id of the VM's user-assigned managed identity that reads it; None: the system-assigned one."""

    def __post_init__(self) -> None:
        if self.kind not in get_args(SecretKind):
            raise InvalidRequestError(
                f"unknown secret store {self.kind!r}: use one of {', '.join(get_args(SecretKind))}",
                code="InvalidSecretRef",
            )
        if self.kind == "azure-keyvault":
            self._check_key_vault()
            return
        if self.kind == "local-file":
            if not os.path.isabs(self.name) or "\0" in self.name or self.region or self.identity_client_id:
                raise InvalidRequestError(
                    "a local-file secret is the absolute path of a file, with no region or identity; got "
                    f"{self.name!r}",
                    code="InvalidSecretRef",
                )
            return
        if self.identity_client_id is not None:
            raise InvalidRequestError("identity_client_id is for Azure Key Vault only", code="InvalidSecretRef")
        arn = _SM_ARN.fullmatch(self.name) if self.kind == "aws-secretsmanager" else None
        if arn is not None and self.region is None:
            object.__setattr__(self, "region", arn.group(1))
        elif arn is not None and arn.group(1) != self.region:
            raise InvalidRequestError(
                f"the secret ARN is in {arn.group(1)}, not {self.region}: give the ARN's region",
                code="InvalidSecretRef",
            )
        if self.region is None or not AWS_REGION.fullmatch(self.region):
            raise InvalidRequestError(
                f"{self.kind}: give the AWS region of the secret (e.g. us-east-1), got {self.region!r}",
                code="InvalidSecretRef",
            )
        if self.kind == "aws-secretsmanager" and not (arn or _SM_NAME.fullmatch(self.name)):
            raise InvalidRequestError(
                f"invalid Secrets Manager secret {self.name!r}: give its ARN, or a name of letters, digits and "
                "/_+=.@-",
                code="InvalidSecretRef",
            )
        if self.kind == "aws-ssm" and not _SSM_NAME.fullmatch(self.name):
            raise InvalidRequestError(
                f"invalid SSM parameter name {self.name!r}: give a path such as /trainmover/JOB/job-secret "
                "(letters, digits and _./-)",
                code="InvalidSecretRef",
            )

    def _check_key_vault(self) -> None:
        parts = urllib.parse.urlsplit(self.name)
        segments = parts.path.strip("/").split("/")
        valid = (
            parts.scheme == "https"
            and bool(parts.hostname)
            and re.fullmatch(r"[A-Za-z0-9.-]+", parts.hostname or "") is not None
            and not parts.query
            and not parts.fragment
            and not parts.username
            and len(segments) == 2
            and segments[0] == "secrets"
            and KEY_VAULT_SECRET_NAME.fullmatch(segments[1]) is not None
        )
        if not valid:
            raise InvalidRequestError(
                f"invalid Key Vault secret URL {self.name!r}: give https://VAULT.vault.azure.net/secrets/NAME (NAME: "
                "letters, digits and '-'; no version, so a host always reads the current one)",
                code="InvalidSecretRef",
            )
        if self.region is not None:
            raise InvalidRequestError("region is for AWS secrets only", code="InvalidSecretRef")
        if self.identity_client_id is not None and not GUID.fullmatch(self.identity_client_id):
            raise InvalidRequestError(
                "identity_client_id must be the managed identity's client id (a GUID), got "
                f"{self.identity_client_id!r}",
                code="InvalidSecretRef",
            )

    @property
    def vault_url(self) -> str:
        """Key Vault: the vault's URL (`https://VAULT.vault.azure.net`)."""
        parts = urllib.parse.urlsplit(self.name)
        return f"{parts.scheme}://{parts.netloc}"

    @property
    def secret_name(self) -> str:
        """Key Vault: the secret's name in its vault."""
        return self.name.rstrip("/").rsplit("/", 1)[-1]


def secret_name_for(job_id: str, kind: SecretKind) -> str:
    """The default name of a job's secret in a store: one per job, found again from the job id alone."""
    validate_job_id(job_id)
    if kind == "aws-secretsmanager":
        return f"trainmover/{job_id}/job-secret"
    if kind == "aws-ssm":
        return f"/trainmover/{job_id}/job-secret"
    if kind == "local-file":
        return f"{job_id}.secret"
    # Key Vault names allow only letters, digits and '-': the job id's '.' and '_' are folded, and a digest of the
    # exact id keeps 'a.b' and 'a-b' apart.
    digest = hashlib.sha256(job_id.encode()).hexdigest()[:8]
    return f"trainmover-{re.sub(r'[._]', '-', job_id)}-{digest}"


class JobSecretStore(abc.ABC):
    """A cloud secret store holding job secrets: three calls, each bounded and retried only on transient errors."""

    kind: SecretKind

    def _name_to_put(self, job_id: str, secret: str) -> str:
        """The default name of `job_id`'s secret in this store, once `secret` passed `check_secret_value` (which
        remembers it for redaction): what every `put` asks before it writes anything."""
        check_secret_value(secret)
        return secret_name_for(job_id, self.kind)

    @abc.abstractmethod
    def put(self, job_id: str, secret: str) -> SecretRef:
        """Store (or replace) `job_id`'s secret, readable only by the job's instance identity; where it lives."""

    @abc.abstractmethod
    def get(self, ref: SecretRef) -> str:
        """The secret's current value. NotFoundError when there is none."""

    @abc.abstractmethod
    def delete(self, ref: SecretRef) -> None:
        """Remove the secret for good (the flows do it when the job is released). A missing secret is no error."""



def write_secret_file(path: str, secret: str) -> None:
    """Write `secret` to `path`, readable by its owner only (what runtime.wire.auth.read_secret_file demands). Replaces
    a previous file atomically; never follows a link planted at `path`."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(secret.strip() + "\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise



__all__ = [
    "MIN_SECRET_CHARS",
    "JobSecretStore",
    "SecretKind",
    "SecretRef",
    "check_secret_value",
    "remember_secret",
    "secret_name_for",
    "write_secret_file",
]
