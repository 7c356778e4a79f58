"""Serving, registering and re-registering device plugin sockets as the kubelet comes and goes.

The kubelet deletes every socket in its device plugin directory when it starts, and never dials plugins
itself: a plugin must notice and register again. Each resource has a supervisor duty that compares what is true
now with what it last did, and repairs the difference:

- its socket exists and is its own (the same inode its server bound), else it serves again;
- the kubelet it registered with is still connected: after a Register, the kubelet opens a ListAndWatch stream,
  and a kubelet that goes away ends it. A registration counts only while that stream lives, so a plugin never
  believes it is registered with a kubelet that is gone, whatever files a storm of restarts left behind;
- every condition of the directory (missing, a directory squatting on the socket's name, a kubelet.sock that
  is a symlink loop) is a state to wait out with a log line and a backoff, never an exit.

inotify events only wake the supervisors; they carry no state.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import stat
import time
from pathlib import Path

import grpc

from gpuppetti._proto.deviceplugin.v1beta1 import api_pb2 as pb
from gpuppetti.base.backoff import Backoff
from gpuppetti.base.instancelock import InstanceLock
from gpuppetti.base.nodepaths import KUBELET_SOCKET
from gpuppetti.base.runtime import Runtime, StartupError
from gpuppetti.base.watch import Change, watch_directory
from gpuppetti.core import cdi
from gpuppetti.deviceplugin import cdispec, instances
from gpuppetti.deviceplugin.devicelists import DeviceLists
from gpuppetti.deviceplugin.endpoints import Registration, ResourceEndpoint, Supervised, Supervision
from gpuppetti.deviceplugin.enforcement import Enforcer
from gpuppetti.deviceplugin.server import too_big
from gpuppetti.kit.endpoint import SocketError
from gpuppetti.kit.registration import register_device_plugin
from gpuppetti.node.inventory import Inventory
from gpuppetti.node.metrics import Metrics

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"
# The kubelet dials back and opens ListAndWatch inside Register, with a 10 s dial timeout of its own.
REGISTER_TIMEOUT_S = 15.0
# After Register, how long to wait for the kubelet's ListAndWatch stream before registering again.
STREAM_WAIT_S = 10.0
OPTIONS = pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)


class DevicePluginManager:
    """Runs every resource's endpoint, and keeps each registered with the kubelet."""

    def __init__(
        self, inventory: Inventory, directory: Path, metrics: Metrics | None = None, cdi_dir: Path | None = None,
        cdi_kind: str = cdispec.KIND, enforcer: Enforcer | None = None, instance: str | None = None,
    ) -> None:
        self._inventory = inventory
        self.directory = directory
        self.metrics = metrics or Metrics()
        self.cdi_dir = cdi_dir
        self.cdi_kind = cdi_kind
        self.enforcer = enforcer
        self.lists = DeviceLists()
        self._cdi_written: dict[str, object] | None = None
        self.kubelet_socket = directory / KUBELET_SOCKET
        self._resources: dict[str, Supervised] = {}
        self.instance = instance  # its sockets named for it, beside the other instance's; without, one at a time
        self.lock = InstanceLock(directory, "device plugin")
        self._kubelet_problem: str | None = None
        # What the plugin waits for while the directory is not there (for /healthz).
        self._directory_missing: str | None = None

    def waiting_for(self) -> str | None:
        """None once every resource is registered with the kubelet; else what is missing (for /healthz)."""
        if self._directory_missing or self.lock.waiting_for:
            return self._directory_missing or self.lock.waiting_for
        if not self._resources:
            return "no resource is being served yet"
        snapshot = self._inventory.snapshot
        for name in sorted(self._resources):
            if (problem := too_big(name, len(self.lists.of(snapshot, name)))) is not None:
                return problem
        missing = sorted(f"{name} ({sup.why})" for name, sup in self._resources.items() if not sup.registered)
        return f"not registered with the kubelet: {', '.join(missing)}" if missing else None

    def check_directory(self) -> bool:
        """At start: whether the directory is there and can hold sockets. Raises StartupError when it cannot be
        used at all (a start-up mistake, not a state to wait out)."""
        if not self.directory.exists():
            parent = self.directory.parent
            while not parent.exists() and parent != parent.parent:
                parent = parent.parent
            if not parent.is_dir():
                raise StartupError(f"the device plugin directory {self.directory} cannot exist: {parent} is not a "
                                   "directory (see --device-plugin-dir)")
            return False
        if not self.directory.is_dir():
            raise StartupError(f"the device plugin directory {self.directory} is not a directory "
                               "(see --device-plugin-dir)")
        if not os.access(self.directory, os.W_OK | os.X_OK):
            raise StartupError(
                f"cannot create sockets in {self.directory}: {os.strerror(errno.EACCES)} "
                "(the plugin needs write access to the kubelet's device plugin directory, usually as root)"
            )
        return True

    async def _until_the_directory_exists(self) -> None:
        """The kubelet makes its device plugin directory; the plugin makes nothing in its place (one it made would
        not be the kubelet's, which would never come there), and says what it waits for until it is there."""
        self._directory_missing = (f"waiting for the kubelet's device plugin directory {self.directory} to exist "
                                   "(a kubelet makes it when it starts; is --device-plugin-dir the directory of "
                                   "this node's kubelet?)")
        log.warning("%s", self._directory_missing)
        backoff = Backoff(0.2, 5.0)
        while not self.check_directory():
            await backoff.wait()
        self._directory_missing = None
        log.info("%s is there now", self.directory)

    async def run(self, runtime: Runtime) -> None:
        """Take the directory's lock, then spawn the socket watcher and the reconciler as duties."""
        if not self.check_directory():
            await self._until_the_directory_exists()
        if self.instance is None:
            await self.lock.acquire()
            runtime.at_end(self.lock.release)
        else:
            runtime.before_stop(lambda: instances.wait_for_the_next(self.directory, self.own_sockets(), any(
                sup.registered for sup in self._resources.values())))
            await instances.remove_left(self.directory, self._inventory.plan, self.instance)
        try:
            await self._write_cdi_spec()
        except OSError as exc:
            raise StartupError(f"cannot write the CDI spec into {self.cdi_dir}: {exc.strerror or exc}") from exc
        watching = asyncio.Event()
        runtime.spawn("device-plugin-socket-watch", self._watch(watching))
        # Serve only once the watch is in place, so that no kubelet restart can slip by unseen.
        await watching.wait()
        runtime.spawn("device-plugin-reconcile", self._reconcile(runtime))

    async def _write_cdi_spec(self) -> None:
        snapshot = self._inventory.snapshot
        strategies = snapshot.config.plugin.device_list_strategy
        if self.cdi_dir is None or not any(s.startswith("cdi") for s in strategies):
            return
        spec = cdispec.plugin_spec(snapshot.gpus.values(), self.cdi_kind)
        # Health changes move the inventory's version but not the spec: only GPUs coming and going do.
        if spec == self._cdi_written:
            return
        path = await asyncio.to_thread(cdi.write_spec, self.cdi_dir, cdi.spec_filename(self.cdi_kind), spec)
        self._cdi_written = spec
        log.info("wrote CDI spec %s", path)

    async def _reconcile(self, runtime: Runtime) -> None:
        try:
            while True:
                seen = self._inventory.version
                # Before serving: an Allocate that names CDI devices must find them in the spec.
                try:
                    await self._write_cdi_spec()
                except OSError as exc:
                    log.error("cannot write the CDI spec into %s (%s); CDI devices of new GPUs are missing until "
                              "it can", self.cdi_dir, exc.strerror or exc)
                wanted = set(self._inventory.plan)
                for name in sorted(wanted - self._resources.keys()):
                    wake = asyncio.Event()
                    endpoint = ResourceEndpoint(self._inventory, name, self.directory, self.metrics, self.cdi_kind,
                                                wake, self.enforcer, self.lists, self.instance)
                    # The list is encoded before the kubelet asks for it: its first list costs a join.
                    self.lists.of(self._inventory.snapshot, name)
                    task = runtime.spawn(f"device-plugin {name}", self._supervise(endpoint, wake))
                    self._resources[name] = Supervised(endpoint, wake, task)
                for name in sorted(self._resources.keys() - wanted):
                    log.info("%s: no longer advertised; stopping its server", name)
                    self._resources.pop(name).task.cancel()
                await self._inventory.wait_for_change(seen)
        finally:
            self._resources.clear()
            log.info("device plugin stopped; sockets removed")

    def own_sockets(self) -> set[Path]:
        return {sup.endpoint.path for sup in self._resources.values()}

    def _wake_all(self) -> None:
        for sup in self._resources.values():
            sup.wake_up()

    async def _watch(self, watching: asyncio.Event) -> None:
        backoff = Backoff(0.2, 5.0)
        while True:
            if not self.directory.is_dir():
                # The kubelet's to make again, as it does when it starts: one made here would not be its own.
                if self._directory_missing is None:
                    self._directory_missing = (f"the device plugin directory {self.directory} is gone; waiting "
                                               "for the kubelet to make it again")
                    log.error("%s", self._directory_missing)
                await backoff.wait()
                continue
            self._directory_missing = None
            async for event in watch_directory(self.directory):
                if event.change is Change.READY:
                    backoff.reset()
                    watching.set()
                    # Whatever happened while the watch was down: everyone looks again.
                    self._wake_all()
                    continue
                names = {sup.endpoint.socket_name: name for name, sup in self._resources.items()}
                if event.change is Change.RESCAN or (
                    event.change is Change.CREATED and event.name == KUBELET_SOCKET
                ):
                    if event.change is Change.CREATED:
                        log.info("kubelet socket %s appeared", self.kubelet_socket)
                    self._wake_all()
                elif event.change is Change.DELETED and event.name in names:
                    self._resources[names[event.name]].wake_up()
            log.error("stopped watching %s (was it removed?); watching it again", self.directory)
            self._wake_all()
            await backoff.wait()

    def _kubelet_identity(self) -> tuple[int, int, int] | None:
        """Which kubelet.sock is there now; None when there is none a Register could reach."""
        try:
            st = self.kubelet_socket.stat()
        except FileNotFoundError:
            self._kubelet_problem = None
            return None
        except OSError as exc:
            # A symlink loop, a dangling link, a permission problem: there is no kubelet to talk to.
            problem = f"{self.kubelet_socket} cannot be reached: {exc.strerror or exc}"
            if problem != self._kubelet_problem:
                log.error("%s; waiting for a real kubelet socket", problem)
                self._kubelet_problem = problem
            return None
        self._kubelet_problem = None
        if not stat.S_ISSOCK(st.st_mode):
            return None
        return (st.st_dev, st.st_ino, st.st_ctime_ns)

    def _mark(self, name: str, registered: bool, why: str = "") -> None:
        supervised = self._resources.get(name)
        if supervised is not None:
            supervised.registered = registered
            supervised.why = why

    async def _supervise(self, endpoint: ResourceEndpoint, wake: asyncio.Event) -> None:
        """Duty: keep one resource's socket served and registered with the kubelet that is there now."""
        state = Supervision(endpoint, wake)
        name = endpoint.resource
        try:
            while True:
                wake.clear()
                if not endpoint.intact() and not await self._serve_again(state):
                    continue
                kubelet = self._kubelet_identity()
                if state.current is not None and await self._still_registered(state, kubelet):
                    continue
                self._mark(name, False, "waiting for the kubelet")
                if kubelet is None:
                    await self._wait_for_kubelet(state)
                    continue
                if await self._register_once(state):
                    state.current = Registration(kubelet, endpoint.serial)
                    state.waiting_logged = False
                    self.metrics.registrations.labels(name).inc()
                    log.info("%s: registered with the kubelet (endpoint %s)", name, endpoint.socket_name)
        finally:
            self._mark(name, False, "stopped")
            await endpoint.stop()

    async def _serve_again(self, state: Supervision) -> bool:
        """Serve the resource's socket anew (gone, or never served); False when it cannot be yet, after waiting."""
        endpoint, name = state.endpoint, state.endpoint.resource
        if endpoint.serial:
            self.metrics.restarts.labels(name).inc()
            log.info("%s: socket %s is gone (kubelet restart?); serving it again", name, endpoint.path)
        state.current = None
        self._mark(name, False, "serving its socket")
        try:
            await endpoint.restart()
        except SocketError as exc:
            delay = state.backoff.next()
            log.error("%s: %s; trying again in %.1fs", name, exc, delay)
            await _wait(state.wake, delay)
            return False
        return True

    async def _still_registered(self, state: Supervision, kubelet: tuple[int, int, int] | None) -> bool:
        """Whether the registration holds (or may still: its stream has not opened yet), after waiting for a change;
        False, the registration dropped, when the resource must register again."""
        current, endpoint, name = state.current, state.endpoint, state.endpoint.resource
        assert current is not None
        if endpoint.service.streams and current.kubelet == kubelet and current.serial == endpoint.serial:
            if not current.connected:
                current.connected = True
                state.backoff.reset()
                self._mark(name, True)
            await _wait(state.wake)
            return True
        if current.connected and self.instance and (newer := await instances.newer(endpoint.path, name)):
            # Replaced by the next instance of a rolling update: registering again would take the resource back.
            self._mark(name, False, f"the plugin's newer instance serves it on {newer.name}")
            await _wait(state.wake, instances.NEWER_POLL_S)
            return True
        if current.connected:
            log.info("%s: the kubelet's ListAndWatch stream ended (kubelet restart?); registering again", name)
        elif kubelet == current.kubelet and time.monotonic() - current.at < STREAM_WAIT_S:
            # Registered, and the kubelet's stream has not opened yet.
            await _wait(state.wake, STREAM_WAIT_S - (time.monotonic() - current.at))
            return True
        elif kubelet == current.kubelet:
            log.warning("%s: the kubelet did not open ListAndWatch within %.0fs of Register; registering again",
                        name, STREAM_WAIT_S)
        state.current = None
        return False

    async def _wait_for_kubelet(self, state: Supervision) -> None:
        delay = state.backoff.next()
        if not state.waiting_logged or state.backoff.at_maximum:
            # A kubelet restart takes a moment: said quietly first, loudly while it lasts.
            log.log(logging.WARNING if state.waiting_logged else logging.INFO,
                    "%s: waiting for the kubelet: %s does not exist yet "
                    "(registering as soon as it appears; re-checking in %.1fs)",
                    state.endpoint.resource, self.kubelet_socket, delay)
            state.waiting_logged = True
        await _wait(state.wake, delay)

    async def _register_once(self, state: Supervision) -> bool:
        """One Register, cut short by anything that wakes the supervisor; False when it failed (after waiting, unless
        it was cut short)."""
        name = state.endpoint.resource
        supervised = self._resources[name]
        supervised.cut_short = False
        try:
            async with asyncio.timeout(REGISTER_TIMEOUT_S) as scope:
                supervised.registering = scope
                try:
                    await self._register(state.endpoint)
                finally:
                    supervised.registering = None
        except grpc.aio.AioRpcError as exc:
            delay = state.backoff.next()
            log.warning("%s: Register with %s failed (%s: %s); retrying in %.1fs on a fresh connection",
                        name, self.kubelet_socket, exc.code().name, exc.details(), delay)
            await _wait(state.wake, delay)
            return False
        except TimeoutError:
            if supervised.cut_short:
                log.info("%s: Register with %s cut short: the plugin's socket or the kubelet changed meanwhile; "
                         "retrying at once", name, self.kubelet_socket)
                return False
            delay = state.backoff.next()
            log.warning("%s: the kubelet did not answer Register within %.0fs; retrying in %.1fs", name,
                        REGISTER_TIMEOUT_S, delay)
            await _wait(state.wake, delay)
            return False
        return True

    async def _register(self, endpoint: ResourceEndpoint) -> None:
        request = pb.RegisterRequest(version=API_VERSION, endpoint=endpoint.socket_name,
                                     resource_name=endpoint.resource, options=OPTIONS)
        await register_device_plugin(self.kubelet_socket, request, REGISTER_TIMEOUT_S)


async def _wait(wake: asyncio.Event, seconds: float | None = None) -> None:
    """Wait until ``wake`` is set or ``seconds`` pass."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await wake.wait()
