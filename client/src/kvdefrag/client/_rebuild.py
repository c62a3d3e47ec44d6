"""The mirror's rebuild: a client adopts a server's state by fetching its tables."""

from __future__ import annotations

from typing import Any

from kvdefrag.client import _convert
from kvdefrag.client._channel import call_unary
from kvdefrag.client._mirror import Mirror
from kvdefrag.client._types import SessionInfo
from kvdefrag.common import InvalidArgument, MirrorDiverged, StalePageToken

# Resolve at most this many ids per call when rebuilding the mirror (keeps messages small;
# the server takes at most num_blocks per call, which a chunk never exceeds).
_RESOLVE_CHUNK = 1 << 18
# A listing that a step or a reset invalidated starts again at most this many times.
_MAX_LISTING_RESTARTS = 2


def fetch_requests(
    stub: Any, context: str, *, timeout_s: float
) -> tuple[int, dict[str, list[int]]]:
    """Fetches every running request from the server, page by page (``ListRequests``).

    Args:
        stub: The service stub.
        context: What the listing is for, prefixed to an error's message.
        timeout_s: Deadline of each call.

    Returns:
        The epoch the requests belong to, and request id -> logical block ids.

    Raises:
        StalePageToken: Steps or resets kept changing the requests between pages.
        DefragError: A call failed.
    """
    for restart in range(_MAX_LISTING_RESTARTS + 1):
        requests: dict[str, list[int]] = {}
        token = ""
        try:
            while True:
                epoch, page, token = _convert.request_page(
                    call_unary(
                        stub,
                        "ListRequests",
                        _convert.list_requests_request(token),
                        context,
                        timeout_s=timeout_s,
                    )
                )
                requests.update(page)
                if not token:
                    return epoch, requests
        except StalePageToken:
            if restart == _MAX_LISTING_RESTARTS:
                raise
    raise AssertionError("unreachable: the last restart returns or raises")


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
    epoch, requests = fetch_requests(stub, "rebuild mirror", timeout_s=timeout_s)
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
