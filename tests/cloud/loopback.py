"""A threaded HTTP server on a free loopback port: the scaffolding every local test server in tests/cloud shares."""

from __future__ import annotations

import ssl
import threading
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self


class LoopbackServer:
    """Serves `handler` on 127.0.0.1:<free port> from a daemon thread, optionally over TLS; `stop` is bounded."""

    def __init__(self, handler: type[BaseHTTPRequestHandler], name: str, *, tls: ssl.SSLContext | None = None) -> None:
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        if tls is not None:
            self.httpd.socket = tls.wrap_socket(self.httpd.socket, server_side=True)
        # A short poll interval keeps shutdown() quick (the default waits up to 0.5 s).
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, name=name, daemon=True
        )

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    def start(self) -> LoopbackServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            self.httpd.shutdown()
            self._thread.join(timeout=10)
        self.httpd.server_close()


class QuietHandler(BaseHTTPRequestHandler):
    """A request handler that logs nothing: pytest shows failures, not every request."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


def send_reply(handler: BaseHTTPRequestHandler, status: int, body: bytes, headers: Mapping[str, str] = {}) -> None:
    """Answer the request `handler` serves: `status`, `headers` in their order, the Content-Length, then `body`."""
    handler.send_response(status)
    for key, value in headers.items():
        handler.send_header(key, value)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


class StartedOnDemand:
    """A test server whose `LoopbackServer` its `start` makes: `stop` stops it when there is one."""

    _server: LoopbackServer | None = None

    def _url(self, scheme: str = "http") -> str:
        assert self._server is not None, "not started"
        return f"{scheme}://127.0.0.1:{self._server.port}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()


class MadeWithServer:
    """A test server that makes its `LoopbackServer` when made (as `_server`): `start` gives the test server back,
    and `with` starts it and stops it at the end of the block."""

    _server: LoopbackServer
    scheme = "http"

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self._server.port}"

    def start(self) -> Self:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
