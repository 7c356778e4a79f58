"""The one TCP listener: /healthz (ready), /livez (alive) and /metrics, on localhost unless told otherwise.

It is the standard library's WSGI server on a thread of its own, serving prometheus-client's exposition: small
enough that the device plugin stays within its memory budget, and unaffected by a busy event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gpuppetti.metrics import Metrics

log = logging.getLogger(__name__)

# Returns None when ready, else what it is still waiting for.
Readiness = Callable[[], str | None]
POLL_INTERVAL_S = 1.0
GPUS_PATH = "/v1/gpus"


class AddressError(ValueError):
    pass


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise AddressError(f"expected HOST:PORT such as 127.0.0.1:9400, got {text!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


class _ThreadingServer(WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        log.debug("http: " + format, *args)


class HttpServer:
    def __init__(
        self, metrics: Metrics, readiness: Readiness, inventory: Callable[[], list[dict[str, Any]]] | None = None
    ) -> None:
        self._metrics = metrics
        self._readiness = readiness
        self._inventory = inventory
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None
        self.address = ""

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [("Content-Type", "text/plain")])
            return [b"only GET\n"]
        if path in ("/healthz", "/readyz"):
            waiting = self._readiness()
            if waiting is None:
                start_response("200 OK", [("Content-Type", "text/plain")])
                return [b"ok\n"]
            start_response("503 Service Unavailable", [("Content-Type", "text/plain")])
            return [f"not ready: {waiting}\n".encode()]
        if path == "/livez":
            start_response("200 OK", [("Content-Type", "text/plain")])
            return [b"ok\n"]
        if path == GPUS_PATH and self._inventory is not None:
            # What the running process serves, facts' staleness included: `gpuppetti discover --from` shows it.
            start_response("200 OK", [("Content-Type", "application/json")])
            return [json.dumps(self._inventory()).encode()]
        if path == "/metrics":
            start_response("200 OK", [("Content-Type", CONTENT_TYPE_LATEST)])
            return [generate_latest(self._metrics.registry)]
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [f"not found: try /healthz, /livez, {GPUS_PATH} or /metrics\n".encode()]

    async def start(self, address: str) -> None:
        host, port = parse_address(address)
        try:
            server = make_server(host, port, self._app, server_class=_ThreadingServer, handler_class=_QuietHandler)
        except OSError as exc:
            raise AddressError(f"cannot listen on {address}: {exc.strerror or exc}") from exc
        self._server = server
        self.address = f"{host}:{server.server_port}"
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": POLL_INTERVAL_S}, name="http", daemon=True)
        self._thread.start()
        log.info("serving /healthz and /metrics on http://%s", self.address)

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        await asyncio.to_thread(server.shutdown)
        server.server_close()
