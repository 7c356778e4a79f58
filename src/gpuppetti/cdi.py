"""CDI (Container Device Interface) specs: rendering container edits, and writing spec files atomically.

Specs declare the lowest ``cdiVersion`` their fields allow: runtimes built with an older CDI library (Debian's
podman 4.3 among them) reject newer versions outright.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gpuppetti.fsutil import atomic_write, make_directory, remove_file
from gpuppetti.model import ContainerEdits

DEFAULT_KIND = "gpu.gpuppetti.dev/gpu"
VERSIONS = ("0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0")


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


def spec_prefix(kind: str) -> str:
    vendor, _, cls = kind.partition("/")
    return f"{vendor}-{cls}"


def spec_filename(kind: str, identifier: str | None = None) -> str:
    """``<vendor>-<class>.json``, or ``<vendor>-<class>_<id>.json`` for a transient spec, as CDI names them."""
    return f"{spec_prefix(kind)}_{identifier}.json" if identifier else f"{spec_prefix(kind)}.json"


def _encode(spec: dict[str, Any]) -> bytes:
    # Compact: the C encoder writes it; the indenting one is pure Python.
    return json.dumps(spec, sort_keys=True, separators=(",", ":")).encode() + b"\n"


def write_spec(directory: Path, filename: str, spec: dict[str, Any]) -> Path:
    """Atomically, since runtimes read specs at any moment; not durably, since /var/run/cdi is tmpfs anyway and
    every writer here re-creates its specs when it starts (the DRA driver from its checkpoint). Readable by the
    runtime whatever the umask."""
    path = directory / filename
    atomic_write(path, _encode(spec), mode=0o644, durable=False)
    return path


def write_specs(directory: Path, specs: Mapping[str, dict[str, Any]]) -> dict[str, OSError]:
    """Write many specs (by file name) into one directory; returns the error of each that failed. A DRA call can
    carry a thousand claims, so the directory is made sure of once and paths stay strings. Each spec is renamed
    into place from a temporary file beside it: runtimes' CDI caches refresh on a rename (or a write) in the
    directory, not on a file merely appearing (neither linked in from O_TMPFILE nor moved in from elsewhere)."""
    try:
        make_directory(directory)
    except OSError as exc:
        return dict.fromkeys(specs, exc)
    base = os.fspath(directory)
    failed: dict[str, OSError] = {}
    for filename, spec in specs.items():
        try:
            atomic_write(f"{base}/{filename}", _encode(spec), mode=0o644, durable=False, make_parent=False)
        except OSError as exc:
            failed[filename] = exc
    return failed


def remove_spec(directory: Path, filename: str) -> None:
    remove_file(directory / filename)
