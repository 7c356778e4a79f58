"""Serving, registering and re-registering device plugin sockets as the kubelet comes and goes.

The kubelet deletes every socket in its device plugin directory when it starts, and never dials plugins
itself: a plugin must notice and register again. Each resource has a supervisor task that compares what
is true now (its socket exists and is its own; the kubelet it registered with is the current one) with what
it last did, and repairs the difference. inotify events only wake the supervisors; they carry no state.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import grpc

from gpuppetti import cdi
from gpuppetti._proto.deviceplugin.v1beta1 import api_pb2 as pb
from gpuppetti._proto.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from gpuppetti.deviceplugin import cdispec
from gpuppetti.deviceplugin.server import DevicePluginService
from gpuppetti.grpcutil import new_server
from gpuppetti.inventory import Inventory
from gpuppetti.metrics import Metrics
from gpuppetti.watch import Change, watch_directory

log = logging.getLogger(__name__)

DEFAULT_DEVICE_PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")
KUBELET_SOCKET = "kubelet.sock"
API_VERSION = "v1beta1"
# The kubelet dials back and opens ListAndWatch inside Register, with a 10 s dial timeout of its own.
REGISTER_TIMEOUT_S = 15.0
BACKOFF_INITIAL_S = 0.1
BACKOFF_MAX_S = 5.0
STOP_GRACE_S = 0.2
# sun_path is 108 bytes on Linux, including the terminating NUL.
MAX_SOCKET_PATH = 107
OPTIONS = pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)


class SocketDirError(Exception):
    """The device plugin directory cannot hold our sockets."""


def socket_name(resource: str) -> str:
    return f"gpuppetti-{resource.replace('/', '_')}.sock"


class Backoff:
    def __init__(self, initial: float = BACKOFF_INITIAL_S, maximum: float = BACKOFF_MAX_S) -> None:
        self._initial, self._maximum = initial, maximum
        self._next = initial

    def next(self) -> float:
        delay = self._next
        self._next = min(self._next * 2, self._maximum)
        return delay

    def reset(self) -> None:
        self._next = self._initial


class ResourceEndpoint:
    """One grpc.aio server on one Unix socket, serving one resource."""

    def __init__(
        self, inventory: Inventory, resource: str, directory: Path, metrics: Metrics, cdi_kind: str = cdispec.KIND
    ) -> None:
        self.resource = resource
        self._metrics = metrics
        self._cdi_kind = cdi_kind
        self.socket_name = socket_name(resource)
        self.path = directory / self.socket_name
        self._inventory = inventory
        self._server: grpc.aio.Server | None = None
        self._inode: int | None = None
        # Bumped on every (re)start: a new socket needs a new registration.
        self.serial = 0

    def intact(self) -> bool:
        """Whether our socket file is still there, and still the one our server bound."""
        if self._server is None or self._inode is None:
            return False
        try:
            st = self.path.lstat()
        except FileNotFoundError:
            return False
        return stat.S_ISSOCK(st.st_mode) and st.st_ino == self._inode

    async def restart(self) -> None:
        await self.stop()
        if len(str(self.path)) > MAX_SOCKET_PATH:
            raise SocketDirError(
                f"socket path {self.path} is {len(str(self.path))} bytes; Unix sockets allow {MAX_SOCKET_PATH}"
            )
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(self.path.lstat().st_mode):
                self.path.unlink()
        server = new_server()
        pb_grpc.add_DevicePluginServicer_to_server(
            DevicePluginService(self._inventory, self.resource, self._metrics, self._cdi_kind), server)
        try:
            server.add_insecure_port(f"unix:{self.path}")
        except RuntimeError as exc:
            raise SocketDirError(f"cannot create socket {self.path}: {exc}") from exc
        await server.start()
        # Only the kubelet (root) has any business on this socket.
        os.chmod(self.path, 0o600)
        self._server = server
        self._inode = self.path.lstat().st_ino
        self.serial += 1
        log.info("%s: serving on %s", self.resource, self.path)

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        await server.stop(STOP_GRACE_S)
        # Remove the socket only if it is still ours: a newer instance may own the name now.
        with contextlib.suppress(FileNotFoundError):
            if self.path.lstat().st_ino == self._inode:
                self.path.unlink()
        self._inode = None


@dataclass
class _Supervised:
    endpoint: ResourceEndpoint
    wake: asyncio.Event
    task: asyncio.Task[None]
    registered: bool = False


class DevicePluginManager:
    """Runs every resource's endpoint, and keeps each registered with the kubelet."""

    def __init__(
        self, inventory: Inventory, directory: Path, metrics: Metrics | None = None, cdi_dir: Path | None = None,
        cdi_kind: str = cdispec.KIND,
    ) -> None:
        self._inventory = inventory
        self.directory = directory
        self.metrics = metrics or Metrics()
        self.cdi_dir = cdi_dir
        self.cdi_kind = cdi_kind
        self._cdi_written: dict[str, object] | None = None
        self.kubelet_socket = directory / KUBELET_SOCKET
        self._resources: dict[str, _Supervised] = {}

    def waiting_for(self) -> str | None:
        """None once every resource is registered with the kubelet; else what is missing (for /healthz)."""
        if not self._resources:
            return "no resource is being served yet"
        missing = sorted(name for name, sup in self._resources.items() if not sup.registered)
        return f"not registered with the kubelet: {', '.join(missing)}" if missing else None

    def _check_directory(self) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SocketDirError(f"cannot create the device plugin directory {self.directory}: {exc.strerror}") from exc
        if not self.directory.is_dir():
            raise SocketDirError(f"{self.directory} is not a directory")
        if not os.access(self.directory, os.W_OK | os.X_OK):
            raise SocketDirError(
                f"cannot create sockets in {self.directory}: {os.strerror(errno.EACCES)} "
                "(the plugin needs write access to the kubelet's device plugin directory, usually as root)"
            )

    async def run(self, stop: asyncio.Event) -> None:
        self._check_directory()
        async with asyncio.TaskGroup() as group:
            watching = asyncio.Event()
            watcher = group.create_task(self._watch(watching), name="device-plugin-socket-watch")
            # Serve only once the watch is in place, so that no kubelet restart can slip by unseen.
            await watching.wait()
            reconciler = group.create_task(self._reconcile(group), name="device-plugin-reconcile")
            await stop.wait()
            watcher.cancel()
            reconciler.cancel()
            for supervised in self._resources.values():
                supervised.task.cancel()
        self._resources.clear()
        log.info("device plugin stopped; sockets removed")

    def _write_cdi_spec(self) -> None:
        strategies = self._inventory.config.plugin.device_list_strategy
        if self.cdi_dir is None or not any(s.startswith("cdi") for s in strategies):
            return
        spec = cdispec.plugin_spec(self._inventory.gpus.values(), self.cdi_kind)
        # Health changes move the inventory's version but not the spec: only GPUs coming and going do.
        if spec == self._cdi_written:
            return
        try:
            path = cdi.write_spec(self.cdi_dir, cdi.spec_filename(self.cdi_kind), spec)
        except OSError as exc:
            raise SocketDirError(f"cannot write the CDI spec into {self.cdi_dir}: {exc.strerror}") from exc
        self._cdi_written = spec
        log.info("wrote CDI spec %s", path)

    async def _reconcile(self, group: asyncio.TaskGroup) -> None:
        while True:
            seen = self._inventory.version
            # Before serving: an Allocate that names CDI devices must find them in the spec.
            self._write_cdi_spec()
            wanted = set(self._inventory.plan)
            for name in sorted(wanted - self._resources.keys()):
                endpoint = ResourceEndpoint(self._inventory, name, self.directory, self.metrics, self.cdi_kind)
                wake = asyncio.Event()
                task = group.create_task(self._supervise(endpoint, wake), name=f"device-plugin {name}")
                self._resources[name] = _Supervised(endpoint, wake, task)
            for name in sorted(self._resources.keys() - wanted):
                log.info("%s: no longer advertised; stopping its server", name)
                supervised = self._resources.pop(name)
                supervised.task.cancel()
            await self._inventory.wait_for_change(seen)

    async def _watch(self, watching: asyncio.Event) -> None:
        while True:
            async for event in watch_directory(self.directory):
                if event.change is Change.READY:
                    watching.set()
                    continue
                names = {sup.endpoint.socket_name: name for name, sup in self._resources.items()}
                if event.change is Change.RESCAN or (
                    event.change is Change.CREATED and event.name == KUBELET_SOCKET
                ):
                    if event.change is Change.CREATED:
                        log.info("kubelet socket %s appeared", self.kubelet_socket)
                    for sup in self._resources.values():
                        sup.wake.set()
                elif event.change is Change.DELETED and event.name in names:
                    self._resources[names[event.name]].wake.set()
            log.error("stopped watching %s (was it removed?); watching again in 1s", self.directory)
            await asyncio.sleep(1.0)
            with contextlib.suppress(OSError):
                self.directory.mkdir(parents=True, exist_ok=True)
            for sup in self._resources.values():
                sup.wake.set()

    async def _supervise(self, endpoint: ResourceEndpoint, wake: asyncio.Event) -> None:
        backoff = Backoff()
        registered_for: tuple[tuple[int, int, int], int] | None = None
        waiting_logged = False
        name = endpoint.resource
        try:
            while True:
                wake.clear()
                if not endpoint.intact():
                    if endpoint.serial:
                        self.metrics.restarts.labels(name).inc()
                        log.info("%s: socket %s is gone (kubelet restart?); serving it again",
                                    name, endpoint.path)
                    self._mark(name, False)
                    await endpoint.restart()
                kubelet = self._kubelet_identity()
                want = (kubelet, endpoint.serial) if kubelet is not None else None
                if want is not None and registered_for == want:
                    await wake.wait()
                    continue
                self._mark(name, False)
                if want is None:
                    delay = backoff.next()
                    if not waiting_logged or delay >= BACKOFF_MAX_S:
                        log.warning("%s: waiting for the kubelet: %s does not exist yet "
                                    "(registering as soon as it appears; re-checking in %.1fs)",
                                    name, self.kubelet_socket, delay)
                        waiting_logged = True
                    await _wait(wake, delay)
                    continue
                try:
                    await self._register(endpoint)
                except grpc.aio.AioRpcError as exc:
                    delay = backoff.next()
                    log.warning("%s: Register with %s failed (%s: %s); retrying in %.1fs on a fresh connection",
                                name, self.kubelet_socket, exc.code().name, exc.details(), delay)
                    await _wait(wake, delay)
                    continue
                registered_for = want
                waiting_logged = False
                backoff.reset()
                self.metrics.registrations.labels(name).inc()
                self._mark(name, True)
                log.info("%s: registered with the kubelet (endpoint %s)", name, endpoint.socket_name)
        finally:
            self._mark(name, False)
            await endpoint.stop()

    def _kubelet_identity(self) -> tuple[int, int, int] | None:
        """Which kubelet.sock is there now: a new file means a new kubelet, which knows no earlier registration.

        The creation time tells a re-created socket from the old one even when the inode number is reused.
        """
        try:
            st = self.kubelet_socket.stat()
        except FileNotFoundError:
            return None
        return (st.st_dev, st.st_ino, st.st_ctime_ns)

    def _mark(self, name: str, registered: bool) -> None:
        supervised = self._resources.get(name)
        if supervised is not None:
            supervised.registered = registered

    async def _register(self, endpoint: ResourceEndpoint) -> None:
        # A local subchannel pool forces a new connection: a half-dead one from a failed attempt is never reused.
        options = [("grpc.use_local_subchannel_pool", 1)]
        async with grpc.aio.insecure_channel(f"unix:{self.kubelet_socket}", options=options) as channel:
            stub = pb_grpc.RegistrationStub(channel)
            await stub.Register(
                pb.RegisterRequest(
                    version=API_VERSION,
                    endpoint=endpoint.socket_name,
                    resource_name=endpoint.resource,
                    options=OPTIONS,
                ),
                timeout=REGISTER_TIMEOUT_S,
            )


async def _wait(event: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await event.wait()
