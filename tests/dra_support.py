"""The DRA test bench: the API stand-in, the kubelet's DRA side, and the driver, in the test's event loop or as a
process of its own."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from tests.helpers import TWO_M3_MAX, Daemon, DaemonProcess, short_tmpdir
from tests.inprocess import InProcessDaemon
from tests.standins.apiserver import ApiStandIn
from tests.standins.dra_kubelet import ClaimKey, DraKubelet

DRIVER = "gpu.gpuppetti.dev"
NODE = "node1"
KUBERNETES_VERSIONS = ("1.34", "1.35")


def validate(obj: dict[str, Any]) -> None:
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)


@dataclass
class Cluster:
    root: Path
    api: ApiStandIn
    kubelet: DraKubelet
    kubeconfig: Path
    started: list[Daemon]

    @property
    def cdi_dir(self) -> Path:
        return self.root / "cdi"

    @property
    def plugin_dir(self) -> Path:
        return self.root / "plugins" / DRIVER

    def start_driver(self, config_text: str | None = TWO_M3_MAX, api_timeout: float | None = None,
                     umask: int | None = None, own_process: bool = False, open_files: int | None = None,
                     instance: str | None = None) -> Daemon:
        """The driver in the test's event loop, or in a process of its own where the test needs one
        (``own_process``, or a ``umask`` or a soft limit on ``open_files`` for that process)."""
        args = ["dra", "--node-name", NODE, "--registry-dir", str(self.root / "registry"),
                "--plugins-dir", str(self.root / "plugins"), "--cdi-dir", str(self.cdi_dir),
                "--kubeconfig", str(self.kubeconfig)]
        if api_timeout is not None:
            args += ["--api-timeout", str(api_timeout)]
        if instance is not None:
            args += ["--instance", instance]
        name = f"dra-{len(self.started)}"
        driver: Daemon
        if own_process or umask is not None or open_files is not None:
            driver = DaemonProcess(args, config_text, self.root, name, umask=umask, open_files=open_files)
        else:
            driver = InProcessDaemon(args, config_text, self.root, name)
        self.started.append(driver)
        return driver

    def slices(self) -> list[dict[str, Any]]:
        return self.api.list("resourceslices")

    def devices(self) -> dict[str, dict[str, Any]]:
        return {d["name"]: d for s in self.slices() for d in s["spec"].get("devices", [])}

    async def wait_slices(self, predicate: Callable[[list[dict[str, Any]]], bool], timeout: float = 10) -> None:
        async with asyncio.timeout(timeout):
            while not predicate(self.slices()):
                await asyncio.sleep(0.02)

    async def allocate(self, name: str, results: list[dict[str, Any]], config: list[dict[str, Any]] | None = None,
                       namespace: str = "default") -> ClaimKey:
        """Play the scheduler: a claim with its allocation written into the status."""
        requests = sorted({r["request"].split("/")[0] for r in results})
        claim = await self.api.create("resourceclaims", {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"devices": {"requests": [
                {"name": r, "exactly": {"deviceClassName": DRIVER}} for r in requests
            ]}},
        }, namespace)
        claim["status"] = {
            "allocation": {"devices": {"results": [{"driver": DRIVER, "pool": NODE, **r} for r in results],
                                       "config": config or []}},
            "reservedFor": [{"resource": "pods", "name": f"{name}-pod", "uid": "0b6c1a9e-pod"}],
        }
        claim = await self.api.update("resourceclaims", claim, namespace, status=True)
        return ClaimKey(namespace, name, claim["metadata"]["uid"])


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    root = short_tmpdir("gp-dra-")
    api = ApiStandIn(validate=validate)
    await api.start()
    await api.create("nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
    kubeconfig = root / "kubeconfig"
    kubeconfig.write_text(api.kubeconfig())
    kubelet = DraKubelet(root / "registry", api, NODE)
    await kubelet.start()
    state = Cluster(root, api, kubelet, kubeconfig, [])
    try:
        yield state
    finally:
        for driver in state.started:
            await driver.close()
        await kubelet.stop()
        await api.stop()
        assert api.rejected == [], f"objects failed schema validation: {api.rejected}"
        shutil.rmtree(root, ignore_errors=True)


