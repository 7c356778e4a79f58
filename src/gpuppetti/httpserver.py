"""The one TCP listener: /healthz (ready), /livez (alive) and /metrics, on localhost unless told otherwise."""

from __future__ import annotations

import logging
from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gpuppetti.metrics import Metrics

log = logging.getLogger(__name__)

# Returns None when ready, else what it is still waiting for.
Readiness = Callable[[], str | None]


class AddressError(ValueError):
    pass


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise AddressError(f"expected HOST:PORT such as 127.0.0.1:9400, got {text!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


class HttpServer:
    def __init__(self, metrics: Metrics, readiness: Readiness) -> None:
        self._metrics = metrics
        self._readiness = readiness
        self._runner: web.AppRunner | None = None
        self.address = ""

    async def start(self, address: str) -> None:
        host, port = parse_address(address)
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._healthz)
        app.router.add_get("/livez", self._livez)
        app.router.add_get("/metrics", self._metrics_page)
        self._runner = web.AppRunner(app, handle_signals=False, access_log=None)
        await self._runner.setup()
        try:
            await web.TCPSite(self._runner, host, port).start()
        except OSError as exc:
            await self._runner.cleanup()
            raise AddressError(f"cannot listen on {address}: {exc.strerror or exc}") from exc
        bound = self._runner.addresses[0]
        self.address = f"{bound[0]}:{bound[1]}"
        log.info("serving /healthz and /metrics on http://%s", self.address)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _healthz(self, request: web.Request) -> web.Response:
        waiting = self._readiness()
        if waiting is None:
            return web.Response(text="ok\n")
        return web.Response(status=503, text=f"not ready: {waiting}\n")

    async def _livez(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def _metrics_page(self, request: web.Request) -> web.Response:
        body = generate_latest(self._metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
