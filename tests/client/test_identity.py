"""``identity_refusal``: a server proves it holds a secret before the caller trusts it."""

from __future__ import annotations

import pytest

from kvdefrag.client import ServiceUnavailable, identity_refusal
from kvdefrag.common.identity import IDENTITY_SECRET_BYTES

from support.server import Serve

SECRET = bytes([7]) * IDENTITY_SECRET_BYTES
OTHER = bytes([8]) * IDENTITY_SECRET_BYTES


def test_the_server_holding_the_secret_proves_it(serve: Serve) -> None:
    handle = serve(identity_secret=SECRET)
    assert identity_refusal(handle.address, SECRET) is None


def test_another_secret_or_none_is_named(serve: Serve) -> None:
    assert identity_refusal(serve(identity_secret=OTHER).address, SECRET) == "mismatch"
    assert identity_refusal(serve(identity_secret=None).address, SECRET) == "UNIMPLEMENTED"


def test_nobody_answering_is_service_unavailable(tmp_path: object) -> None:
    with pytest.raises(ServiceUnavailable, match="did not answer within 1 s"):
        identity_refusal(f"unix:{tmp_path}/nobody.sock", SECRET, timeout_s=1.0)
