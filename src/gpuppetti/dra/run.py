"""The ``gpuppetti dra`` process: its duties, started by the runtime and stopped on one path.

Duties: the HTTP endpoint (first), the kit's kubelet plugin (kit.kubeletplugin: the DRA service, the registration
socket and the slice publisher), the claims' ledgers (and taking over those the driver's other instance served), the
CDI directory's keeper (which restores the prepared claims at start), the claims' status writer (dra.claimstatus),
the reader of the pods of claims prepared before this process, the health monitor, and reloads. Nothing waits for
the API server: the driver registers with the kubelet and serves Unprepare whatever the API does, and the publisher
converges once the API is back.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

from gpuppetti.base.dirlock import DirectoryLock
from gpuppetti.base.fsutil import make_directory
from gpuppetti.base.memory import one_heap
from gpuppetti.base.nodepaths import DEFAULT_PLUGINS_DIR, DEFAULT_REGISTRY_DIR
from gpuppetti.base.runtime import Runtime, StartupError
from gpuppetti.core.model import Serves
from gpuppetti.dra.checkpoint import Checkpoint, UnusableCheckpoint
from gpuppetti.dra.claimstatus import ClaimStatus
from gpuppetti.dra.driver import GpuDriver
from gpuppetti.dra.slices import device_health, pool_content
from gpuppetti.dra.store import ClaimStore
from gpuppetti.kit import kubeletplugin
from gpuppetti.layer.vulkan import install_layer
from gpuppetti.node.daemon import Serving, Sources, reload, start_inventory
from gpuppetti.node.httpserver import READY_NOTE, HttpServer
from gpuppetti.node.kube import REQUEST_TIMEOUT_S, ConfigError, Kube, load_config
from gpuppetti.node.metrics import Metrics
from gpuppetti.node.report import gpu_records, slice_records

log = logging.getLogger(__name__)

CHECKPOINT_FILE = "checkpoint.json"
STOP_GRACE_S = 1.0


@dataclass(frozen=True)
class DraOptions:
    node_name: str
    serving: Serving
    registry_dir: Path = DEFAULT_REGISTRY_DIR
    plugins_dir: Path = DEFAULT_PLUGINS_DIR
    kubeconfig: Path | None = None
    api_timeout: float = REQUEST_TIMEOUT_S
    # This instance's name (the pod's UID): kit.instances.
    instance: str | None = None


async def run_dra(runtime: Runtime, sources: Sources, options: DraOptions) -> None:
    # Before any thread allocates: the checkpoint and CDI specs are written from threads, and a heap of their own
    # kept some of a thousand-claim Prepare resident for good.
    one_heap()
    await runtime.run(lambda runtime: start_dra(runtime, sources, options))


async def start_dra(runtime: Runtime, sources: Sources, options: DraOptions) -> None:
    # The config first: a broken one must stop the process before it listens anywhere.
    inventory, monitor, _ = await start_inventory(sources, Serves.POOL)
    metrics = Metrics()
    http = HttpServer(metrics)
    serving = options.serving
    if serving.http_address and options.instance is not None:
        # Beside the old instance of a rolling update, which may hold the port on the node's network.
        runtime.spawn("http", http.serve_once_free(serving.http_address))
    elif serving.http_address:
        await http.start(serving.http_address)
        runtime.spawn("http", http.serve())
    metrics.watch(inventory)
    driver = inventory.config.dra.driver_name
    plugin_dir = options.plugins_dir / driver
    for directory in (plugin_dir, options.registry_dir, serving.cdi_dir):
        try:
            make_directory(directory)
        except OSError as exc:
            raise StartupError(f"cannot create {directory}: {exc.strerror or exc}") from exc
    try:
        config = load_config(options.kubeconfig)
    except ConfigError as exc:
        raise StartupError(f"cannot configure the Kubernetes API client: {exc}") from None
    kube = Kube(config, options.api_timeout)

    checkpoint = Checkpoint(plugin_dir / CHECKPOINT_FILE)
    try:
        checkpoint.load()
    except UnusableCheckpoint as exc:
        raise StartupError(str(exc)) from exc
    enforcement = await install_layer(serving.vulkan_layer_dir)
    metrics.enforced(enforcement.enforced)
    # Shared with the driver's other instance during a rolling update: each change takes the plugin directory's
    # lock. The prepared claims are restored by the CDI directory's keeper once it watches, not here: an instance
    # of an earlier version holds that lock for its whole life, and this one must register (and so be ready, which
    # lets the DaemonSet stop the old one) before it gets it.
    store = ClaimStore(serving.cdi_dir, checkpoint, layer=enforcement.layer, ledgers=enforcement.ledgers,
                       shared=DirectoryLock(plugin_dir, "instance of the DRA driver"))
    if enforcement.ledgers is not None:
        # Closed at stop whatever else fails: the containers' processes wait for the next driver.
        runtime.spawn("ledgers", enforcement.ledgers.keep())
        runtime.spawn("ledgers-take-over", store.take_over())
    status = ClaimStatus(kube, driver)
    gpu_driver = GpuDriver(inventory, options.node_name, store, kube, status)
    metrics.watch_claims(store)
    metrics.watch_slices(gpu_driver)

    plugin = kubeletplugin.start(runtime, gpu_driver, kubeletplugin.PluginSpec(
        driver_name=driver, node=options.node_name, plugin_dir=plugin_dir, registry_dir=options.registry_dir,
        source=inventory, content_of=functools.partial(pool_content, layer=enforcement.enforced),
        health_of=device_health, writer=kube, metrics=metrics, stop_grace_s=STOP_GRACE_S, instance=options.instance))

    def waiting_for() -> str | None:
        if (waiting := plugin.waiting_for()) is not None:
            return waiting
        note = enforcement.note()
        return None if note is None else f"{READY_NOTE}{note}"

    http.readiness = waiting_for
    http.records = lambda: gpu_records(inventory.snapshot, enforcement.enforced)
    http.slices = lambda: slice_records(gpu_driver)

    runtime.spawn("cdi-specs", store.keep_specs())
    runtime.spawn("claim-status", status.keep())
    runtime.spawn("claim-pods", gpu_driver.keep_pods())
    for name, duty in monitor.duties():
        runtime.spawn(name, duty)
    runtime.spawn("config-reload", runtime.reloads(lambda: reload(sources, inventory, monitor)))
    runtime.spawn("api-client", _close_at_stop(kube))


async def _close_at_stop(kube: Kube) -> None:
    try:
        await asyncio.Event().wait()
    finally:
        await kube.close()
