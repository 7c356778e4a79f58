"""The daemons' one TCP listener: /healthz (ready), /livez (alive), /metrics, /v1/gpus and /v1/slices, in the event
loop."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from gpuppetti.base.pagebuilder import PageBuilder
from gpuppetti.base.webserver import AddressError, Answer, Server, parse_address
from gpuppetti.node.metrics import Metrics

__all__ = ["READY_NOTE", "AddressError", "HttpServer", "parse_address"]

log = logging.getLogger(__name__)

# Returns None when ready, else what it is still waiting for; a ready process may add a note ("ok: ...").
Readiness = Callable[[], str | None]
GPUS_PATH = "/v1/gpus"
SLICES_PATH = "/v1/slices"
READY_NOTE = "ok: "
# How often a port another process holds is tried again.
PORT_POLL_S = 0.25
CONTENT_TYPE_LATEST = "text/plain; version=0.0.4; charset=utf-8"


class HttpServer:
    """The daemons' endpoint. It serves from the moment it starts: ``readiness`` and ``records`` are set once the
    process has them."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self.readiness: Readiness = lambda: "starting"
        self.records: Callable[[], list[dict[str, Any]]] = list
        # Each slice a container holds (report.slice_records); called in a thread: it reads files.
        self.slices: Callable[[], list[dict[str, Any]]] = list
        # The pages that read files are built off the event loop, in a thread of their own (not the loop's default
        # executor, which writes the checkpoints), one at a time.
        self._builds = ThreadPoolExecutor(1, thread_name_prefix="http-pages")
        self._metrics_pages = PageBuilder(self._build_metrics, self._builds)
        self._slices_pages = PageBuilder(self._build_slices, self._builds)
        self._server = Server({"/healthz": self._healthz, "/readyz": self._healthz, "/livez": self._livez,
                               "/metrics": self._metrics_page, GPUS_PATH: self._gpus,
                               SLICES_PATH: self._slices})

    @property
    def address(self) -> str:
        return self._server.address

    async def _healthz(self) -> Answer:
        waiting = self.readiness()
        if waiting is None:
            return Answer.text(200, "ok\n")
        if waiting.startswith(READY_NOTE):
            return Answer.text(200, f"{waiting}\n")
        return Answer.text(503, f"not ready: {waiting}\n")

    async def _livez(self) -> Answer:
        return Answer.text(200, "ok\n")

    async def _gpus(self) -> Answer:
        # What the running process serves, facts' staleness included: `gpuppetti discover --from` shows it.
        return Answer.json(self.records())

    async def _slices(self) -> Answer:
        # Who holds which slice and how much of it: `gpuppetti top` shows it.
        return Answer(200, await self._slices_pages.get(), "application/json")

    async def _metrics_page(self) -> Answer:
        return Answer(200, await self._metrics_pages.get(), CONTENT_TYPE_LATEST)

    def _build_slices(self) -> bytes:
        return json.dumps(self.slices()).encode()

    def _build_metrics(self) -> bytes:
        from prometheus_client import generate_latest

        # Rendering a node's pages takes a while: called in the endpoint's own thread.
        return generate_latest(self._metrics.registry)

    async def start(self, address: str) -> None:
        host, port = parse_address(address, "--http-address")
        try:
            bound = await self._server.start(host, port)
        except OSError as exc:
            raise AddressError(f"cannot listen on {address}: {exc.strerror or exc}") from exc
        log.info("serving /healthz and /metrics on http://%s", bound)

    async def serve_once_free(self, address: str) -> None:
        """The HTTP duty where another instance of the daemon may hold the port (a rolling update's old pod on the
        node's network): wait until it is free, saying so, then serve."""
        said = False
        while True:
            try:
                await self.start(address)
                break
            except AddressError as exc:
                if not isinstance(exc.__cause__, OSError) or exc.__cause__.errno != errno.EADDRINUSE:
                    raise
                if not said:
                    log.warning("%s: another process holds the port (the other instance of a rolling update, on "
                                "the node's network); serving once it is free", exc)
                    said = True
            await asyncio.sleep(PORT_POLL_S)
        await self.serve()

    async def serve(self) -> None:
        """The HTTP duty: serve until cancelled, then close the listener."""
        try:
            await self._server.serve()
        finally:
            self._builds.shutdown(wait=False, cancel_futures=True)
