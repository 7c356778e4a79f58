"""Discovery backends: each knows one kind of hardware and nothing about Kubernetes."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

from gpuppetti.config import Config
from gpuppetti.discovery.drm import DrmBackend, FactsSource
from gpuppetti.discovery.macos import MacosBackend
from gpuppetti.discovery.nvml import NvmlBackend
from gpuppetti.discovery.simulated import SimulatedBackend
from gpuppetti.model import Gpu, HealthEvent, Vendor

log = logging.getLogger(__name__)


class Backend(Protocol):
    name: str

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
    agent: FactsSource | None = None,
) -> list[Backend]:
    """The backends to run for ``choice`` (a ``--backend`` value) or the config's ``backend``.

    ``auto`` keeps every backend that can run here, and appends why it left out the others to ``skipped``.
    A backend named explicitly must be able to run, or this raises BackendUnavailable saying why.
    Simulated GPUs in the config are always added.
    """
    selected = choice or config.backend
    real: dict[str, Backend] = {
        "nvml": NvmlBackend(host_root, config.health.ignored_xids),
        "drm": DrmBackend(host_root, config.virtio, agent),
        "macos": MacosBackend(),
    }
    backends: list[Backend]
    if selected == "auto":
        backends = []
        for backend in real.values():
            if backend.available():
                backends.append(backend)
            else:
                log.debug("backend %s skipped: %s", backend.name, backend.looked_at())
                if skipped is not None:
                    skipped.append(backend.looked_at())
    elif selected in real:
        backend = real[selected]
        # The macOS backend runs wherever it is asked to (its commands come from PATH).
        if selected != "macos" and not backend.available():
            raise BackendUnavailable(f"backend {selected} cannot run here: {backend.looked_at()}")
        backends = [backend]
    elif selected == "simulated":
        backends = []
    else:
        raise BackendUnavailable(f"unknown backend {selected!r}")
    backends.append(SimulatedBackend(config.simulated))
    return backends


def discover(backends: Sequence[Backend]) -> list[Gpu]:
    """Run every backend and merge: for an NVIDIA card, NVML's record wins over the sysfs one."""
    found: list[Gpu] = []
    for backend in backends:
        found.extend(backend.discover())
    nvml_keys = {key for gpu in found if gpu.backend == "nvml" for key in (gpu.pci_address, gpu.uuid) if key}
    merged = [
        gpu for gpu in found
        if not (gpu.backend == "drm" and gpu.vendor is Vendor.NVIDIA
                and ({gpu.pci_address, gpu.uuid} & nvml_keys))
    ]
    ids: set[str] = set()
    unique: list[Gpu] = []
    for gpu in merged:
        if gpu.id in ids:
            log.warning("two backends report GPU id %s; keeping the first (%s)", gpu.id, gpu.backend)
            continue
        ids.add(gpu.id)
        unique.append(gpu)
    return unique


def looked_at(backends: Sequence[Backend]) -> list[str]:
    return [backend.looked_at() for backend in backends]
