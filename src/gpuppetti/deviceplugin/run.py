"""The ``gpuppetti plugin`` process: discover, serve, and stop or reload on signals."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from gpuppetti.daemon import Sources, reload, serve_until_signalled, start_inventory
from gpuppetti.deviceplugin.lifecycle import DevicePluginManager

log = logging.getLogger(__name__)


async def run_plugin(sources: Sources, device_plugin_dir: Path) -> None:
    inventory, monitor = await start_inventory(sources)
    for name, plan in inventory.plan.items():
        log.info("advertising %s: %d unit(s)", name, len(plan.units))

    async def serve(stop: asyncio.Event) -> None:
        async with asyncio.TaskGroup() as group:
            group.create_task(DevicePluginManager(inventory, device_plugin_dir).run(stop), name="device-plugin")
            watching = group.create_task(monitor.run(), name="health-monitor")
            await stop.wait()
            watching.cancel()

    await serve_until_signalled(serve, lambda: reload(sources, inventory, monitor))
