"""Local stand-ins for Azure Key Vault's secrets REST API and the managed-identity token endpoint of IMDS.

`KeyVaultServer` speaks the routes `cloud.secrets.AzureKeyVaultStore` calls, over HTTPS with a throw-away CA (as
`arm_server.ArmServer` does): `PUT /secrets/{name}`, `GET /secrets/{name}[/{version}]`, `DELETE /secrets/{name}`,
each with `api-version=7.4`, answering like the service: a bundle with `id` (`{vault}/secrets/{name}/{version}`),
`value`, `attributes` and `tags`; 401 with a `WWW-Authenticate: Bearer` challenge when the request carries no token
it issued, 404 `SecretNotFound`, 400 `BadParameter` for a wrong api-version. Faults: `fail_next(status, code)`.
https://learn.microsoft.com/rest/api/keyvault/secrets/set-secret/set-secret

`ManagedIdentityImds` serves `/metadata/identity/oauth2/token` over plain http, as 169.254.169.254 does, only to a
request with the `Metadata: true` header, and its tokens are the ones the vault accepts.

Neither logs a request body: the tests check that no secret reaches a log.
"""

from __future__ import annotations

import json
import re
import ssl
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from tests.cloud.arm_server import make_tls_files
from tests.cloud.loopback import LoopbackServer, QuietHandler, StartedOnDemand, send_reply

API_VERSION = "7.4"
_ROUTE = re.compile(r"/secrets/([0-9A-Za-z-]{1,127})(?:/([0-9a-f]{32}))?/?")


@dataclass(frozen=True)
class KvRequest:
    """One request as the vault saw it (never its body)."""

    method: str
    path: str
    api_version: str | None
    authorized: bool


class TokenBook:
    """Tokens issued by the fake IMDS (or minted by a test) that the fake vault accepts."""

    def __init__(self) -> None:
        self._tokens: set[str] = set()
        self._lock = threading.Lock()

    def issue(self) -> str:
        token = f"kv-{uuid.uuid4().hex}"
        with self._lock:
            self._tokens.add(token)
        return token

    def valid(self, token: str) -> bool:
        with self._lock:
            return token in self._tokens


class KeyVaultServer(StartedOnDemand):
    def __init__(self, tls_dir: Path, tokens: TokenBook) -> None:
        self.tokens = tokens
        self.ca_path, cert_path, key_path = make_tls_files(tls_dir)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert_path, key_path)
        self._tls = context
        # name -> list of versions, newest last: (version, value, tags); None marks a deleted secret
        self._secrets: dict[str, list[tuple[str, str, dict[str, str]]]] = {}
        self._faults: list[tuple[int, str]] = []
        self.requests: list[KvRequest] = []
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return self._url("https")

    def client_ssl_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca_path))

    def fail_next(self, status: int, code: str, times: int = 1) -> None:
        with self._lock:
            self._faults.extend([(status, code)] * times)

    def stored(self, name: str) -> tuple[str, dict[str, str]] | None:
        """(value, tags) of the current version, or None."""
        with self._lock:
            versions = self._secrets.get(name)
            return (versions[-1][1], dict(versions[-1][2])) if versions else None

    def secret_names(self) -> list[str]:
        """The names of every secret the vault holds now (what Key Vault's List Secrets shows), sorted."""
        with self._lock:
            return sorted(name for name, versions in self._secrets.items() if versions)

    def start(self) -> None:
        vault = self

        class Handler(QuietHandler):
            def do_PUT(self) -> None:
                vault._handle(self, "PUT")

            def do_GET(self) -> None:
                vault._handle(self, "GET")

            def do_DELETE(self) -> None:
                vault._handle(self, "DELETE")

        self._server = LoopbackServer(Handler, "keyvault", tls=self._tls).start()

    # ---------------------------------------------------------------------------------------------- requests

    def _handle(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else b""
        parts = urlsplit(handler.path)
        api_version = parse_qs(parts.query).get("api-version", [None])[-1]
        auth = handler.headers.get("Authorization", "")
        authorized = auth.startswith("Bearer ") and self.tokens.valid(auth.removeprefix("Bearer "))
        with self._lock:
            self.requests.append(KvRequest(method, parts.path, api_version, authorized))
        if not authorized:
            # What Key Vault answers an unauthenticated request: the challenge azure-identity's policy follows.
            self._send(handler, 401, _error("Unauthorized", "AKV10000: Request is missing a Bearer or PoP token."),
                       {"WWW-Authenticate": 'Bearer authorization="https://login.microsoftonline.com/tenant", '
                                            'resource="https://vault.azure.net"'})
            return
        if api_version != API_VERSION:
            self._send(handler, 400, _error("BadParameter", f"api-version {api_version} is not supported here"))
            return
        with self._lock:
            fault = self._faults.pop(0) if self._faults else None
        if fault is not None:
            self._send(handler, fault[0], _error(fault[1], "Injected"))
            return
        match = _ROUTE.fullmatch(parts.path)
        if match is None:
            self._send(handler, 404, _error("NotFound", "no such route"))
            return
        name, version = match.group(1), match.group(2)
        if method == "PUT" and version is None:
            request = json.loads(body or b"{}")
            if not isinstance(request.get("value"), str):
                self._send(handler, 400, _error("BadParameter", "value is required"))
                return
            new_version = uuid.uuid4().hex
            with self._lock:
                self._secrets.setdefault(name, []).append((new_version, request["value"], request.get("tags") or {}))
            self._send(handler, 200, self._bundle(handler, name, new_version, request["value"], request.get("tags")))
            return
        with self._lock:
            versions = list(self._secrets.get(name) or [])
            if method == "DELETE" and versions:
                del self._secrets[name]
        if not versions:
            self._send(handler, 404, _error("SecretNotFound", f"A secret with (name/id) {name} was not found"))
            return
        found = versions[-1] if version is None else next((v for v in versions if v[0] == version), None)
        if found is None:
            self._send(handler, 404, _error("SecretNotFound", f"{name}/{version} was not found"))
            return
        bundle = self._bundle(handler, name, found[0], found[1], found[2])
        if method == "DELETE":
            bundle.pop("value")
            bundle["recoveryId"] = f"{self.url}/deletedsecrets/{name}"
        self._send(handler, 200, bundle)

    def _bundle(
        self, handler: BaseHTTPRequestHandler, name: str, version: str, value: str, tags: dict[str, str] | None
    ) -> dict[str, Any]:
        now = int(time.time())
        return {
            "value": value,
            "id": f"{self.url}/secrets/{name}/{version}",
            "attributes": {"enabled": True, "created": now, "updated": now, "recoveryLevel": "Recoverable+Purgeable"},
            "tags": tags or {},
        }

    @staticmethod
    def _send(handler: BaseHTTPRequestHandler, status: int, payload: dict[str, Any],
              headers: dict[str, str] | None = None) -> None:
        content_type = {"Content-Type": "application/json; charset=utf-8"}
        send_reply(handler, status, json.dumps(payload).encode(), {**content_type, **(headers or {})})


def _error(code: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message}}


class ManagedIdentityImds(StartedOnDemand):
    """The managed-identity token endpoint of Azure's IMDS (plain http), issuing tokens from `tokens`."""

    def __init__(self, tokens: TokenBook) -> None:
        self.tokens = tokens
        self.requests: list[dict[str, str]] = []  # each request's query and whether it had Metadata: true
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return self._url()

    def start(self) -> None:
        imds = self

        class Handler(QuietHandler):
            def do_GET(self) -> None:
                parts = urlsplit(self.path)
                query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
                metadata = self.headers.get("Metadata") == "true"
                with imds._lock:
                    imds.requests.append({**query, "metadata_header": str(metadata)})
                if parts.path != "/metadata/identity/oauth2/token":
                    status, payload = 404, {"error": "not_found"}
                elif not metadata:
                    status, payload = 400, {"error": "invalid_request", "error_description": "Required metadata "
                                            "header not specified"}
                elif query.get("resource") != "https://vault.azure.net":
                    status, payload = 400, {"error": "invalid_resource"}
                else:
                    status, payload = 200, {
                        "access_token": imds.tokens.issue(), "expires_on": str(int(time.time()) + 3600),
                        "resource": query["resource"], "token_type": "Bearer",
                    }
                send_reply(self, status, json.dumps(payload).encode(), {"Content-Type": "application/json"})

        self._server = LoopbackServer(Handler, "azure-imds").start()


@contextmanager
def key_vault(tls_dir: Path) -> Iterator[tuple[KeyVaultServer, ManagedIdentityImds]]:
    """A vault and the IMDS whose tokens it accepts, both started; stopped afterwards."""
    tokens = TokenBook()
    vault, imds = KeyVaultServer(tls_dir, tokens), ManagedIdentityImds(tokens)
    vault.start()
    imds.start()
    try:
        yield vault, imds
    finally:
        imds.stop()
        vault.stop()
