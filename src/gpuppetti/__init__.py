"""gpuppetti: GPU sharing for Kubernetes that does not assume NVIDIA."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("gpuppetti")
except PackageNotFoundError:  # pragma: no cover - running from a source tree without installing
    __version__ = "0.0.0+unknown"
