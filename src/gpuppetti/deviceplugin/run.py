"""The ``gpuppetti plugin`` process: load, discover, serve, and stop or reload on signals."""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass
from pathlib import Path

from gpuppetti.config import Config, ConfigError, load_config
from gpuppetti.deviceplugin.lifecycle import DevicePluginManager
from gpuppetti.discovery import backends_for, discover
from gpuppetti.inventory import Inventory
from gpuppetti.model import Gpu

log = logging.getLogger(__name__)


class NoGpusError(Exception):
    pass


@dataclass(frozen=True)
class PluginOptions:
    config_path: Path | None
    device_plugin_dir: Path
    backend: str | None = None


def load_and_discover(options: PluginOptions) -> tuple[Config, list[Gpu]]:
    """Everything that can fail before serving: the config, the backends and what they find."""
    config = load_config(options.config_path)
    try:
        backends = backends_for(config, options.backend)
    except ValueError as exc:
        raise ConfigError(config.source, [("backend", str(exc))]) from exc
    gpus = discover(backends)
    return config, gpus


def describe(gpus: list[Gpu]) -> str:
    return ", ".join(f"{gpu.id} ({gpu.model})" for gpu in gpus)


async def run_plugin(options: PluginOptions) -> None:
    config, gpus = await asyncio.to_thread(load_and_discover, options)
    if not gpus:
        raise NoGpusError(
            f"no GPUs found (backend {options.backend or config.backend}, config {config.source}); "
            "add simulated GPUs to the config or run on a node with GPUs"
        )
    inventory = Inventory(config, gpus)
    log.info("found %d GPU(s): %s", len(gpus), describe(gpus))
    for name, plan in inventory.plan.items():
        log.info("advertising %s: %d unit(s)", name, len(plan.units))

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    reloads: set[asyncio.Task[None]] = set()

    def request_stop(signum: int) -> None:
        log.info("received %s; stopping", signal.Signals(signum).name)
        stop.set()

    def request_reload() -> None:
        task = loop.create_task(_reload(options, inventory), name="config-reload")
        reloads.add(task)
        task.add_done_callback(reloads.discard)

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, request_stop, signum)
    loop.add_signal_handler(signal.SIGHUP, request_reload)
    try:
        await DevicePluginManager(inventory, options.device_plugin_dir).run(stop)
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(signum)
        for task in reloads:
            task.cancel()


async def _reload(options: PluginOptions, inventory: Inventory) -> None:
    """SIGHUP: apply a new config if it is valid as a whole; otherwise keep serving the old one."""
    log.info("received SIGHUP; reloading %s", options.config_path or "the built-in defaults")
    try:
        config, gpus = await asyncio.to_thread(load_and_discover, options)
        await inventory.replace(config, gpus)
    except ConfigError as exc:
        log.error("config reload failed; keeping the previous config:\n%s", exc)
        return
    log.info("config reloaded: %s", ", ".join(f"{n}={len(p.units)}" for n, p in inventory.plan.items()))
