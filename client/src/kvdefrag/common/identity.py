"""How a server proves it holds the secret it was started with (``IdentityService``).

Whoever starts a server may give it a secret; whoever it told the secret (and the address)
can then check, before trusting that address, that the server there is the one that was
started, and not a stale file's or another process's::

    caller ── ProveIdentity(nonce: fresh random bytes) ──▶ server
    caller ◀── proof = HMAC-SHA256(secret, DOMAIN || nonce) ── server
    caller: compare_digest(proof, identity_proof(secret, nonce))

The proof reveals nothing about the secret, and a fresh nonce makes an old proof useless.
"""

from __future__ import annotations

import hashlib
import hmac

__all__ = [
    "IDENTITY_SECRET_BYTES",
    "MAX_NONCE_BYTES",
    "MIN_NONCE_BYTES",
    "identity_proof",
]

IDENTITY_SECRET_BYTES = 32
"""Bytes of a secret drawn for one server (``secrets.token_bytes``)."""

MIN_NONCE_BYTES = 16
MAX_NONCE_BYTES = 64

# NOTE: domain separation: a proof is never an HMAC some other protocol would accept.
_DOMAIN = b"kvdefrag-identity-v1\x00"


def identity_proof(secret: bytes, nonce: bytes) -> bytes:
    """The proof of holding ``secret`` for ``nonce``: 32 bytes.

    Example:
        >>> proof = identity_proof(b"s" * 32, b"n" * 16)
        >>> len(proof), proof == identity_proof(b"s" * 32, b"n" * 16)
        (32, True)
        >>> proof == identity_proof(b"t" * 32, b"n" * 16)
        False
    """
    return hmac.new(secret, _DOMAIN + nonce, hashlib.sha256).digest()
