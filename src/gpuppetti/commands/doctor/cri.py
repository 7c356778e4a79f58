"""The container runtime, asked through its CRI socket as the kubelet asks it: its name and version (``Version``)
and its configuration (verbose ``Status``), and whether it hands CDI devices to containers.

CDI is how DRA claims reach containers: the kubelet passes the CDI device names from NodePrepareResources to the
runtime, and a runtime that does not resolve them starts the container without its GPU, and without an error.
containerd resolves them from 1.7 with ``enable_cdi`` (on by default from 2.0); CRI-O from 1.23, always.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import grpc

from gpuppetti._proto.cri.v1 import api_pb2 as pb
from gpuppetti._proto.cri.v1 import api_pb2_grpc as pb_grpc
from gpuppetti.commands.doctor.result import Result, fail, ok, warn

TIMEOUT_S = 5.0
CHECK = "CDI in the runtime"
_VERSION = re.compile(r"(\d+)\.(\d+)(?:\.(\d+))?")


class RuntimeUnreachable(Exception):
    pass


@dataclass(frozen=True)
class RuntimeFacts:
    name: str
    version: str
    api_version: str
    # containerd's CRI configuration, from the verbose status (None where the runtime gives none).
    config: dict[str, object] | None
    not_ready: list[str]

    @property
    def release(self) -> tuple[int, int, int] | None:
        match = _VERSION.search(self.version)
        if match is None:
            return None
        return int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)

    def describe(self) -> str:
        return f"{self.name} {self.version.removeprefix('v')} (CRI {self.api_version})"


async def ask(socket: Path) -> RuntimeFacts:
    """Version and verbose Status from the runtime at ``socket``. Raises RuntimeUnreachable saying why."""
    try:
        async with grpc.aio.insecure_channel(f"unix:{socket}") as channel:
            stub = pb_grpc.RuntimeServiceStub(channel)
            version = await stub.Version(pb.VersionRequest(version="v1"), timeout=TIMEOUT_S)
            status = await stub.Status(pb.StatusRequest(verbose=True), timeout=TIMEOUT_S)
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
            raise RuntimeUnreachable("it does not serve CRI v1 (runtime.v1): it is older than the kubelets that "
                                     "support DRA") from None
        raise RuntimeUnreachable(f"{exc.code().name}: {exc.details()}") from None
    config: dict[str, object] | None = None
    try:
        loaded = json.loads(status.info.get("config", ""))
        config = loaded if isinstance(loaded, dict) else None
    except ValueError:
        config = None
    not_ready = [f"{c.type} ({c.reason or 'false'})" for c in status.status.conditions
                 if not c.status and c.type in ("RuntimeReady", "NetworkReady")]
    return RuntimeFacts(version.runtime_name, version.runtime_version, version.runtime_api_version, config,
                        not_ready)


def judge_cdi(facts: RuntimeFacts, cdi_dir: Path) -> Result:
    """Whether containers get the CDI devices the kubelet names, and read them from ``cdi_dir``."""
    release = facts.release
    lost = ("DRA claims (and the device plugin's cdi-cri strategy) reach no container: the pod starts without "
            "its GPU, and without an error")
    if facts.name == "containerd":
        if release is not None and release < (1, 7, 0):
            return fail(CHECK, f"{facts.describe()} cannot apply CDI devices: {lost}",
                        "upgrade containerd to 1.7 or newer with enable_cdi = true (on by default from 2.0); until "
                        "then use the device plugin with deviceListStrategy envvar")
        enabled = facts.config.get("enableCDI") if facts.config else None
        if enabled is False:
            return fail(CHECK, f"CDI is off in {facts.describe()}: {lost}",
                        "set enable_cdi = true in containerd's CRI config ([plugins.\"io.containerd.grpc.v1.cri\"] "
                        "in 1.7, [plugins.\"io.containerd.cri.v1.runtime\"] in 2.x) and restart containerd")
        if enabled is None and (release is None or release < (2, 0, 0)):
            return warn(CHECK, f"{facts.describe()} did not say whether CDI is on",
                        "check enable_cdi = true in containerd's config")
        dirs = facts.config.get("cdiSpecDirs") if facts.config else None
        if isinstance(dirs, list) and dirs and not _covers(dirs, cdi_dir):
            return fail(CHECK, f"{facts.describe()} reads CDI specs from {', '.join(map(str, dirs))}, not from "
                        f"{cdi_dir}, where gpuppetti writes them",
                        f"add {cdi_dir} to containerd's cdi_spec_dirs, or give the daemons a --cdi-dir it reads")
        where = f", reading {', '.join(map(str, dirs))}" if isinstance(dirs, list) and dirs else ""
        return ok(CHECK, f"{facts.describe()} applies CDI devices{where}")
    if facts.name in ("cri-o", "crio"):
        if release is not None and release < (1, 23, 0):
            return fail(CHECK, f"{facts.describe()} cannot apply CDI devices: {lost}", "upgrade CRI-O to 1.23 or "
                        "newer")
        return ok(CHECK, f"{facts.describe()} applies CDI devices (always on from 1.23)")
    return warn(CHECK, f"{facts.describe()}: gpuppetti cannot tell whether this runtime applies CDI devices",
                "check its documentation for CDI; DRA needs it")


def _covers(dirs: list[object], cdi_dir: Path) -> bool:
    # /var/run is a link to /run on most systems: compare the two spellings as one.
    def canonical(text: str) -> str:
        return text.rstrip("/").replace("/var/run/", "/run/", 1) if text.startswith("/var/run/") else \
            text.rstrip("/")

    wanted = canonical(str(cdi_dir))
    return any(canonical(str(item)) == wanted for item in dirs)
