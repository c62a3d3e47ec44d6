from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RequestBlocks(_message.Message):
    __slots__ = ("request_id", "block_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class BlockIds(_message.Message):
    __slots__ = ("block_ids",)
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class BlockTable(_message.Message):
    __slots__ = ("block_ids",)
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("seq", "epoch", "finished_request_ids", "resumed", "new_blocks", "fresh", "evicted_block_ids", "unpinned_keys", "pins")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FRESH_FIELD_NUMBER: _ClassVar[int]
    EVICTED_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    UNPINNED_KEYS_FIELD_NUMBER: _ClassVar[int]
    PINS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    epoch: int
    finished_request_ids: _containers.RepeatedScalarFieldContainer[str]
    resumed: _containers.RepeatedCompositeFieldContainer[RequestBlocks]
    new_blocks: _containers.RepeatedCompositeFieldContainer[RequestBlocks]
    fresh: BlockIds
    evicted_block_ids: _containers.RepeatedScalarFieldContainer[int]
    unpinned_keys: _containers.RepeatedScalarFieldContainer[str]
    pins: _containers.RepeatedCompositeFieldContainer[BlockPin]
    def __init__(self, seq: _Optional[int] = ..., epoch: _Optional[int] = ..., finished_request_ids: _Optional[_Iterable[str]] = ..., resumed: _Optional[_Iterable[_Union[RequestBlocks, _Mapping]]] = ..., new_blocks: _Optional[_Iterable[_Union[RequestBlocks, _Mapping]]] = ..., fresh: _Optional[_Union[BlockIds, _Mapping]] = ..., evicted_block_ids: _Optional[_Iterable[int]] = ..., unpinned_keys: _Optional[_Iterable[str]] = ..., pins: _Optional[_Iterable[_Union[BlockPin, _Mapping]]] = ...) -> None: ...

class BlockPin(_message.Message):
    __slots__ = ("key", "block_ids")
    KEY_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    key: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, key: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Stats(_message.Message):
    __slots__ = ("num_blocks", "num_live", "max_live", "holes", "num_requests", "fragmentation_ratio", "is_healthy", "num_steps", "num_moves", "num_two_way_moves", "num_placements", "num_defrag_runs", "num_bytes_moved", "num_unknown_finished", "num_pinned", "num_unknown_unpins")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_LIVE_FIELD_NUMBER: _ClassVar[int]
    MAX_LIVE_FIELD_NUMBER: _ClassVar[int]
    HOLES_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTATION_RATIO_FIELD_NUMBER: _ClassVar[int]
    IS_HEALTHY_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_MOVES_FIELD_NUMBER: _ClassVar[int]
    NUM_TWO_WAY_MOVES_FIELD_NUMBER: _ClassVar[int]
    NUM_PLACEMENTS_FIELD_NUMBER: _ClassVar[int]
    NUM_DEFRAG_RUNS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    NUM_UNKNOWN_FINISHED_FIELD_NUMBER: _ClassVar[int]
    NUM_PINNED_FIELD_NUMBER: _ClassVar[int]
    NUM_UNKNOWN_UNPINS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    num_live: int
    max_live: int
    holes: int
    num_requests: int
    fragmentation_ratio: float
    is_healthy: bool
    num_steps: int
    num_moves: int
    num_two_way_moves: int
    num_placements: int
    num_defrag_runs: int
    num_bytes_moved: int
    num_unknown_finished: int
    num_pinned: int
    num_unknown_unpins: int
    def __init__(self, num_blocks: _Optional[int] = ..., num_live: _Optional[int] = ..., max_live: _Optional[int] = ..., holes: _Optional[int] = ..., num_requests: _Optional[int] = ..., fragmentation_ratio: _Optional[float] = ..., is_healthy: _Optional[bool] = ..., num_steps: _Optional[int] = ..., num_moves: _Optional[int] = ..., num_two_way_moves: _Optional[int] = ..., num_placements: _Optional[int] = ..., num_defrag_runs: _Optional[int] = ..., num_bytes_moved: _Optional[int] = ..., num_unknown_finished: _Optional[int] = ..., num_pinned: _Optional[int] = ..., num_unknown_unpins: _Optional[int] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("seq", "epoch", "logical_block_ids", "physical_block_ids", "digest", "num_moves", "num_placed", "num_unknown_finished", "replayed", "stats")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LOGICAL_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    PHYSICAL_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    NUM_MOVES_FIELD_NUMBER: _ClassVar[int]
    NUM_PLACED_FIELD_NUMBER: _ClassVar[int]
    NUM_UNKNOWN_FINISHED_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    epoch: int
    logical_block_ids: _containers.RepeatedScalarFieldContainer[int]
    physical_block_ids: _containers.RepeatedScalarFieldContainer[int]
    digest: int
    num_moves: int
    num_placed: int
    num_unknown_finished: int
    replayed: bool
    stats: Stats
    def __init__(self, seq: _Optional[int] = ..., epoch: _Optional[int] = ..., logical_block_ids: _Optional[_Iterable[int]] = ..., physical_block_ids: _Optional[_Iterable[int]] = ..., digest: _Optional[int] = ..., num_moves: _Optional[int] = ..., num_placed: _Optional[int] = ..., num_unknown_finished: _Optional[int] = ..., replayed: _Optional[bool] = ..., stats: _Optional[_Union[Stats, _Mapping]] = ...) -> None: ...

class OpenSession(_message.Message):
    __slots__ = ("epoch", "prefix_caching", "client_name")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    prefix_caching: bool
    client_name: str
    def __init__(self, epoch: _Optional[int] = ..., prefix_caching: _Optional[bool] = ..., client_name: _Optional[str] = ...) -> None: ...

class SessionOpened(_message.Message):
    __slots__ = ("epoch", "next_seq", "num_blocks", "block_size", "prefix_caching", "digest", "supports_pins")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NEXT_SEQ_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_PINS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    next_seq: int
    num_blocks: int
    block_size: int
    prefix_caching: bool
    digest: int
    supports_pins: bool
    def __init__(self, epoch: _Optional[int] = ..., next_seq: _Optional[int] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., prefix_caching: _Optional[bool] = ..., digest: _Optional[int] = ..., supports_pins: _Optional[bool] = ...) -> None: ...

class StepStreamRequest(_message.Message):
    __slots__ = ("open", "step")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    open: OpenSession
    step: StepRequest
    def __init__(self, open: _Optional[_Union[OpenSession, _Mapping]] = ..., step: _Optional[_Union[StepRequest, _Mapping]] = ...) -> None: ...

class StepStreamResponse(_message.Message):
    __slots__ = ("opened", "step")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    opened: SessionOpened
    step: StepResponse
    def __init__(self, opened: _Optional[_Union[SessionOpened, _Mapping]] = ..., step: _Optional[_Union[StepResponse, _Mapping]] = ...) -> None: ...

class ResolveRequest(_message.Message):
    __slots__ = ("logical_block_ids", "block_tables")
    LOGICAL_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLES_FIELD_NUMBER: _ClassVar[int]
    logical_block_ids: _containers.RepeatedScalarFieldContainer[int]
    block_tables: _containers.RepeatedCompositeFieldContainer[BlockTable]
    def __init__(self, logical_block_ids: _Optional[_Iterable[int]] = ..., block_tables: _Optional[_Iterable[_Union[BlockTable, _Mapping]]] = ...) -> None: ...

class ResolveResponse(_message.Message):
    __slots__ = ("epoch", "physical_block_ids", "block_tables")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PHYSICAL_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLES_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    physical_block_ids: _containers.RepeatedScalarFieldContainer[int]
    block_tables: _containers.RepeatedCompositeFieldContainer[BlockTable]
    def __init__(self, epoch: _Optional[int] = ..., physical_block_ids: _Optional[_Iterable[int]] = ..., block_tables: _Optional[_Iterable[_Union[BlockTable, _Mapping]]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("epoch", "next_seq", "is_session_open", "digest", "stats", "unhealthy_reason")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NEXT_SEQ_FIELD_NUMBER: _ClassVar[int]
    IS_SESSION_OPEN_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    UNHEALTHY_REASON_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    next_seq: int
    is_session_open: bool
    digest: int
    stats: Stats
    unhealthy_reason: str
    def __init__(self, epoch: _Optional[int] = ..., next_seq: _Optional[int] = ..., is_session_open: _Optional[bool] = ..., digest: _Optional[int] = ..., stats: _Optional[_Union[Stats, _Mapping]] = ..., unhealthy_reason: _Optional[str] = ...) -> None: ...

class GetRequestRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class GetRequestResponse(_message.Message):
    __slots__ = ("request_id", "logical_block_ids", "physical_block_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LOGICAL_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    PHYSICAL_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    logical_block_ids: _containers.RepeatedScalarFieldContainer[int]
    physical_block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., logical_block_ids: _Optional[_Iterable[int]] = ..., physical_block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ListRequestsRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListRequestsResponse(_message.Message):
    __slots__ = ("epoch", "requests", "next_page_token")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    requests: _containers.RepeatedCompositeFieldContainer[RequestBlocks]
    next_page_token: str
    def __init__(self, epoch: _Optional[int] = ..., requests: _Optional[_Iterable[_Union[RequestBlocks, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class DefragmentRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DefragmentResponse(_message.Message):
    __slots__ = ("is_scheduled",)
    IS_SCHEDULED_FIELD_NUMBER: _ClassVar[int]
    is_scheduled: bool
    def __init__(self, is_scheduled: _Optional[bool] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ("epoch", "prefix_caching", "force")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    prefix_caching: bool
    force: bool
    def __init__(self, epoch: _Optional[int] = ..., prefix_caching: _Optional[bool] = ..., force: _Optional[bool] = ...) -> None: ...

class ResetResponse(_message.Message):
    __slots__ = ("epoch",)
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    def __init__(self, epoch: _Optional[int] = ...) -> None: ...
