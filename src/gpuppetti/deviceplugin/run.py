"""The ``gpuppetti plugin`` process: discover, serve, and stop or reload on signals."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

from gpuppetti.daemon import Sources, StartupError, reload, serve_until_signalled, start_inventory
from gpuppetti.deviceplugin.lifecycle import DevicePluginManager
from gpuppetti.discovery import looked_at
from gpuppetti.httpserver import READY_NOTE, HttpServer
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
    inventory, monitor, found = await start_inventory(sources)
    for name, plan in inventory.plan.items():
        log.info("advertising %s: %d unit(s)", name, len(plan.units))
    metrics = Metrics()
    metrics.watch(inventory)
    manager = DevicePluginManager(inventory, device_plugin_dir, metrics, cdi_dir)

    def waiting_for() -> str | None:
        if not inventory.gpus:
            return f"{READY_NOTE}no GPUs found on this node; serving nothing ({'; '.join(looked_at(found.backends))})"
        return manager.waiting_for()

    http = HttpServer(metrics, waiting_for, lambda: gpu_records(inventory))
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

    labeler = None
    if api is not None and labelling is not None:
        from gpuppetti.labels import NodeLabeler

        labeler = NodeLabeler(api, inventory, labelling.node)

    async def serve(stop: asyncio.Event) -> None:
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(manager.run(stop), name="device-plugin")
                background = [group.create_task(monitor.run(), name="health-monitor")]
                if labeler is not None:
                    background.append(group.create_task(labeler.run(), name="node-labels"))
                await stop.wait()
                for task in background:
                    task.cancel()
        finally:
            await http.stop()
            if labeler is not None:
                await labeler.clear()
            if api is not None:
                await api.close()

    await serve_until_signalled(serve, lambda: reload(sources, inventory, monitor))
