"""One resource's Device Plugin endpoint, and what the plugin's manager (lifecycle.py) keeps of it: the supervisor
duty that serves it, its registration with the kubelet, and what that duty carries from one turn to the next."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from gpuppetti.base.backoff import Backoff
from gpuppetti.deviceplugin import cdispec
from gpuppetti.deviceplugin.devicelists import DeviceLists
from gpuppetti.deviceplugin.enforcement import Enforcer
from gpuppetti.deviceplugin.instances import socket_name
from gpuppetti.deviceplugin.server import DevicePluginService
from gpuppetti.kit.endpoint import UnixEndpoint
from gpuppetti.node.inventory import Inventory
from gpuppetti.node.metrics import Metrics

log = logging.getLogger(__name__)

STOP_GRACE_S = 0.2


class ResourceEndpoint:
    """One resource's Device Plugin service, served on one Unix socket of ours (the kit's endpoint)."""

    def __init__(
        self, inventory: Inventory, resource: str, directory: Path, metrics: Metrics, cdi_kind: str = cdispec.KIND,
        wake: asyncio.Event | None = None, enforcer: Enforcer | None = None, lists: DeviceLists | None = None,
        instance: str | None = None,
    ) -> None:
        self.resource = resource
        self.socket_name = socket_name(resource, instance, directory)
        self.path = directory / self.socket_name
        # A ListAndWatch stream opening or ending wakes the supervisor: it is how a registration lives or dies.
        self.wake = wake or asyncio.Event()
        self.service = DevicePluginService(inventory, resource, metrics, cdi_kind, lambda count: self.wake.set(),
                                           enforcer, lists)
        self._endpoint = UnixEndpoint(self.path, lambda server: server.add_generic_rpc_handlers(
            (self.service.handler(),)), STOP_GRACE_S)
        # Bumped on every (re)start: a new socket needs a new registration.
        self.serial = 0

    def intact(self) -> bool:
        """Whether our socket file is still there, and still the one our server bound."""
        return self._endpoint.intact()

    async def restart(self) -> None:
        """Serve on a fresh socket. Raises SocketError (a state to wait out) when the path cannot take one."""
        await self._endpoint.start()
        self.serial += 1
        log.info("%s: serving on %s", self.resource, self.path)

    async def stop(self) -> None:
        await self._endpoint.stop()


@dataclass
class Supervised:
    endpoint: ResourceEndpoint
    wake: asyncio.Event
    task: asyncio.Task[None]
    registered: bool = False
    # Why it is not registered (for /healthz), when it is not.
    why: str = "starting"
    # The deadline of a Register in flight: a kubelet that restarts meanwhile deleted our socket, and would spend
    # its whole dial timeout (10 s) on it, so anything that wakes the supervisor cuts the Register short.
    registering: asyncio.Timeout | None = None
    cut_short: bool = False

    def wake_up(self) -> None:
        self.wake.set()
        if self.registering is not None and not self.registering.expired():
            self.cut_short = True
            self.registering.reschedule(asyncio.get_running_loop().time())


@dataclass
class Registration:
    kubelet: tuple[int, int, int]
    serial: int
    at: float = field(default_factory=time.monotonic)
    connected: bool = False


@dataclass
class Supervision:
    """What one resource's supervisor carries from one turn of its loop to the next."""

    endpoint: ResourceEndpoint
    wake: asyncio.Event
    backoff: Backoff = field(default_factory=lambda: Backoff(0.1, 5.0))
    current: Registration | None = None
    # Whether waiting for the kubelet was said since the last registration.
    waiting_logged: bool = False
