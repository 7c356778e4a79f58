"""GPUs that exist only in the config: the embedded default, the demo and the base of the tests."""

from __future__ import annotations

from gpuppetti.core.config import SimulatedSection
from gpuppetti.core.model import Gpu, Health, Vendor


class SimulatedBackend:
    name = "simulated"
    # Nothing here changes by itself; a reload re-reads the config.
    polls = False
    authoritative_for: frozenset[Vendor] = frozenset()
    runs_when_named = True

    def __init__(self, section: SimulatedSection) -> None:
        self._section = section

    def available(self) -> bool:
        return True

    def looked_at(self) -> str:
        return "simulated: the config lists no simulated.gpus"

    def discover(self) -> list[Gpu]:
        gpus: list[Gpu] = []
        per_vendor: dict[Vendor, int] = {}
        for entry in self._section.gpus:
            vendor = Vendor(entry.vendor)
            for _ in range(entry.count):
                index = per_vendor.get(vendor, 0)
                per_vendor[vendor] = index + 1
                gpus.append(
                    Gpu(
                        id=f"sim-{vendor.value}-{index}",
                        index=index,
                        vendor=vendor,
                        model=entry.model,
                        backend=self.name,
                        cores=entry.cores,
                        memory_bytes=entry.memory,
                        numa_node=entry.numa_node,
                        health=Health(entry.health),
                        simulated=True,
                    )
                )
        return gpus

