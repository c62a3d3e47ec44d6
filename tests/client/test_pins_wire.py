"""Pins over the wire: a real server applies them, an older one is never sent any."""

from __future__ import annotations

from typing import Any

import pytest

from kvdefrag.client import DefragClient
from kvdefrag.common import InvalidArgument, StepEvents
from kvdefrag.server import _convert


def test_pins_reach_the_engine_and_hold_blocks_through_a_scheduled_pass(serve: Any) -> None:
    handle = serve(threshold=1000)
    with DefragClient(handle.address, timeout_s=10) as client:
        client.step(StepEvents(new_blocks={"a": [1, 2], "b": [30, 31]}, fresh=[]))
        client.step(StepEvents(finished=("a",), pins={"send/b": [30, 31]}))
        assert client.stats().stats.num_pinned == 2
        client.defragment()
        client.step(StepEvents())
        assert client.resolve([30, 31]) == [30, 31]
        reply = client.step(StepEvents(unpinned=("send/b", "gone")))
        assert reply.stats.num_pinned == 0 and reply.stats.totals.num_unknown_unpins == 1
        client.defragment()
        client.step(StepEvents())
        assert client.resolve([30, 31]) == [1, 2]
        assert client.resolve([30, 31]) == handle.resolve([30, 31]).tolist()


def test_a_server_that_does_not_apply_pins_is_not_sent_any(
    serve: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def older_server(**fields: Any) -> Any:
        message = session_opened(**fields)
        message.opened.supports_pins = False  # what a server without the field answers
        return message

    session_opened = _convert.session_opened
    monkeypatch.setattr(_convert, "session_opened", older_server)
    handle = serve()
    with DefragClient(handle.address, timeout_s=10) as client:
        client.step(StepEvents(new_blocks={"a": [1]}))
        with pytest.raises(InvalidArgument, match="does not apply pins"):
            client.step(StepEvents(pins={"send/a": [1]}))
        with pytest.raises(InvalidArgument, match="does not apply pins"):
            client.step(StepEvents(unpinned=("send/a",)))
        assert client.step(StepEvents(new_blocks={"a": [2]})).seq == 2
    assert handle.stats().num_pinned == 0
