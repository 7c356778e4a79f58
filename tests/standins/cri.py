"""A container runtime's CRI socket, as far as ``gpuppetti doctor`` asks it: Version, and verbose Status with the
configuration JSON that containerd puts under ``config``. It answers as the runtime it is told to be."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc

from gpuppetti._proto.cri.v1 import api_pb2 as pb
from gpuppetti._proto.cri.v1 import api_pb2_grpc as pb_grpc


class _Runtime(pb_grpc.RuntimeServiceServicer):
    def __init__(self, name: str, version: str, config: dict[str, Any] | None) -> None:
        self.name, self.version, self.config = name, version, config

    async def Version(self, request: pb.VersionRequest, context: Any) -> pb.VersionResponse:
        return pb.VersionResponse(version="0.1.0", runtime_name=self.name, runtime_version=self.version,
                                  runtime_api_version="v1")

    async def Status(self, request: pb.StatusRequest, context: Any) -> pb.StatusResponse:
        status = pb.RuntimeStatus(conditions=[pb.RuntimeCondition(type="RuntimeReady", status=True),
                                              pb.RuntimeCondition(type="NetworkReady", status=True)])
        info = {"config": json.dumps(self.config)} if request.verbose and self.config is not None else {}
        return pb.StatusResponse(status=status, info=info)


class CriStandIn:
    def __init__(self, socket: Path, name: str, version: str, config: dict[str, Any] | None = None) -> None:
        self.socket = socket
        self._server = grpc.aio.server()
        pb_grpc.add_RuntimeServiceServicer_to_server(_Runtime(name, version, config), self._server)
        self._server.add_insecure_port(f"unix:{socket}")

    async def __aenter__(self) -> CriStandIn:
        await self._server.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._server.stop(None)
