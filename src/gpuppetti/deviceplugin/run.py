"""The ``gpuppetti plugin`` process: its duties, started by the runtime and stopped on one path.

Duties: the HTTP endpoint (first, so that /livez answers during start-up), the allocations' ledgers and the check
of who holds them, the socket watcher, the reconciler and one supervisor per resource, the health monitor's duties,
node labels, and config reloads.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from gpuppetti.base.runtime import Runtime, StartupError
from gpuppetti.core.model import Serves
from gpuppetti.deviceplugin import instances
from gpuppetti.deviceplugin.enforcement import Enforcer, pod_resources_socket
from gpuppetti.deviceplugin.lifecycle import DevicePluginManager
from gpuppetti.layer.vulkan import install_layer
from gpuppetti.node.daemon import Serving, Sources, reload, start_inventory, where_looked
from gpuppetti.node.httpserver import READY_NOTE, HttpServer
from gpuppetti.node.metrics import Metrics
from gpuppetti.node.report import gpu_records, slice_records

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Labelling:
    """--label-node: which node, and how to reach the API server."""

    node: str
    kubeconfig: Path | None


@dataclass(frozen=True)
class PluginOptions:
    device_plugin_dir: Path
    serving: Serving
    labelling: Labelling | None = None
    # This instance's name (the pod's UID): its sockets are named for it (kit.instances).
    instance: str | None = None


async def run_plugin(runtime: Runtime, sources: Sources, options: PluginOptions) -> None:
    await runtime.run(lambda runtime: start_plugin(runtime, sources, options))


async def start_plugin(runtime: Runtime, sources: Sources, options: PluginOptions) -> None:
    # The config first: a broken one must stop the process before it listens anywhere.
    inventory, monitor, found = await start_inventory(sources, Serves.UNITS)
    metrics = Metrics()
    for name, plan in inventory.plan.items():
        log.info("advertising %s: %d unit(s)", name, len(plan.units))
    metrics.watch(inventory)
    enforcer = None
    enforcement = await install_layer(options.serving.vulkan_layer_dir)
    metrics.enforced(enforcement.enforced, hooks=False)
    if (layer := enforcement.layer) is not None and (ledgers := enforcement.ledgers) is not None:
        enforcer = Enforcer(layer, ledgers, pod_resources_socket(options.device_plugin_dir))
        metrics.watch_slices(enforcer)
        # Closed at stop whatever else fails: the containers' processes wait for the next daemon.
        runtime.spawn("ledgers", ledgers.keep())
        await enforcer.start({unit.id for plan in inventory.plan.values() for unit in plan.units})
        runtime.spawn("ledger-owners", enforcer.keep_in_use())
    manager = DevicePluginManager(inventory, options.device_plugin_dir, metrics, options.serving.cdi_dir,
                                  enforcer=enforcer, instance=options.instance)
    if enforcer is not None and options.instance is not None:
        async def others_serving() -> bool:
            return bool(await instances.others(manager.directory, manager.own_sockets()))

        enforcer.others_serving = others_serving
        runtime.spawn("ledgers-take-over", enforcer.take_over())

    def waiting_for() -> str | None:
        if not inventory.gpus:
            return f"{READY_NOTE}no GPUs found on this node; serving nothing ({where_looked(found)})"
        waiting = manager.waiting_for()
        note = enforcement.note()
        return waiting if waiting is not None or note is None else f"{READY_NOTE}{note}"

    # Listening only once readiness is set: /healthz answers from what the plugin knows, never a placeholder.
    http = HttpServer(metrics)
    http.readiness = waiting_for
    http.records = lambda: gpu_records(inventory.snapshot, enforcement.enforced, hooks=False)
    http.slices = lambda: slice_records(enforcer)
    if options.serving.http_address and options.instance is not None:
        # Beside the old instance of a rolling update, which may hold the port on the node's network.
        runtime.spawn("http", http.serve_once_free(options.serving.http_address))
    elif options.serving.http_address:
        await http.start(options.serving.http_address)
        runtime.spawn("http", http.serve())

    labelling = options.labelling
    if labelling is not None:
        from gpuppetti.node.kube import ConfigError, Kube, load_config
        from gpuppetti.node.labels import NodeLabeler

        try:
            config = load_config(labelling.kubeconfig)
        except ConfigError as exc:
            raise StartupError(f"--label-node cannot configure the Kubernetes API client: {exc}") from exc
        runtime.spawn("node-labels", NodeLabeler(Kube(config), inventory, labelling.node).run())

    for name, duty in monitor.duties():
        runtime.spawn(name, duty)
    runtime.spawn("config-reload", runtime.reloads(lambda: reload(sources, inventory, monitor)))
    await manager.run(runtime)
