"""Where a node keeps what the daemons talk to: the kubelet's directories, CDI specs, and the CRI sockets.

A module of constants only, so that the command line can name the defaults in ``--help`` without importing the
daemons.
"""

from pathlib import Path

DEFAULT_DEVICE_PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")
KUBELET_SOCKET = "kubelet.sock"
DEFAULT_REGISTRY_DIR = Path("/var/lib/kubelet/plugins_registry")
DEFAULT_PLUGINS_DIR = Path("/var/lib/kubelet/plugins")
DEFAULT_CDI_DIR = Path("/var/run/cdi")
DEFAULT_HTTP_ADDRESS = "127.0.0.1:9400"
# Where the daemons install the Vulkan layer and serve each allocation's ledger; mounted into containers, read-only.
DEFAULT_VULKAN_LAYER_DIR = Path("/var/lib/gpuppetti/vulkan")
DEFAULT_HOST_AGENT_TOKEN_FILE = "/var/run/secrets/gpuppetti-host-agent/token"

# Where CRI runtimes listen, in the order crictl tries them (k3s keeps its own containerd).
CRI_SOCKETS = (
    Path("/run/containerd/containerd.sock"),
    Path("/run/crio/crio.sock"),
    Path("/var/run/cri-dockerd.sock"),
    Path("/run/k3s/containerd/containerd.sock"),
)
