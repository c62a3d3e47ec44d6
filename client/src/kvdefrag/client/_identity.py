"""Asking a server to prove it holds a secret (``IdentityService``), before trusting it.

A worker that publishes its address publishes a secret with it; whoever reads the address
sends a fresh nonce and compares the server's proof with the one the secret gives
(``kvdefrag.common.identity``). An address that another process serves (a port the rank
published and lost, a stale record) then fails the check instead of being stepped.
"""

from __future__ import annotations

import hmac
import secrets

import grpc

from kvdefrag.client._channel import open_channel
from kvdefrag.common import ServiceUnavailable
from kvdefrag.common.identity import identity_proof
from kvdefrag.v1 import identity_pb2, identity_pb2_grpc

__all__ = ["identity_refusal"]

_NONCE_BYTES = 32
_MAX_MESSAGE_BYTES = 1 << 16


def identity_refusal(
    address: str,
    secret: bytes,
    *,
    timeout_s: float = 10.0,
    root_certificates: bytes | None = None,
    private_key: bytes | None = None,
    certificate_chain: bytes | None = None,
) -> str | None:
    """Asks the server at ``address`` to prove it holds ``secret``.

    Args:
        address: The server's gRPC address (``unix:/path`` or ``host:port``).
        secret: The secret the server should hold.
        timeout_s: How long to wait for the server (it may still be starting).
        root_certificates, private_key, certificate_chain: TLS, as ``DefragClient``.

    Returns:
        None when the proof matches; ``"mismatch"`` when the server proved another
        secret; otherwise the status it answered instead of a proof (``"UNIMPLEMENTED"``:
        it serves no ``IdentityService``).

    Raises:
        ServiceUnavailable: Nobody answered within ``timeout_s``.
    """
    nonce = secrets.token_bytes(_NONCE_BYTES)
    channel = open_channel(
        address,
        max_message_bytes=_MAX_MESSAGE_BYTES,
        root_certificates=root_certificates,
        private_key=private_key,
        certificate_chain=certificate_chain,
    )
    with channel:
        stub = identity_pb2_grpc.IdentityServiceStub(channel)
        try:
            reply = stub.ProveIdentity(
                identity_pb2.ProveIdentityRequest(nonce=nonce),
                timeout=timeout_s,
                wait_for_ready=True,
            )
        except grpc.RpcError as err:
            code = err.code() if isinstance(err, grpc.Call) else None
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                details = err.details() if isinstance(err, grpc.Call) else err
                raise ServiceUnavailable(
                    f"service at {address} did not answer within {timeout_s:g} s: {details}"
                ) from None
            return code.name if code is not None else type(err).__name__
    if not hmac.compare_digest(reply.proof, identity_proof(secret, nonce)):
        return "mismatch"
    return None
