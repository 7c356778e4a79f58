"""The ``gpuppetti host-agent`` process: the HTTP server, and the refresh of live figures, as its duties."""

from __future__ import annotations

import logging

from gpuppetti.base.runtime import Runtime, StartupError
from gpuppetti.hostagent.server import Collector, HostAgent

log = logging.getLogger(__name__)


async def run_agent(runtime: Runtime, token: str, host: str | None, port: int, interval: float) -> None:
    await runtime.run(lambda runtime: start_agent(runtime, token, host, port, interval))


async def start_agent(runtime: Runtime, token: str, host: str | None, port: int, interval: float) -> None:
    agent = HostAgent(token, Collector(), interval)
    try:
        await agent.start(host, port)
    except OSError as exc:
        raise StartupError(f"cannot listen on {host or '*'}:{port}: {exc.strerror or exc}") from exc
    if not agent.collector.gpus:
        log.warning("no GPU found here (%s): /v1/gpus answers 503 until one is; is this the Mac whose GPU the VM "
                    "uses?", agent.collector.error)
    runtime.spawn("host-agent-http", agent.serve())
    runtime.spawn("host-agent-refresh", agent.refresh_forever())
    runtime.spawn("config-reload", runtime.reloads(agent.recollect))
