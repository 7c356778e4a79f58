"""Discovery backends: each knows one kind of hardware and nothing about Kubernetes; and the merge of what they
found, where one backend's record of a GPU can win over another's and the Mac's own facts reach its virtio GPU."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from gpuppetti.core.config import Config
from gpuppetti.core.model import Gpu, HealthEvent, Vendor
from gpuppetti.discovery.simulated import SimulatedBackend

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HostFacts:
    """What the Mac itself says about its GPU (from ``gpuppetti host-agent``), for the virtio GPU a VM sees."""

    model: str
    cores: int | None
    memory_bytes: int | None
    utilization_percent: int | None
    in_use_memory_bytes: int | None
    source: str  # "host-agent", or "host-agent (stale)" once the agent stopped answering


class Backend(Protocol):
    name: str
    # Whether the hardware can change under it (a GPU vanishing, appearing): the health monitor polls these.
    polls: bool
    # Vendors whose GPUs this backend knows best: its record wins over another backend's for the same card.
    authoritative_for: frozenset[Vendor]
    # Whether it runs when named (`--backend NAME`) even where available() says no (commands from PATH).
    runs_when_named: bool

    def available(self) -> bool:
        """Whether this backend can run on this machine."""
        ...

    def looked_at(self) -> str:
        """What it looked at, for the message when nothing is found."""
        ...

    def discover(self) -> list[Gpu]:
        """The GPUs this backend sees now. May block; the plugin runs it in a thread."""
        ...


@runtime_checkable
class EventSource(Protocol):
    """A backend that also pushes health events (NVML's XIDs)."""

    def watch(self, emit: Callable[[HealthEvent], None], stop: threading.Event) -> None:
        ...


class BackendUnavailable(Exception):
    pass


def backends_for(
    config: Config, choice: str | None = None, host_root: Path = Path("/"), skipped: list[str] | None = None,
) -> list[Backend]:
    """The backends to run for ``choice`` (a ``--backend`` value) or the config's ``backend``.

    ``auto`` keeps every backend that can run here, and appends why it left out the others to ``skipped``.
    A backend named explicitly must be able to run, or this raises BackendUnavailable saying why.
    Simulated GPUs in the config are always added.
    """
    selected = choice or config.backend
    # Made only when asked for: a node of simulated GPUs loads none of the hardware backends.
    real: dict[str, Callable[[], Backend]] = {
        "nvml": lambda: _nvml(host_root, config),
        "drm": lambda: _drm(host_root, config),
        "macos": _macos,
    }
    backends: list[Backend]
    if selected == "auto":
        backends = []
        for make in real.values():
            backend = make()
            if backend.available():
                backends.append(backend)
            else:
                log.debug("backend %s skipped: %s", backend.name, backend.looked_at())
                if skipped is not None:
                    skipped.append(backend.looked_at())
    elif selected in real:
        backend = real[selected]()
        if not backend.runs_when_named and not backend.available():
            raise BackendUnavailable(f"backend {selected} cannot run here: {backend.looked_at()}")
        backends = [backend]
    elif selected == "simulated":
        backends = []
    else:
        raise BackendUnavailable(f"unknown backend {selected!r}")
    backends.append(SimulatedBackend(config.simulated))
    return backends


def _nvml(host_root: Path, config: Config) -> Backend:
    from gpuppetti.discovery.nvml import NvmlBackend

    return NvmlBackend(host_root, config.health.ignored_xids)


def _drm(host_root: Path, config: Config) -> Backend:
    from gpuppetti.discovery.drm import DrmBackend

    return DrmBackend(host_root, config.virtio)


def _macos() -> Backend:
    from gpuppetti.discovery.macos import MacosBackend

    return MacosBackend()


def discover(backends: Sequence[Backend], facts: HostFacts | None = None) -> list[Gpu]:
    """Run every backend and merge what they found.

    A card two backends report (by PCI address or UUID) is kept once, as the backend authoritative for its vendor
    reports it (NVML over sysfs for NVIDIA). A GPU whose facts come from the config (a virtio GPU) takes the Mac's
    own facts where the host agent gave them.
    """
    found: list[tuple[Backend, Gpu]] = []
    for backend in backends:
        found.extend((backend, gpu) for gpu in backend.discover())
    authoritative: set[tuple[Vendor, str]] = {
        (gpu.vendor, key) for backend, gpu in found if gpu.vendor in backend.authoritative_for
        for key in (gpu.pci_address, gpu.uuid) if key
    }
    ids: set[str] = set()
    unique: list[Gpu] = []
    for backend, gpu in found:
        keys = {(gpu.vendor, key) for key in (gpu.pci_address, gpu.uuid) if key}
        if gpu.vendor not in backend.authoritative_for and keys & authoritative:
            continue
        if gpu.id in ids:
            log.warning("two backends report GPU id %s; keeping the first (%s)", gpu.id, gpu.backend)
            continue
        ids.add(gpu.id)
        unique.append(with_host_facts(gpu, facts))
    return unique


def with_host_facts(gpu: Gpu, facts: HostFacts | None) -> Gpu:
    """A virtio GPU described by the config takes what the Mac says it is: only the Mac knows, the VM sees
    a virtio device."""
    if facts is None or gpu.facts != "config" or gpu.vendor not in (Vendor.VIRTIO, Vendor.APPLE):
        return gpu
    return dataclasses.replace(
        gpu, vendor=Vendor.APPLE, model=facts.model, facts=facts.source, cores=facts.cores or gpu.cores,
        memory_bytes=facts.memory_bytes or gpu.memory_bytes, utilization_percent=facts.utilization_percent,
        memory_used_bytes=facts.in_use_memory_bytes,
    )


def looked_at(backends: Sequence[Backend]) -> list[str]:
    return [backend.looked_at() for backend in backends]
