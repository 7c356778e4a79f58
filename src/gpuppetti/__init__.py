"""gpuppetti: GPU sharing for Kubernetes that does not assume NVIDIA."""

# The one place the version is written: pyproject.toml reads it from here. A literal, so that knowing it costs
# the running daemons nothing (importlib.metadata would cost megabytes).
__version__ = "0.1.0"
