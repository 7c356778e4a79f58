"""Registration with the kubelet, both ways it knows.

The plugin watcher's (DRA drivers): a registration socket of ours in the kubelet's plugins_registry, which the
kubelet finds, asks for the plugin's name, type and endpoint (GetInfo), and tells whether it took it
(NotifyRegistrationStatus). The device manager's (device plugins): a Register call on kubelet.sock naming our
socket, after which the kubelet dials back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from pathlib import Path

import grpc

from gpuppetti._proto.deviceplugin.v1beta1 import api_pb2 as dp
from gpuppetti._proto.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from gpuppetti._proto.pluginregistration.v1 import api_pb2 as reg
from gpuppetti._proto.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from gpuppetti.base.backoff import Backoff
from gpuppetti.kit.endpoint import SocketError, UnixEndpoint

log = logging.getLogger(__name__)


class PluginRegistration(reg_grpc.RegistrationServicer):
    """The plugin watcher's side of one plugin: what the kubelet asks, and what it answered."""

    def __init__(self, plugin_type: str, name: str, endpoint: Path, versions: Sequence[str], what: str) -> None:
        self._info = reg.PluginInfo(type=plugin_type, name=name, endpoint=str(endpoint.absolute()),
                                    supported_versions=list(versions))
        self._what = what
        self.registered = False
        self.last_error = ""
        # Set once the kubelet has confirmed a registration: a DRA driver's slice published earlier could be
        # scheduled to, and the kubelet would fail that pod's Prepare ("driver not registered") and retry only a
        # minute later.
        self.confirmed = asyncio.Event()

    @property
    def name(self) -> str:
        return self._info.name

    def add_to(self, server: grpc.aio.Server) -> None:
        reg_grpc.add_RegistrationServicer_to_server(self, server)

    async def GetInfo(self, request: reg.InfoRequest, context: grpc.aio.ServicerContext) -> reg.PluginInfo:
        return self._info

    async def NotifyRegistrationStatus(
        self, request: reg.RegistrationStatus, context: grpc.aio.ServicerContext
    ) -> reg.RegistrationStatusResponse:
        self.registered = request.plugin_registered
        self.last_error = request.error
        if request.plugin_registered:
            log.info("registered with the kubelet as %s %s", self._what, self.name)
            self.confirmed.set()
        else:
            log.error("the kubelet refused the registration of %s: %s", self.name, request.error)
        return reg.RegistrationStatusResponse()


async def serve(endpoint: UnixEndpoint, what: str) -> None:
    """Serve on the endpoint's socket, waiting out what keeps it from being served (said in the log)."""
    backoff = Backoff(0.1, 5.0)
    while True:
        try:
            await endpoint.start()
            endpoint.problem = None
            return
        except SocketError as exc:
            endpoint.problem = str(exc)
            delay = backoff.next()
            log.error("cannot serve the %s yet: %s; trying again in %.1fs", what, exc, delay)
            await asyncio.sleep(delay)


async def serve_and_register(service: UnixEndpoint, registration: UnixEndpoint, name: str) -> None:
    """Duty: serve the plugin's service, then its registration socket; at stop unregister first, so that the
    kubelet stops sending work to a service that is going away."""
    try:
        await serve(service, f"{name} service")
        # The kubelet may call the service as soon as it sees the registration socket: serve it first.
        await serve(registration, f"{name} registration")
        log.info("%s serving on %s, registration on %s", name, service.path, registration.path)
        try:
            await asyncio.Event().wait()
        finally:
            await registration.stop()
    finally:
        await service.stop()


async def register_device_plugin(kubelet_socket: Path, request: dp.RegisterRequest, timeout: float) -> None:
    """One Register call to the kubelet's device manager; the caller retries."""
    # A local subchannel pool forces a new connection: a half-dead one from a failed attempt is never reused.
    options = [("grpc.use_local_subchannel_pool", 1)]
    async with grpc.aio.insecure_channel(f"unix:{kubelet_socket}", options=options) as channel:
        await dp_grpc.RegistrationStub(channel).Register(request, timeout=timeout)
