"""The client's gRPC channel: how it is opened and how a unary call is retried on it."""

from __future__ import annotations

import time
from typing import Any

import grpc

from kvdefrag.client import _convert

# Retries of a broken transport wait this long at first, doubling up to the maximum.
BACKOFF_START_S = 0.02
BACKOFF_MAX_S = 0.5
# A dead peer is noticed within KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS (10 s).
KEEPALIVE_TIME_MS = 5_000
KEEPALIVE_TIMEOUT_MS = 5_000


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """The client channel's options: message limits, quick reconnects, keepalive."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # NOTE: a sidecar is local; come back quickly after a restart.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
        # NOTE: on a half-open TCP connection (a peer or a middlebox gone silent) every
        # call would wait on it forever; a ping unanswered for KEEPALIVE_TIMEOUT_MS
        # closes it, the call fails UNAVAILABLE and the session reconnects. The stream
        # is open but quiet between steps, so ping without calls and without data;
        # the server's ping policy (kvdefrag.server grpc_options) allows this interval.
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        # NOTE: gRPC closes the connection when a ping goes unanswered for this long
        # (60 s by default), whatever keepalive_timeout_ms says.
        ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


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
    options = channel_options(max_message_bytes)
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
