"""The client's error mapping: a grpc error becomes the shared class its metadata names."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from kvdefrag.client import (
    DefragError,
    EngineUnhealthy,
    EpochMismatch,
    InvalidArgument,
    MessageTooLarge,
    NotFound,
    OutOfOrder,
    ServiceUnavailable,
    _convert,
)


class FakeRpcError(grpc.RpcError):
    """An RpcError as grpc raises them: code, details and trailing metadata."""

    def __init__(self, code: grpc.StatusCode, details: str, name: str | None = None) -> None:
        super().__init__(details)
        self._code, self._details = code, details
        self._metadata = ((_convert.ERROR_METADATA_KEY, name),) if name else ()

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> Any:
        return self._metadata


@pytest.mark.parametrize(
    ("code", "name", "expected"),
    [
        (grpc.StatusCode.FAILED_PRECONDITION, "EpochMismatch", EpochMismatch),
        (grpc.StatusCode.FAILED_PRECONDITION, "OutOfOrder", OutOfOrder),
        (grpc.StatusCode.UNAVAILABLE, "EngineUnhealthy", EngineUnhealthy),
        (grpc.StatusCode.INVALID_ARGUMENT, None, InvalidArgument),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, None, MessageTooLarge),
        (grpc.StatusCode.NOT_FOUND, None, NotFound),
        (grpc.StatusCode.UNAVAILABLE, None, ServiceUnavailable),
        (grpc.StatusCode.DEADLINE_EXCEEDED, None, ServiceUnavailable),
        (grpc.StatusCode.FAILED_PRECONDITION, None, DefragError),
        (grpc.StatusCode.INTERNAL, "NoSuchClass", DefragError),
    ],
)
def test_rpc_errors_map_to_the_shared_classes_metadata_first(
    code: grpc.StatusCode, name: str | None, expected: type[DefragError]
) -> None:
    error = _convert.defrag_error(FakeRpcError(code, "what went wrong", name), "ctx")

    assert type(error) is expected
    assert str(error).startswith("ctx: what went wrong")
    assert _convert.is_transport_failure(FakeRpcError(code, "x", name)) == (
        code == grpc.StatusCode.UNAVAILABLE and name is None
    )
