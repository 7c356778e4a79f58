"""Where the kubelet expects a DRA driver's sockets, and where runtimes read CDI specs."""

from pathlib import Path

DEFAULT_REGISTRY_DIR = Path("/var/lib/kubelet/plugins_registry")
DEFAULT_PLUGINS_DIR = Path("/var/lib/kubelet/plugins")
DEFAULT_CDI_DIR = Path("/var/run/cdi")
