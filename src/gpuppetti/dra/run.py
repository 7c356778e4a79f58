"""The ``gpuppetti dra`` process: its duties, started by the runtime and stopped on one path.

Duties: the HTTP endpoint (first), the kubelet services (the DRA service, then the registration socket; stopped
the other way round), the CDI directory's keeper, the slice publisher, the health monitor, and reloads. Nothing
waits for the API server: the driver registers with the kubelet and serves Unprepare whatever the API does, and
the publisher converges once the API is back.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

from gpuppetti.base.backoff import Backoff
from gpuppetti.base.fsutil import make_directory
from gpuppetti.base.instancelock import InstanceLock
from gpuppetti.base.nodepaths import DEFAULT_PLUGINS_DIR, DEFAULT_REGISTRY_DIR
from gpuppetti.base.runtime import Runtime, StartupError
from gpuppetti.base.watch import Change, watch_directory
from gpuppetti.core import cdi
from gpuppetti.core.model import Serves
from gpuppetti.dra.checkpoint import Checkpoint, UnusableCheckpoint
from gpuppetti.dra.slices import pool_content
from gpuppetti.dra.state import DraState
from gpuppetti.kit.draplugin import PLUGIN_TYPE, SUPPORTED_VERSIONS, DraService, add_services
from gpuppetti.kit.endpoint import UnixEndpoint
from gpuppetti.kit.publisher import SlicePublisher
from gpuppetti.kit.registration import PluginRegistration, serve_and_register
from gpuppetti.node.daemon import Serving, Sources, reload, start_inventory
from gpuppetti.node.httpserver import READY_NOTE, HttpServer
from gpuppetti.node.kube import REQUEST_TIMEOUT_S, ConfigError, Kube, load_config
from gpuppetti.node.metrics import Metrics
from gpuppetti.node.report import gpu_records, slice_records
from gpuppetti.node.vulkanlayer import install_layer

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


async def _keep_cdi_specs(state: DraState) -> None:
    """Duty: re-create the specs of prepared claims when something deletes them (or the whole directory), and keep
    trying while some cannot be written (a full directory)."""
    backoff = Backoff(0.5, 30.0)
    while True:
        try:
            make_directory(state.cdi_dir)
        except OSError as exc:
            log.error("cannot create the CDI directory %s: %s", state.cdi_dir, exc.strerror or exc)
            await backoff.wait()
            continue
        # Deletions only (a spec removed, the directory emptied by a reboot): the driver's own writes, each a
        # rename from a temporary file, make no noise for it, even a thousand of them in one Prepare.
        async for event in watch_directory(state.cdi_dir, creations=False, moves=False):
            lost = event.change is Change.DELETED and event.name.startswith(cdi.spec_prefix(state.kind))
            if lost or event.change in (Change.RESCAN, Change.READY) or state.missing_specs:
                # Only specs of claims still prepared come back; the driver's own removals are not losses.
                restored = await state.restore()
                if restored and event.change is not Change.READY:
                    log.warning("CDI specs of prepared claims were removed from %s; re-created %d",
                                state.cdi_dir, restored)
            if state.missing_specs:
                # The directory refuses them (ENOSPC): try again after a while, not only on the next event.
                break
        else:
            log.warning("CDI directory %s was removed; re-creating it and its specs", state.cdi_dir)
        if state.missing_specs:
            await backoff.wait()
        else:
            backoff.reset()


async def run_dra(runtime: Runtime, sources: Sources, options: DraOptions) -> None:
    await runtime.run(lambda runtime: start_dra(runtime, sources, options))


async def start_dra(runtime: Runtime, sources: Sources, options: DraOptions) -> None:
    # The config first: a broken one must stop the process before it listens anywhere.
    inventory, monitor, _ = await start_inventory(sources, Serves.POOL)
    metrics = Metrics()
    http = HttpServer(metrics)
    serving = options.serving
    if serving.http_address:
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
    lock = InstanceLock(plugin_dir, "DRA driver")
    http.readiness = lambda: lock.waiting_for or "taking the driver's lock"
    await lock.acquire()
    runtime.at_end(lock.release)

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
    state = DraState(inventory, options.node_name, serving.cdi_dir, checkpoint, kube, layer=enforcement.layer)
    restored = await state.restore()
    if restored:
        log.info("re-created the CDI specs of %d prepared claim(s) from %s", restored, checkpoint.path)
    metrics.watch_claims(state)
    metrics.watch_slices(state)
    service = DraService(state, metrics)

    dra_socket = plugin_dir / "dra.sock"
    dra_endpoint = UnixEndpoint(dra_socket, lambda server: add_services(server, service, inventory,
                                                                        options.node_name), STOP_GRACE_S)
    registration = PluginRegistration(PLUGIN_TYPE, driver, dra_socket, SUPPORTED_VERSIONS, "DRA driver")
    registration_endpoint = UnixEndpoint(options.registry_dir / f"{driver}-reg.sock", registration.add_to,
                                         STOP_GRACE_S)
    publisher = SlicePublisher(kube, inventory, functools.partial(pool_content, layer=enforcement.enforced),
                               options.node_name, metrics, registration.confirmed)

    def waiting_for() -> str | None:
        for endpoint, what in ((dra_endpoint, "service"), (registration_endpoint, "registration")):
            # Our own socket that cannot be served: not the kubelet's doing.
            if endpoint.problem is not None:
                return f"cannot serve the driver's {what} socket: {endpoint.problem}"
        if not registration.registered:
            return f"the kubelet has not confirmed the registration ({registration.last_error or 'no answer yet'})"
        if not publisher.published.is_set():
            why = f": {publisher.last_error}" if publisher.last_error else ""
            return f"the ResourceSlices are not published yet{why}"
        note = enforcement.note()
        return None if note is None else f"{READY_NOTE}{note}"

    http.readiness = waiting_for
    http.records = lambda: gpu_records(inventory.snapshot, enforcement.enforced)
    http.slices = lambda: slice_records(state)

    runtime.spawn("kubelet-services", serve_and_register(dra_endpoint, registration_endpoint, f"DRA driver {driver}"))
    runtime.spawn("cdi-specs", _keep_cdi_specs(state))
    runtime.spawn("layer-trash", state.empty_trash())
    runtime.spawn("slices-inventory", publisher.follow_inventory())
    runtime.spawn("slices-reconcile", publisher.reconcile_loop())
    runtime.spawn("slices-watch", publisher.watch())
    for name, duty in monitor.duties():
        runtime.spawn(name, duty)
    runtime.spawn("config-reload", runtime.reloads(lambda: reload(sources, inventory, monitor)))
    runtime.spawn("api-client", _close_at_stop(kube))


async def _close_at_stop(kube: Kube) -> None:
    try:
        await asyncio.Event().wait()
    finally:
        await kube.close()
