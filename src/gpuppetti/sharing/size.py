"""How much of a GPU a unit is: computed once, for what is advertised and for what the container is told alike."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from types import MappingProxyType

from gpuppetti.core.model import Gpu


@dataclass(frozen=True)
class Size:
    """A share of one GPU: the fraction, and the cores and memory it amounts to where the GPU's are known."""

    fraction: Fraction
    cores: Fraction | None
    # Whole bytes, rounded down: a share never claims more memory than the GPU has.
    memory: int | None

    @classmethod
    def part(cls, gpu: Gpu, parts: int) -> Size:
        """One of ``parts`` equal parts of ``gpu``."""
        return part_size(gpu.cores, gpu.memory_bytes, parts)

    @classmethod
    def whole(cls, gpu: Gpu) -> Size:
        return part_size(gpu.cores, gpu.memory_bytes, 1)

    @functools.cached_property
    def _amounts(self) -> Mapping[str, Fraction]:
        found = {"share": self.fraction}
        if self.cores is not None:
            found["cores"] = self.cores
        if self.memory is not None:
            found["memory"] = Fraction(self.memory)
        return MappingProxyType(found)

    def amounts(self) -> Mapping[str, Fraction]:
        """Per capacity name, as ResourceSlices count them: ``share`` always, ``cores`` and ``memory`` where known."""
        return self._amounts


@functools.cache
def part_size(cores: int | None, memory_bytes: int | None, parts: int) -> Size:
    # GPUs of one model have one size per number of parts: computed once, not per GPU (Fraction arithmetic, and
    # hashing Fractions, is slow; a node can list thousands of simulated GPUs).
    fraction = Fraction(1, parts)
    memory = memory_bytes // parts if memory_bytes is not None else None
    return Size(fraction, cores * fraction if cores is not None else None, memory)
