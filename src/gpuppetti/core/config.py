"""The versioned YAML config (``version: v1``), validated strictly before anything starts.

Every error names the file, the key path and what is wrong, so that a broken ConfigMap is fixed from one log line.
"""

from __future__ import annotations

import difflib
import os
import re
import stat
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BeforeValidator, Field, ValidationError, field_validator, model_validator

from gpuppetti.base.nodepaths import DEFAULT_HOST_AGENT_TOKEN_FILE
from gpuppetti.base.quantity import parse_bytes, parse_duration
from gpuppetti.base.strict import Strict, problems, shown
from gpuppetti.base.syntax import DNS_SUBDOMAIN, http_url_problem
from gpuppetti.core.model import DEFAULT_RESOURCE_NAMES, FALLBACK_RESOURCE_NAME, Health, Vendor

CONFIG_ENV = "GPUPPETTI_CONFIG"
SUPPORTED_VERSIONS = ("v1",)
# A ConfigMap holds at most 1 MiB; a config is a few hundred bytes.
MAX_CONFIG_BYTES = 1 << 20
# A regular file is read in milliseconds; one on a filesystem that stalls must not hold a reload for ever.
READ_DEADLINE_S = 10.0
# How many values YAML's aliases may add to a config by repeating what an anchor holds. A config repeats a few
# entries at most; an alias bomb (anchors of lists of aliases of anchors...) expands a few hundred bytes into
# billions of values, and every one of them would be validated and echoed into the error.
MAX_ALIAS_EXPANSION = 10_000


class ConfigError(Exception):
    """A config that cannot be used. ``str()`` is the message to show the user."""

    def __init__(self, source: str, problems: Sequence[tuple[str, str]]) -> None:
        self.source = source
        self.problems = list(problems)
        lines = [f"{source}: {path}: {what}" if path else f"{source}: {what}" for path, what in problems]
        super().__init__("\n".join(lines))


# The kubelet's rule for extended resources: a domain prefix that is not kubernetes.io, and no "requests." prefix.
_RESOURCE_NAME = re.compile(
    r"^(?P<domain>[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*)/"
    r"(?P<name>[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)$"
)


def resource_name_problem(name: str) -> str | None:
    """Why the kubelet would reject ``name`` as an extended resource name, or None if it is fine."""
    match = _RESOURCE_NAME.fullmatch(name)
    if not match:
        return f"{shown(name)} is not an extended resource name of the form 'vendor.example.com/name'"
    domain = match.group("domain")
    if domain == "kubernetes.io" or domain.endswith(".kubernetes.io"):
        return f"{shown(name)} uses the reserved kubernetes.io domain"
    if name.startswith("requests."):
        return f"{shown(name)} must not start with 'requests.'"
    if len(match.group("name")) > 63:
        return f"{shown(name)}: the part after '/' is longer than 63 characters"
    return None


def _check_resource_name(value: object) -> object:
    if isinstance(value, str) and (problem := resource_name_problem(value)):
        raise ValueError(problem)
    return value


ResourceName = Annotated[str, BeforeValidator(_check_resource_name)]
Bytes = Annotated[int, BeforeValidator(parse_bytes)]
Seconds = Annotated[float, BeforeValidator(parse_duration)]
SERVED_RESOURCE_NAMES = (*DEFAULT_RESOURCE_NAMES.values(), FALLBACK_RESOURCE_NAME)
BACKENDS = ("auto", "simulated", "drm", "nvml", "macos")
BackendName = Literal["auto", "simulated", "drm", "nvml", "macos"]
# NVIDIA's list of XIDs caused by applications rather than the GPU (its health monitor ignores them too).
APPLICATION_XIDS = (13, 31, 43, 45, 68, 109)
# The model's own enumerations, read from YAML's strings (strict mode takes only enum members from Python).
VendorName = Annotated[Vendor, Field(strict=False)]
HealthName = Annotated[Health, Field(strict=False)]
# Which units to prefer for a request (sharing/policy.py): spread over GPUs, or packed onto as few as possible.
AllocationPolicy = Literal["distributed", "packed"]


class SimulatedGpu(Strict):
    model: str = Field(min_length=1)
    vendor: VendorName = Vendor.OTHER
    cores: int | None = Field(default=None, ge=1)
    memory: Bytes | None = None
    count: int = Field(default=1, ge=1, le=4096)
    numa_node: int | None = Field(default=None, ge=0)
    health: HealthName = Health.HEALTHY


class SimulatedSection(Strict):
    gpus: list[SimulatedGpu] = Field(default_factory=list)


class VirtioSection(Strict):
    """What a virtio-gpu really is. Inside a krunkit/libkrun VM it is the host's Apple GPU, seen through Venus."""

    vendor: Literal["apple", "virtio"] = "virtio"
    model: str | None = Field(default=None, min_length=1)
    cores: int | None = Field(default=None, ge=1)
    memory: Bytes | None = None
    # "vid:did" for MESA_VK_DEVICE_SELECT, as `MESA_VK_DEVICE_SELECT=list vulkaninfo` prints it in the guest. Vulkan
    # ids are 32 bits: PCI vendors fit in 4 hex digits, Khronos-registered ones do not (Mesa's drivers are 0x10005).
    vulkan_device: str | None = Field(default=None, pattern=r"^[0-9a-fA-F]{1,8}:[0-9a-fA-F]{1,8}$")


class HealthSection(Strict):
    poll_interval: Seconds = Field(default=5.0, gt=0)
    ignored_xids: list[int] = Field(default_factory=lambda: list(APPLICATION_XIDS))
    # A GPU marked unhealthy by an XID is healthy again after this long without another one; 0 never recovers.
    recovery_period: Seconds = Field(default=60.0, ge=0)


class HostAgentSection(Strict):
    """Where the Mac's host agent answers, for a virtio-gpu that is really the Mac's GPU."""

    url: str | None = None
    token_file: str = DEFAULT_HOST_AGENT_TOKEN_FILE
    poll_interval: Seconds = Field(default=10.0, gt=0)

    @field_validator("url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is not None and (problem := http_url_problem(value)):
            raise ValueError(problem)
        return value


def _check_served_name(value: object) -> object:
    # A GPU is offered under its vendor's name; an entry under any other name would match nothing, silently.
    if isinstance(value, str) and (problem := resource_name_problem(value)):
        raise ValueError(problem)
    if isinstance(value, str) and value not in SERVED_RESOURCE_NAMES:
        known = ", ".join(SERVED_RESOURCE_NAMES)
        close = difflib.get_close_matches(value, SERVED_RESOURCE_NAMES, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise ValueError(f"{shown(value)} is not a resource any GPU is offered under; {hint}each GPU's is its vendor's "
                         f"({known}); 'rename' gives it another")
    return value


class ReplicatedResource(Strict):
    name: Annotated[str, BeforeValidator(_check_served_name)]
    replicas: int | None = Field(default=None, ge=1, le=1024)
    # Instead of a fixed count: one replica per this many cores (10 gives 4 slices on a 40-core GPU).
    replicas_per_cores: int | None = Field(default=None, ge=1, le=10000)
    rename: ResourceName | None = None
    # GPU indexes or ids. None means every GPU of the resource.
    devices: list[str | int] | None = None
    # The memory of one replica, which the Vulkan layer holds a container to; default: the GPU's memory / replicas.
    slice_memory: Bytes | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _devices_not_empty(self) -> ReplicatedResource:
        if self.devices is not None and not self.devices:
            raise ValueError("devices: must list at least one GPU index or id when given")
        if (self.replicas is None) == (self.replicas_per_cores is None):
            raise ValueError("give exactly one of replicas and replicasPerCores")
        return self


class TimeSlicing(Strict):
    rename_by_default: bool = False
    fail_requests_greater_than_one: bool = False
    resources: list[ReplicatedResource] = Field(default_factory=list)

    @model_validator(mode="after")
    def _one_catch_all_per_name(self) -> TimeSlicing:
        seen: set[str] = set()
        for entry in self.resources:
            if entry.devices is None:
                if entry.name in seen:
                    raise ValueError(
                        f"resource {shown(entry.name)} is listed twice without 'devices'; give each entry "
                        "its own 'devices' to set per-GPU replica counts"
                    )
                seen.add(entry.name)
        return self


class Sharing(Strict):
    time_slicing: TimeSlicing = Field(default_factory=TimeSlicing)
    # Hold each container given a share of a GPU (a replica, a partition, a consumable share) to its memory through
    # the Vulkan layer. Cooperative: docs/enforced-slices.md says what it does not stop.
    enforce_memory: bool = True
    # Hold each such container to its share of the GPU's time: a cooperative duty cycle on its Vulkan submits. Off
    # by default: it can only delay work, never preempt it, and it slows a share that is alone on its GPU.
    enforce_compute: bool = False


PartitionCount = Literal[2, 4, 8, 10, 20, 25, 40, 50]


def _default_partitions() -> list[PartitionCount]:
    return [2, 4, 8]


class DraSection(Strict):
    driver_name: str = Field(default="gpu.gpuppetti.dev", max_length=63, pattern=DNS_SUBDOMAIN.pattern)
    # whole: one device per GPU. partitions: fixed-size parts of a GPU. consumable: one device per GPU that many
    # claims share, each taking part of its capacity.
    slicing: Literal["whole", "partitions", "consumable"] = "whole"
    # Each count must divide 1000, so that every partition's share is a whole number of milli-units.
    partitions: list[PartitionCount] = Field(default_factory=_default_partitions)
    # How partitions are published. capacity: one device per GPU whose memory claims take in the partitions'
    # sizes (its validValues): as cheap for the scheduler as whole GPUs. counters: a device per partition, each
    # consuming its GPU's shared counters: the API's partitionable devices, which cost the scheduler far more per
    # pod (docs/scale.md has how much) and suit only small clusters.
    partition_layout: Literal["capacity", "counters"] = "capacity"
    # partitions: the one a claim that names none gets (1: the whole GPU), and with it a plain resources.limits
    # through the extended-resource bridge; default: the smallest of partitions.
    default_partition: Literal[1] | PartitionCount | None = None
    # consumable: a claim that asks for no capacity gets 1/shares of each.
    shares: int = Field(default=4, ge=1, le=1000)

    @model_validator(mode="after")
    def _default_is_a_partition(self) -> DraSection:
        if self.default_partition not in (None, 1, *self.partitions):
            raise ValueError(f"defaultPartition: {self.default_partition} is not one of partitions "
                             f"{sorted(self.partitions)} (or 1, the whole GPU)")
        return self

    @property
    def plain_partition(self) -> int:
        """The number of equal parts of a GPU a claim that names no partition gets one of."""
        return self.default_partition or max(self.partitions, default=1)


DeviceListStrategy = Literal["envvar", "cdi-cri", "cdi-annotations"]


def _strategies(value: object) -> object:
    # NVIDIA's config takes one strategy or a list; "cdi" is short for the structured CDI field.
    items = [value] if isinstance(value, str) else value
    if isinstance(items, list):
        return ["cdi-cri" if item == "cdi" else item for item in items]
    return value


def _default_strategies() -> list[DeviceListStrategy]:
    return ["envvar"]


class PluginSection(Strict):
    allocation_policy: AllocationPolicy = "distributed"
    # envvar: env vars and device nodes in the Allocate response. cdi-cri: CDI device names in its cdi_devices
    # field (Kubernetes 1.28+). cdi-annotations: the same names as cdi.k8s.io/ annotations, for older runtimes.
    device_list_strategy: Annotated[list[DeviceListStrategy], BeforeValidator(_strategies)] = Field(
        default_factory=_default_strategies, min_length=1)


class Config(Strict):
    version: Literal["v1"]
    backend: BackendName = "auto"
    simulated: SimulatedSection = Field(default_factory=SimulatedSection)
    virtio: VirtioSection = Field(default_factory=VirtioSection)
    health: HealthSection = Field(default_factory=HealthSection)
    host_agent: HostAgentSection = Field(default_factory=HostAgentSection)
    sharing: Sharing = Field(default_factory=Sharing)
    plugin: PluginSection = Field(default_factory=PluginSection)
    dra: DraSection = Field(default_factory=DraSection)

    # Where the config came from, for error messages raised after loading (e.g. against discovered GPUs).
    source: str = Field(default="<defaults>", exclude=True, alias="__source__")


def default_config() -> Config:
    return Config(version="v1")


# libyaml's parser where it is installed (it is, with PyYAML's wheels): ten times the pure-Python one's speed.
_SafeLoader: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _UniqueKeyLoader(_SafeLoader):  # type: ignore[valid-type, misc]
    """A safe loader that rejects duplicate keys, which plain YAML silently resolves to the last one."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {shown(key)}", key_node.start_mark
            )
        seen.add(key)
    mapping: dict[Any, Any] = loader.construct_mapping(node, deep=deep)
    return mapping


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


class _AliasBomb(Exception):
    pass


def _check_expansion(root: yaml.Node) -> None:
    """Refuse a document whose aliases repeat more than MAX_ALIAS_EXPANSION values. An alias is the very node its
    anchor names, so each value met again on the walk is one that an alias repeats; the walk stops at the bound,
    which also ends a recursive alias (an anchor that contains itself)."""
    seen: set[int] = set()
    repeated = 0
    stack: list[yaml.Node] = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            repeated += 1
            if repeated > MAX_ALIAS_EXPANSION:
                raise _AliasBomb
        else:
            seen.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)
        elif isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                stack.append(key)
                stack.append(value)


def _load_yaml(text: str) -> Any:
    loader = _UniqueKeyLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expansion(node)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def parse_config(text: str, source: str) -> Config:
    """Parse and validate config text. Raises ConfigError naming ``source``, the key path and the problem."""
    try:
        data = _load_yaml(text)
    except _AliasBomb:
        raise ConfigError(source, [("", f"its aliases (*name) repeat more than {MAX_ALIAS_EXPANSION:,} values; write "
                                        "the config out, or repeat less")]) from None
    except yaml.YAMLError as exc:
        where = ""
        mark = getattr(exc, "problem_mark", None)
        if mark is not None:
            where = f"line {mark.line + 1}, column {mark.column + 1}: "
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(source, [("", f"{where}not valid YAML: {problem}")]) from exc
    if data is None:
        raise ConfigError(source, [("", "the file is empty; it needs at least 'version: v1'")])
    if not isinstance(data, dict):
        raise ConfigError(source, [("", f"expected a mapping at the top level, got {type(data).__name__}")])
    if "version" in data and data["version"] not in SUPPORTED_VERSIONS:
        supported = ", ".join(SUPPORTED_VERSIONS)
        raise ConfigError(source, [("version",
                                    f"unsupported version {shown(data['version'])} (supported: {supported})")])
    if "__source__" in data:
        raise ConfigError(source, [("__source__", "unknown key")])
    try:
        return Config.model_validate({**data, "__source__": source})
    except ValidationError as exc:
        raise ConfigError(source, problems(exc, Config)) from None


def load_config(path: str | os.PathLike[str] | None) -> Config:
    """Load the config at ``path``, or the built-in defaults when no path is given."""
    if path is None:
        return default_config()
    source = str(path)
    try:
        data = _read_file(Path(path), source)
    except OSError as exc:
        raise ConfigError(source, [("", f"cannot read the config file: {exc.strerror or exc}")]) from exc
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(source, [("", f"the file is not UTF-8 text: {exc}")]) from exc
    return parse_config(text, source)


_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def _read_file(path: Path, source: str) -> bytes:
    """The bytes of a regular file of at most MAX_CONFIG_BYTES, read within READ_DEADLINE_S. Opened without
    blocking and checked before it is read: a FIFO would block the open and the read until a writer came, and
    the thread that waits could be neither cancelled nor left behind by a process asked to stop."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = next((name for test, name in _FILE_KINDS if test(mode)), "not a regular file")
            raise ConfigError(source, [("", f"the config must be a regular file, and this is {kind}")])
        chunks: list[bytes] = []
        size = 0
        deadline = time.monotonic() + READ_DEADLINE_S
        while chunk := os.read(fd, 64 * 1024):
            size += len(chunk)
            if size > MAX_CONFIG_BYTES:
                raise ConfigError(source, [("", f"the file is larger than {MAX_CONFIG_BYTES:,} bytes (a "
                                                "ConfigMap's limit); a config is a few hundred")])
            if time.monotonic() > deadline:
                raise ConfigError(source, [("", f"reading the file took more than {READ_DEADLINE_S:.0f} seconds")])
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
