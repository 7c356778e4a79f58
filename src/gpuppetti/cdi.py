"""CDI (Container Device Interface) specs: rendering container edits, and writing spec files atomically.

Specs declare the lowest ``cdiVersion`` their fields allow: runtimes built with an older CDI library (Debian's
podman 4.3 among them) reject newer versions outright.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpuppetti.fsutil import atomic_write
from gpuppetti.model import ContainerEdits

DEFAULT_KIND = "gpu.gpuppetti.dev/gpu"
VERSIONS = ("0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0")
_VENDOR = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$")
_CLASS = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")
_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?$")
_ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def qualified_name(kind: str, name: str) -> str:
    return f"{kind}={name}"


def render_edits(edits: ContainerEdits) -> dict[str, Any]:
    rendered: dict[str, Any] = {}
    if edits.env:
        rendered["env"] = [f"{key}={value}" for key, value in edits.env.items()]
    if edits.device_nodes:
        nodes = []
        for node in edits.device_nodes:
            entry: dict[str, Any] = {"path": node.path, "permissions": node.permissions}
            if node.host_path and node.host_path != node.path:
                entry["hostPath"] = node.host_path
            nodes.append(entry)
        rendered["deviceNodes"] = nodes
    if edits.mounts:
        rendered["mounts"] = [
            {"hostPath": m.host_path, "containerPath": m.container_path,
             "options": ["ro" if m.read_only else "rw", "nosuid", "nodev", "bind"]}
            for m in edits.mounts
        ]
    return rendered


def minimum_version(spec: dict[str, Any]) -> str:
    """The lowest cdiVersion whose schema admits every field ``spec`` uses."""
    needed = "0.3.0"

    def need(version: str) -> None:
        nonlocal needed
        if VERSIONS.index(version) > VERSIONS.index(needed):
            needed = version

    _, _, cls = str(spec.get("kind", "")).partition("/")
    if "." in cls or spec.get("annotations"):
        need("0.6.0")
    edit_sets = [spec.get("containerEdits") or {}]
    for device in spec.get("devices", []):
        edit_sets.append(device.get("containerEdits") or {})
        if device.get("annotations"):
            need("0.6.0")
        if str(device.get("name", ""))[:1].isdigit():
            need("0.5.0")
    for edits in edit_sets:
        if any("hostPath" in node for node in edits.get("deviceNodes", [])):
            need("0.5.0")
        if any("type" in mount for mount in edits.get("mounts", [])):
            need("0.4.0")
        if "intelRdt" in edits or "additionalGids" in edits:
            need("0.7.0")
        if "netDevices" in edits:
            need("1.1.0")
    return needed


def build_spec(kind: str, devices: Sequence[tuple[str, ContainerEdits]]) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "cdiVersion": VERSIONS[0],
        "kind": kind,
        "devices": [{"name": name, "containerEdits": render_edits(edits)} for name, edits in devices],
    }
    spec["cdiVersion"] = minimum_version(spec)
    return spec


def spec_problems(spec: dict[str, Any]) -> list[str]:
    """What a CDI runtime would reject in ``spec``, per the CDI spec's rules; empty when it is valid."""
    problems: list[str] = []
    if spec.get("cdiVersion") not in VERSIONS:
        problems.append(f"cdiVersion {spec.get('cdiVersion')!r} is not a known version")
    elif VERSIONS.index(spec["cdiVersion"]) < VERSIONS.index(minimum_version(spec)):
        problems.append(f"cdiVersion {spec['cdiVersion']} is lower than its fields need ({minimum_version(spec)})")
    vendor, slash, cls = str(spec.get("kind", "")).partition("/")
    if not slash or not _VENDOR.match(vendor) or len(vendor) > 253:
        problems.append(f"kind {spec.get('kind')!r} is not vendor/class with a DNS-like vendor")
    if not _CLASS.match(cls) or len(cls) > 63 or len(cls) < 2:
        # One-character classes are legal on paper but crash some runtimes' parsers.
        problems.append(f"class {cls!r} must be 2-63 alphanumerics, '-', '_' or '.'")
    devices = spec.get("devices")
    if not isinstance(devices, list) or not devices:
        problems.append("devices must list at least one device")
        devices = []
    names: set[str] = set()
    for device in devices:
        name = str(device.get("name", ""))
        if not _NAME.match(name):
            problems.append(f"device name {name!r} is not valid")
        if name in names:
            problems.append(f"device name {name!r} is used twice")
        names.add(name)
        if not isinstance(device.get("containerEdits"), dict):
            problems.append(f"device {name!r} needs a containerEdits object")
            continue
        edits = device["containerEdits"]
        problems += [f"device {name!r}: env {e!r} is not KEY=VALUE" for e in edits.get("env", []) if not _ENV.match(e)]
        for node in edits.get("deviceNodes", []):
            if not str(node.get("path", "")).startswith("/"):
                problems.append(f"device {name!r}: device node path {node.get('path')!r} is not absolute")
            if set(str(node.get("permissions", ""))) - set("rwm"):
                problems.append(f"device {name!r}: permissions {node.get('permissions')!r} are not r, w, m")
        for mount in edits.get("mounts", []):
            if not mount.get("hostPath") or not str(mount.get("containerPath", "")).startswith("/"):
                problems.append(f"device {name!r}: mount {mount!r} needs hostPath and an absolute containerPath")
    return problems


def spec_prefix(kind: str) -> str:
    vendor, _, cls = kind.partition("/")
    return f"{vendor}-{cls}"


def spec_filename(kind: str, identifier: str | None = None) -> str:
    """``<vendor>-<class>.json``, or ``<vendor>-<class>_<id>.json`` for a transient spec, as CDI names them."""
    return f"{spec_prefix(kind)}_{identifier}.json" if identifier else f"{spec_prefix(kind)}.json"


def write_spec(directory: Path, filename: str, spec: dict[str, Any]) -> Path:
    """Atomically, since runtimes read specs at any moment; not durably, since /var/run/cdi is tmpfs anyway and
    every writer here re-creates its specs when it starts (the DRA driver from its checkpoint)."""
    path = directory / filename
    atomic_write(path, json.dumps(spec, indent=2, sort_keys=True).encode() + b"\n", durable=False)
    return path


def remove_spec(directory: Path, filename: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        (directory / filename).unlink()
