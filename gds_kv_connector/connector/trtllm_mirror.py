"""In-repo mirror of TensorRT-LLM's connector API, used when tensorrt_llm is not importable.

Names, fields and signatures follow ``tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector``:
the release manager's (the contract document, section 3) and what the newest one adds, the optional
prefix-reservation protocol (``reserve_prefix``, ``release_prefix_reservation``,
``get_finished_prefix_loads``, ``SchedulerOutput.prefix_loads``); tests/test_trtllm_api.py pins them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Tuple

BAD_PAGE_INDEX = -1


@dataclass
class RequestData:
    request_id: int
    new_tokens: List[int]
    new_block_ids: List[int]
    computed_position: int
    num_scheduled_tokens: int
    block_hashes: List[int] = field(default_factory=list)
    priorities: Optional[List[int]] = None
    cache_salt: Optional[str] = None
    new_block_ids_by_layer_group: List[List[int]] = field(default_factory=list)


@dataclass(frozen=True)
class PrefixReservation:
    reservation_id: int
    request_id: int
    start: int  # absolute half-open token interval
    end: int
    is_async: bool


@dataclass(frozen=True)
class PrefixLoad(PrefixReservation):
    block_ids_by_layer_group: List[List[int]]  # complete destination pages, by group and block ordinal
    tokens: List[int]
    cache_salt: Optional[str]


@dataclass
class SchedulerOutput:
    new_requests: List[RequestData] = field(default_factory=list)
    cached_requests: List[RequestData] = field(default_factory=list)
    attention_dp_rank: Optional[int] = None
    # accepted reservation loads not yet dispatched, parked requests' included (newest manager)
    prefix_loads: List[PrefixLoad] = field(default_factory=list)


class KvCacheConnectorWorker(ABC):
    supports_attention_dp: bool = False

    def __init__(self, llm_args: Any) -> None:
        self._llm_args = llm_args
        self._metadata = None

    def bind_connector_meta(self, metadata: object) -> None:
        self._metadata = metadata

    def get_connector_meta(self) -> object:
        return self._metadata

    def _clear_connector_meta(self) -> None:
        self._metadata = None

    def register_forward_pass_callable(self) -> Optional[Callable]:
        return None

    @abstractmethod
    def register_kv_caches(self, kv_cache_tensor: Any) -> None: ...

    def register_kv_cache_layout(self, layout: Any) -> None:
        tensor = layout.as_single_pool_tensor()
        if tensor is None:
            raise NotImplementedError("this connector needs one layer group with one region")
        self.register_kv_caches(tensor)

    @abstractmethod
    def start_load_kv(self, stream: Any) -> None: ...

    @abstractmethod
    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None: ...

    @abstractmethod
    def save_kv_layer(self, layer_idx: int, stream: Any) -> None: ...

    @abstractmethod
    def wait_for_save(self, stream: Any) -> None: ...

    @abstractmethod
    def get_finished(self, finished_gen_req_ids: List[int],
                     started_loading_req_ids: List[int]) -> Tuple[List[int], List[int]]: ...

    def get_finished_prefix_loads(self) -> List[int]:
        return []


class KvCacheConnectorScheduler(ABC):
    supports_attention_dp: bool = False

    def __init__(self, llm_args: Any) -> None:
        self._llm_args = llm_args

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Tuple[int, bool]: ...

    def reserve_prefix(self, request: Any, num_computed_tokens: int, reservation_id: int) -> Tuple[int, bool]:
        raise NotImplementedError

    def release_prefix_reservation(self, request: Any, reservation_id: int, start: int, end: int) -> None:
        raise NotImplementedError

    @abstractmethod
    def update_state_after_alloc(self, request: Any, block_ids: List[int]) -> None: ...

    def update_state_after_alloc_by_layer_group(self, request: Any,
                                                block_ids_by_layer_group: List[List[int]]) -> None:
        if len(block_ids_by_layer_group) != 1:
            raise NotImplementedError("flat-only connector scheduler with several layer groups")
        self.update_state_after_alloc(request, block_ids_by_layer_group[0])

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> object: ...

    @abstractmethod
    def request_finished(self, request: Any, cache_block_ids: List[int]) -> bool: ...

    def request_finished_by_layer_group(self, request: Any,
                                        cache_block_ids_by_layer_group: List[List[int]]) -> bool:
        if len(cache_block_ids_by_layer_group) != 1:
            raise NotImplementedError("flat-only connector scheduler with several layer groups")
        return self.request_finished(request, cache_block_ids_by_layer_group[0])

    def wait_for_initialization(self) -> None:
        return None
