"""gRPC server plumbing shared by every gpuppetti service."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError


class _Malformed:
    def __init__(self, reason: str) -> None:
        self.reason = reason


class RejectMalformed(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Answers undecodable request bytes with INVALID_ARGUMENT, naming the method.

    Without it, grpc.aio reports a request that fails to parse as UNKNOWN, which tells a caller nothing.
    """

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], details: Any
    ) -> Any:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None or handler.request_streaming:
            return handler
        deserialize = handler.request_deserializer
        method = details.method

        def safe(data: bytes) -> Any:
            try:
                return deserialize(data)
            except DecodeError as exc:
                return _Malformed(str(exc))

        async def reject(request: _Malformed, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: malformed request: {request.reason}")

        if handler.response_streaming:
            stream = handler.unary_stream

            async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                if isinstance(request, _Malformed):
                    await reject(request, context)
                async for item in stream(request, context):
                    yield item

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, request_deserializer=safe, response_serializer=handler.response_serializer)
        unary = handler.unary_unary

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Malformed):
                await reject(request, context)
            return await unary(request, context)

        return grpc.unary_unary_rpc_method_handler(
            unary_unary, request_deserializer=safe, response_serializer=handler.response_serializer)


def new_server() -> grpc.aio.Server:
    return grpc.aio.server(interceptors=[RejectMalformed()])
