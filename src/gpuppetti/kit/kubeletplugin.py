"""A DRA driver's kubelet plugin, started whole, as the Go helper's ``Start``: the DRA service's socket (the
DRAPlugin versions and the health stream around the driver's callbacks), the registration socket, the slice
publisher, and what readiness waits for. The daemon brings the driver and the seams (kit.seams); ``start`` makes
the parts and spawns their duties in the daemon's runtime, and the handle it returns says why the plugin is not
ready yet.

Duties: ``kubelet-services`` (the service, then the registration socket; stopped the other way round), and the
publisher's ``slices-source``, ``slices-reconcile`` and ``slices-watch``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from gpuppetti.base.runtime import Runtime
from gpuppetti.base.sockets import listening
from gpuppetti.kit.draplugin import (
    PLUGIN_TYPE,
    SUPPORTED_VERSIONS,
    DeviceHealth,
    DraDriver,
    DraService,
    ResourceHealth,
    add_services,
)
from gpuppetti.kit.endpoint import UnixEndpoint
from gpuppetti.kit.instances import hand_over, instance_socket, live_others, remove_stale, sockets_like
from gpuppetti.kit.publisher import PoolContent, SlicePublisher
from gpuppetti.kit.registration import PluginRegistration, serve_and_register
from gpuppetti.kit.seams import Changing, PluginMetrics, SliceWriter, Versioned

log = logging.getLogger(__name__)

S = TypeVar("S", bound=Versioned)

REGISTRATION_SUFFIX = "-reg.sock"
ANOTHER_INSTANCE_POLL_S = 0.5


@dataclass(frozen=True)
class PluginSpec(Generic[S]):
    """Who the plugin is and where it serves, and the seams it reads its pool through.

    ``source`` is what changes (the inventory); ``content_of`` reads the pool's slices from one of its snapshots,
    ``health_of`` its devices' health."""

    driver_name: str
    node: str
    plugin_dir: Path
    registry_dir: Path
    source: Changing[S]
    content_of: Callable[[S, str], PoolContent]
    health_of: Callable[[S], Iterable[DeviceHealth]]
    writer: SliceWriter
    metrics: PluginMetrics
    stop_grace_s: float = 1.0
    # This instance's name (the pod's UID in a DaemonSet): its sockets are named for it, so that a new instance
    # serves beside the old one during a rolling update (kit.instances). None: the fixed names, one instance.
    instance: str | None = None

    @property
    def socket(self) -> Path:
        return instance_socket(self.plugin_dir, "dra", self.instance, ".sock")

    @property
    def registration_socket(self) -> Path:
        return instance_socket(self.registry_dir, self.driver_name, self.instance, REGISTRATION_SUFFIX)

    def leftovers(self) -> list[Path]:
        """The sockets other instances of this driver may have left on the node."""
        return [*sockets_like(self.plugin_dir, "dra", ".sock"),
                *sockets_like(self.registry_dir, self.driver_name, REGISTRATION_SUFFIX)]


@dataclass(frozen=True)
class KubeletPlugin:
    """The started plugin's parts."""

    service: UnixEndpoint
    registration: PluginRegistration
    registration_endpoint: UnixEndpoint
    publisher: SlicePublisher[Any]

    def waiting_for(self) -> str | None:
        """Why the plugin is not ready yet; None once it serves, is registered and has published its pool."""
        for endpoint, what in ((self.service, "service"), (self.registration_endpoint, "registration")):
            # Our own socket that cannot be served: not the kubelet's doing.
            if endpoint.problem is not None:
                return f"cannot serve the driver's {what} socket: {endpoint.problem}"
        if not self.registration.registered:
            why = self.registration.last_error or "no answer yet"
            return f"the kubelet has not confirmed the registration ({why})"
        if not self.publisher.published.is_set():
            why = f": {self.publisher.last_error}" if self.publisher.last_error else ""
            return f"the ResourceSlices are not published yet{why}"
        return None


def start(runtime: Runtime, driver: DraDriver, spec: PluginSpec[S]) -> KubeletPlugin:
    """Serve ``driver`` to the kubelet, register it, and keep its pool published, as duties of ``runtime``."""
    service = DraService(driver, spec.metrics)
    resource_health = ResourceHealth(spec.source, spec.health_of, spec.node)
    endpoint = UnixEndpoint(spec.socket, lambda server: add_services(server, service, resource_health),
                            spec.stop_grace_s)
    registration = PluginRegistration(PLUGIN_TYPE, spec.driver_name, spec.socket, SUPPORTED_VERSIONS, "DRA driver")
    registration_endpoint = UnixEndpoint(spec.registration_socket, registration.add_to, spec.stop_grace_s)
    # Published only once the kubelet has confirmed the registration: see kit.publisher.
    publisher = SlicePublisher(spec.writer, spec.source, spec.content_of, spec.node, spec.driver_name, spec.metrics,
                               registration.confirmed)
    runtime.spawn("kubelet-services", _serve(spec, endpoint, registration_endpoint))
    if spec.instance is not None:
        runtime.before_stop(lambda: _hand_over(spec, registration))
    runtime.spawn("slices-source", publisher.follow_source())
    runtime.spawn("slices-reconcile", publisher.reconcile_loop())
    runtime.spawn("slices-watch", publisher.watch())
    return KubeletPlugin(endpoint, registration, registration_endpoint, publisher)


async def _serve(spec: PluginSpec[Any], endpoint: UnixEndpoint, registration_endpoint: UnixEndpoint) -> None:
    own = (spec.socket, spec.registration_socket)
    if spec.instance is None:
        await _while_another_serves(own, endpoint)
    # What killed instances left goes first: the kubelet would keep trying their sockets.
    await asyncio.to_thread(remove_stale, spec.leftovers(), own)
    await serve_and_register(endpoint, registration_endpoint, f"DRA driver {spec.driver_name}")


async def _while_another_serves(sockets: tuple[Path, ...], endpoint: UnixEndpoint) -> None:
    """With the fixed names, one instance at a time: taking over the sockets of one that serves would unregister
    it while it prepares claims. Waits for it to stop, saying so."""
    said = False
    while busy := [path for path in sockets if await asyncio.to_thread(listening, path)]:
        endpoint.problem = (f"another instance of the driver serves {busy[0]}; waiting for it to stop (give each "
                            "instance its own sockets with --instance to run two side by side)")
        if not said:
            log.error("%s", endpoint.problem)
            said = True
        await asyncio.sleep(ANOTHER_INSTANCE_POLL_S)
    if said:
        log.info("the other instance stopped; this one serves now")
    endpoint.problem = None


async def _hand_over(spec: PluginSpec[Any], registration: PluginRegistration) -> None:
    if registration.registered:
        own = (spec.registration_socket,)
        await hand_over(lambda: live_others(sockets_like(spec.registry_dir, spec.driver_name, REGISTRATION_SUFFIX),
                                            own), f"DRA driver {spec.driver_name}")
