"""The client's gRPC channel: how it is opened and how a unary call is retried on it."""

from __future__ import annotations

import time
from typing import Any

import grpc

from kvdefrag.client import _convert

# Retries of a broken transport wait this long at first, doubling up to the maximum.
BACKOFF_START_S = 0.02
BACKOFF_MAX_S = 0.5


def open_channel(
    address: str,
    *,
    max_message_bytes: int,
    root_certificates: bytes | None,
    private_key: bytes | None,
    certificate_chain: bytes | None,
) -> grpc.Channel:
    """Opens a channel to ``address``; any TLS argument makes it a TLS channel.

    Args:
        address: ``unix:/abs/path.sock`` or ``HOST:PORT``.
        max_message_bytes: Largest message sent or received.
        root_certificates: PEM CA bundle.
        private_key: PEM client key (mTLS).
        certificate_chain: PEM client certificate chain (mTLS).

    Returns:
        The channel, without interceptors.
    """
    options = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # NOTE: a sidecar is local; come back quickly after a restart.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]
    if root_certificates or private_key or certificate_chain:
        credentials = grpc.ssl_channel_credentials(
            root_certificates, private_key, certificate_chain
        )
        return grpc.secure_channel(address, credentials, options)
    return grpc.insecure_channel(address, options)


def call_unary(
    stub: Any,
    method: str,
    request: Any,
    context: str,
    *,
    timeout_s: float,
    is_idempotent: bool = True,
) -> Any:
    """Calls a unary RPC within ``timeout_s``, retrying a broken transport if idempotent.

    NOTE: a call can fail on a connection that broke a moment ago (a cut, a server
    restart) before the channel noticed; reads and Defragment are safe to repeat,
    Reset is not (a second one would start yet another epoch).

    Args:
        stub: The service stub.
        method: The RPC's name (``GetStats``).
        request: The request message.
        context: What the call is for, prefixed to an error's message.
        timeout_s: Deadline of the call, retries included.
        is_idempotent: Whether the call may be repeated after a broken transport.

    Returns:
        The response message.

    Raises:
        DefragError: The server refused the call (the matching subclass), or the
            transport stayed broken until the deadline.
    """
    deadline = time.monotonic() + timeout_s
    backoff_s = BACKOFF_START_S
    while True:
        try:
            return getattr(stub, method)(
                request, timeout=max(deadline - time.monotonic(), 0.0), wait_for_ready=True
            )
        except grpc.RpcError as err:
            if (
                is_idempotent
                and _convert.is_transport_failure(err)
                and time.monotonic() + backoff_s < deadline
            ):
                time.sleep(backoff_s)
                backoff_s = min(2 * backoff_s, BACKOFF_MAX_S)
                continue
            raise _convert.defrag_error(err, context) from err
