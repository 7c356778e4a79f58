"""The ``gpuppetti dra`` process: the DRA kubelet plugin, the ResourceSlice publisher and the CDI specs."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import grpc

from gpuppetti import cdi
from gpuppetti._proto.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from gpuppetti.daemon import Sources, StartupError, reload, serve_until_signalled, start_inventory
from gpuppetti.dra.checkpoint import Checkpoint
from gpuppetti.dra.paths import DEFAULT_CDI_DIR, DEFAULT_PLUGINS_DIR, DEFAULT_REGISTRY_DIR
from gpuppetti.dra.plugin import DraService, Registration, add_services
from gpuppetti.dra.publisher import SlicePublisher
from gpuppetti.dra.state import DraState
from gpuppetti.grpcutil import new_server
from gpuppetti.httpserver import HttpServer
from gpuppetti.kube import ApiClaims, api_client, node_owner
from gpuppetti.metrics import Metrics
from gpuppetti.report import gpu_records
from gpuppetti.watch import Change, watch_directory

log = logging.getLogger(__name__)

CHECKPOINT_FILE = "checkpoint.json"
STOP_GRACE_S = 1.0


@dataclass(frozen=True)
class DraOptions:
    node_name: str
    registry_dir: Path = DEFAULT_REGISTRY_DIR
    plugins_dir: Path = DEFAULT_PLUGINS_DIR
    cdi_dir: Path = DEFAULT_CDI_DIR
    kubeconfig: Path | None = None
    http_address: str | None = None


def _remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


async def _serve_socket(server: grpc.aio.Server, path: Path) -> None:
    _remove(path)
    try:
        server.add_insecure_port(f"unix:{path}")
    except RuntimeError as exc:
        raise StartupError(f"cannot create socket {path}: {exc}") from exc
    await server.start()
    os.chmod(path, 0o600)


async def _keep_cdi_specs(state: DraState) -> None:
    """Re-create the specs of prepared claims when something deletes them (or the whole directory)."""
    while True:
        state.cdi_dir.mkdir(parents=True, exist_ok=True)
        async for event in watch_directory(state.cdi_dir):
            lost = event.change is Change.DELETED and event.name.startswith(cdi.spec_prefix(state.kind))
            if lost or event.change is Change.RESCAN:
                # Only specs of claims still prepared come back; the driver's own removals are not losses.
                restored = state.restore()
                if restored:
                    log.warning("CDI specs of prepared claims were removed from %s; re-created %d",
                                state.cdi_dir, restored)
        await asyncio.sleep(0.5)
        restored = state.restore()
        log.warning("CDI directory %s was removed; re-created it with %d spec(s)", state.cdi_dir, restored)


async def run_dra(sources: Sources, options: DraOptions) -> None:
    if not options.node_name:
        raise StartupError("the node name is required: pass --node-name or set NODE_NAME "
                              "(in a DaemonSet, from the downward API: fieldRef spec.nodeName)")
    inventory, monitor, _ = await start_inventory(sources)
    driver = inventory.config.dra.driver_name
    plugin_dir = options.plugins_dir / driver
    for directory in (plugin_dir, options.registry_dir, options.cdi_dir):
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StartupError(f"cannot create {directory}: {exc.strerror}") from exc

    try:
        api = await api_client(options.kubeconfig)
    except Exception as exc:
        where = options.kubeconfig or "the in-cluster service account"
        raise StartupError(f"cannot configure the Kubernetes API client from {where}: {exc}") from exc

    checkpoint = Checkpoint(plugin_dir / CHECKPOINT_FILE)
    checkpoint.load()
    state = DraState(inventory, options.node_name, options.cdi_dir, checkpoint, ApiClaims(api))
    restored = state.restore()
    if restored:
        log.info("re-created the CDI specs of %d prepared claim(s) from %s", restored, checkpoint.path)
    metrics = Metrics()
    metrics.watch(inventory)
    service = DraService(state, metrics)

    dra_socket = plugin_dir / "dra.sock"
    registration_socket = options.registry_dir / f"{driver}-reg.sock"
    dra_server = new_server()
    add_services(dra_server, service, inventory, options.node_name)
    registration = Registration(driver, str(dra_socket.absolute()))
    registration_server = new_server()
    reg_grpc.add_RegistrationServicer_to_server(registration, registration_server)

    publisher = SlicePublisher(api, inventory, options.node_name, await node_owner(api, options.node_name), metrics,
                               registration.confirmed)

    def waiting_for() -> str | None:
        if not registration.registered:
            return f"the kubelet has not confirmed the registration ({registration.last_error or 'no answer yet'})"
        if not publisher.published.is_set():
            return "the ResourceSlices are not published yet"
        return None

    http = HttpServer(metrics, waiting_for, lambda: gpu_records(inventory))

    async def serve(stop: asyncio.Event) -> None:
        # The kubelet may call the DRA service as soon as it sees the registration socket: serve it first.
        await _serve_socket(dra_server, dra_socket)
        await _serve_socket(registration_server, registration_socket)
        log.info("DRA driver %s serving on %s, registration on %s", driver, dra_socket, registration_socket)
        if options.http_address:
            await http.start(options.http_address)
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [
                    group.create_task(publisher.run(), name="resource-slices"),
                    group.create_task(monitor.run(), name="health-monitor"),
                    group.create_task(_keep_cdi_specs(state), name="cdi-specs"),
                ]
                await stop.wait()
                for task in tasks:
                    task.cancel()
        finally:
            # Unregister first, so that the kubelet stops sending work to a service that is going away.
            await registration_server.stop(STOP_GRACE_S)
            _remove(registration_socket)
            await dra_server.stop(STOP_GRACE_S)
            _remove(dra_socket)
            await http.stop()
            await api.close()

    await serve_until_signalled(serve, lambda: reload(sources, inventory, monitor))
