"""The health monitor's refreshes, in-process: the health poll, the host agent and a config reload all discover and
apply what they found, one at a time."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from gpuppetti.core.model import Gpu, Health, Vendor
from gpuppetti.discovery import HostFacts
from gpuppetti.hostagent.client import HostAgentSource
from gpuppetti.node.daemon import Sources, reload
from gpuppetti.node.inventory import Inventory
from gpuppetti.node.monitor import HealthMonitor
from tests.helpers import config_from

CONFIG = """\
version: v1
backend: simulated
sharing:
  timeSlicing:
    resources:
      - {name: apple.com/gpu, replicasPerCores: 10}
"""
MAC = HostFacts(model="Apple M3 Max", cores=40, memory_bytes=64 * 2**30, utilization_percent=None,
                in_use_memory_bytes=None, source="host-agent")


class _VirtioCard:
    """A virtio GPU described by the config, whose first discovery blocks until the test lets it go."""

    name = "drm"
    polls = True
    authoritative_for: frozenset[Vendor] = frozenset()
    runs_when_named = False

    def __init__(self) -> None:
        self.first_started = threading.Event()
        self.release_first = threading.Event()
        self.calls = 0

    def available(self) -> bool:
        return True

    def looked_at(self) -> str:
        return "a virtio card"

    def discover(self) -> list[Gpu]:
        self.calls += 1
        if self.calls == 1:
            self.first_started.set()
            assert self.release_first.wait(10)
        return [_virtio_card()]


def _virtio_card() -> Gpu:
    return Gpu(id="virtio-card0", index=0, vendor=Vendor.APPLE, model="From the config", backend="drm",
               cores=20, memory_bytes=8 * 2**30, facts="config")


class _Agent(HostAgentSource):
    def __init__(self) -> None:
        super().__init__("http://127.0.0.1:9", Path("/nonexistent"))
        self.facts: HostFacts | None = None

    def current(self) -> HostFacts | None:
        return self.facts


async def test_a_discovery_begun_before_the_agent_answered_does_not_land_after_one_with_its_facts() -> None:
    card = _VirtioCard()
    inventory = Inventory(config_from(CONFIG), [_virtio_card()])
    agent = _Agent()
    monitor = HealthMonitor(inventory, [card], agent)

    # The health poll refreshes with no facts yet, and its discovery is slow.
    poll = asyncio.create_task(monitor.refresh())
    assert await asyncio.to_thread(card.first_started.wait, 10)
    # The agent answers meanwhile and refreshes at once.
    agent.facts = MAC
    answer = asyncio.create_task(monitor.refresh())
    await asyncio.sleep(0.05)
    card.release_first.set()
    await asyncio.gather(poll, answer)

    [served] = inventory.gpus.values()
    assert (served.model, served.cores, served.facts) == ("Apple M3 Max", 40, "host-agent")
    assert len(inventory.snapshot.plan["apple.com/gpu"].units) == 4


async def test_a_refresh_begun_with_the_old_backends_does_not_land_after_a_reload(tmp_path: Path) -> None:
    card = _VirtioCard()
    inventory = Inventory(config_from(CONFIG), [_virtio_card()])
    monitor = HealthMonitor(inventory, [card])
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG.replace("backend: simulated", "backend: simulated\nsimulated:\n  gpus:\n"
                                     "    - {model: Apple M3 Max, vendor: apple, cores: 40, memory: 48Gi}"))

    # The poll's refresh runs with the old backend (the virtio card), and its discovery is slow.
    poll = asyncio.create_task(monitor.refresh())
    assert await asyncio.to_thread(card.first_started.wait, 10)
    # SIGHUP meanwhile: the new config has a simulated GPU instead.
    reloading = asyncio.create_task(reload(Sources(config, "simulated"), inventory, monitor))
    await asyncio.sleep(0.05)
    card.release_first.set()
    await asyncio.gather(poll, reloading)

    assert {gpu_id: gpu.health for gpu_id, gpu in inventory.gpus.items()} == {"sim-apple-0": Health.HEALTHY}, (
        "the reload's GPUs, as its discovery found them")
