"""``IdentityService``: the server proves it holds the secret it was started with.

Served only when ``serve_in_process`` is given an ``identity_secret`` (the vLLM worker
draws one per rank); the scheduler checks the proof before it trusts a published address
(``kvdefrag.common.identity`` has the protocol).
"""

from __future__ import annotations

from typing import Any

import grpc

from kvdefrag.common import InvalidArgument
from kvdefrag.common.identity import MAX_NONCE_BYTES, MIN_NONCE_BYTES, identity_proof
from kvdefrag.v1 import identity_pb2 as pb
from kvdefrag.v1 import identity_pb2_grpc as pb_grpc

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["IdentityService"].full_name


def check_secret(secret: bytes) -> bytes:
    """Returns ``secret`` if it can serve as an identity secret.

    Raises:
        InvalidArgument: It is not bytes, or shorter than 16 bytes.
    """
    if not isinstance(secret, bytes) or len(secret) < MIN_NONCE_BYTES:
        raise InvalidArgument(
            f"identity_secret must be at least {MIN_NONCE_BYTES} random bytes "
            "(secrets.token_bytes(32))"
        )
    return secret


class IdentityServicer:
    """Answers every nonce with its proof for one secret; holds no other state."""

    def __init__(self, secret: bytes) -> None:
        self._secret = check_secret(secret)

    def ProveIdentity(
        self, request: pb.ProveIdentityRequest, context: grpc.ServicerContext
    ) -> pb.ProveIdentityResponse:
        if not MIN_NONCE_BYTES <= len(request.nonce) <= MAX_NONCE_BYTES:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the nonce must be {MIN_NONCE_BYTES} to {MAX_NONCE_BYTES} bytes, got "
                f"{len(request.nonce)}",
            )
        return pb.ProveIdentityResponse(proof=identity_proof(self._secret, request.nonce))


def add_identity_service(secret: bytes, server: Any) -> None:
    """Registers ``IdentityService`` for ``secret`` on ``server``."""
    pb_grpc.add_IdentityServiceServicer_to_server(IdentityServicer(secret), server)
