"""A threaded HTTP server on a free loopback port: the scaffolding every local test server in tests/cloud shares."""

from __future__ import annotations

import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


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
