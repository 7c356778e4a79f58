"""Discovery backends: each knows one kind of hardware and nothing about Kubernetes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from gpuppetti.config import Config
from gpuppetti.discovery.simulated import SimulatedBackend
from gpuppetti.model import Gpu


class Backend(Protocol):
    name: str

    def available(self) -> bool:
        """Whether this backend can run on this machine (for ``backend: auto``)."""
        ...

    def discover(self) -> list[Gpu]:
        """The GPUs this backend sees now. May block; callers run it in a thread."""
        ...


def backends_for(config: Config, choice: str | None = None) -> list[Backend]:
    """The backends to run for ``choice`` (a ``--backend`` value) or the config's ``backend``."""
    selected = choice or config.backend
    if selected not in ("auto", "simulated"):
        raise ValueError(f"unknown backend {selected!r} (choose auto or simulated)")
    # Simulated GPUs in the config are always added, whatever else runs.
    return [SimulatedBackend(config.simulated)]


def discover(backends: Sequence[Backend]) -> list[Gpu]:
    gpus: list[Gpu] = []
    for backend in backends:
        if backend.available():
            gpus.extend(backend.discover())
    return gpus
