"""Proto <-> domain conversions: the only server module that touches ``*_pb2`` messages.

Requests become plain Python values that the engine validates (ranges, request ids);
this module only refuses what the engine cannot see once a message is flattened into
dicts, such as a request id listed twice in one field.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import struct
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from kvdefrag.common import InvalidArgument, PoolStats, StepEvents, Totals
from kvdefrag.common.errors import quote
from kvdefrag.server._engine import RequestPage, StepResult
from kvdefrag.v1 import defrag_pb2 as pb

# The proto messages are generated code without type information for mypy.
Message = Any

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["DefragService"].full_name


@dataclasses.dataclass(frozen=True)
class Unparsable:
    """A request whose bytes are not a valid message of its type (see ``parsed``)."""

    type_name: str
    reason: str


def _lenient_parser(message_class: Any) -> Callable[[bytes], Message]:
    """Parses requests of one type; bytes that do not parse become an ``Unparsable``.

    NOTE: a deserializer that raises makes gRPC answer INTERNAL before any handler runs;
    a malformed message is the caller's mistake, so the servicer answers it (``parsed``)
    with INVALID_ARGUMENT and the kvdefrag-error metadata instead.
    """

    def parse(data: bytes) -> Message:
        message = message_class()
        try:
            message.ParseFromString(data)
        except DecodeError as err:
            return Unparsable(message_class.DESCRIPTOR.full_name, str(err))
        return message

    return parse


def parsed(request: Message) -> Message:
    """Returns a request message as parsed.

    Raises:
        InvalidArgument: Its bytes were not a valid message of the RPC's request type.
    """
    if isinstance(request, Unparsable):
        raise InvalidArgument(
            f"the request is not a valid {request.type_name} message ({request.reason})"
        )
    return request


_HANDLER_KINDS: dict[tuple[bool, bool], Callable[..., grpc.RpcMethodHandler[Any, Any]]] = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def add_service(servicer: object, server: grpc.Server) -> None:
    """Registers a DefragService servicer (methods named as the RPCs) on a server.

    Like the generated ``add_DefragServiceServicer_to_server``, except that requests are
    parsed leniently (``parsed`` turns a malformed one into ``InvalidArgument``).
    """
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name["DefragService"].methods:
        make_handler = _HANDLER_KINDS[method.client_streaming, method.server_streaming]
        handlers[method.name] = make_handler(
            getattr(servicer, method.name),
            request_deserializer=_lenient_parser(getattr(pb, method.input_type.name)),
            response_serializer=getattr(pb, method.output_type.name).SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    # NOTE: what the generated code does too (lets gRPC skip the generic lookup); the
    # type stubs predate it.
    server.add_registered_method_handlers(SERVICE_NAME, handlers)  # type: ignore[attr-defined]


def _block_lists(field: str, entries: Iterable[Message]) -> dict[str, list[int]]:
    lists: dict[str, list[int]] = {}
    for index, entry in enumerate(entries):
        request_id = entry.request_id
        if request_id in lists:
            raise InvalidArgument(
                f"{field}[{index}]: request id {quote(request_id)} appears twice in {field}"
            )
        lists[request_id] = list(entry.block_ids)
    return lists


@dataclasses.dataclass(frozen=True)
class OpenArgs:
    """One OpenSession message."""

    epoch: int
    prefix_caching: bool
    client_name: str


def stream_request(request: Message) -> tuple[str | None, Message]:
    """Splits a StepStreamRequest into its kind (``"open"``, ``"step"`` or None) and body.

    Raises:
        InvalidArgument: The message did not parse.
    """
    kind = parsed(request).WhichOneof("kind")
    return kind, (getattr(request, kind) if kind else None)


def open_args(request: Message) -> OpenArgs:
    """Converts an OpenSession message."""
    return OpenArgs(
        epoch=request.epoch,
        prefix_caching=request.prefix_caching,
        client_name=request.client_name,
    )


def step_events(request: Message) -> StepEvents:
    """Converts a StepRequest (seq and epoch are the servicer's business).

    Raises:
        InvalidArgument: A request id appears twice in ``resumed`` or ``new_blocks``.
    """
    return StepEvents(
        finished=tuple(request.finished_request_ids),
        resumed=_block_lists("resumed", request.resumed),
        new_blocks=_block_lists("new_blocks", request.new_blocks),
        fresh=list(request.fresh.block_ids) if request.HasField("fresh") else None,
        evicted=list(request.evicted_block_ids),
        unpinned=tuple(request.unpinned_keys),
        pins=_pins(request.pins),
    )


def _pins(entries: Any) -> dict[str, list[int]]:
    """BlockPin entries as key -> logical ids, refusing a key listed twice."""
    pins: dict[str, list[int]] = {}
    for index, entry in enumerate(entries):
        if entry.key in pins:
            raise InvalidArgument(f"pins[{index}]: key {quote(entry.key)} appears twice in pins")
        pins[entry.key] = list(entry.block_ids)
    return pins


# Bytes of a StepResponse besides its two id lists: seq, epoch, digest, counts, Stats,
# list headers and the StepStreamResponse wrapper (all of them at most ~250 bytes).
_STEP_RESPONSE_OVERHEAD_BYTES = 320


def max_step_response_bytes(events: StepEvents, num_blocks: int, max_moves_per_step: int) -> int:
    """An upper bound of the size of the StepResponse that applying ``events`` produces.

    Every logical id a step lists can add two mapping entries (itself, and the free
    block its placement displaces), and every compaction move two more.
    """
    num_ids = sum(len(ids) for ids in (*events.resumed.values(), *events.new_blocks.values()))
    num_entries = 2 * num_ids + 2 * max_moves_per_step
    id_bytes = max(1, ((num_blocks - 1).bit_length() + 6) // 7)  # varint length
    return num_entries * 2 * id_bytes + _STEP_RESPONSE_OVERHEAD_BYTES


def min_message_bytes(num_blocks: int, max_moves_per_step: int) -> int:
    """The smallest ``max_message_bytes`` that lets a step of one new block through.

    Below it ``max_step_response_bytes`` refuses every step, an empty one included,
    since compaction alone may move ``max_moves_per_step`` blocks.
    """
    one_block = StepEvents(new_blocks={"r": [1]})
    return max_step_response_bytes(one_block, num_blocks, max_moves_per_step)


_GAUGE_NAMES = PoolStats.gauge_names()
_TOTAL_NAMES = tuple(field.name for field in dataclasses.fields(Totals))


def _fill_stats(message: Message, stats: PoolStats) -> None:
    """Sets a Stats message's fields from PoolStats (the gauges and totals by name)."""
    for name in _GAUGE_NAMES:
        setattr(message, name, getattr(stats, name))
    totals = stats.totals
    for name in _TOTAL_NAMES:
        setattr(message, name, getattr(totals, name))


def stats_message(stats: PoolStats) -> Message:
    """Converts PoolStats to a Stats message."""
    message = pb.Stats()
    _fill_stats(message, stats)
    return message


def step_response(result: StepResult, seq: int, epoch: int) -> Message:
    """Builds the reply of an applied step: a StepStreamResponse whose ``step`` is the
    StepResponse (mapping deltas, digest and stats); the unary Step returns that ``step``.

    NOTE: filled in place: a StepResponse built from its fields, then wrapped, is copied
    twice (its Stats, then itself): ~35% of the build for a decode step's reply.
    """
    message = pb.StepStreamResponse()
    response = message.step
    response.seq = seq
    response.epoch = epoch
    mapping = result.block_mapping
    response.logical_block_ids.extend(mapping)
    response.physical_block_ids.extend(mapping.values())
    response.digest = result.digest
    response.num_moves = len(result.moves)
    response.num_placed = result.num_placed
    response.num_unknown_finished = result.num_unknown_finished
    _fill_stats(response.stats, result.stats)
    return message


def replayed_response(cached: Message) -> Message:
    """Returns a copy of a cached reply (``step_response``) marked as replayed."""
    message = pb.StepStreamResponse()
    message.CopyFrom(cached)
    message.step.replayed = True
    return message


def session_opened(
    *,
    epoch: int,
    next_seq: int,
    num_blocks: int,
    block_size: int,
    prefix_caching: bool,
    digest: int,
) -> Message:
    """Builds the stream's first reply."""
    return pb.StepStreamResponse(
        opened=pb.SessionOpened(
            epoch=epoch,
            next_seq=next_seq,
            num_blocks=num_blocks,
            block_size=block_size,
            prefix_caching=prefix_caching,
            digest=digest,
            supports_pins=True,
        )
    )


def resolve_request(request: Message, max_ids: int) -> tuple[list[int], list[list[int]]]:
    """Returns a ResolveRequest's logical ids and block tables.

    Raises:
        InvalidArgument: More than ``max_ids`` ids in all, or more than ``max_ids``
            tables (counted before anything is copied).
    """
    num_tables = len(request.block_tables)
    num_ids = len(request.logical_block_ids)
    if num_tables <= max_ids:
        num_ids += sum(len(table.block_ids) for table in request.block_tables)
    if num_ids > max_ids or num_tables > max_ids:
        raise InvalidArgument(
            f"Resolve: {num_ids} ids in {num_tables} block tables, over the limit of {max_ids} "
            "ids (num_blocks) per call, logical_block_ids and every table's ids together; "
            "split the lookup"
        )
    tables = [list(table.block_ids) for table in request.block_tables]
    return list(request.logical_block_ids), tables


def resolve_response(
    epoch: int, physical_ids: Sequence[int], tables: Sequence[Sequence[int]]
) -> Message:
    """Builds a ResolveResponse."""
    return pb.ResolveResponse(
        epoch=epoch,
        physical_block_ids=list(physical_ids),
        block_tables=[pb.BlockTable(block_ids=list(table)) for table in tables],
    )


def get_stats_response(
    *,
    epoch: int,
    next_seq: int,
    is_session_open: bool,
    digest: int,
    stats: PoolStats,
    unhealthy_reason: str | None,
) -> Message:
    """Builds a GetStatsResponse."""
    return pb.GetStatsResponse(
        epoch=epoch,
        next_seq=next_seq,
        is_session_open=is_session_open,
        digest=digest,
        stats=stats_message(stats),
        unhealthy_reason=unhealthy_reason or "",
    )


def get_request_response(
    request_id: str, logical_ids: Sequence[int], physical_ids: Sequence[int]
) -> Message:
    """Builds a GetRequestResponse."""
    return pb.GetRequestResponse(
        request_id=request_id,
        logical_block_ids=list(logical_ids),
        physical_block_ids=list(physical_ids),
    )


def list_requests_args(request: Message) -> tuple[int, str]:
    """Returns a ListRequestsRequest's page size and page token."""
    return request.page_size, request.page_token


# A page token: epoch, generation of the first page, position of the next request.
_PAGE_TOKEN = struct.Struct("<QQQ")


def page_token(epoch: int, generation: int, start: int) -> str:
    """Encodes where the next page of ListRequests starts (opaque to callers)."""
    return base64.urlsafe_b64encode(_PAGE_TOKEN.pack(epoch, generation, start)).decode()


def parse_page_token(token: str) -> tuple[int, int, int]:
    """Decodes a ``page_token``: (epoch, generation, start).

    Raises:
        InvalidArgument: The token is not one ``page_token`` made.
    """
    try:
        epoch, generation, start = _PAGE_TOKEN.unpack(base64.urlsafe_b64decode(token))
    except (binascii.Error, ValueError, struct.error):
        raise InvalidArgument(
            f"page_token {quote(token)} is not a next_page_token this server issued"
        ) from None
    return epoch, generation, start


# Bytes of a ListRequestsResponse besides its entries: epoch, next_page_token, headers.
_LIST_RESPONSE_OVERHEAD_BYTES = 128
# Bytes of one entry besides its request id and ids: tags and length prefixes.
_REQUEST_BLOCKS_OVERHEAD_BYTES = 16


def list_requests_response(
    epoch: int, page: RequestPage, start: int, *, num_blocks: int, max_bytes: int
) -> Message:
    """Builds a ListRequestsResponse of the page's first requests that fit in
    ``max_bytes`` (at least one), and the token of the page after them.

    Args:
        epoch: The epoch the page belongs to.
        page: Requests read from position ``start`` (in the engine's order).
        start: The page's position.
        num_blocks: The pool size (how wide an id's varint can be).
        max_bytes: The size the response must stay within.
    """
    id_bytes = max(1, ((num_blocks - 1).bit_length() + 6) // 7)
    budget_bytes = max_bytes - _LIST_RESPONSE_OVERHEAD_BYTES
    entries: list[Message] = []
    for request_id, block_ids in page.requests.items():
        size_bytes = (
            len(request_id.encode()) + len(block_ids) * id_bytes + _REQUEST_BLOCKS_OVERHEAD_BYTES
        )
        if entries and size_bytes > budget_bytes:
            break
        budget_bytes -= size_bytes
        entries.append(pb.RequestBlocks(request_id=request_id, block_ids=block_ids))
    next_start = start + len(entries) if len(entries) < len(page.requests) else page.next_start
    token = "" if next_start is None else page_token(epoch, page.generation, next_start)
    return pb.ListRequestsResponse(epoch=epoch, requests=entries, next_page_token=token)


def defragment_response() -> Message:
    """Builds a DefragmentResponse (the pass runs inside the next step)."""
    return pb.DefragmentResponse(is_scheduled=True)


def reset_response(epoch: int) -> Message:
    """Builds a ResetResponse carrying the new epoch."""
    return pb.ResetResponse(epoch=epoch)
