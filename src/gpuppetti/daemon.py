"""What the long-running commands share: loading and discovering, signals, and config reloads."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuppetti.config import Config, ConfigError, load_config
from gpuppetti.discovery import Backend, BackendUnavailable, backends_for, discover, looked_at
from gpuppetti.hostagent.client import HostAgentSource
from gpuppetti.inventory import Inventory
from gpuppetti.model import Gpu
from gpuppetti.monitor import HealthMonitor

log = logging.getLogger(__name__)


class StartupError(Exception):
    """A long-running command cannot start; the message says why and what to do."""


@dataclass(frozen=True)
class Sources:
    """Where the config and the hardware come from."""

    config_path: Path | None
    backend: str | None = None
    host_root: Path = Path("/")
    host_agent_url: str | None = None
    host_agent_token_file: Path | None = None


@dataclass(frozen=True)
class Discovered:
    config: Config
    backends: list[Backend]
    gpus: list[Gpu]
    skipped: list[str]
    agent: HostAgentSource | None = None


def host_agent(sources: Sources, config: Config) -> HostAgentSource | None:
    """The host agent to ask about a virtio-gpu, from the flags or the config; None when there is none."""
    url = sources.host_agent_url or config.host_agent.url
    if not url:
        return None
    token_file = sources.host_agent_token_file or Path(config.host_agent.token_file)
    return HostAgentSource(url, token_file)


def load_and_discover(sources: Sources, agent: HostAgentSource | None = None) -> Discovered:
    """Everything that can fail before serving: the config, the backends and what they find."""
    config = load_config(sources.config_path)
    if agent is None:
        agent = host_agent(sources, config)
        if agent is not None:
            # Once before discovering, so that the first list already has the Mac's facts when it answers.
            agent.fetch_once()
    skipped: list[str] = []
    backends = backends_for(config, sources.backend, sources.host_root, skipped, agent)
    return Discovered(config, backends, discover(backends), skipped, agent)


def nothing_found(found: Discovered) -> str:
    return "no GPUs found; looked at:\n  " + "\n  ".join([*found.skipped, *looked_at(found.backends)])


def describe(gpus: list[Gpu]) -> str:
    return ", ".join(f"{gpu.id} ({gpu.model})" for gpu in gpus)


async def start_inventory(sources: Sources) -> tuple[Inventory, HealthMonitor, Discovered]:
    """Load, discover and build the inventory. Finding nothing is not an error: a daemon then serves nothing, says
    why, and serves what appears later (a GPU hot-plugged, or a reload)."""
    found = await asyncio.to_thread(load_and_discover, sources)
    inventory = Inventory(found.config, found.gpus)
    if found.gpus:
        log.info("found %d GPU(s) with %s: %s", len(found.gpus), ", ".join(b.name for b in found.backends),
                 describe(found.gpus))
    else:
        log.warning("%s\nserving nothing until a GPU appears", nothing_found(found))
    return inventory, HealthMonitor(inventory, found.backends, found.agent), found


async def reload(sources: Sources, inventory: Inventory, monitor: HealthMonitor) -> None:
    """SIGHUP: apply a new config if it is valid as a whole; otherwise keep serving the old one.

    The host agent's address is read at start only; a reload keeps asking the same agent.
    """
    log.info("received SIGHUP; reloading %s", sources.config_path or "the built-in defaults")
    try:
        found = await asyncio.to_thread(load_and_discover, sources, monitor.agent)
        await inventory.replace(found.config, found.gpus)
    except (ConfigError, BackendUnavailable) as exc:
        log.error("config reload failed; keeping the previous config:\n%s", exc)
        return
    monitor.set_backends(found.backends)
    log.info("config reloaded: %s", ", ".join(f"{n}={len(p.units)}" for n, p in inventory.plan.items()))


async def serve_until_signalled(
    serve: Callable[[asyncio.Event], Awaitable[None]], on_reload: Callable[[], Coroutine[Any, Any, None]]
) -> None:
    """Run ``serve(stop)``; SIGTERM and SIGINT set ``stop``, SIGHUP runs ``on_reload``."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    reloads: set[asyncio.Task[None]] = set()

    def request_stop(signum: int) -> None:
        log.info("received %s; stopping", signal.Signals(signum).name)
        stop.set()

    def request_reload() -> None:
        task = loop.create_task(on_reload(), name="config-reload")
        reloads.add(task)
        task.add_done_callback(reloads.discard)

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, request_stop, signum)
    loop.add_signal_handler(signal.SIGHUP, request_reload)
    try:
        await serve(stop)
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(signum)
        for task in reloads:
            task.cancel()
