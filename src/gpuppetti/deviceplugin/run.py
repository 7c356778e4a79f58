"""The ``gpuppetti plugin`` process: discover, serve, and stop or reload on signals."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

from gpuppetti.daemon import Sources, StartupError, reload, serve_until_signalled, start_inventory
from gpuppetti.deviceplugin.lifecycle import DevicePluginManager
from gpuppetti.httpserver import HttpServer
from gpuppetti.metrics import Metrics
from gpuppetti.report import gpu_records

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Labelling:
    """--label-node: which node, and how to reach the API server."""

    node: str
    kubeconfig: Path | None


async def run_plugin(
    sources: Sources, device_plugin_dir: Path, http_address: str | None, cdi_dir: Path | None = None,
    labelling: Labelling | None = None,
) -> None:
    inventory, monitor = await start_inventory(sources)
    for name, plan in inventory.plan.items():
        log.info("advertising %s: %d unit(s)", name, len(plan.units))
    metrics = Metrics()
    metrics.watch(inventory)
    manager = DevicePluginManager(inventory, device_plugin_dir, metrics, cdi_dir)
    http = HttpServer(metrics, manager.waiting_for, lambda: gpu_records(inventory))
    if http_address:
        await http.start(http_address)

    api = None
    if labelling is not None:
        if not labelling.node:
            raise StartupError("--label-node needs the node's name: pass --node-name or set NODE_NAME")
        from gpuppetti.kube import api_client

        try:
            api = await api_client(labelling.kubeconfig)
        except Exception as exc:
            raise StartupError(f"--label-node cannot configure the Kubernetes API client: {exc}") from exc

    async def serve(stop: asyncio.Event) -> None:
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(manager.run(stop), name="device-plugin")
                background = [group.create_task(monitor.run(), name="health-monitor")]
                if api is not None and labelling is not None:
                    from gpuppetti.labels import NodeLabeler

                    labeler = NodeLabeler(api, inventory, labelling.node)
                    background.append(group.create_task(labeler.run(), name="node-labels"))
                await stop.wait()
                for task in background:
                    task.cancel()
        finally:
            await http.stop()
            if api is not None:
                await api.close()

    await serve_until_signalled(serve, lambda: reload(sources, inventory, monitor))
