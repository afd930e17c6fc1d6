"""Proof of membership: a process shows it holds the job's secret before it is trusted with state.

Proofs are HMAC-SHA256 over a statement that names the job, the process and the purpose, so a proof seen on
the (unauthenticated) store cannot be replayed for another process, generation or rank.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets


def new_token() -> str:
    return secrets.token_hex(32)


def prove(token: str, *statement: object) -> str:
    message = "\x1f".join(str(part) for part in statement).encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def verify(token: str, proof: str, *statement: object) -> bool:
    return hmac.compare_digest(prove(token, *statement), proof)
