"""What a CDI runtime would reject in a spec, per the CDI spec's rules: the tests' check of every spec written."""

from __future__ import annotations

import re
from typing import Any

from gpuppetti.core.cdi import VERSIONS, minimum_version

_VENDOR = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$")
_CLASS = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")
_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?$")
_ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


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
