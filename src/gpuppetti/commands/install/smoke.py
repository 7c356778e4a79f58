"""The smoke pod: one slice asked for, and what the layer shows of it printed; how ``gpuppetti install`` runs it."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from gpuppetti.commands import manifests
from gpuppetti.commands.install.cluster import InstallApi
from gpuppetti.commands.install.errors import InstallError
from gpuppetti.commands.install.settings import Settings
from gpuppetti.node.kube import ApiError

SMOKE_POD = "gpuppetti-smoke"
# The probe the layer mounts into every container given a slice; it prints the Vulkan devices as the layer shows
# them: the slice's memory as the heap, with its budget. It needs the image's Vulkan loader and glibc.
VKINFO = "/usr/local/bin/gpuppetti-vkinfo"
SMOKE_SCRIPT = (
    f"env | grep '^GPUPPETTI_' | sort; echo '--- gpuppetti-vkinfo'; if [ -e {VKINFO} ]; then {VKINFO} 2>&1 || "
    "echo 'gpuppetti-vkinfo could not run: this image has no Vulkan loader (or glibc older than 2.34); "
    "--smoke-image IMAGE picks one that has'; else echo 'gpuppetti-vkinfo is not mounted: this slice is not held "
    "by the layer (a whole GPU, or enforcement off: see GPUPPETTI_LIMITS)'; fi")
# A busybox for the smoke pod's env; the Mac's VM gets the image with the patched Mesa its Venus needs.
SMOKE_IMAGE = "busybox:1.36"
KRUNKIT_SMOKE_IMAGE = "quay.io/slopezpa/fedora-vgpu"


def smoke_objects(settings: Settings, resource: str | None, image: str) -> list[dict[str, Any]]:
    """The smoke pod that asks for one slice (and for DRA, the claim template it asks through)."""
    container: dict[str, Any] = {"name": "smoke", "image": image, "command": ["sh", "-c", SMOKE_SCRIPT]}
    spec: dict[str, Any] = {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1, "containers": [container]}
    metadata = {"name": SMOKE_POD, "namespace": settings.namespace, "labels": dict(manifests.LABELS)}
    objects: list[dict[str, Any]] = []
    if settings.mode == "dra":
        objects.append({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": dict(metadata),
            "spec": {"spec": {"devices": {"requests": [
                {"name": "gpu", "exactly": {"deviceClassName": manifests.DRIVER}}]}}}})
        container["resources"] = {"claims": [{"name": "gpu"}]}
        spec["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": SMOKE_POD}]
    else:
        container["resources"] = {"limits": {resource: 1}}
    objects.append({"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec})
    return objects


async def run_smoke(api: InstallApi, settings: Settings, resource: str | None, image: str) -> str:
    """Run the smoke pod on ``resource`` (the device plugin's) or a claim (DRA) until it ends; returns what it
    printed. Raises InstallError."""
    objects = smoke_objects(settings, resource, image)
    try:
        # A smoke pod of an earlier install goes first: a pod's spec cannot be changed.
        for obj in reversed(objects):
            await api.delete(obj)
        deadline = time.monotonic() + settings.timeout
        while await api.pod(settings.namespace, SMOKE_POD) is not None:
            if time.monotonic() > deadline:
                raise InstallError(f"the smoke pod of an earlier install is still going after {settings.timeout:g}s")
            await asyncio.sleep(0.5)
        for obj in objects:
            await api.apply(obj)
        while True:
            pod = await api.pod(settings.namespace, SMOKE_POD) or {}
            status = pod.get("status") or {}
            if status.get("phase") in ("Succeeded", "Failed"):
                log = await api.log(settings.namespace, SMOKE_POD)
                if status["phase"] == "Failed":
                    raise InstallError(f"the smoke pod failed: {log.strip().splitlines()[-1] if log.strip() else ''}")
                return log
            if time.monotonic() > deadline:
                why = "; ".join(f"{c.get('reason')}: {c.get('message')}" for c in status.get("conditions") or []
                                if c.get("status") == "False" and c.get("message"))
                raise InstallError(f"the smoke pod did not finish within {settings.timeout:g}s"
                                   + (f" ({why})" if why else "") + f": kubectl -n {settings.namespace} describe pod "
                                   f"{SMOKE_POD}")
            await asyncio.sleep(0.5)
    except ApiError as exc:
        raise InstallError(str(exc)) from None
