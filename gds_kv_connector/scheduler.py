"""The scheduler half: prefix matching, per-request block bookkeeping, and the per-iteration plan.

It runs on TP rank 0 and on every attention-DP owner, on the executor thread, so everything
here is plain Python over plain data: no I/O except ``stat`` of candidate files, no CUDA.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, List, Tuple

from .keys import base_fingerprint, chain_seed, extend_chain, tokens_to_bytes
from .llm_config import EngineConfig, read_llm_args
from .local_peer import PeerInfo, lookup
from .metadata import GdsKvMetadata, LoadOp, SaveOp
from .nvtx_ranges import nvtx_range
from .pool import BlockPool
from .pool_format import ZERO_KEY
from .recency import RecencyLog
from .settings import Settings
from .trtllm_api import KvCacheConnectorScheduler

log = logging.getLogger(__name__)
_SEEN_CAPACITY = 1 << 20


@dataclass
class _Request:
    """What the scheduler knows of one live request."""

    rid: int
    seed: bytes
    tokens: list[int] = field(default_factory=list)
    token_bytes: bytearray = field(default_factory=bytearray)
    keys: list[bytes] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    prompt_len: int = 0
    kv_end: int = 0  # tokens whose KV is valid once this iteration's forward has run
    next_save: int = 0  # first block index not yet considered for saving
    load_range: tuple[int, int] = (0, 0)  # blocks [first, end) loaded from the pool
    pending_load: tuple[int, list[bytes], bool] | None = None  # (first block, keys, async)
    sync_loaded_tokens: int = 0
    reported: bool = False
    dispatched: bool = False  # a save or load was handed to the worker

    def set_tokens(self, tokens: list[int]) -> None:
        if len(tokens) < len(self.tokens) or tokens[:len(self.tokens)] != self.tokens:
            self.keys.clear()  # a different prefix (replay after reset): keys must be recomputed
            self.token_bytes = bytearray()
        self.tokens = list(tokens)

    def keys_upto(self, n_blocks: int, tpb: int) -> list[bytes]:
        have = len(self.keys)
        if n_blocks > have:
            need = n_blocks * tpb
            if len(self.token_bytes) < need * 8:
                self.token_bytes += tokens_to_bytes(self.tokens[len(self.token_bytes) // 8:need])
            prev = self.keys[-1] if self.keys else self.seed
            self.keys.extend(extend_chain(prev, bytes(self.token_bytes), tpb, have, n_blocks - have))
        return self.keys[:n_blocks]


class GdsKvConnectorScheduler(KvCacheConnectorScheduler):
    """TensorRT-LLM connector scheduler over a shared GDS/POSIX block pool."""

    supports_attention_dp = True

    def __init__(self, llm_args: Any) -> None:
        super().__init__(llm_args)
        self.settings = Settings.load_from()
        self.config: EngineConfig = read_llm_args(llm_args, self.settings.model_id)
        self._peer: PeerInfo | None = None
        self._lookup_pools: list[BlockPool] = []
        self._recency: RecencyLog | None = None
        self._reqs: dict[int, _Request] = {}
        self._out_loads: list[LoadOp] = []
        self._out_saves: list[SaveOp] = []
        self._seen: OrderedDict[bytes, int] = OrderedDict()
        self._min_seen = int(self.settings.admission[5:]) if self.settings.admission.startswith("seen:") else 0

    # -- wiring -----------------------------------------------------------------------------------
    def wait_for_initialization(self) -> None:
        self._connect()

    def _connect(self) -> PeerInfo:
        if self._peer is None:
            peer = lookup(self._llm_args)
            if peer is None:
                raise RuntimeError("gds-kv-connector: the scheduler found no worker in this process; "
                                   "register_kv_caches / register_kv_cache_layout must run first")
            self._peer = peer
            self._recency = RecencyLog.for_process(self.settings.roots)
            self._lookup_pools = [
                BlockPool(self.settings.roots, fp, peer.block_bytes, self.config.tokens_per_block,
                          share_group=self.settings.share_group, index_ttl_s=self.settings.index_ttl_s)
                for fp in peer.fingerprints]
        return self._peer

    @property
    def _sole_worker(self) -> bool:
        """True when this process's worker is the only one that must see a save."""
        return not self.config.sharded_attention

    def _state(self, request_or_id: Any, salt: str | None = None) -> _Request:
        rid = request_or_id if isinstance(request_or_id, int) else _request_id(request_or_id)
        st = self._reqs.get(rid)
        if st is None:
            if not isinstance(request_or_id, int):
                salt = _cache_salt(request_or_id)
            st = _Request(rid, chain_seed(base_fingerprint(self._connect().geometry), salt))
            self._reqs[rid] = st
        return st

    # -- admission --------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Tuple[int, bool]:
        with nvtx_range("sched/match", "green"):
            if getattr(request, "is_dummy_request", False) or not self.settings.load:
                return 0, False
            tpb = self.config.tokens_per_block
            st = self._state(request)
            st.set_tokens(list(request.get_tokens(0)))
            st.prompt_len = len(st.tokens)
            if num_computed_tokens % tpb:
                return 0, False
            first = num_computed_tokens // tpb
            limit = (len(st.tokens) - 1) // tpb  # always leave one prompt token to compute
            if first >= limit:
                return 0, False
            keys = st.keys_upto(limit, tpb)
            self._note_seen(keys)
            n = limit - first
            for pool in self._lookup_pools:  # every TP shard must hold the block
                n = min(n, pool.count_present(keys, first))
                if n == 0:
                    break
            stats = self._peer.stats
            stats.add_many(match_queries=1, match_blocks_hit=n, match_blocks_miss=limit - first - n)
            if n == 0:
                return 0, False
            is_async = n * self._peer.block_bytes > self.settings.async_load_bytes
            self._recency.touch(keys[first:first + n])  # protects the promise from eviction until pinned
            st.pending_load = (first, keys[first:first + n], is_async)
            return n * tpb, is_async

    def update_state_after_alloc(self, request: Any, block_ids: List[int]) -> None:
        with nvtx_range("sched/after_alloc", "green"):
            st = self._reqs.get(_request_id(request))
            if st is None or st.pending_load is None:
                return
            first, keys, is_async = st.pending_load
            st.pending_load = None
            ids = list(block_ids[first:first + len(keys)])
            if len(ids) < len(keys):
                raise RuntimeError(f"gds-kv-connector: request {st.rid} was promised {len(keys)} blocks from "
                                   f"block {first} but only {len(ids)} pages were allocated")
            pairs = [(k, b) for k, b in zip(keys, ids) if b >= 0]  # -1: no page (BAD_PAGE_INDEX)
            if not pairs:
                return
            self._out_loads.append(LoadOp(st.rid, tuple(k for k, _ in pairs), tuple(b for _, b in pairs),
                                          is_async))
            st.load_range = (first, first + len(keys))
            st.kv_end = max(st.kv_end, (first + len(keys)) * self.config.tokens_per_block)
            if not is_async:
                st.sync_loaded_tokens = len(keys) * self.config.tokens_per_block
            st.dispatched = True

    def cancel_load(self, request: Any, start: int, end: int) -> None:
        """V2: the runtime will not use offered tokens [start, end); drop what has not been sent."""
        st = self._reqs.get(_request_id(request))
        if st is not None and st.pending_load is not None:
            st.pending_load = None

    def request_reset(self, request: Any) -> None:
        """V2: the allocation was released and the request replays from scratch."""
        self._reqs.pop(_request_id(request), None)

    # -- per iteration ----------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: Any) -> object:
        with nvtx_range("sched/build_meta", "green"):
            saves = self._out_saves
            for rd in scheduler_output.new_requests:
                self._on_report(rd, first=True)
                saves.extend(self._due_saves(self._reqs[rd.request_id]))
            for rd in scheduler_output.cached_requests:
                self._on_report(rd, first=False)
                saves.extend(self._due_saves(self._reqs[rd.request_id]))
            meta = GdsKvMetadata(self._out_loads, saves)
            self._out_loads, self._out_saves = [], []
            return meta

    def _on_report(self, rd: Any, first: bool) -> None:
        st = self._state(rd.request_id, getattr(rd, "cache_salt", None))
        if first and not st.reported:
            if rd.new_tokens:
                st.set_tokens(list(rd.new_tokens))
            st.prompt_len = st.prompt_len or len(st.tokens)
        else:
            st.tokens.extend(rd.new_tokens)
        st.reported = True
        blocks = list(rd.new_block_ids)
        by_group = getattr(rd, "new_block_ids_by_layer_group", None) or []
        if not blocks and len(by_group) == 1:
            blocks = list(by_group[0])
        st.block_ids.extend(blocks)
        computed = rd.computed_position + (st.sync_loaded_tokens if first else 0)
        st.kv_end = max(st.kv_end, computed + rd.num_scheduled_tokens)

    def _due_saves(self, st: _Request) -> list[SaveOp]:
        """Blocks that are full and whose KV the forward will have written this iteration."""
        if not self.settings.save:
            return []
        tpb = self.config.tokens_per_block
        full = min(len(st.tokens), st.kv_end) // tpb
        if self.settings.admission == "prompt":
            full = min(full, st.prompt_len // tpb)
        full = min(full, len(st.block_ids))  # a block id is known only once reported
        if full <= st.next_save:
            return []
        keys = st.keys_upto(full, tpb)
        lo, hi = st.load_range
        candidates = [b for b in range(st.next_save, full) if st.block_ids[b] >= 0 and not lo <= b < hi]
        sel = [b for b in candidates if self._admit(keys[b])]
        st.next_save = full
        if len(sel) < len(candidates):
            self._connect().stats.add("save_blocks_not_admitted", len(candidates) - len(sel))
        if not sel:
            return []
        st.dispatched = True
        return [SaveOp(st.rid, tuple(keys[b] for b in sel), tuple(keys[b - 1] if b else ZERO_KEY for b in sel),
                       tuple(st.block_ids[b] for b in sel))]

    def _admit(self, key: bytes) -> bool:
        return self._min_seen == 0 or self._seen.get(key, 0) >= self._min_seen

    def _note_seen(self, keys: list[bytes]) -> None:
        if not self._min_seen:
            return
        for k in keys:
            self._seen[k] = self._seen.pop(k, 0) + 1
        while len(self._seen) > _SEEN_CAPACITY:
            self._seen.popitem(last=False)

    # -- completion -------------------------------------------------------------------------------
    def request_finished(self, request: Any, cache_block_ids: List[int]) -> bool:
        with nvtx_range("sched/request_finished", "green"):
            if getattr(request, "is_dummy_request", False):
                return False
            st = self._reqs.pop(_request_id(request), None)
            if st is None:
                return False
            tokens = list(request.get_tokens(0))
            if len(tokens) > len(st.tokens) and tokens[:len(st.tokens)] == st.tokens:
                st.tokens = tokens
            if len(cache_block_ids) > len(st.block_ids):
                st.block_ids = list(cache_block_ids)
            final = self._due_saves(st)
            if final:
                if self._sole_worker:
                    self._connect().deliver_saves(final)
                else:
                    self._out_saves.extend(final)
            return st.dispatched

    def request_finished_by_layer_group(self, request: Any, cache_block_ids_by_layer_group: List[List[int]]) -> bool:
        if len(cache_block_ids_by_layer_group) != 1:
            raise NotImplementedError("gds-kv-connector supports one KV layer group")
        return self.request_finished(request, cache_block_ids_by_layer_group[0])

    def update_state_after_alloc_by_layer_group(self, request: Any,
                                                block_ids_by_layer_group: List[List[int]]) -> None:
        if len(block_ids_by_layer_group) != 1:
            raise NotImplementedError("gds-kv-connector supports one KV layer group")
        self.update_state_after_alloc(request, block_ids_by_layer_group[0])


def _request_id(request: Any) -> int:
    for attr in ("request_id", "py_request_id"):
        rid = getattr(request, attr, None)
        if rid is not None:
            return int(rid)
    raise AttributeError(f"{type(request).__name__} has no request_id")


def _cache_salt(request: Any) -> str | None:
    for attr in ("cache_salt", "py_cache_salt"):
        salt = getattr(request, attr, None)
        if salt is not None:
            return str(salt)
    salt_id = getattr(request, "cache_salt_id", None)
    return None if salt_id is None else f"id:{salt_id}"
