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
# The longest layer directory, in bytes: a ledger's socket whose path would be too long is bound at
# <layer dir>/.b<8 hex> before it is renamed into its allocation's directory, and a socket's path is at most 107 bytes.
LAYER_DIR_MAX_BYTES = 107 - len("/.b") - 8

# What the DaemonSets mount besides the Vulkan layer's directory, which is mounted at its node path: the layer's
# directory may be none of these, nor inside one, nor hold one (a duplicate mountPath the API server refuses, or
# the layer's read-write mount laid over the node's read-only root).
DAEMONSET_MOUNTS = {
    "/host": "the node's root",
    "/etc/gpuppetti": "the config",
    str(DEFAULT_DEVICE_PLUGIN_DIR): "the kubelet's device plugin directory",
    str(DEFAULT_CDI_DIR): "the CDI specs",
    "/var/run/secrets/gpuppetti-host-agent": "the host agent's token",
    str(DEFAULT_REGISTRY_DIR): "the kubelet's plugin registry",
    str(DEFAULT_PLUGINS_DIR): "the kubelet's plugin directory",
}
# The system's own trees: the layer's directory is nowhere in them (the container's image and the kernel's files
# live there).
SYSTEM_TREES = ("/proc", "/sys", "/dev", "/etc", "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
                "/boot")
# Directories that hold far more than the layer: the layer's directory is none of them (each one's parents are in
# the list too, so none of theirs either).
SYSTEM_DIRECTORIES = ("/", "/var", "/var/lib", "/var/lib/kubelet", "/var/run", "/run", "/tmp", "/var/tmp", "/home",
                      "/root", "/opt", "/srv", "/mnt", "/media")

# Where CRI runtimes listen, in the order crictl tries them (k3s keeps its own containerd).
CRI_SOCKETS = (
    Path("/run/containerd/containerd.sock"),
    Path("/run/crio/crio.sock"),
    Path("/var/run/cri-dockerd.sock"),
    Path("/run/k3s/containerd/containerd.sock"),
)
