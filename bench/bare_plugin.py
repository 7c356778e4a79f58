"""The floor the device plugin's start is measured against: a bare grpc.aio device plugin, in the same run.

It imports only grpc and the generated stubs, serves one resource with a fixed list, and registers: what any
Python device plugin pays before doing anything of its own. Usage: bare_plugin.py DEVICE_PLUGIN_DIR RESOURCE.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from gpuppetti._proto.deviceplugin.v1beta1 import api_pb2 as pb
from gpuppetti._proto.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc


class Bare(pb_grpc.DevicePluginServicer):
    async def GetDevicePluginOptions(
        self, request: pb.Empty, context: grpc.aio.ServicerContext
    ) -> pb.DevicePluginOptions:
        return pb.DevicePluginOptions()

    async def ListAndWatch(self, request: pb.Empty, context: grpc.aio.ServicerContext
                           ) -> AsyncIterator[pb.ListAndWatchResponse]:
        yield pb.ListAndWatchResponse(devices=[pb.Device(ID=f"dev-{n}", health="Healthy") for n in range(8)])
        await asyncio.Event().wait()


async def main(directory: Path, resource: str) -> None:
    server = grpc.aio.server()
    pb_grpc.add_DevicePluginServicer_to_server(Bare(), server)
    server.add_insecure_port(f"unix:{directory / 'bare.sock'}")
    await server.start()
    async with grpc.aio.insecure_channel(f"unix:{directory / 'kubelet.sock'}") as channel:
        await pb_grpc.RegistrationStub(channel).Register(
            pb.RegisterRequest(version="v1beta1", endpoint="bare.sock", resource_name=resource))
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), sys.argv[2]))
