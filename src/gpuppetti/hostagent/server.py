"""``gpuppetti host-agent``: the Mac's GPU facts over HTTP, for the plugin inside a krunkit VM.

It runs natively on the Mac, needs no root, and answers only requests that carry its bearer token. The static
facts (model, cores, memory, Metal family) are read at start; utilisation and in-use memory are refreshed at an
interval on a thread, so that a request never waits for ioreg.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from gpuppetti import __version__
from gpuppetti.base.webserver import Answer, Server
from gpuppetti.discovery.macos import IOREG, SYSCTL_MEMSIZE, MacosBackend, metal_working_set, parse_ioreg, run_command
from gpuppetti.hostagent import API_PATH
from gpuppetti.hostagent.token import matches

log = logging.getLogger(__name__)

REFUSALS_LOG_INTERVAL_S = 60.0


@dataclass
class AgentGpu:
    model: str
    vendor: str
    cores: int | None
    unified_memory_bytes: int | None
    recommended_max_working_set_bytes: int | None
    metal_family: str | None
    utilization_percent: int | None
    in_use_memory_bytes: int | None


class Collector:
    """The static facts once (system_profiler is slow), the live ones from ioreg at every refresh."""

    def __init__(self, backend: MacosBackend | None = None) -> None:
        self._backend = backend or MacosBackend()
        self.gpus: list[AgentGpu] = []
        self.collected_at = 0.0
        self.error: str | None = None

    def collect(self) -> None:
        gpus = self._backend.discover()
        if not gpus:
            self.error = self._backend.looked_at()
            return
        memory: int | None = None
        try:
            memory = int(run_command(SYSCTL_MEMSIZE).strip())
        except Exception:  # sysctl missing: memory stays unknown, the rest still counts
            memory = None
        working_set = metal_working_set()
        self.gpus = [
            AgentGpu(
                model=gpu.model, vendor=gpu.vendor.value, cores=gpu.cores,
                unified_memory_bytes=memory if gpu.vendor.value == "apple" else gpu.memory_bytes,
                recommended_max_working_set_bytes=working_set if gpu.vendor.value == "apple" else None,
                metal_family=gpu.metal_family, utilization_percent=gpu.utilization_percent,
                in_use_memory_bytes=gpu.memory_used_bytes,
            )
            for gpu in gpus
        ]
        self.collected_at = time.time()
        self.error = None

    def refresh(self) -> None:
        if not self.gpus:
            self.collect()
            return
        try:
            accelerators = parse_ioreg(run_command(IOREG))
        except Exception as exc:  # keep the last figures; say why they are old
            self.error = f"ioreg failed: {exc}"
            return
        apple = [gpu for gpu in self.gpus if gpu.vendor == "apple"]
        for gpu, accelerator in zip(apple, accelerators, strict=False):
            gpu.utilization_percent = accelerator.utilization_percent
            gpu.in_use_memory_bytes = accelerator.in_use_memory_bytes
        self.collected_at = time.time()
        self.error = None

    def document(self) -> dict[str, Any]:
        return {"version": __version__, "collectedAt": self.collected_at,
                "gpus": [asdict(gpu) for gpu in self.gpus], "error": self.error}


class HostAgent:
    def __init__(self, token: str, collector: Collector, interval: float) -> None:
        self._token = token
        self.collector = collector
        self._interval = interval
        self._server = Server({API_PATH: self._gpus}, guard=self._auth)
        # Refusals are counted and said at most once an interval: a client that retries without the token must not
        # fill the Mac's disk with the agent's log.
        self._refused = 0
        self._refusals_said_at: float | None = None

    @property
    def address(self) -> str:
        return self._server.address

    def _auth(self, headers: Mapping[str, str], path: str, peer: str) -> Answer | None:
        if matches(self._token, headers.get("authorization")):
            return None
        self._refused += 1
        now = time.monotonic()
        if self._refusals_said_at is None or now - self._refusals_said_at >= REFUSALS_LOG_INTERVAL_S:
            log.warning("refused %d request%s without the right token (the last from %s)%s", self._refused,
                        "" if self._refused == 1 else "s", peer,
                        "" if self._refusals_said_at is not None else
                        f"; further refusals are counted and said at most once every {REFUSALS_LOG_INTERVAL_S:.0f}s")
            self._refused, self._refusals_said_at = 0, now
        return Answer(401, json.dumps({"error": "a valid bearer token is required"}).encode(), "application/json",
                      {"www-authenticate": 'Bearer realm="gpuppetti-host-agent"'})

    async def _gpus(self) -> Answer:
        # No GPU is not an answer a client should take as one: 503, with what was looked at.
        return Answer.json(self.collector.document(), 200 if self.collector.gpus else 503)

    async def start(self, host: str | None, port: int) -> None:
        await asyncio.to_thread(self.collector.collect)
        await self._server.start(host, port)
        log.info("host agent serving %s on http://%s", API_PATH, self.address)

    async def refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            await asyncio.to_thread(self.collector.refresh)

    async def recollect(self) -> None:
        await asyncio.to_thread(self.collector.collect)

    async def serve(self) -> None:
        """Duty: serve until cancelled, then close the listener."""
        await self._server.serve()

    async def stop(self) -> None:
        await self._server.stop()
