"""The data every part of gpuppetti shares: GPUs, their health, and container edits."""

from __future__ import annotations

import enum
import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field


class Health(enum.StrEnum):
    # The values are the kubelet's strings: it treats anything but "Healthy" as unhealthy.
    HEALTHY = "Healthy"
    UNHEALTHY = "Unhealthy"


class Vendor(enum.StrEnum):
    APPLE = "apple"
    NVIDIA = "nvidia"
    AMD = "amd"
    INTEL = "intel"
    VIRTIO = "virtio"
    OTHER = "other"


DEFAULT_RESOURCE_NAMES: dict[Vendor, str] = {
    Vendor.APPLE: "apple.com/gpu",
    Vendor.NVIDIA: "nvidia.com/gpu",
    Vendor.AMD: "amd.com/gpu",
    Vendor.INTEL: "gpu.intel.com/i915",
}
FALLBACK_RESOURCE_NAME = "gpuppetti.dev/gpu"


class Serves(enum.Flag):
    """What a process offers the kubelet, and so what is derived from its GPUs: the device plugin's units, the DRA
    driver's pool, or both (the commands that show what either front end would offer)."""

    UNITS = enum.auto()
    POOL = enum.auto()
    BOTH = UNITS | POOL


def default_resource_name(vendor: Vendor) -> str:
    return DEFAULT_RESOURCE_NAMES.get(vendor, FALLBACK_RESOURCE_NAME)


@dataclass(frozen=True, slots=True)
class DeviceNode:
    """A device node handed to a container. Paths are host paths, never prefixed by a host root."""

    path: str
    host_path: str | None = None
    permissions: str = "rw"

    @property
    def source(self) -> str:
        return self.host_path or self.path


class Mechanism(enum.StrEnum):
    """What holds a container to its slice's memory (docs/enforced-slices.md compares them)."""

    # Ours: Vulkan calls, cooperatively, on every vendor.
    VULKAN_LAYER = "vulkan-layer"
    # NVIDIA's driver, through the container toolkit's apply-cuda-memory-limits hook: CUDA and Vulkan alike.
    NVML = "nvml"
    # The kernel's dmem cgroup controller, in a region the GPU's driver registers (xe, amdgpu).
    DMEM = "dmem"


# What a GPU's slices are said to be enforced by where nothing holds them.
NOT_ENFORCED = "none"


@dataclass(frozen=True, slots=True)
class DriverLimit:
    """A memory limit the GPU's driver or the kernel enforces for a container, as discovery found it on the node:
    for NVML the toolkit's hook program (a host path), for dmem the region the driver registers."""

    mechanism: Mechanism
    hook: str | None = None
    region: str | None = None


def enforced_by(mechanisms: Sequence[Mechanism]) -> str:
    """``vulkan-layer+nvml``, or ``none``: in the one order every place that shows it uses."""
    return _enforced_by(tuple(mechanisms))


@functools.cache
def _enforced_by(mechanisms: tuple[Mechanism, ...]) -> str:
    # Once per combination: a pool of 10,000 devices asks for each GPU's, and iterating an Enum is slow.
    return "+".join(m.value for m in Mechanism if m in mechanisms) or NOT_ENFORCED


@dataclass(frozen=True)
class Hook:
    """An OCI hook a CDI spec adds to the container (CDI's ``hooks[]``). ``args`` start with the program's name."""

    hook_name: str
    path: str
    args: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    timeout: int | None = None


@dataclass(frozen=True)
class Mount:
    container_path: str
    host_path: str
    read_only: bool = True


# Slots: a driver holds its GPUs, their units and devices for its whole life, and a node may have 10,000 of them.
@dataclass(frozen=True, slots=True)
class Gpu:
    """One physical GPU as a backend found it."""

    id: str
    index: int
    vendor: Vendor
    model: str
    backend: str
    cores: int | None = None
    memory_bytes: int | None = None
    device_nodes: tuple[DeviceNode, ...] = ()
    numa_node: int | None = None
    pci_address: str | None = None
    health: Health = Health.HEALTHY
    uuid: str | None = None
    driver: str | None = None
    # PCI vendor and device ids as 4 hex digits, for Vulkan device selection.
    pci_ids: tuple[str, str] | None = None
    metal_family: str | None = None
    # Live telemetry: not part of the GPU's identity, so a change in it wakes no consumer.
    utilization_percent: int | None = field(default=None, compare=False)
    memory_used_bytes: int | None = field(default=None, compare=False)
    # Where model, cores and memory came from when the hardware cannot tell: "config", "host-agent", or
    # "host-agent (stale)" once the agent stopped answering and its last facts are kept.
    facts: str | None = field(default=None, compare=False)
    # A GPU that exists only in the config: no device node, no vendor runtime to select it.
    simulated: bool = False
    # The limits its driver or the kernel can hold a container to on this node (beside the Vulkan layer, which the
    # daemon brings): a driver upgrade that adds one changes what its devices offer.
    limits: tuple[DriverLimit, ...] = ()

    def limit(self, mechanism: Mechanism) -> DriverLimit | None:
        return next((limit for limit in self.limits if limit.mechanism is mechanism), None)

    @property
    def resource_name(self) -> str:
        return default_resource_name(self.vendor)

    @property
    def render_node(self) -> str | None:
        """The DRM render node a container reaches this GPU through (Vulkan, OpenCL on Mesa), if any."""
        return next((n.path for n in self.device_nodes if n.path.startswith("/dev/dri/renderD")), None)


@dataclass(frozen=True)
class HealthEvent:
    """A backend's word that a GPU became healthy or unhealthy, and why."""

    gpu_id: str
    health: Health
    reason: str
    at: float = field(default_factory=time.monotonic)


@dataclass
class ContainerEdits:
    """What a container needs to see its GPUs: rendered as an Allocate response, a CDI spec or podman flags."""

    env: dict[str, str] = field(default_factory=dict)
    device_nodes: list[DeviceNode] = field(default_factory=list)
    mounts: list[Mount] = field(default_factory=list)
    hooks: list[Hook] = field(default_factory=list)

    def add_device_node(self, node: DeviceNode) -> None:
        if node not in self.device_nodes:
            self.device_nodes.append(node)

    def add_mount(self, mount: Mount) -> None:
        if mount not in self.mounts:
            self.mounts.append(mount)

    def add_hook(self, hook: Hook) -> None:
        if hook not in self.hooks:
            self.hooks.append(hook)

    def merge(self, other: ContainerEdits) -> None:
        """Take ``other``'s edits too; its env wins where both set a variable."""
        self.env.update(other.env)
        for node in other.device_nodes:
            self.add_device_node(node)
        for mount in other.mounts:
            self.add_mount(mount)
        for hook in other.hooks:
            self.add_hook(hook)
