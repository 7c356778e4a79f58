"""What the long-running commands share: loading and discovering, and config reloads."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

from gpuppetti.base.runtime import StartupError
from gpuppetti.core.config import Config, ConfigError, load_config
from gpuppetti.core.model import Gpu, Serves
from gpuppetti.discovery import Backend, BackendUnavailable, HostFacts, backends_for, discover, looked_at
from gpuppetti.hostagent.client import HostAgentSource
from gpuppetti.node.inventory import Inventory
from gpuppetti.node.monitor import HealthMonitor
from gpuppetti.sharing.remarks import config_remarks

__all__ = ["Discovered", "Sources", "StartupError", "load_and_discover", "reload", "start_inventory"]

log = logging.getLogger(__name__)

# Fields a running process cannot take on: the driver's name is in its sockets, its slices and its CDI kind.
IMMUTABLE_FIELDS = (("dra", "driver_name", "dra.driverName"),)


@dataclass(frozen=True)
class Sources:
    """Where the config and the hardware come from."""

    config_path: Path | None
    backend: str | None = None
    host_root: Path = Path("/")
    host_agent_url: str | None = None
    host_agent_token_file: Path | None = None


@dataclass(frozen=True)
class Serving:
    """What both front ends take from the same flags: where the HTTP endpoint listens (None: nowhere), where CDI
    specs go, and where the Vulkan layer is installed for the containers (None: slices are not enforced)."""

    http_address: str | None
    cdi_dir: Path
    vulkan_layer_dir: Path | None


@dataclass(frozen=True)
class Discovered:
    config: Config
    backends: list[Backend]
    gpus: list[Gpu]
    skipped: list[str]


def host_agent(sources: Sources, config: Config) -> HostAgentSource | None:
    """The host agent to ask about a virtio-gpu, from the flags or the config; None when there is none."""
    url = sources.host_agent_url or config.host_agent.url
    if not url:
        return None
    token_file = sources.host_agent_token_file or Path(config.host_agent.token_file)
    return HostAgentSource(url, token_file)


def load_and_discover(sources: Sources, facts: HostFacts | None = None) -> Discovered:
    """Everything that can fail before serving: the config, the backends and what they find. Blocks (it reads
    files and runs backends): call it in a thread from the event loop."""
    config = load_config(sources.config_path)
    skipped: list[str] = []
    backends = backends_for(config, sources.backend, sources.host_root, skipped)
    return Discovered(config, backends, discover(backends, facts), skipped)


def nothing_found(found: Discovered) -> str:
    return "no GPUs found; looked at:\n  " + "\n  ".join([*found.skipped, *looked_at(found.backends)])


def where_looked(found: Discovered) -> str:
    """Where discovery looked and what each backend found, on one line (for /healthz)."""
    return "; ".join(looked_at(found.backends))


# GPUs named one by one in a log line; a node of thousands (simulated) gets a count for the rest.
DESCRIBED_GPUS = 8


def describe(gpus: list[Gpu]) -> str:
    named = ", ".join(f"{gpu.id} ({gpu.model})" for gpu in gpus[:DESCRIBED_GPUS])
    return named if len(gpus) <= DESCRIBED_GPUS else f"{named} and {len(gpus) - DESCRIBED_GPUS:,} more"


async def start_inventory(sources: Sources, serves: Serves) -> tuple[Inventory, HealthMonitor, Discovered]:
    """Load, discover and build the inventory. Finding nothing is not an error: a daemon then serves nothing, says
    why, and serves what appears later (a GPU hot-plugged, or a reload). The host agent is not waited for: the
    monitor asks it, and the GPUs take its facts when it answers."""
    found = await asyncio.to_thread(load_and_discover, sources)
    inventory = Inventory(found.config, found.gpus, serves)
    if found.gpus:
        log.info("found %d GPU(s) with %s: %s", len(found.gpus), ", ".join(b.name for b in found.backends),
                 describe(found.gpus))
    else:
        log.warning("%s\nserving nothing until a GPU appears", nothing_found(found))
    warn_about_config(inventory)
    agent = host_agent(sources, found.config)
    return inventory, HealthMonitor(inventory, found.backends, agent), found


def warn_about_config(inventory: Inventory) -> None:
    snapshot = inventory.snapshot
    gpus, config = list(snapshot.gpus.values()), snapshot.config
    for remark in config_remarks(gpus, config, inventory.serves, snapshot.pool):
        log.log(logging.WARNING if remark.warning else logging.INFO, "%s: %s: %s", config.source, remark.path,
                remark.why)


def immutable_change(old: Config, new: Config) -> str | None:
    """The first field a reload may not change that ``new`` changes, as the user writes it; None if there is none."""
    for section, field, name in IMMUTABLE_FIELDS:
        before, after = getattr(getattr(old, section), field), getattr(getattr(new, section), field)
        if before != after:
            return f"{name} ({before!r} -> {after!r})"
    return None


async def reload(sources: Sources, inventory: Inventory, monitor: HealthMonitor) -> None:
    """SIGHUP: apply a new config if it is valid as a whole; otherwise keep serving the old one.

    The host agent's address is read at start only; a reload keeps asking the same agent.
    """
    log.info("reloading %s", sources.config_path or "the built-in defaults")
    agent = monitor.agent
    # No refresh runs meanwhile: one begun with the old backends would otherwise land after the new config's GPUs.
    async with monitor.discovering:
        try:
            found = await asyncio.to_thread(load_and_discover, sources, agent.current() if agent else None)
            if (field := immutable_change(inventory.config, found.config)) is not None:
                log.error("config reload refused; keeping the previous config: %s: %s cannot change while the "
                          "process runs (restart it to change it)", found.config.source, field)
                return
            inventory.replace(found.config, found.gpus)
            warn_about_config(inventory)
        except (ConfigError, BackendUnavailable) as exc:
            log.error("config reload failed; keeping the previous config:\n%s", exc)
            return
        monitor.set_backends(found.backends)
    offered = [f"{n}={len(p.units)}" for n, p in inventory.plan.items()]
    if Serves.POOL in inventory.serves:
        offered.append(f"{len(inventory.snapshot.pool.devices)} DRA device(s)")
    log.info("config reloaded: %s", ", ".join(offered) or "nothing to offer")
