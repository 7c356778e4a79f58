"""The ``gpuppetti host-agent`` process."""

from __future__ import annotations

import asyncio
import logging

from gpuppetti.daemon import StartupError, serve_until_signalled
from gpuppetti.hostagent.server import Collector, HostAgent

log = logging.getLogger(__name__)


async def run_agent(token: str, host: str | None, port: int, interval: float) -> None:
    agent = HostAgent(token, Collector(), interval)
    try:
        await agent.start(host, port)
    except OSError as exc:
        raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    if agent.collector.error:
        log.warning("no GPU found yet: %s", agent.collector.error)

    async def serve(stop: asyncio.Event) -> None:
        refresher = asyncio.create_task(agent.refresh_forever(), name="host-agent-refresh")
        try:
            await stop.wait()
        finally:
            refresher.cancel()
            await agent.stop()

    async def reload() -> None:
        await asyncio.to_thread(agent.collector.collect)

    await serve_until_signalled(serve, reload)
