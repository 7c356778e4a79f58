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

from gpuppetti.base.fsutil import atomic_write, make_directory, remove_file
from gpuppetti.core.model import ContainerEdits

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
    if edits.hooks:
        hooks = []
        for hook in edits.hooks:
            entry = {"hookName": hook.hook_name, "path": hook.path}
            if hook.args:
                entry["args"] = list(hook.args)
            if hook.env:
                entry["env"] = list(hook.env)
            if hook.timeout is not None:
                entry["timeout"] = hook.timeout
            hooks.append(entry)
        rendered["hooks"] = hooks
    return rendered


def minimum_version(spec: dict[str, Any]) -> str:
    """The lowest cdiVersion whose schema admits every field ``spec`` uses."""
    needs: list[str] = []
    _, _, cls = str(spec.get("kind", "")).partition("/")
    if "." in cls or spec.get("annotations"):
        needs.append("0.6.0")
    edit_sets = [spec.get("containerEdits") or {}]
    for device in spec.get("devices", []):
        edit_sets.append(device.get("containerEdits") or {})
        if device.get("annotations"):
            needs.append("0.6.0")
        if str(device.get("name", ""))[:1].isdigit():
            needs.append("0.5.0")
    for edits in edit_sets:
        # Checked only where there is something to check: a DRA call builds a thousand specs.
        if (nodes := edits.get("deviceNodes")) and any("hostPath" in node for node in nodes):
            needs.append("0.5.0")
        if (mounts := edits.get("mounts")) and any("type" in mount for mount in mounts):
            needs.append("0.4.0")
        if "intelRdt" in edits or "additionalGids" in edits:
            needs.append("0.7.0")
        if "netDevices" in edits:
            needs.append("1.1.0")
    return max(needs, key=VERSIONS.index) if needs else VERSIONS[0]


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


# Compact: the C encoder writes it (the indenting one is pure Python). Made once: json.dumps with options builds an
# encoder on every call, and a DRA call can write a thousand specs. A spec is a tree of plain values: no cycle.
_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), check_circular=False)


def encode_spec(spec: dict[str, Any]) -> str:
    """A spec's canonical JSON: compact, keys sorted. Its file holds this and a newline."""
    return _ENCODER.encode(spec)


def _encode(spec: dict[str, Any]) -> bytes:
    return f"{encode_spec(spec)}\n".encode()


def write_spec(directory: Path, filename: str, spec: dict[str, Any]) -> Path:
    """Atomically, since runtimes read specs at any moment; not durably, since /var/run/cdi is tmpfs anyway and
    every writer here re-creates its specs when it starts (the DRA driver from its checkpoint). Readable by the
    runtime whatever the umask."""
    path = directory / filename
    atomic_write(path, _encode(spec), mode=0o644, durable=False)
    return path


def write_spec_files(directory: Path, files: Mapping[str, bytes]) -> dict[str, OSError]:
    """Write many encoded specs (by file name) into one directory, as write_spec does; returns the error of each
    that failed. A DRA call can carry a thousand claims, so the directory is made sure of once and paths stay
    strings. Each spec is renamed into place from a temporary file beside it: runtimes' CDI caches refresh on a
    rename (or a write) in the directory, not on a file merely appearing (neither linked in from O_TMPFILE nor
    moved in from elsewhere)."""
    try:
        make_directory(directory)
    except OSError as exc:
        return dict.fromkeys(files, exc)
    base = os.fspath(directory)
    failed: dict[str, OSError] = {}
    for filename, data in files.items():
        try:
            atomic_write(f"{base}/{filename}", data, mode=0o644, durable=False, make_parent=False)
        except OSError as exc:
            failed[filename] = exc
    return failed


def remove_spec(directory: Path, filename: str) -> None:
    remove_file(directory / filename)
