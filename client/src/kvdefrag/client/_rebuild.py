"""The mirror's rebuild: a client adopts a server's state by fetching its tables."""

from __future__ import annotations

from typing import Any

from kvdefrag.client import _convert
from kvdefrag.client._channel import call_unary
from kvdefrag.client._mirror import Mirror
from kvdefrag.client._types import SessionInfo
from kvdefrag.common import InvalidArgument, MirrorDiverged

# Resolve at most this many ids per call when rebuilding the mirror (keeps messages small).
_RESOLVE_CHUNK = 1 << 18


def fetch_mirror(stub: Any, info: SessionInfo, *, timeout_s: float) -> Mirror:
    """Builds a mirror from the server's tables (call while holding the session).

    Args:
        stub: The service stub.
        info: What the server said when the session opened: the mirror must match it.
        timeout_s: Deadline of each call.

    Returns:
        A mirror of the server's mapping and requests as of ``info``.

    Raises:
        MirrorDiverged: The tables do not add up to the session's epoch and digest.
        DefragError: A call failed.
    """
    epoch, requests = _convert.request_lists(
        call_unary(
            stub,
            "ListRequests",
            _convert.list_requests_request(),
            "rebuild mirror",
            timeout_s=timeout_s,
        )
    )
    fwd: list[int] = []
    for start in range(0, info.num_blocks, _RESOLVE_CHUNK):
        ids = list(range(start, min(start + _RESOLVE_CHUNK, info.num_blocks)))
        resolve_epoch, physical_ids = _convert.resolved_ids(
            call_unary(
                stub,
                "Resolve",
                _convert.resolve_request(ids),
                "rebuild mirror",
                timeout_s=timeout_s,
            )
        )
        if resolve_epoch != info.epoch:
            epoch = resolve_epoch
        fwd += physical_ids
    if epoch != info.epoch:
        raise MirrorDiverged(
            f"rebuild mirror: the server moved from epoch {info.epoch} to {epoch} "
            "meanwhile (reset by someone else); try again"
        )
    try:
        mirror = Mirror.from_tables(fwd, requests)
    except InvalidArgument as err:
        raise MirrorDiverged(f"rebuild mirror: {err}") from err
    if mirror.digest != info.digest:
        raise MirrorDiverged(
            f"rebuild mirror: the tables' digest {mirror.digest:#018x} differs from the "
            f"server's {info.digest:#018x}"
        )
    return mirror
