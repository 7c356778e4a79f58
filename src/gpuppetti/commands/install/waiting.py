"""How ``gpuppetti install`` waits for the GPUs to be served: the daemon's pods ready, and their resources
allocatable (device plugin) or their devices published (DRA); or a daemon's own words for why they are not."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Collection, Iterable, Sequence
from typing import Any

from gpuppetti.commands import manifests
from gpuppetti.commands.install.cluster import InstallApi
from gpuppetti.commands.install.errors import InstallError
from gpuppetti.commands.install.settings import Settings
from gpuppetti.core.config import parse_config
from gpuppetti.node.kube import ApiError

# How long a daemon pod may run without serving a GPU before its log is read for why.
GRACE_S = 20.0


def served_names(config: str | None) -> frozenset[str]:
    """The extended resources the device plugin may advertise with ``config``: every vendor's default name, the
    config's own names and renames, and the names renameByDefault gives."""
    names = set(manifests.ALL_RESOURCES)
    if config is not None:
        for entry in parse_config(config, "the config").sharing.time_slicing.resources:
            names |= {entry.name, *([entry.rename] if entry.rename else [])}
    return frozenset(names | {f"{name}.shared" for name in names})


def extended_resources(node: dict[str, Any], names: Collection[str]) -> dict[str, int]:
    """A node's allocatable resources among ``names``, with a count."""
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    found = {}
    for name, value in allocatable.items():
        if name in names:
            with contextlib.suppress(ValueError):
                if int(str(value)) > 0:
                    found[name] = int(str(value))
    return found


def ready_nodes(pods: Iterable[dict[str, Any]]) -> set[str]:
    """The nodes whose daemon pod is Ready: registered with the kubelet (and for DRA, its slices published)."""
    return {str((pod.get("spec") or {}).get("nodeName")) for pod in pods
            if any(condition.get("type") == "Ready" and condition.get("status") == "True"
                   for condition in (pod.get("status") or {}).get("conditions") or [])}


def slice_devices(slices: Iterable[dict[str, Any]], nodes: Iterable[str]) -> dict[str, int]:
    """How many devices the driver publishes for each of ``nodes``."""
    wanted = set(nodes)
    counts: dict[str, int] = {}
    for item in slices:
        spec = item.get("spec") or {}
        node = spec.get("nodeName")
        if node in wanted:
            counts[node] = counts.get(node, 0) + len(spec.get("devices") or [])
    return {node: count for node, count in counts.items() if count}


def daemon_problem(pod: dict[str, Any], log: str | None) -> str | None:
    """Why a daemon's pod serves nothing, from its status and its log; None where it may yet."""
    node = (pod.get("spec") or {}).get("nodeName") or "?"
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        waiting = (status.get("state") or {}).get("waiting") or {}
        reason = waiting.get("reason", "")
        if reason in ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"):
            return (f"node {node} cannot get the image {status.get('image')}: {reason}: "
                    f"{waiting.get('message', '').strip()}".rstrip(": "))
        if reason == "CrashLoopBackOff" and log:
            return f"the daemon on node {node} keeps exiting; its last line: {log.strip().splitlines()[-1]}"
    if log and "no GPUs found" in log:
        looked = [line.strip() for line in log.split("no GPUs found", 1)[1].splitlines()[1:]
                  if line.startswith("  ")]
        where = f" (looked at: {'; '.join(looked)})" if looked else ""
        return f"the daemon on node {node} found no GPUs{where}"
    return None


async def wait_served(api: InstallApi, settings: Settings, nodes: Sequence[str], names: Collection[str]
                      ) -> dict[str, str]:
    """What each of ``nodes`` serves, once one does; a daemon's problem or the timeout ends it. Raises
    InstallError."""
    deadline = time.monotonic() + settings.timeout
    component = manifests.COMPONENTS[settings.mode]
    running_since: dict[str, float] = {}
    while True:
        try:
            pods = await api.pods(settings.namespace, {"app.kubernetes.io/component": component})
            # Only where gpuppetti's own pod is ready: another plugin's resources on a node are not its.
            ready = ready_nodes(pods)
            served = await _served(api, settings.mode, [node for node in nodes if node in ready], names)
            if served:
                return served
            for pod in pods:
                name = pod["metadata"]["name"]
                if (pod.get("status") or {}).get("phase") == "Running":
                    running_since.setdefault(name, time.monotonic())
                log = None
                if time.monotonic() - running_since.get(name, time.monotonic()) > GRACE_S:
                    with contextlib.suppress(ApiError):
                        log = await api.log(settings.namespace, name)
                if (problem := daemon_problem(pod, log)) is not None:
                    raise InstallError(problem)
        except ApiError as exc:
            raise InstallError(str(exc)) from None
        if time.monotonic() > deadline:
            raise InstallError(f"no GPU served within {settings.timeout:g}s on {', '.join(nodes)}: see `kubectl -n "
                               f"{settings.namespace} describe daemonset gpuppetti-{component}` and its pods' logs")
        await asyncio.sleep(0.5)


async def _served(api: InstallApi, mode: manifests.Mode, nodes: Sequence[str], names: Collection[str]
                  ) -> dict[str, str]:
    if mode == "dra":
        return {node: f"{count} device{'s' if count != 1 else ''} of {manifests.DRIVER}"
                for node, count in slice_devices(await api.slices(), nodes).items()}
    served = {}
    for node in nodes:
        resources = extended_resources(await api.node(node), names)
        if resources:
            served[node] = ", ".join(f"{name}={count}" for name, count in sorted(resources.items()))
    return served
