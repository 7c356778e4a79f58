"""The floor the DRA driver is measured against: a minimal Python DRA driver, in the same run.

It does what any Python DRA driver must and nothing more: grpc.aio serving DRAPlugin v1 and the plugin watcher's
registration, lightkube (the driver's client) for the API, its pool published as ResourceSlices of 128 devices
with a GPU's attributes and capacity once the kubelet has registered it, and a prepared claim as a CDI spec file.
No config, discovery, sharing, checkpoint, metrics or health. Usage:

    bare_driver.py DEVICES NODE REGISTRY_DIR PLUGINS_DIR CDI_DIR KUBECONFIG
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path
from typing import Any

import grpc
from lightkube import AsyncClient, KubeConfig
from lightkube.generic_resource import create_global_resource, create_namespaced_resource

from gpuppetti._proto.dra.v1 import api_pb2 as dra
from gpuppetti._proto.dra.v1 import api_pb2_grpc as dra_grpc
from gpuppetti._proto.pluginregistration.v1 import api_pb2 as reg
from gpuppetti._proto.pluginregistration.v1 import api_pb2_grpc as reg_grpc

DRIVER = "gpu.gpuppetti.dev"
PER_SLICE = 128
Slice = create_global_resource("resource.k8s.io", "v1", "ResourceSlice", "resourceslices")
Claim = create_namespaced_resource("resource.k8s.io", "v1", "ResourceClaim", "resourceclaims")
Node = create_global_resource("", "v1", "Node", "nodes")


def device(n: int) -> dict[str, Any]:
    return {"name": f"gpu-apple-{n}", "attributes": {
        "vendor": {"string": "apple"}, "model": {"string": "Apple M3 Max"}, "uuid": {"string": f"sim-{n}"},
        "index": {"int": n}, "backend": {"string": "simulated"}, "driverVersion": {"version": "0.1.0"},
        "cores": {"int": 40}}, "capacity": {"memory": {"value": "48Gi"}, "cores": {"value": "40"}}}


class Driver(dra_grpc.DRAPluginServicer, reg_grpc.RegistrationServicer):
    def __init__(self, devices: int, node: str, cdi_dir: Path, kube: AsyncClient, socket: Path) -> None:
        self.devices, self.node, self.cdi_dir, self.kube, self.socket = devices, node, cdi_dir, kube, socket
        self.registered = asyncio.Event()

    async def GetInfo(self, request: reg.InfoRequest, context: Any) -> reg.PluginInfo:
        return reg.PluginInfo(type="DRAPlugin", name=DRIVER, endpoint=str(self.socket),
                              supported_versions=["v1.DRAPlugin"])

    async def NotifyRegistrationStatus(self, request: reg.RegistrationStatus, context: Any
                                       ) -> reg.RegistrationStatusResponse:
        if request.plugin_registered:
            self.registered.set()
        return reg.RegistrationStatusResponse()

    async def NodePrepareResources(self, request: dra.NodePrepareResourcesRequest, context: Any
                                   ) -> dra.NodePrepareResourcesResponse:
        answer = dra.NodePrepareResourcesResponse()
        wanted: dict[str, set[str]] = {}
        for claim in request.claims:
            wanted.setdefault(claim.namespace, set()).add(claim.name)
        found: dict[tuple[str, str], Any] = {}
        for namespace, names in wanted.items():
            async for item in self.kube.list(Claim, namespace=namespace, chunk_size=500):
                name = item.metadata.name if item.metadata else None
                if name in names:
                    found[(namespace, str(name))] = item
        for claim in request.claims:
            item = found[(claim.namespace, claim.name)]
            results = item.status["allocation"]["devices"]["results"]
            name = f"claim-{claim.uid}"
            spec = {"cdiVersion": "0.6.0", "kind": f"{DRIVER}/claim", "devices": [
                {"name": name, "containerEdits": {"env": [f"GPU_DEVICE={r['device']}" for r in results]}}]}
            (self.cdi_dir / f"{DRIVER}-{name}.json").write_text(json.dumps(spec))
            devices = [dra.Device(request_names=[r["request"]], pool_name=r["pool"], device_name=r["device"],
                                  cdi_device_ids=[f"{DRIVER}/claim={name}"]) for r in results]
            answer.claims[claim.uid].devices.extend(devices)
        return answer

    async def NodeUnprepareResources(self, request: dra.NodeUnprepareResourcesRequest, context: Any
                                     ) -> dra.NodeUnprepareResourcesResponse:
        answer = dra.NodeUnprepareResourcesResponse()
        for claim in request.claims:
            (self.cdi_dir / f"{DRIVER}-claim-{claim.uid}.json").unlink(missing_ok=True)
            answer.claims[claim.uid].CopyFrom(dra.NodeUnprepareResourceResponse())
        return answer

    async def publish(self) -> None:
        await self.registered.wait()
        node = await self.kube.get(Node, self.node)
        uid = node.metadata.uid if node.metadata else None
        owner = {"apiVersion": "v1", "kind": "Node", "name": self.node, "uid": uid, "controller": True}
        count = (self.devices + PER_SLICE - 1) // PER_SLICE
        limit = asyncio.Semaphore(4)

        async def write(number: int) -> None:
            async with limit:
                start = number * PER_SLICE
                await self.kube.create(Slice.from_dict({
                    "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                    "metadata": {"name": f"{self.node}-{DRIVER}-{number}", "ownerReferences": [owner]},
                    "spec": {"driver": DRIVER, "nodeName": self.node,
                             "pool": {"name": self.node, "generation": 1, "resourceSliceCount": count},
                             "devices": [device(n) for n in range(start, min(start + PER_SLICE, self.devices))]}}))

        await asyncio.gather(*(write(n) for n in range(count)))


async def main(devices: int, node: str, registry: Path, plugins: Path, cdi_dir: Path, kubeconfig: Path) -> None:
    kube = AsyncClient(KubeConfig.from_file(kubeconfig), field_manager="bare")
    driver = Driver(devices, node, cdi_dir, kube, plugins / DRIVER / "dra.sock")
    driver.socket.parent.mkdir(parents=True, exist_ok=True)
    cdi_dir.mkdir(parents=True, exist_ok=True)
    service = grpc.aio.server()
    dra_grpc.add_DRAPluginServicer_to_server(driver, service)
    service.add_insecure_port(f"unix:{driver.socket}")
    await service.start()
    registration = grpc.aio.server()
    reg_grpc.add_RegistrationServicer_to_server(driver, registration)
    registration.add_insecure_port(f"unix:{registry / f'{DRIVER}-reg.sock'}")
    await registration.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    publishing = asyncio.create_task(driver.publish())
    await stop.wait()
    publishing.cancel()
    await registration.stop(None)
    await service.stop(None)


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), sys.argv[2], *(Path(a) for a in sys.argv[3:7])))
