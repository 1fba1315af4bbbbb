"""The worker half: owns the KV pool view, the I/O engine and the transfer threads of one rank."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, List, Tuple

import torch

from gds_kv_connector.connector.cancel_board import CancelReader
from gds_kv_connector.maintenance.capacity import CapacityGuard, PromisedKeys
from gds_kv_connector.engines.select import make_engine
from gds_kv_connector.engines.fileops import FileOps
from gds_kv_connector.format.keys import PoolGeometry, shard_fingerprint
from gds_kv_connector.engines.kv_layout import KvPool, LayoutError, pool_from_layout, pool_from_tensor
from gds_kv_connector.connector.llm_config import check_parallelism, read_llm_args
from gds_kv_connector.connector.load_policy import ForwardClock, ForwardCost, LoadEstimates, LoadRate
from gds_kv_connector.connector.local_peer import PeerInfo, register, unregister
from gds_kv_connector.maintenance.owner_stats import Snapshot, StatsPublisher
from gds_kv_connector.connector.metadata import GdsKvMetadata
from gds_kv_connector.transfer.jobs import LoadOp
from gds_kv_connector.store.arena import slab_kind, start_arena
from gds_kv_connector.store.pool import BlockPool
from gds_kv_connector.maintenance.recency import RecencyLog
from gds_kv_connector.config.settings import Settings, SettingsError
from gds_kv_connector.util.counters import GaugeSource, Stats
from gds_kv_connector.config.trace_ranges import check_mode, trace_range, traced
from gds_kv_connector.transfer.manager import TransferManager
from gds_kv_connector.connector.trtllm_api import KvCacheConnectorWorker, control_grace_s, mpi_rank, transfer_timeout_s

log = logging.getLogger(__name__)


class GdsKvConnectorWorker(KvCacheConnectorWorker):
    """TensorRT-LLM connector worker moving full KV blocks between the pool tensor and files."""

    supports_attention_dp = True

    def __init__(self, llm_args: Any, *, fileops: FileOps | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        """``fileops``: the pool's system calls (tests inject faults); ``clock``: the time source of
        the load policy's measurements (tests inject a simulated one; a CUDA pool times forwards
        with CUDA events)."""
        super().__init__(llm_args)
        self.settings = Settings.load_from()
        _check_deadline_fits(self.settings, transfer_timeout_s(llm_args), control_grace_s(llm_args))
        check_mode(self.settings.trace)
        self.config = read_llm_args(llm_args, self.settings.model_id)
        check_parallelism(self.config)
        self.stats = Stats()
        self._fileops = fileops
        self.kv: KvPool | None = None
        self.pool: BlockPool | None = None
        self.transfers: TransferManager | None = None
        self.recency: RecencyLog | None = None
        self.capacity: CapacityGuard | None = None
        self._board: CancelReader | None = None  # plain TP: the scheduler's cancels between metadata
        # The binding taken last (``_take_binding``), and the saves of the bindings taken since the
        # last forward's wait_for_save: each binding's work is taken once.
        self._bound: GdsKvMetadata | None = None
        self._unsaved: list = []
        # Asynchronous loads handed over but not yet confirmed by TensorRT-LLM (``_hold_async``).
        self._unconfirmed: dict[int, list[tuple[LoadOp, Any]]] = {}
        self.stats_publisher: StatsPublisher | None = None
        self._clock = clock or time.monotonic
        # what TLLM_GDS_KV_LOAD_POLICY decides from; None under always (nothing measured)
        self.estimates: LoadEstimates | None = None
        self._forwards: ForwardClock | None = None

    # -- start-up ---------------------------------------------------------------------------------
    def register_kv_caches(self, kv_cache_tensor: torch.Tensor) -> None:
        self._setup(pool_from_tensor(kv_cache_tensor))

    def register_kv_cache_layout(self, layout: Any) -> None:
        pages = getattr(layout, "tokens_per_block", None)
        if isinstance(pages, int) and pages != self.config.tokens_per_block:
            # keys cut every config.tokens_per_block tokens would name pages of another size: each
            # page's bytes published under a shorter (or longer) prefix's key
            raise LayoutError(f"the KV cache layout has {pages} tokens per block, but llm_args says "
                              f"{self.config.tokens_per_block} (kv_cache_config.tokens_per_block): set it to "
                              f"{pages}")
        self._setup(pool_from_layout(layout), from_layout=True)

    def _setup(self, kv: KvPool, from_layout: bool = False) -> None:
        if self.kv is not None:
            raise RuntimeError("gds-kv-connector: the KV cache was registered twice")
        cfg = self.config
        if cfg.kv_fp4:
            raise LayoutError(f"gds-kv-connector: an NVFP4 KV cache ({cfg.precision}) keeps its block scales in a "
                              "pool of their own, which the connector does not save or load: a loaded block would "
                              "be read with another block's scales; use an FP8 or 16-bit KV cache")
        # A V2 layout's byte tensor does not say whether its KV is fp16 or bf16 (equal sizes): the
        # configured precision stands in for the dtype, so the two never share a fingerprint.  A
        # tensor handed to register_kv_caches keeps its own dtype, uint8 too (pools saved stay found).
        dtype = f"bytes[{cfg.precision}]" if from_layout and kv.dtype_name == "uint8" else kv.dtype_name
        geom = PoolGeometry(cfg.model_id, dtype, kv.num_layers, kv.kv_factor, kv.block_bytes,
                            cfg.tokens_per_block, cfg.tp_size if cfg.sharded_attention else 1)
        shards = range(geom.tp_size)
        fingerprints = tuple(shard_fingerprint(geom, r) for r in shards)
        my_fp = fingerprints[mpi_rank() % geom.tp_size] if cfg.sharded_attention else fingerprints[0]
        self.pool = BlockPool(self.settings.roots, my_fp, kv.block_bytes, cfg.tokens_per_block,
                              share_group=self.settings.share_group, fsync=self.settings.fsync,
                              index_ttl_s=self.settings.index_ttl_s, geometry_note=geom.describe(),
                              ops=self._fileops, refs=self.settings.arena_bytes > 0)
        limit = self.settings.max_queued_save_bytes
        if 0 < limit < self.pool.payload_len:  # no save would ever fit: saving silently off
            raise SettingsError(f"TLLM_GDS_KV_MAX_QUEUED_SAVE_BYTES={limit} is below one block's {self.pool.payload_len} "
                                "bytes, so every save would be dropped: raise it, or set TLLM_GDS_KV_SAVE=false")
        engine = make_engine(self.settings.engine, kv.device, self.settings.io_threads, self._fileops,
                             probe_dir=self.pool.fp_dirs[0], compat_io=self.settings.compat_io)
        if self.settings.arena_bytes:
            self.pool.arena = start_arena(self.pool, engine, self.settings)
        self.kv = kv
        self.recency = RecencyLog.for_process(self.settings.roots)
        self.capacity = CapacityGuard.from_settings(self.settings, recency=self.recency, stats=self.stats)
        if self.pool.arena is not None:  # a full arena keeps the blocks any owner promised, as every remover
            self.pool.arena.promised = PromisedKeys(self.pool.root_of, self.pool.roots, self.recency,
                                                    self.capacity.grace_s)
        self.stats_publisher = StatsPublisher(self.settings.roots, self.recency.owner_id, self._snapshot,
                                              self.settings.stats_interval_s)
        if self.settings.load_policy != "always":
            self.estimates = LoadEstimates(LoadRate(f"{':'.join(self.pool.roots)} via {engine.data_path()}",
                                                    self._clock),
                                           ForwardClock(ForwardCost(), *_forward_stamps(kv.device, self._clock),
                                                        self._clock))
            self._forwards = self.estimates.forwards
        self.transfers = TransferManager(self.pool, engine, kv, self.settings, self.stats,
                                         on_saved=self.capacity.note_saved, record_event=self._record_event,
                                         load_meter=self.estimates.rate if self.estimates is not None else None)
        self.stats.add_gauges(self.transfers.queue_gauges)
        self.stats.add_gauges(_pool_usage(self.capacity))
        register(self._llm_args, PeerInfo(geom, fingerprints, kv.block_bytes, self.transfers.deliver_saves,
                                          self.transfers.fence, self.transfers.cancel_loads, self.stats, self.pool,
                                          self.estimates))
        arena = self.pool.arena
        log.info("gds-kv-connector: %d blocks of %d bytes, engine %s, pool %s (%s), %s", kv.num_blocks,
                 kv.block_bytes, engine.data_path(), ":".join(self.pool.roots), geom.describe(),
                 "one file per block" if arena is None else
                 f"slot arena of {self.settings.arena_bytes} bytes, {slab_kind(arena.mapped)}")

    # -- per iteration ----------------------------------------------------------------------------
    @traced("worker/start_load_kv", "yellow")
    def start_load_kv(self, stream: Any) -> None:
        """Also fences the transfers of requests reset under plain TP (``GdsKvMetadata.resets``), and
        stops the loads of offers cancelled after they were handed over (``cancels``): the executor
        runs this before every forward, the one that may give their pages to another request
        included (an override of bind_connector_meta cost every iteration a call).

        TensorRT-LLM may call it more than once in an iteration, each time for newly bound work: a
        binding's loads start once, and a binding built again in place of one already started
        starts only the loads that one did not."""
        taken = self._take_binding()
        if taken is None:
            return
        meta, loads = taken
        if meta.cancel_board and (self._board is None or self._board.path != meta.cancel_board):
            if self._board is not None:
                self._board.close()
            self._board = CancelReader(meta.cancel_board)
        if loads:
            # ids posted while nothing was in flight here are read before these loads are submitted:
            # one must never stop a replay's load (a request reset and replayed keeps its id)
            self._cancels_from_board()
        if meta.cancels:
            self._drop_unconfirmed(meta.cancels, "cancel")
            self.transfers.cancel_loads(meta.cancels)
        if meta.resets:
            self._drop_unconfirmed(meta.resets, "reset")
            self.transfers.fence(meta.resets)
        if loads:
            event = self._record_event(stream)
            self.transfers.submit_loads(self._hold_async(loads, event), event)

    def _take_binding(self) -> tuple[GdsKvMetadata, list[LoadOp]] | None:
        """The bound metadata and its loads to start, once per binding (None: nothing new bound).

        Its saves join those of the bindings taken since the last forward: TensorRT-LLM may bind
        several plans in one iteration, each for newly bound work, and the forward's
        ``wait_for_save`` submits them all.  A plan built again in place of the one taken last
        (``GdsKvMetadata.replaces``) replaces that one's saves and starts only the loads it lacked."""
        meta = self._metadata
        if not isinstance(meta, GdsKvMetadata) or meta is self._bound:
            return None
        prev, self._bound = self._bound, meta
        if prev is not None and meta.replaces and meta.replaces == prev.serial:
            started = set(_op_ids(prev.loads))
            self._unsaved = list(meta.saves)
            return meta, [op for op, oid in zip(meta.loads, _op_ids(meta.loads)) if oid not in started]
        self._unsaved += meta.saves
        return meta, meta.loads

    def _hold_async(self, loads: list[LoadOp], event: Any) -> list[LoadOp]:
        """The loads to submit now; the asynchronous ones TensorRT-LLM has not confirmed yet are held.

        An asynchronous answer parks the request only once the runtime commits it; an admission
        dropped after ``update_state_after_alloc`` (its allocation destroyed, its pages free at
        once) is never committed, and its id never reaches ``get_finished`` as started.  Such a load
        is submitted when its id arrives there (the same iteration's poll, after the forward), and
        dropped if it does not: it must never write pages the runtime has freed.  A load of a
        prefix reservation was dispatched by the runtime itself and goes at once."""
        now: list[LoadOp] = []
        loading = self.transfers.loading_ids
        for op in loads:
            if op.is_async and not op.reservation and op.request_id not in loading:
                self._unconfirmed.setdefault(op.request_id, []).append((op, event))
            else:
                now.append(op)
        return now

    def _confirm_async(self, started_loading_req_ids: List[int]) -> None:
        """Submit the held loads of requests the runtime parked; drop the others (never admitted)."""
        held, self._unconfirmed = self._unconfirmed, {}
        started = set(started_loading_req_ids)
        for rid, entries in held.items():
            if rid in started:
                for op, event in entries:
                    self.transfers.submit_loads([op], event)
            else:
                self.stats.add("load_blocks_not_admitted", sum(len(op.keys) for op, _ in entries))

    def _drop_unconfirmed(self, request_ids: List[int], cause: str) -> None:
        for rid in request_ids:
            entries = self._unconfirmed.pop(rid, None)
            if entries:
                self.stats.add(f"load_blocks_{cause}_held", sum(len(op.keys) for op, _ in entries))

    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None:
        if self.transfers is not None and self.transfers.has_sync_loads:
            with trace_range("worker/wait_sync_load", "red"):
                self.transfers.wait_sync_loads()
        if self._forwards is not None:  # the forward's compute starts here, after any load it waited for
            self._forwards.begin(stream)

    def save_kv_layer(self, layer_idx: int, stream: Any) -> None:
        """Saves are issued once per iteration in wait_for_save, after the last layer."""

    @traced("worker/wait_for_save", "yellow")
    def wait_for_save(self, stream: Any) -> None:
        if self.transfers is None:
            return
        if self._forwards is not None:
            self._forwards.end(stream)
        self._take_binding()  # one bound without a start_load_kv still has its saves taken
        saves, self._unsaved = self._unsaved, []
        if saves:
            event = self._record_event(stream)
            self.transfers.note_forward(stream, event)
            self.transfers.submit_saves(saves, event)
        else:  # no event unless saves of finished requests arrive (transfers.poll records one then)
            self.transfers.note_forward(stream)

    @traced("worker/get_finished", "yellow")
    def get_finished(self, finished_gen_req_ids: List[int],
                     started_loading_req_ids: List[int]) -> Tuple[List[int], List[int]]:
        if self.transfers is None:
            return [], []
        if self._forwards is not None:
            self._forwards.collect()
        if self._unconfirmed:
            self._confirm_async(started_loading_req_ids)
        if self._board is not None and self.transfers.has_async_loads:  # plain TP: cancels no metadata brought
            self._cancels_from_board()
        done = self.transfers.poll(list(finished_gen_req_ids), list(started_loading_req_ids))
        if done[1] and self._forwards is not None:
            self._forwards.loads_reported(done[1])
        return done

    def get_finished_prefix_loads(self) -> List[int]:
        """Reservation ids whose accepted loads (``SchedulerOutput.prefix_loads``) have finished here,
        each once; a failed one raises ConnectorFailure, as a failed asynchronous load does."""
        if self.transfers is None:
            return []
        done = self.transfers.finished_reservations()
        if done and self._forwards is not None:
            self._forwards.loads_reported((), done)
        return done

    def _cancels_from_board(self) -> None:
        """Stop the loads of requests the scheduler posted to its cancel board since the last read."""
        if self._board is not None:
            cancelled = self._board.new_ids()
            if cancelled:
                self.transfers.cancel_loads(cancelled)

    # -- shutdown ---------------------------------------------------------------------------------
    def shutdown(self) -> dict[str, int]:
        """Stop accepting transfers, drop queued ones, drain in-flight ones within the control grace."""
        unregister(self._llm_args)
        if self._board is not None:
            self._board.close()
        if self.transfers is None:
            return {"dropped": 0, "stuck": 0}
        result = self.transfers.shutdown()
        if self.pool is not None and self.pool.arena is not None:
            if result.get("stuck"):  # unmapping under a transfer still copying would crash the process
                log.warning("gds-kv: %d transfers still running at shutdown; the arena stays mapped", result["stuck"])
            else:
                self.pool.arena.close()
        self.capacity.close()
        self.stats_publisher.close()
        self.recency.flush()  # not close(): the scheduler of this process shares the log
        return result

    def _snapshot(self) -> Snapshot:
        """Counters for the owner's stats file, with the arena's numbers when it runs one: its slot
        and slab holdings are gauges (what this process holds now, which the next process adopts
        when this one exits), its event counts counters; ``gds-kv stats`` sums the two differently.
        The latency histograms go as counters too, and the gauges of the transfer queue and the
        pool's usage as this owner's evictor saw it (``Stats.add_gauges``)."""
        counters, gauges = self.stats.snapshot() | self.stats.histogram_counters(), self.stats.gauges()
        if self.pool is not None and self.pool.arena is not None:
            held = ("owned_slots", "used_slots", "free_slots", "ready_slots", "mapped_slabs")
            for k, v in self.pool.arena.usage().items():
                (gauges if k in held else counters)[f"arena_{k}"] = v
        return Snapshot(counters, gauges)

    def _record_event(self, stream: Any) -> Any:
        """An event after all work queued so far on the forward stream; None for a host pool."""
        if self.kv is None or self.kv.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(stream if isinstance(stream, torch.cuda.Stream) else torch.cuda.current_stream())
        return event


def _forward_stamps(device: torch.device, clock: Callable[[], float]) -> tuple[Callable[[Any], Any],
                                                                              Callable[[Any, Any], float | None]]:
    """How forwards are timed (``ForwardClock``): CUDA timing events on the forward's stream, read
    once reached (the host returns from launching a forward long before the GPU ends it), or the
    host clock for a host pool, whose forward has run when ``wait_for_save`` is called."""
    if device.type != "cuda":
        return (lambda stream: clock()), (lambda start, end: end - start)

    def mark(stream: Any) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream if isinstance(stream, torch.cuda.Stream) else torch.cuda.current_stream())
        return event

    def elapsed(start: Any, end: Any) -> float | None:
        return start.elapsed_time(end) / 1e3 if end.query() else None
    return mark, elapsed


def _pool_usage(capacity: CapacityGuard) -> GaugeSource:
    """The pool's usage in bytes as this owner's evictor last scanned it (what its last run left, over
    every root) and its quota (per root, so times the roots): usage against quota for the metrics
    exporter, which never scans the pool itself.  Only an owner that evicts (a quota or a free-space
    floor) scans; a run skipped because another owner held the eviction lock scans nothing, and the
    usage of the last run that did stays."""
    last: dict[str, int] = {}

    def gauges() -> dict[str, int]:
        reports = capacity.last_reports
        if reports and not any(r.skipped for r in reports):
            last["pool_usage_bytes"] = sum(r.usage_after for r in reports)
        quota = capacity.quota_bytes * len(capacity.roots)
        return {"pool_quota_bytes": quota, **last} if quota else dict(last)
    return gauges


def _op_ids(ops: list) -> list[tuple]:
    """What names a transfer across a rebuild: its request, first key and first page."""
    return [(op.request_id, op.keys[:1], op.block_ids[:1]) for op in ops]


def _check_deadline_fits(settings: Settings, trtllm_timeout_s: float | None,
                         trtllm_grace_s: float | None = None) -> None:
    """A save may end up to twice the connector's deadline plus the control grace after it was
    accepted (queued, then writing); past TensorRT-LLM's own transfer timeout the process fails
    before the connector can drop the save, so slow storage would cost the process, not saves.
    And after a cancel or at shutdown TensorRT-LLM waits its control grace for transfers to drain:
    the connector's own grace must end first."""
    if trtllm_grace_s is not None and settings.control_grace_s >= trtllm_grace_s:
        raise SettingsError(
            f"TLLM_GDS_KV_CONTROL_GRACE_S={settings.control_grace_s:g} is not below TensorRT-LLM's "
            f"kv_connector_config.control_grace_sec={trtllm_grace_s:g}: set it below {trtllm_grace_s:g}")
    if trtllm_timeout_s is None:
        return
    worst = 2 * settings.deadline_s + settings.control_grace_s
    if worst >= trtllm_timeout_s:
        raise SettingsError(
            f"TLLM_GDS_KV_DEADLINE_S={settings.deadline_s:g} lets a save end up to {worst:g}s after it was accepted "
            f"(queued up to the deadline, then writing up to it, plus TLLM_GDS_KV_CONTROL_GRACE_S="
            f"{settings.control_grace_s:g}), not under TensorRT-LLM's transfer timeout of {trtllm_timeout_s:g}s: "
            f"set TLLM_GDS_KV_DEADLINE_S below {(trtllm_timeout_s - settings.control_grace_s) / 2:g}")

