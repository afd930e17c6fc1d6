"""Who may steer the job: proofs of membership and signed store records, both keyed by the job's secret.

The store is reachable by anyone who reaches its port, and torch's TCPStore authenticates no one. So nothing
read from it is obeyed on its word: every record that changes membership, state sources or the job's fate is
written sealed (`Sealer.seal`: an HMAC-SHA256 over the key's name and the value) and opened (`Sealer.open`)
by its reader, which ignores, counts and warns once about a value that fails. The key's name is part of what
is signed, so a genuine record cannot be moved to another key (another generation, rank or process); records
that change over time carry a number that only grows (generation, heartbeat count, control sequence), so a
replayed old value is refused as stale by its reader.

Proofs (`prove`/`verify`) are HMACs over a statement that names the job, the process and the purpose, with a
fresh nonce where they answer a challenge (the state handoff), so a proof seen on the wire proves nothing else.
Keys are derived per purpose from the secret (`derive`), never used raw.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

log = logging.getLogger("trainmover.auth")

ENV_SECRET = "TRAINMOVER_JOB_SECRET"
"""Where `trainmover run` and `runtime.wire.control.JobControl` look for the job's secret (hex), unless given one."""
MIN_SECRET_CHARS = 32


def new_token() -> str:
    return secrets.token_hex(32)


def check_secret(secret: str, where: str) -> str:
    """A secret as given by a user: stripped, long enough; the error never shows it."""
    secret = secret.strip()
    if len(secret) < MIN_SECRET_CHARS or not secret.isprintable() or any(c.isspace() for c in secret):
        raise ValueError(f"the job secret from {where} must be at least {MIN_SECRET_CHARS} printable characters "
                         "without spaces (for example: python -c 'import secrets; print(secrets.token_hex(32))')")
    return secret


def read_secret_file(path: str) -> str:
    """Read a job secret from a file that only its owner can read (it grants full control of the job)."""
    st = os.stat(path)
    if st.st_mode & 0o077:
        raise ValueError(f"the secret file {path} is readable by other users (mode {st.st_mode & 0o777:o}); "
                         f"run `chmod 600 {path}`")
    with open(path, encoding="utf-8") as f:
        return check_secret(f.read(), path)


def write_secret_file(path: str, secret: str) -> None:
    """Create `path` holding `secret`, readable by its owner only; never overwrites a file."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(secret + "\n")


def derive(token: str, purpose: str) -> bytes:
    """A key for one purpose (store records, handoff proofs, chunk MACs), derived from the job secret."""
    return hmac.new(token.encode(), b"trainmover/" + purpose.encode(), hashlib.sha256).digest()


def prove(token: str, *statement: object) -> str:
    message = "\x1f".join(str(part) for part in statement).encode()
    return hmac.new(derive(token, "proof"), message, hashlib.sha256).hexdigest()


def verify(token: str, proof: str, *statement: object) -> bool:
    return hmac.compare_digest(prove(token, *statement), proof)


class Sealer:
    """Seals and opens the job's store records; counts what it refused, warns once per key."""

    MAC_CHARS = 64

    REPORTED_PER_KIND = 10

    def __init__(self, token: str, who: str = "", on_refused: Callable[[str, str, str], None] | None = None) -> None:
        """`on_refused(kind, key, why)` hears the first `REPORTED_PER_KIND` refusals of each kind of key (for
        events); beyond them refusals are only counted, so a flood of forgeries cannot flood the reports."""
        self._key = derive(token, "store-records")
        self.who = who
        self.on_refused = on_refused
        self.refused: Counter[str] = Counter()
        """Refused values by kind of key (the key name with its numbers dropped)."""
        self._warned: set[str] = set()
        self._lock = threading.Lock()  # the heartbeat thread opens records too

    def _mac(self, key: str, payload: bytes) -> str:
        return hmac.new(self._key, key.encode() + b"\0" + payload, hashlib.sha256).hexdigest()

    def seal(self, key: str, value: Any) -> str:
        payload = json.dumps(value, separators=(",", ":"))
        return self._mac(key, payload.encode()) + payload

    def open(self, key: str, raw: bytes | str) -> Any:
        """The value sealed under `key`, or None (counted, warned about once) if it was not sealed with the secret."""
        data = raw if isinstance(raw, bytes) else raw.encode()
        mac, payload = data[: self.MAC_CHARS], data[self.MAC_CHARS :]
        try:
            ok = hmac.compare_digest(self._mac(key, payload).encode(), mac)
        except TypeError:
            ok = False
        if ok:
            try:
                return json.loads(payload)
            except ValueError:  # sealed by us, so never; refuse rather than crash
                pass
        self.refuse(key, "not signed with the job's secret")
        return None

    def refuse(self, key: str, why: str) -> None:
        kind = re.sub(r"\d+", "#", key)
        with self._lock:
            self.refused[kind] += 1
            reported = self.refused[kind] <= self.REPORTED_PER_KIND
            first = kind not in self._warned
            self._warned.add(kind)
        if reported and self.on_refused is not None:
            self.on_refused(kind, key, why)
        if first:
            log.warning("%signored a value of %s: %s (further ones of this kind are counted, not logged)",
                        f"{self.who}: " if self.who else "", key, why)

    def total_refused(self) -> int:
        with self._lock:
            return sum(self.refused.values())
