"""The ``gpuppetti plugin`` process: discover, serve, and stop or reload on signals."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from gpuppetti.daemon import Sources, reload, serve_until_signalled, start_inventory
from gpuppetti.deviceplugin.lifecycle import DevicePluginManager
from gpuppetti.httpserver import HttpServer
from gpuppetti.metrics import Metrics

log = logging.getLogger(__name__)


async def run_plugin(
    sources: Sources, device_plugin_dir: Path, http_address: str | None, cdi_dir: Path | None = None
) -> None:
    inventory, monitor = await start_inventory(sources)
    for name, plan in inventory.plan.items():
        log.info("advertising %s: %d unit(s)", name, len(plan.units))
    metrics = Metrics()
    metrics.watch(inventory)
    manager = DevicePluginManager(inventory, device_plugin_dir, metrics, cdi_dir)
    http = HttpServer(metrics, manager.waiting_for)
    if http_address:
        await http.start(http_address)

    async def serve(stop: asyncio.Event) -> None:
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(manager.run(stop), name="device-plugin")
                watching = group.create_task(monitor.run(), name="health-monitor")
                await stop.wait()
                watching.cancel()
        finally:
            await http.stop()

    await serve_until_signalled(serve, lambda: reload(sources, inventory, monitor))
