"""How much of a GPU a unit is: computed once, for what is advertised and for what the container is told alike."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from gpuppetti.model import Gpu


@dataclass(frozen=True)
class Size:
    """A share of one GPU: the fraction, and the cores and memory it amounts to where the GPU's are known."""

    fraction: Fraction
    cores: Fraction | None
    # Whole bytes, rounded down: a share never claims more memory than the GPU has.
    memory: int | None

    @classmethod
    def of(cls, gpu: Gpu, fraction: Fraction, memory: int | None = None) -> Size:
        """``fraction`` of ``gpu``; ``memory`` overrides the fraction of the GPU's memory when given."""
        cores = gpu.cores * fraction if gpu.cores is not None else None
        if memory is None and gpu.memory_bytes is not None:
            memory = int(gpu.memory_bytes * fraction)
        return cls(fraction, cores, memory)

    @classmethod
    def whole(cls, gpu: Gpu) -> Size:
        return cls.of(gpu, Fraction(1))

    def amounts(self) -> dict[str, Fraction]:
        """Per capacity name, as ResourceSlices count them: ``share`` always, ``cores`` and ``memory`` where known."""
        found = {"share": self.fraction}
        if self.cores is not None:
            found["cores"] = self.cores
        if self.memory is not None:
            found["memory"] = Fraction(self.memory)
        return found
