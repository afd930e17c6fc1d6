"""The job's secret on this machine: a file only its owner can read, which the local provider's hosts read where it
is (`trainmover agent --secret-file`)."""

from __future__ import annotations

import contextlib
import os

from cloud.base import InvalidRequestError, NotFoundError, PermissionDeniedError
from cloud.secret_store import JobSecretStore, SecretKind, SecretRef, write_secret_file


class LocalFileStore(JobSecretStore):
    """Job secrets as files in one directory, each readable by its owner only: the local provider's hosts share this
    machine's filesystem and read the file where it is (`trainmover agent --secret-file`)."""

    kind: SecretKind = "local-file"

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = os.path.abspath(directory)

    def __repr__(self) -> str:
        return f"LocalFileStore({self.directory!r})"

    def put(self, job_id: str, secret: str) -> SecretRef:
        name = self._name_to_put(job_id, secret)
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        ref = SecretRef(self.kind, os.path.join(self.directory, name))
        write_secret_file(ref.name, secret)
        return ref

    def get(self, ref: SecretRef) -> str:
        self._check_ref(ref)
        try:
            st = os.stat(ref.name)
            if st.st_mode & 0o077:
                raise PermissionDeniedError(
                    f"local: the secret file {ref.name} is readable by other users (mode {st.st_mode & 0o777:o}); "
                    f"run `chmod 600 {ref.name}`",
                    provider="local",
                )
            with open(ref.name, encoding="utf-8") as f:
                return f.read().strip()
        except FileNotFoundError:
            raise NotFoundError(f"local: no secret file {ref.name}", provider="local") from None

    def delete(self, ref: SecretRef) -> None:
        self._check_ref(ref)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(ref.name)

    def _check_ref(self, ref: SecretRef) -> None:
        if ref.kind != self.kind or os.path.dirname(ref.name) != self.directory:
            raise InvalidRequestError(f"local: {ref.kind} secret {ref.name!r} is not in {self.directory}")


__all__ = ["LocalFileStore"]
