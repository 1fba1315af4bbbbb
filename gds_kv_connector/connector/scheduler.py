"""The scheduler half: prefix matching, per-request block bookkeeping, and the per-iteration plan.

It runs on TP rank 0 and on every attention-DP owner, on the executor thread, so everything
here is plain Python over plain data: no I/O except ``stat`` of candidate files, no CUDA.
"""

from __future__ import annotations

import logging
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, List, Sequence, Tuple

from gds_kv_connector.connector.cancel_board import CancelBoard
from gds_kv_connector.format.keys import base_fingerprint, chain_from_tokens, chain_seed, inputs_seed
from gds_kv_connector.connector.llm_config import EngineConfig, check_parallelism, read_llm_args
from gds_kv_connector.connector.load_policy import ForwardClock, LoadPolicy
from gds_kv_connector.connector.local_peer import PeerInfo, lookup
from gds_kv_connector.connector.metadata import GdsKvMetadata
from gds_kv_connector.transfer.jobs import LoadOp, SaveOp
from gds_kv_connector.store.pool import BlockPool
from gds_kv_connector.format.records import ZERO_KEY
from gds_kv_connector.maintenance.recency import RecencyLog
from gds_kv_connector.connector.reservations import ReservationKeeper
from gds_kv_connector.config.settings import Settings, SettingsError
from gds_kv_connector.config.trace_ranges import check_mode, traced
from gds_kv_connector.connector.trtllm_api import KvCacheConnectorScheduler

log = logging.getLogger(__name__)
_SEEN_CAPACITY = 1 << 20
_SEEDS_CAPACITY = 4096  # chain seeds remembered per cache salt
# Tokens are read one by one at the end while fewer than 1/_TAIL_RATIO of the request's (an estimate:
# one bound call per token against about 20 ns per token for converting the whole list).
_TAIL_RATIO = 8
# A new prompt this long whose first block is not in the pool is answered from that block's tokens
# alone: 32 bound calls against converting at least this many tokens.
_PROBE_MIN_TOKENS = 1024


@dataclass(slots=True)  # slots: its fields are read for every request every iteration
class _Request:
    """What the scheduler knows of one live request.

    Only the tokens from ``base`` on are kept: those of blocks already keyed are never read again,
    and holding a prompt's whole token list cost a copy in the first report and, once the request
    finished, releasing a reference to every token, read cold (1.2 us of the 3 us that
    ``request_finished`` took per request in the bench's executor phase).
    """

    rid: int
    seed: bytes
    tokens: list[int] = field(default_factory=list)  # the request's tokens from ``base`` on
    base: int = 0  # tokens dropped from the front: a multiple of tokens_per_block, <= len(keys) * it
    keys: list[bytes] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    prompt_len: int = 0
    kv_end: int = 0  # tokens whose KV is valid once this iteration's forward has run
    next_save: int = 0  # first block index not yet considered for saving
    load_range: tuple[int, int] = (0, 0)  # blocks [first, end) loaded from the pool
    pending_load: tuple[int, list[bytes], bool] | None = None  # (first block, keys, async)
    sync_loaded_tokens: int = 0
    # blocks [lo, hi) of an asynchronous load of it handed to the workers, less the cuts since (cancel_load)
    handed: tuple[int, int] | None = None
    reported: bool = False
    dispatched: bool = False  # a save or load was handed to the worker
    allocated: bool = False  # update_state_after_alloc ran for this attempt

    def set_tokens(self, tokens: Sequence[int], adopt: bool = False) -> None:
        """Take ``tokens``, all of the request's tokens, as its tokens: those from ``base`` on are
        copied, or with ``adopt`` and nothing dropped yet the list itself is kept.

        The match adopts ``get_tokens``' list, which TensorRT-LLM converts anew for each call, since
        copying a 128k-token prompt costs about a millisecond; the match then keeps only the
        tokens after its keyed blocks (:meth:`drop_keyed`), and the request's first report takes a
        list of the scheduler's own, which later reports extend in place, so a caller's list is
        never mutated.  Tokens that differ from those kept drop the keys, which are then made
        again from all of them; the dropped ones are not compared (a request's earlier tokens
        change only in a replay, whose first sight drops the earlier attempt's state first).
        """
        old, base = self.tokens, self.base
        have = base + len(old)
        if have:
            kept = tokens[base:have]
            if len(tokens) < have or (kept != old if type(kept) is list else list(kept) != old):
                self.keys.clear()  # a different prefix: keys must be recomputed from all tokens
                self.base = base = 0
        if base:
            rest = tokens[base:]
            self.tokens = rest if type(rest) is list else list(rest)
        else:
            self.tokens = tokens if adopt and type(tokens) is list else list(tokens)

    def drop_keyed(self, tpb: int) -> None:
        """Stop holding the tokens of keyed blocks."""
        cut = len(self.keys) * tpb - self.base
        if cut > 0:
            self.tokens = self.tokens[cut:]
            self.base += cut

    def keys_upto(self, n_blocks: int, tpb: int) -> list[bytes]:
        """Keys of blocks ``[0, n_blocks)``; may be ``self.keys`` itself, so never mutate it.

        Only the tokens of blocks not keyed yet are converted, straight from the token list.
        """
        keys = self.keys
        have = len(keys)
        if n_blocks > have:
            prev = keys[-1] if have else self.seed
            keys += chain_from_tokens(prev, self.tokens, have * tpb - self.base, tpb, n_blocks - have)
        return keys if len(keys) == n_blocks else keys[:n_blocks]


@dataclass(slots=True)
class _Reservation:
    """A prefix reservation: the blocks it promised from ``first`` on, and which are still protected."""

    rid: int
    first: int
    keys: list[bytes]
    protected: list[bool]


class GdsKvConnectorScheduler(KvCacheConnectorScheduler):
    """TensorRT-LLM connector scheduler over a shared GDS/POSIX block pool."""

    supports_attention_dp = True

    def __init__(self, llm_args: Any) -> None:
        super().__init__(llm_args)
        self.settings = Settings.load_from()
        check_mode(self.settings.trace)
        self.config: EngineConfig = read_llm_args(llm_args, self.settings.model_id)
        check_parallelism(self.config)
        # read on every callback: plain attributes, not settings lookups
        self._tpb = self.config.tokens_per_block
        self._load, self._save = self.settings.load, self.settings.save
        self._prompt_only = self.settings.admission == "prompt"
        mode = self.settings.save_generated
        if mode == "auto":
            mode = "finish" if self._sole_worker else "eager"
        elif mode == "finish" and not self._sole_worker:
            raise SettingsError("TLLM_GDS_KV_SAVE_GENERATED=finish needs the scheduler's own worker to be the only "
                                "one (TP 1, or attention DP); under plain TP a finished request's saves could reach "
                                "the other ranks only after its pages are freed: use eager or auto")
        # Whether decode reports are folded: only to save generated blocks as they fill.  Otherwise a
        # report is folded only while its request's prompt is being computed (``_prefilling``), and a
        # finished request's generated blocks are saved from its final tokens and block ids: folding 64
        # decode reports was most of a steady iteration's callback time (each report's state read cold).
        self._fold_decode = self._save and not self._prompt_only and mode == "eager"
        self._prefilling: set[int] = set()
        self._peer: PeerInfo | None = None
        self._policy: LoadPolicy | None = None  # TLLM_GDS_KV_LOAD_POLICY other than always (_connect)
        self._forwards: ForwardClock | None = None  # the worker's forward timing where it measures: fed each plan
        self._base_fp = b""
        self._seeds: dict[Any, bytes] = {}  # by salt, or (salt, adapter, input hashes)
        self._opaque: set[int] = set()  # requests with inputs the keys cannot name (_request_inputs)
        self._lookup_pools: list[BlockPool] = []
        self._recency: RecencyLog | None = None
        self._reqs: dict[int, _Request] = {}
        self._out_loads: list[LoadOp] = []
        self._out_resets: list[int] = []  # reset requests the workers fence at the next metadata (plain TP)
        self._out_cancels: list[int] = []  # requests whose handed-over load the workers stop (plain TP)
        self._cancelled: dict[int, list[tuple[int, int]]] = {}  # cancel_load ranges before allocation
        self._board: CancelBoard | None = None  # plain TP: cancels for workers that get no metadata
        self._board_tried = False
        self._seen: OrderedDict[bytes, int] = OrderedDict()
        self._match = [0, 0, 0]  # queries, blocks hit, blocks missed since the last build_connector_meta
        self._min_seen = int(self.settings.admission[5:]) if self.settings.admission.startswith("seen:") else 0
        # prefix reservations (the newest manager's optional protocol), by reservation id
        self._reservations: dict[int, _Reservation] = {}
        self._keeper: ReservationKeeper | None = None
        self._emitted_reservations: set[int] = set()  # whose load a metadata carried
        # The last plan built, for TensorRT-LLM's rebuild of a bound plan from the same scheduler output
        # (after it releases an unstarted load): the output, the requests it named, and the plan.
        self._serial = 0
        self._last_out: Callable[[], Any] = _no_output  # a reference that does not keep it alive (build_connector_meta)
        self._last_rids: list[int] = []
        self._last_meta: GdsKvMetadata | None = None

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
            self._base_fp = base_fingerprint(peer.geometry)
            self._recency = RecencyLog.for_process(self.settings.roots)
            self._lookup_pools = [
                peer.pool if peer.pool is not None and peer.pool.fingerprint == fp else
                BlockPool(self.settings.roots, fp, peer.block_bytes, self.config.tokens_per_block,
                          share_group=self.settings.share_group, index_ttl_s=self.settings.index_ttl_s,
                          refs=self.settings.arena_bytes > 0)
                for fp in peer.fingerprints]
            self._policy = self._load_policy(peer)
            self._forwards = peer.estimates.forwards if peer.estimates is not None else None
        return self._peer

    @property
    def load_policy(self) -> LoadPolicy | None:
        """The policy deciding this scheduler's loads (``TLLM_GDS_KV_LOAD_POLICY``); None for ``always``
        and before the worker registered its KV cache."""
        return self._policy

    def _load_policy(self, peer: PeerInfo) -> LoadPolicy | None:
        """The policy deciding whether a match is loaded; None for always (every match is)."""
        mode = self.settings.load_policy
        if mode == "always":
            return None
        if peer.estimates is None:
            raise SettingsError(f"TLLM_GDS_KV_LOAD_POLICY={mode} reached the scheduler, but this process's worker "
                                "measures nothing (it read always): give both the same settings")
        return LoadPolicy(mode, peer.estimates, peer.block_bytes, self._tpb, self.settings.deadline_s)

    @property
    def _sole_worker(self) -> bool:
        """True when this process's worker is the only one that must see a save."""
        return not self.config.sharded_attention

    def _state(self, request_or_id: Any, salt: str | int | None = None) -> _Request | None:
        """The request's state, made on first sight with its chain seed; None for a request whose
        KV depends on inputs the keys cannot name (multimodal data without TensorRT-LLM's hashes of
        it): such a request is neither matched nor saved (``_opaque``)."""
        rid = request_or_id if isinstance(request_or_id, int) else _request_id(request_or_id)
        st = self._reqs.get(rid)
        if st is None:
            inputs = None
            if not isinstance(request_or_id, int):
                salt = _cache_salt(request_or_id)
                inputs = _request_inputs(request_or_id)
                if inputs is _OPAQUE:
                    self._opaque.add(rid)
                    return None
            elif rid in self._opaque:
                return None
            key = salt if inputs is None else (salt, *inputs)
            seed = self._seeds.get(key)
            if seed is None:
                self._connect()
                if len(self._seeds) >= _SEEDS_CAPACITY:
                    self._seeds.clear()
                seed = chain_seed(self._base_fp, salt)
                if inputs is not None:
                    seed = inputs_seed(seed, *inputs)
                self._seeds[key] = seed
            st = _Request(rid, seed)
            self._reqs[rid] = st
        return st

    # -- admission --------------------------------------------------------------------------------
    @traced("sched/match", "green")
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Tuple[int, bool]:
        found = self._find_prefix(request, num_computed_tokens)
        if found is None:
            return 0, False
        st, first, hit, is_async = found
        st.pending_load = (first, hit, is_async)
        return len(hit) * self._tpb, is_async

    @traced("sched/reserve", "green")
    def reserve_prefix(self, request: Any, num_computed_tokens: int, reservation_id: int) -> Tuple[int, bool]:
        """The newest manager's admission query (prefix-aware scheduling): the prefix matched after
        ``num_computed_tokens`` is protected from every owner's eviction (``ReservationKeeper``)
        until TensorRT-LLM releases it; nothing is loaded and no page is written until the load
        arrives accepted in ``SchedulerOutput.prefix_loads``."""
        found = self._find_prefix(request, num_computed_tokens)
        if found is None:
            return 0, False
        st, first, hit, is_async = found
        self._reservations[reservation_id] = _Reservation(st.rid, first, hit, [True] * len(hit))
        if self._keeper is None:
            self._keeper = ReservationKeeper(self._recency.promise, self.settings.evict_grace_s / 4)
        self._keeper.hold(reservation_id, hit)
        return len(hit) * self._tpb, is_async

    def release_prefix_reservation(self, request: Any, reservation_id: int, start: int, end: int) -> None:
        """Stop protecting the reservation's blocks that overlap tokens ``[start, end)``; the others,
        and other reservations of the same blocks, keep theirs."""
        res = self._reservations.get(reservation_id)
        if res is None or end <= start:
            return
        tpb = self._tpb
        lo, hi = max(start // tpb - res.first, 0), min(-(-end // tpb) - res.first, len(res.keys))
        for i in range(lo, hi):
            res.protected[i] = False
        kept = [k for k, on in zip(res.keys, res.protected) if on]
        self._keeper.keep(reservation_id, kept)
        if not kept:
            del self._reservations[reservation_id]
            self._emitted_reservations.discard(reservation_id)

    def _find_prefix(self, request: Any, num_computed_tokens: int) -> tuple[_Request, int, list[bytes], bool] | None:
        """The prefix in the pool after ``num_computed_tokens``: (state, first block, keys, async),
        promised to the request; None when nothing is to be loaded.

        The query is once per allocation: a request id seen here before is a replay (its allocation
        was destroyed, by a rollback or a failed admission, with no connector hook called), and
        starts from scratch (:meth:`_drop_attempt`)."""
        if getattr(request, "is_dummy_request", False):
            return None
        if _request_id(request) in self._reqs:
            self._drop_attempt(_request_id(request))
        if not self._load:
            if self._save:  # its seed from the request itself (salt, adapter, inputs), not a later report
                self._state(request)
            return None
        tpb = self._tpb
        st = self._state(request)
        if st is None:
            return None
        if num_computed_tokens == 0 and not st.tokens and self._first_block_absent(request, st):
            return None
        st.set_tokens(request.get_tokens(0), adopt=True)
        st.prompt_len = total = st.base + len(st.tokens)
        if num_computed_tokens % tpb:
            return None
        first = num_computed_tokens // tpb
        limit = (total - 1) // tpb  # always leave one prompt token to compute
        if first >= limit:
            return None
        pools = self._lookup_pools
        if first == 0 and not st.keys:
            # a new prompt: keyed and counted by the pool, a long one in one step (match_chain)
            st.keys, n = pools[0].match_chain(st.seed, st.tokens, tpb, limit)
            keys, pools = st.keys, pools[1:]
        else:
            keys, n = st.keys_upto(limit, tpb), limit - first
        st.drop_keyed(tpb)
        self._note_seen(keys)
        for pool in pools:  # every TP shard must hold the block
            if n == 0:
                break
            n = min(n, pool.count_present(keys, first))
        m = self._match  # folded into the shared counters once per iteration (build_connector_meta)
        m[0] += 1
        m[1] += n
        m[2] += limit - first - n
        if n == 0:
            return None
        is_async = n * self._peer.block_bytes > self.settings.async_load_bytes
        if self._policy is not None and not self._policy.offers(first, n, is_async):
            st.load_range = (first, first + n)  # computed, not loaded: in the pool already, so not saved again
            self._peer.stats.add_many(policy_loads_declined=1, policy_blocks_declined=n)
            return None
        hit = keys[first:first + n]
        self._recency.promise(hit)  # protects the promise from eviction until pinned
        return st, first, hit, is_async

    def _first_block_absent(self, request: Any, st: _Request) -> bool:
        """For a new long prompt, whether its first block is missing from the pool, read from that
        block's tokens alone (TensorRT-LLM's ``get_token``): then nothing matches, and its tokens are
        taken from its first report instead of converting them all here (``get_tokens`` builds an
        int per token: about 1.5 ms more for a 128k-token match).  False where that does not
        apply (a short prompt, no ``get_token``, ``admission=seen:N``, which counts every prefix)."""
        get = getattr(request, "get_token", None)
        if get is None or self._min_seen:
            return False
        count = _num_tokens(request)
        tpb = self._tpb
        if count is None or count < _PROBE_MIN_TOKENS:
            return False
        key = chain_from_tokens(st.seed, [get(0, pos) for pos in range(tpb)], 0, tpb, 1)[0]
        if not self._lookup_pools[0].absent(key):
            return False
        st.prompt_len = count
        m = self._match
        m[0] += 1
        m[2] += (count - 1) // tpb
        return True

    @traced("sched/after_alloc", "green")
    def update_state_after_alloc(self, request: Any, block_ids: List[int]) -> None:
        """A second allocation of a request without a query between is a replay too: the first was
        destroyed, and nothing of it may be loaded into or saved from."""
        rid = _request_id(request)
        st = self._reqs.get(rid)
        if st is not None and st.allocated:
            self._drop_attempt(rid)
            st = self._state(request)
        if st is None:
            return
        st.allocated = True
        if st.pending_load is None:
            return
        first, keys, is_async = st.pending_load
        st.pending_load = None
        n = len(keys)
        ids = block_ids[first:first + n]
        cut = self._cancelled.pop(st.rid, ()) if self._cancelled else ()
        if len(ids) < n:
            # V2 reserves pages for less than the offer when they run short (after handing the
            # offer, or its tail, back with cancel_load, or with chunked prefill's first chunk
            # only): the runtime computes the blocks without a page itself, so they are cut
            tpb = self._tpb
            cut = [*cut, ((first + len(ids)) * tpb, (first + n) * tpb)]
            ids = [*ids, *[-1] * (n - len(ids))]
        self._queue_load(st, first, keys, ids, is_async, cut)

    def _queue_load(self, st: _Request, first: int, keys: Sequence[bytes], ids: Sequence[int], is_async: bool,
                    cut: Sequence[tuple[int, int]] = ()) -> None:
        """Queue the load of blocks ``first, first + 1, ...`` (``keys``) into pages ``ids``, leaving out
        blocks without a page (-1: BAD_PAGE_INDEX) and blocks that overlap a token range in ``cut``
        (``cancel_load``: the runtime will not use those tokens, and their pages may be released).

        The tokens counted as loaded (``kv_end``, ``sync_loaded_tokens``) are those of the blocks
        from ``first`` up to the first cut one: the runtime computes from there on.
        """
        tpb = self._tpb
        n = len(keys)
        kept = n
        blocks: Sequence[int] = range(first, first + n)  # the block index of each of keys
        if cut:
            drop = {b for s, e in cut for b in range(max(first, s // tpb), min(first + n, -(-e // tpb)))}
            if drop:
                kept = min(drop) - first
                keep = [i for i in range(n) if first + i not in drop]
                keys, ids, blocks = [keys[i] for i in keep], [ids[i] for i in keep], [first + i for i in keep]
        if ids and min(ids) >= 0:
            op = LoadOp(st.rid, tuple(keys), tuple(ids), is_async)
        else:
            moved = [(k, b, x) for k, b, x in zip(keys, ids, blocks) if b >= 0]  # -1: no page (BAD_PAGE_INDEX)
            if not moved:
                if is_async:  # the runtime parked the request: an empty load tells the workers it is done
                    self._out_loads.append(LoadOp(st.rid, (), (), True))
                return
            op = LoadOp(st.rid, tuple(k for k, _, _ in moved), tuple(b for _, b, _ in moved), is_async)
            blocks = [x for _, _, x in moved]
        self._out_loads.append(op)
        st.load_range = (first, first + n)  # every block of the offer is in the pool: none is saved again
        if kept:
            st.kv_end = max(st.kv_end, (first + kept) * tpb)
        if is_async:
            st.handed = (blocks[0], blocks[-1] + 1)
        else:
            st.sync_loaded_tokens = kept * tpb
        st.dispatched = True

    def cancel_load(self, request: Any, start: int, end: int) -> None:
        """V2: the runtime will not use offered tokens ``[start, end)`` (their pages could not be
        allocated, or the request ended before a batch).  The blocks of the offer that overlap them
        are not loaded, the others still are.  A load already handed to the workers
        (``build_connector_meta`` ran) is left to finish, as the contract allows, unless the cut
        covers its whole offer (:meth:`_stop_handed_over`)."""
        rid = _request_id(request)
        st = self._reqs.get(rid)
        if st is None or end <= start:
            return
        if st.pending_load is not None:  # cut when the pages are known (update_state_after_alloc)
            self._cancelled.setdefault(rid, []).append((start, end))
            return
        if st.reported:
            return
        queued = self._unqueue_loads(rid)
        if not queued:
            self._stop_handed_over(st, start, end)
            return
        where = {k: b for b, k in enumerate(st.keys)}
        first, end_block = st.load_range
        pages = [-1] * (end_block - first)
        for op in queued:
            for k, page in zip(op.keys, op.block_ids):
                pages[where[k] - first] = page
        st.kv_end = st.sync_loaded_tokens = 0  # nothing was reported yet: only the load had set them
        self._queue_load(st, first, st.keys[first:end_block], pages, queued[0].is_async, [(start, end)])

    def _stop_handed_over(self, st: _Request, start: int, end: int) -> None:
        """Stop an asynchronous load already handed to the workers whose whole offer the runtime
        will not use (the parked request was cancelled, timed out or failed): TensorRT-LLM waits for
        the load before it frees the pages, and after a cancel for only its control grace
        (``control_grace_sec``) before it fails the process, while a long prompt's load from disk can take many.
        Its queued blocks are dropped and its running reads stop between blocks
        (``TransferManager.cancel_loads``); the request is reported loaded once they have.  The
        blocks handed over are what counts (cuts before the hand-over are out already), and cuts of
        its head and of its tail add up; a cut that leaves part of it lets the load finish: the
        blocks the runtime keeps must arrive."""
        if st.handed is None:
            return
        tpb = self._tpb
        lo, hi = st.handed
        cut_lo, cut_hi = start // tpb, -(-end // tpb)  # the blocks the cut overlaps
        if cut_lo <= lo:
            lo = max(lo, cut_hi)
        elif cut_hi >= hi:
            hi = min(hi, cut_lo)
        if lo < hi:
            st.handed = (lo, hi)
            return
        st.handed = None
        st.kv_end = min(st.kv_end, st.load_range[0] * tpb)  # nothing of the offer may count as computed now
        if self._sole_worker:
            self._connect().cancel_loads([st.rid])
        else:
            self._out_cancels.append(st.rid)
            if self._board is not None:  # made when the load was handed over (build_connector_meta)
                self._board.post([st.rid])

    def request_reset(self, request: Any) -> None:
        """V2 versions that call it: the allocation was released and the request replays from
        scratch (:meth:`_drop_attempt`).  Versions that do not are served as well: a replay is
        recognised by its next query, allocation or first report."""
        self._drop_attempt(_request_id(request))

    def _drop_attempt(self, rid: int) -> None:
        """The request's allocation was destroyed; its pages may hold another request's KV after
        the next forward.  A load of it not yet handed to the workers is
        dropped here.  Transfers already handed over are fenced (``TransferManager.fence``) before
        that forward: a save reading the pages later would publish another request's KV under this
        one's keys, a load would write into another request's pages.  The next metadata carries the
        id, and every worker fences in start_load_kv (before every forward): it waits for the
        request's running transfers and raises ConnectorFailure if one outlives its deadline (a
        wrong publish is worse than a crash), from a callback whose exceptions TensorRT-LLM treats
        as fatal.  The process's only worker (TP 1, attention DP) also drops the queued ones now.
        The request's prefix reservations are not touched: TensorRT-LLM releases each by its id."""
        st = self._reqs.pop(rid, None)
        self._opaque.discard(rid)
        self._prefilling.discard(rid)
        self._cancelled.pop(rid, None)
        self._unqueue_loads(rid)
        if st is not None and st.dispatched:
            if self._sole_worker:  # its queued transfers go now; start_load_kv waits for running ones
                self._connect().fence([rid], wait=False)
            self._out_resets.append(rid)

    def _unqueue_loads(self, rid: int) -> list[LoadOp]:
        """Take the request's loads not yet handed to the workers out of the queue."""
        mine = [op for op in self._out_loads if op.request_id == rid]
        if mine:
            self._out_loads = [op for op in self._out_loads if op.request_id != rid]
        return mine

    # -- per iteration ----------------------------------------------------------------------------
    @traced("sched/build_meta", "green")
    def build_connector_meta(self, scheduler_output: Any) -> GdsKvMetadata | None:
        """This iteration's loads and saves for the workers; None where there are none (most decode
        iterations), so no object is built, broadcast under TP, bound and freed for nothing.

        The same scheduler output given again is TensorRT-LLM rebuilding the plan it bound, after
        taking out a request whose load had not started (:meth:`_rebuild`)."""
        # Runs every iteration on the executor thread: a helper call costs about a microsecond, so
        # the steps that usually have nothing to do are tested here before their helper is called.
        if scheduler_output is self._last_out():
            return self._rebuild(scheduler_output)
        if self._forwards is not None:
            self._note_work(scheduler_output)
        prefix_loads = getattr(scheduler_output, "prefix_loads", None)
        loads: list[LoadOp] = self._prefix_loads(prefix_loads) if prefix_loads else []
        saves: list[SaveOp] = []
        new, cached = scheduler_output.new_requests, scheduler_output.cached_requests
        if new:
            self._fold_reports(new, True, saves)
        self._fold_reports(cached, False, saves)
        if self._match[0]:
            self._flush_match_counts()
        if self._out_loads:
            loads += self._take_loads(new)
        # The output is kept to tell a rebuild (the same object given again) from a new plan, weakly: a
        # strong reference would keep it and every report in it alive until the next iteration, whose
        # callback would then pay for freeing them, time TensorRT-LLM spends anyway where it drops it.
        try:
            self._last_out = weakref.ref(scheduler_output)
        except TypeError:  # a type without weak references (__slots__): kept one iteration longer
            self._last_out = lambda: scheduler_output
        meta = self._plan(loads, saves, 0)
        # TensorRT-LLM rebuilds a plan after taking out a request whose load had not started: only a
        # plan with work can be rebuilt with requests gone, so only its requests are named (a decode
        # step's plan is None, and naming its requests every iteration is most of its cost here).
        self._last_rids = _rids_named(scheduler_output) if meta is not None else []
        self._last_meta = meta
        return meta

    def _prefix_loads(self, prefix_loads: Sequence[Any]) -> list[LoadOp]:
        """The loads of this output's accepted prefix reservations not handed over yet."""
        return [op for pl in prefix_loads if (op := self._prefix_load(pl)) is not None]

    def _note_work(self, scheduler_output: Any) -> None:
        """The tokens this plan's forward computes, for the load policy's compute estimate: each
        scheduled request's tokens and how many precede them (a synchronously loaded request's first
        report leaves its loaded tokens out of ``computed_position``; they are still attended to).
        A new request computes prompt tokens; a cached one does when it has more than one token
        scheduled (a prompt chunk), a decode step otherwise.  A new request with a loaded prefix is
        on its first forward after the load (``ForwardClock.after_load_s``)."""
        reqs = self._reqs
        spans: list[tuple[int, int, bool]] = []
        loaded: list[int] = []
        for rd in scheduler_output.new_requests:
            st = reqs.get(rd.request_id)
            spans.append((rd.computed_position + (st.sync_loaded_tokens if st else 0), rd.num_scheduled_tokens, True))
            if st is not None and st.load_range[1] > st.load_range[0]:  # its first report follows its load
                loaded.append(rd.request_id)
        spans += [(rd.computed_position, rd.num_scheduled_tokens, rd.num_scheduled_tokens > 1)
                  for rd in scheduler_output.cached_requests]
        self._forwards.note_work(spans, loaded)

    def _plan(self, loads: list[LoadOp], saves: list[SaveOp], replaces: int) -> GdsKvMetadata | None:
        """The metadata of these loads and saves, with the resets and cancels queued since the last."""
        resets, cancels = self._out_resets, self._out_cancels
        if not loads and not saves and not resets and not cancels:
            return None
        if resets:
            self._out_resets = []
        if cancels:
            self._out_cancels = []
        board = ""
        if not self._sole_worker and any(op.is_async for op in loads):  # the loads a cancel can stop
            if not self._board_tried:
                self._board_tried = True
                self._board = CancelBoard.open()
            board = self._board.path if self._board is not None else ""
        self._serial += 1
        return GdsKvMetadata(loads, saves, resets, cancels, board, self._serial, replaces)

    def _take_loads(self, new_requests: Sequence[Any]) -> list[LoadOp]:
        """The queued loads to hand over now: every asynchronous one (its request is parked, or the
        workers drop it unconfirmed), and a synchronous one only with its request's first report:
        an admission dropped after ``update_state_after_alloc`` is not in the batch, and its load
        must never write the pages its destroyed allocation gave back (it waits for the replay,
        which drops it, or for ``request_finished``)."""
        queued = self._out_loads
        if not queued:
            return []
        if all(op.is_async for op in queued):
            self._out_loads = []
            return queued
        scheduled = {rd.request_id for rd in new_requests}
        now = [op for op in queued if op.is_async or op.request_id in scheduled]
        self._out_loads = [op for op in queued if not op.is_async and op.request_id not in scheduled]
        return now

    def _rebuild(self, scheduler_output: Any) -> GdsKvMetadata | None:
        """The plan bound last, built again for the same output less the requests TensorRT-LLM took
        out of it (their loads had not started; they terminate or replay): their state is dropped
        and their transfers with it.  Saves planned in the replaced binding for the requests still
        in the output are carried over, so none is lost; nothing is folded twice."""
        gone = set(self._last_rids) - set(_rids_named(scheduler_output))
        for rid in gone:
            self._drop_attempt(rid)
        prev = self._last_meta
        loads = [op for op in prev.loads if op.request_id not in gone] if prev is not None else []
        saves = [op for op in prev.saves if op.request_id not in gone] if prev is not None else []
        loads += self._take_loads(scheduler_output.new_requests)
        resets, cancels = (prev.resets, prev.cancels) if prev is not None else ([], [])
        self._out_resets[:0] = [r for r in resets if r not in self._out_resets]
        self._out_cancels[:0] = [c for c in cancels if c not in self._out_cancels]
        self._last_rids = [rid for rid in self._last_rids if rid not in gone]
        self._last_meta = self._plan(loads, saves, prev.serial if prev is not None else 0)
        return self._last_meta

    def _prefix_load(self, pl: Any) -> LoadOp | None:
        """The load of an accepted prefix reservation: its blocks inside ``[start, end)`` into the
        pages the runtime gave them, and nothing past that range; each reservation's load is handed
        over once, and an empty one still is, so the worker reports its id."""
        rid_res = pl.reservation_id
        if rid_res in self._emitted_reservations:
            return None
        res = self._reservations.get(rid_res)
        if res is None:
            raise RuntimeError(f"gds-kv-connector: prefix load {rid_res} of request {pl.request_id} names no "
                               "reservation this scheduler made (released before its load was accepted)")
        groups = pl.block_ids_by_layer_group
        if len(groups) != 1:
            raise NotImplementedError("gds-kv-connector supports one KV layer group")
        pages = groups[0]
        tpb = self._tpb
        lo = max(-(-pl.start // tpb), res.first)
        hi = min(pl.end // tpb, res.first + len(res.keys), len(pages))
        moved = [(res.keys[b - res.first], pages[b]) for b in range(lo, hi) if pages[b] >= 0]
        self._emitted_reservations.add(rid_res)
        op = LoadOp(pl.request_id, tuple(k for k, _ in moved), tuple(p for _, p in moved), bool(pl.is_async),
                    rid_res)
        st = self._reqs.get(pl.request_id)
        if st is not None and hi > lo:
            st.load_range = (lo, hi)  # in the pool: none of these blocks is saved again
            st.kv_end = max(st.kv_end, hi * tpb)
            if pl.is_async:
                st.handed = (lo, hi)
                if self._forwards is not None:
                    self._forwards.expect_reservation(rid_res, pl.request_id)
            else:
                st.sync_loaded_tokens = pl.end - pl.start  # what the runtime subtracts from its first report
            st.dispatched = True
        return op

    def _flush_match_counts(self) -> None:
        """The match counters go to the shared stats (a lock and a dict update) once per iteration,
        not once per request matched: admitting 64 requests paid that 64 times."""
        m = self._match
        if m[0] and self._peer is not None:
            self._peer.stats.add_many(match_queries=m[0], match_blocks_hit=m[1], match_blocks_miss=m[2])
            m[0] = m[1] = m[2] = 0

    def _fold_reports(self, reports: Sequence[Any], first: bool, saves: list[SaveOp]) -> None:
        """Fold each scheduled request's report into its state and queue the saves it makes due.

        With eager saving of generated blocks it runs for every scheduled request every iteration, so
        it is one loop over locals; otherwise later reports are folded only for requests whose prompt
        is still being computed, and a decode step costs nothing here.
        """
        reqs, tpb, save = self._reqs, self._tpb, self._save
        prefilling = None if self._fold_decode else self._prefilling
        if prefilling is not None and not first:
            if not prefilling or not save:
                return  # every scheduled request is decoding: nothing to fold until it finishes
            reports = [rd for rd in reports if rd.request_id in prefilling]
        # Reports of one call share a type: whether it has V2's per-group ids is asked once, and each
        # report's field is then read directly (a getattr call per report cost about a tenth of a
        # 64-request decode step's fold); a report without it is still handled.
        grouped = bool(reports) and hasattr(reports[0], "new_block_ids_by_layer_group")
        for rd in reports:
            st = reqs.get(rd.request_id)
            if st is None:
                if not first:  # its earlier tokens and pages are unknown here (its state was dropped
                    continue   # by request_reset): keys of a suffix would name another prefix's KV
                st = self._state(rd.request_id, _cache_salt(rd))
                if st is None:  # opaque inputs: never saved
                    continue
            if first and st.reported:  # reported new again: its allocation was destroyed and replayed
                self._drop_attempt(st.rid)
                st = self._state(rd.request_id, _cache_salt(rd))
                if st is None:
                    continue
            if first and not st.reported:
                if rd.new_tokens:
                    st.set_tokens(rd.new_tokens)  # a list of its own, extended in place below
                else:
                    st.tokens = list(st.tokens)  # the match may have adopted the caller's list
                st.prompt_len = st.prompt_len or st.base + len(st.tokens)
                end = st.sync_loaded_tokens
            else:
                st.tokens += rd.new_tokens
                end = 0
            st.reported = True
            blocks = rd.new_block_ids
            if not blocks and grouped:
                try:
                    by_group = rd.new_block_ids_by_layer_group
                except AttributeError:
                    by_group = None
                blocks = by_group[0] if by_group and len(by_group) == 1 else ()
            if blocks:
                st.block_ids += blocks
            end += rd.computed_position + rd.num_scheduled_tokens
            if end > st.kv_end:
                st.kv_end = end
            if save and st.kv_end >= (st.next_save + 1) * tpb:  # a further block's KV is written
                op = self._due_save(st)
                if op is not None:
                    saves.append(op)
            if prefilling is not None:
                if st.kv_end < st.prompt_len:
                    prefilling.add(st.rid)
                else:
                    prefilling.discard(st.rid)

    def _due_save(self, st: _Request) -> SaveOp | None:
        """Blocks that are full and whose KV the forward will have written this iteration.

        Called for every request every iteration; most have completed no block since the last
        call, so that case is settled by a few comparisons before any list is built.
        """
        tpb = self._tpb
        start = st.next_save
        if st.kv_end < (start + 1) * tpb or not self._save:  # the KV of no further block is written yet
            return None
        # floor(min(...) / tpb) == min of the floors: full blocks of tokens, of written KV and of
        # reported block ids (and of the prompt, when only prompts are saved)
        full = min(st.base + len(st.tokens), st.kv_end, len(st.block_ids) * tpb)
        if self._prompt_only:
            full = min(full, st.prompt_len)
        full //= tpb
        if full <= start:
            return None
        keys = st.keys_upto(full, tpb)
        st.drop_keyed(tpb)
        lo, hi = st.load_range
        ids = st.block_ids
        st.next_save = full
        if (hi <= start or lo >= full) and not self._min_seen and min(ids[start:full]) >= 0:
            # the usual case, every block of the run: slices, not a selection per block
            st.dispatched = True
            return SaveOp(st.rid, tuple(keys[start:full]),
                          (keys[start - 1] if start else ZERO_KEY, *keys[start:full - 1]), tuple(ids[start:full]))
        sel = [b for b in range(start, full) if ids[b] >= 0 and not lo <= b < hi]
        if self._min_seen:
            admitted = [b for b in sel if self._admit(keys[b])]
            if len(admitted) < len(sel):
                self._connect().stats.add("save_blocks_not_admitted", len(sel) - len(admitted))
            sel = admitted
        if not sel:
            return None
        st.dispatched = True
        return SaveOp(st.rid, tuple([keys[b] for b in sel]), tuple([keys[b - 1] if b else ZERO_KEY for b in sel]),
                      tuple([ids[b] for b in sel]))

    def _admit(self, key: bytes) -> bool:
        return self._seen.get(key, 0) >= self._min_seen

    def _note_seen(self, keys: list[bytes]) -> None:
        if not self._min_seen:
            return
        for k in keys:
            self._seen[k] = self._seen.pop(k, 0) + 1
        while len(self._seen) > _SEEN_CAPACITY:
            self._seen.popitem(last=False)

    # -- completion -------------------------------------------------------------------------------
    @traced("sched/request_finished", "green")
    def request_finished(self, request: Any, cache_block_ids: List[int]) -> bool:
        if getattr(request, "is_dummy_request", False):
            return False
        rid = _request_id(request)
        st = self._reqs.pop(rid, None)
        if st is None:
            if self._opaque:
                self._opaque.discard(rid)
            return False
        if self._cancelled:
            self._cancelled.pop(rid, None)
        if self._out_loads:  # ended after its allocation, before the metadata that carries its load:
            self._unqueue_loads(rid)  # that load would write pages the runtime frees now
        # eager saving folds every report, so its KV end says whether the prompt was computed
        prefilled = st.kv_end >= st.prompt_len if self._fold_decode else rid not in self._prefilling
        self._prefilling.discard(rid)
        saving = self._final_save(request, st, cache_block_ids, prefilled)
        if st.keys and self._recency is not None:
            # The chain, head first: RecencyLog stamps it newest at the head, so every ancestor of a
            # block this request saved is at least as recent as that block, and least-recently-used
            # eviction removes a chain's tail before its head without seeing the whole chain.
            self._recency.touch(st.keys)
        return saving

    def _final_save(self, request: Any, st: _Request, cache_block_ids: List[int], prefilled: bool) -> bool:
        """Hand over the save of the blocks the request completed since its last save; whether a save
        of it is in progress, the value :meth:`request_finished` returns."""
        if self._save:  # the final tokens and block ids matter only to the last save
            tpb, base = self._tpb, st.base
            have = base + len(st.tokens)
            # Tokens that complete no further block cannot change the save.  TensorRT-LLM's count
            # says so without converting the whole token list (128k ints for a long prompt).
            count = _num_tokens(request)
            if count is None or count // tpb > have // tpb:
                tail = _tail_tokens(request, st.tokens, have, count)
                if tail is not None:
                    st.tokens = st.tokens + tail
                else:
                    tokens = request.get_tokens(0)
                    if not isinstance(tokens, list):
                        tokens = list(tokens)
                    if len(tokens) // tpb > have // tpb and tokens[base:have] == st.tokens:
                        st.tokens = tokens[base:]
            if len(cache_block_ids) > len(st.block_ids):
                st.block_ids = list(cache_block_ids)
            # Every token but the last sampled one has been through a forward, whose event the
            # final save waits for; the last one's KV never was (with speculative decoding its
            # position may hold a rejected draft's, which a decode report counted as written).
            total = count if count is not None else st.base + len(st.tokens)
            if prefilled and st.reported and total - 1 > st.kv_end:
                # its decode reports were not folded, or the last one lags a step (overlap scheduler)
                st.kv_end = total - 1
            elif st.kv_end > total - 1:
                st.kv_end = total - 1
            dispatched = st.dispatched
            final = self._due_save(st)
            if final is not None:
                if self._sole_worker:
                    self._connect().deliver_saves([final])
                    return True
                # Under plain TP the other ranks' workers would get this save only with the next
                # metadata, after this iteration's get_finished has let TensorRT-LLM free the pages
                # it reads: it is dropped (counted), never sent late.
                self._connect().stats.add("save_blocks_dropped_at_finish", len(final.keys))
                return dispatched
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


def _no_output() -> None:
    return None


def _rids_named(scheduler_output: Any) -> list[int]:
    """The requests a scheduler output reports or loads a reservation for."""
    rids = [rd.request_id for rd in scheduler_output.new_requests]
    rids += [rd.request_id for rd in scheduler_output.cached_requests]
    rids += [pl.request_id for pl in getattr(scheduler_output, "prefix_loads", None) or ()]
    return rids


def _num_tokens(request: Any) -> int | None:
    """The request's token count (beam 0) where it has ``get_num_tokens``, as TensorRT-LLM's binding
    does; None where it does not (the contract promises only ``get_tokens``)."""
    count = getattr(request, "get_num_tokens", None)
    if count is None:
        return None
    n = count(0)
    return n if type(n) is int else None


def _tail_tokens(request: Any, held: list[int], have: int, count: int | None) -> list[int] | None:
    """Tokens ``[have, count)`` read one by one (TensorRT-LLM's ``get_token``) when they are few
    beside the request's length; None where that does not apply, and the caller converts the whole
    list.  ``get_tokens`` converts every token of a 128k-token request (about 3 ms for 131073 ints,
    ``array.tolist``) to save the few generated ones.  The last held token, if any (those
    of keyed blocks are not held), is read back as a check that the tokens are still the ones held."""
    get = getattr(request, "get_token", None)
    if get is None or count is None or (count - have) * _TAIL_RATIO > count:
        return None
    if held and get(0, have - 1) != held[-1]:
        return None
    return [get(0, pos) for pos in range(have, count)]


_OPAQUE = ()  # _request_inputs' answer for inputs no key can name


def _request_inputs(request: Any) -> tuple[int | None, tuple[int, ...]] | tuple[()] | None:
    """What besides tokens and salt decides the request's KV: None when nothing does (its keys are
    the plain chain's), (LoRA task id, multimodal content hashes flattened) when those do, and
    ``_OPAQUE`` for multimodal data without TensorRT-LLM's hashes (``multimodal_hashes``), whose KV
    no key here could tell apart from another image's behind the same placeholder tokens."""
    lora = getattr(request, "lora_task_id", None)
    hashes = getattr(request, "multimodal_hashes", None)
    flat: tuple[int, ...] = ()
    if hashes:
        flat = tuple(int(h) for group in hashes for h in (group if isinstance(group, (list, tuple)) else (group,)))
    elif (getattr(request, "py_multimodal_data", None) or getattr(request, "multimodal_embedding", None) is not None
          or getattr(request, "multimodal_positions", None) or getattr(request, "multimodal_lengths", None)):
        return _OPAQUE
    if lora is None and not flat:
        return None
    return (None if lora is None else int(lora), flat)


def _cache_salt(request: Any) -> str | int | None:
    """The request's salt: a string, or the integer ``cache_salt_id`` of older versions, which
    ``chain_seed`` keeps apart from every string salt."""
    for attr in ("cache_salt", "py_cache_salt"):
        salt = getattr(request, attr, None)
        if salt is not None:
            return str(salt)
    salt_id = getattr(request, "cache_salt_id", None)
    return None if salt_id is None else int(salt_id)
