"""The one TCP listener: /healthz (ready), /livez (alive), /metrics and /v1/gpus.

It is aiohttp's server in the process's own event loop: requests are handled concurrently, and a client that
connects and sends nothing is dropped after a timeout, so idle connections cannot take the liveness probe down.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import socket
from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gpuppetti.metrics import Metrics

log = logging.getLogger(__name__)

# Returns None when ready, else what it is still waiting for; a ready process may add a note ("ok: ...").
Readiness = Callable[[], str | None]
GPUS_PATH = "/v1/gpus"
# A peer that connects and says nothing, or goes quiet between requests, is dropped after this long.
KEEPALIVE_TIMEOUT_S = 5.0
READY_NOTE = "ok: "


class AddressError(ValueError):
    pass


def parse_address(text: str, what: str = "address") -> tuple[str | None, int]:
    """``HOST:PORT``, ``[IPv6]:PORT`` or ``:PORT`` (every address, IPv4 and IPv6). Raises AddressError."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise AddressError(f"{what}: expected HOST:PORT such as 127.0.0.1:9400, [::1]:9400 or :9400, got {text!r}")
    if host.startswith("["):
        if not host.endswith("]"):
            raise AddressError(f"{what}: unbalanced brackets in {text!r}")
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise AddressError(f"{what}: {host!r} in brackets is not an IPv6 address (in {text!r})") from None
    elif ":" in host:
        raise AddressError(f"{what}: write an IPv6 address in brackets, as [{host}]:{port}")
    elif host and not _is_host(host):
        raise AddressError(f"{what}: {host!r} is not an IP address or host name (in {text!r})")
    return (host or None), int(port)


def _is_host(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        labels = text.rstrip(".").split(".")
        return all(label and len(label) <= 63 and label.replace("-", "").isalnum() for label in labels)


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class HttpServer:
    """Serves from the moment it starts: ``readiness`` and ``records`` are set once the process has them."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self.readiness: Readiness = lambda: "no resource is being served yet (discovering GPUs)"
        self.records: Callable[[], list[dict[str, Any]]] = list
        self._runner: web.AppRunner | None = None
        self.address = ""

    async def _healthz(self, request: web.Request) -> web.Response:
        waiting = self.readiness()
        if waiting is None:
            return web.Response(text="ok\n")
        if waiting.startswith(READY_NOTE):
            return web.Response(text=f"{waiting}\n")
        return web.Response(status=503, text=f"not ready: {waiting}\n")

    async def _livez(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def _gpus(self, request: web.Request) -> web.Response:
        # What the running process serves, facts' staleness included: `gpuppetti discover --from` shows it.
        return web.Response(text=json.dumps(self.records()), content_type="application/json")

    async def _metrics_page(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self._metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _not_found(self, request: web.Request) -> web.Response:
        return web.Response(status=404, text=f"not found: try /healthz, /livez, {GPUS_PATH} or /metrics\n")

    def _app(self) -> web.Application:
        app = web.Application()
        for path in ("/healthz", "/readyz"):
            app.router.add_get(path, self._healthz)
        app.router.add_get("/livez", self._livez)
        app.router.add_get("/metrics", self._metrics_page)
        app.router.add_get(GPUS_PATH, self._gpus)
        app.router.add_route("GET", "/{tail:.*}", self._not_found)
        return app

    async def start(self, address: str) -> None:
        host, port = parse_address(address, "--http-address")
        # A connection that says nothing is closed after the keep-alive timeout, which starts when it opens.
        runner = web.AppRunner(self._app(), handle_signals=False, access_log=None,
                               keepalive_timeout=KEEPALIVE_TIMEOUT_S)
        await runner.setup()
        try:
            # No host: every address, IPv6 included where the machine has it.
            await web.TCPSite(runner, host, port, reuse_address=True).start()
        except OSError as exc:
            await runner.cleanup()
            raise AddressError(f"cannot listen on {address}: {exc.strerror or exc}") from exc
        self._runner = runner
        bound = runner.addresses[0]
        bound_host = str(bound[0])
        if host is None:
            bound_host = "127.0.0.1" if _family(bound_host) == socket.AF_INET else "::1"
        self.address = format_address(bound_host, int(bound[1]))
        log.info("serving /healthz and /metrics on http://%s", self.address)

    async def serve(self) -> None:
        """The HTTP duty: serve until cancelled, then close the listener."""
        try:
            await asyncio.Event().wait()
        finally:
            await self.stop()

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()


def _family(host: str) -> int:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
