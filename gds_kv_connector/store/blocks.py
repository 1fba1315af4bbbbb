"""Save and load batches of blocks: checksum, header, payload transfer, publication, verification.

Runs on transfer threads.  Per-block failures are returned, not raised, so one bad file or
one full disk never takes down the batch of another request; the caller decides what a
failure means (a dropped save is counted, a failed promised load is fatal).
"""

from __future__ import annotations

import errno
import itertools
import logging
import operator
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from gds_kv_connector.format.checksum import CHECKSUM_ALGO
from gds_kv_connector.format import native
from gds_kv_connector.engines.base import InTime, IoEngine, Once, ReadStopped, TransferItem, ViewsRead, WriteExpired
from gds_kv_connector.store.pool import FILE_FAULT_ERRNOS, BlockPool, Pin, PoolError
from gds_kv_connector.format.records import HEADER_SIZE, ZERO_KEY, BlockHeader, FormatError, SlotRef

if TYPE_CHECKING:
    from gds_kv_connector.store.arena import SlotArena

log = logging.getLogger(__name__)

TRANSIENT_ERRNOS = {errno.EIO, errno.EAGAIN, errno.EINTR, errno.ETIMEDOUT}
# Pause before the first retry of a transient read error, doubled for each further one (cut at the
# deadline): retries at once would all land inside a storage hiccup of a few milliseconds.
RETRY_PAUSE_S = 0.01
_FIRST, _SECOND, _SLAB = operator.itemgetter(0), operator.itemgetter(1), operator.attrgetter("slab")


@dataclass
class SaveOutcome:
    published: int = 0
    already_present: int = 0
    lost_race: int = 0
    failed: list[tuple[bytes, str]] = field(default_factory=list)  # (key, cause)
    bytes_written: int = 0
    arena_fallback: int = 0  # saved as block files because the arena had no free slot
    expired: int = 0  # not written: the save's deadline passed before their writes could start


class LoadFailure(RuntimeError):
    """A promised block could not be loaded; ``key``/``path``/``reason`` say which and why."""

    def __init__(self, key: bytes, path: str, reason: str) -> None:
        super().__init__(f"block {key.hex()} ({path}): {reason}")
        self.key, self.path, self.reason = key, path, reason
        self.request_id: int | None = None  # set by the transfer layer when the batch held several requests


class LoadStopped(Exception):
    """A load stopped between blocks by its ``in_time`` (no request of it will use the blocks): not a
    failure; ``blocks`` of it were not read, and its views hold no KV anyone may use."""

    def __init__(self, blocks: int) -> None:
        super().__init__(f"load stopped with {blocks} block(s) not read")
        self.blocks = blocks


def save_blocks(pool: BlockPool, engine: IoEngine, keys: list[bytes], parents: list[bytes],
                views: list[torch.Tensor], in_time: InTime | None = None,
                views_read: ViewsRead | None = None, on_staged: ViewsRead | None = None) -> SaveOutcome:
    """Publish each (key, view) not yet in the pool; ``parents[i]`` is the key of the block before.
    With ``in_time``, blocks whose file write has not started once it returns False are left out
    (``expired``): a save stops between blocks at its deadline instead of holding its pages.
    ``views_read`` is called once no view will be read again: before the writes end where the
    engine stages the bytes (the last ``engine.write`` gets it), at the latest before this returns.
    ``on_staged`` is called after it only in the first case, when writes from the stage are left."""
    once = Once(views_read)
    early = once
    if on_staged is not None:
        def staged() -> None:
            once()
            on_staged()
        early = Once(staged)
    try:
        return _save_blocks(pool, engine, keys, parents, views, in_time, early)
    finally:
        once()


def _save_blocks(pool: BlockPool, engine: IoEngine, keys: list[bytes], parents: list[bytes],
                 views: list[torch.Tensor], in_time: InTime | None, views_read: Once) -> SaveOutcome:
    out = SaveOutcome()
    if pool.arena is not None:
        # Only the in-memory index, no stat per key: a key published meanwhile loses at link(2) and
        # is counted as already present, so the check costs no system call per block.
        todo = pool.not_indexed(keys)
    else:
        todo = [i for i, k in enumerate(keys) if not pool.contains(k)]
    if len(todo) > 1 and len(set(keys if len(todo) == len(keys) else map(keys.__getitem__, todo))) < len(todo):
        todo = _first_of_each_key(keys, todo)
    out.already_present = len(keys) - len(todo)
    if not todo:
        return out
    if in_time is not None and not in_time():  # stopped (a fence) before it read a page
        out.expired = len(todo)
        return out
    sums = engine.checksums(views if len(todo) == len(keys) else [views[i] for i in todo])
    now = time.time_ns()
    if pool.arena is not None:
        slots = pool.arena.alloc(len(todo))
        if slots:
            if pool.arena.mapped:  # a copy into host memory: nothing slow enough to stop
                _save_to_arena(pool, engine, keys, parents, views, todo[:len(slots)], sums[:len(slots)], slots,
                               now, out)
            else:  # the last write where every block got a slot; block files for the rest read views later
                _save_to_slab_files(pool, engine, keys, parents, views, todo[:len(slots)], sums[:len(slots)],
                                    slots, now, out, in_time, views_read if len(slots) == len(todo) else None)
            todo, sums = todo[len(slots):], sums[len(slots):]
            if not todo:
                return out
        out.arena_fallback = len(todo)
    opened: list[tuple[int, int, str]] = []  # (index, fd, tmp) not yet published or discarded
    packed: list[bytes] = []  # each opened file's header, written with its payload in one I/O
    try:
        for i, csum in zip(todo, sums):
            header = _header(pool, keys[i], parents[i], csum, now)
            try:
                fd, tmp = pool.create_tmp(keys[i], None)  # the header goes with the payload
            except (OSError, PoolError) as exc:  # PoolError: a directory was replaced by a file
                out.failed.append((keys[i], _cause(exc)))
                continue
            opened.append((i, fd, tmp))
            packed.append(header.pack())
        errors = engine.write([TransferItem(fd, HEADER_SIZE, views[i], raw)
                               for (i, fd, _), raw in zip(opened, packed)], in_time, views_read)
        while opened:
            (i, fd, tmp), err = opened.pop(0), errors.pop(0)
            if err is not None:
                pool.discard_tmp(fd, tmp)
                _count_failed(out, keys[i], err)
                continue
            try:
                if pool.publish(fd, tmp, keys[i]):
                    out.published += 1
                    out.bytes_written += pool.payload_len
                else:
                    out.lost_race += 1
            except OSError as exc:
                out.failed.append((keys[i], _cause(exc)))
    finally:
        # Only reached with entries left when something unexpected escaped (a bug, an interrupt):
        # never leave their temporary files behind.
        for _i, fd, tmp in opened:
            pool.discard_tmp(fd, tmp)
    return out


def _first_of_each_key(keys: list[bytes], todo: list[int]) -> list[int]:
    """``todo`` without the repeats of a key (two requests of one prompt merged into one batch).
    Saved twice, a key would get two slots and two entries in one reference file; the name links
    once, so the second slot is freed at once while readers of the file could still be sent to it."""
    seen: set[bytes] = set()
    firsts: list[int] = []
    for i in todo:
        if keys[i] not in seen:
            seen.add(keys[i])
            firsts.append(i)
    return firsts


def _header(pool: BlockPool, key: bytes, parent: bytes, csum: int, now: int) -> BlockHeader:
    """The header a block file or disk slot is written with (mapped slots get the same bytes from
    native.write_headers)."""
    return BlockHeader(pool.fingerprint, key, pool.payload_len, csum, CHECKSUM_ALGO, pool.tokens_per_block, now,
                       parent or ZERO_KEY)


def _save_to_arena(pool: BlockPool, engine: IoEngine, keys: list[bytes], parents: list[bytes],
                   views: list[torch.Tensor], todo: list[int], sums: list[int], slots: list[tuple[str, int]],
                   now: int, out: SaveOutcome) -> None:
    """Headers cleared, payloads copied, headers written, then one reference file per slab."""
    arena = pool.arena
    assert arena is not None
    addrs = arena.slot_addrs(slots)
    every = len(todo) == len(keys)  # the common batch: no key of it was in the pool
    try:
        native.clear_headers(addrs)
        todo_views = views if every else map(views.__getitem__, todo)
        engine.copy_to_host(list(zip(map(HEADER_SIZE.__add__, addrs), todo_views)), arena.slot_bytes)
    except BaseException as exc:
        _give_slots_back(arena, slots, [keys[i] for i in todo], exc, out)
        return
    todo_keys = keys if every else [keys[i] for i in todo]
    todo_parents = parents if every else [parents[i] for i in todo]
    if not all(todo_parents):  # b"" stands for no parent
        todo_parents = [p or ZERO_KEY for p in todo_parents]
    native.write_headers(addrs, pool.fingerprint, todo_keys, todo_parents,
                         sums, pool.payload_len, CHECKSUM_ALGO, pool.tokens_per_block, now)
    _publish_slots(pool, todo_keys, slots, now, out)


def _give_slots_back(arena: SlotArena, slots: list[tuple[str, int]], failed_keys: list[bytes], exc: BaseException,
                     out: SaveOutcome) -> None:
    """A slot write that raised before any reference named its slots: every slot back to the arena
    (else it is neither free nor used, lost to the arena for good) and every block counted failed;
    an interrupt (not an Exception) goes on up once the slots are back."""
    for slab, slot in slots:
        arena.release(slab, slot)
    if not isinstance(exc, Exception):
        raise exc
    out.failed.extend((k, _cause(exc)) for k in failed_keys)


def _save_to_slab_files(pool: BlockPool, engine: IoEngine, keys: list[bytes], parents: list[bytes],
                        views: list[torch.Tensor], todo: list[int], sums: list[int], slots: list[tuple[str, int]],
                        now: int, out: SaveOutcome, in_time: InTime | None, views_read: Once | None) -> None:
    """Slabs on disk: each slot's header and payload in one write at its offset (the engine joins
    adjacent slots into larger I/Os), then one reference file per slab.  A slot whose write failed
    is freed and its block counted failed."""
    arena = pool.arena
    assert arena is not None
    items: list[TransferItem] = []
    written: list[tuple[int, tuple[str, int]]] = []  # (index, slot) of the items made
    for i, csum, (slab, slot) in zip(todo, sums, slots):
        try:
            fd, nslots = arena.slab_fd(slab)
        except (OSError, FormatError, ValueError) as exc:
            arena.release(slab, slot)
            out.failed.append((keys[i], _cause(exc)))
            continue
        header = _header(pool, keys[i], parents[i], csum, now)
        items.append(TransferItem(fd, arena.payload_offset(slot), views[i], header.pack()))
        written.append((i, (slab, slot)))
    try:
        errors = engine.write(items, in_time, views_read) if items else []
    except BaseException as exc:  # an engine that raises (staging registration, MemoryError): no slot written
        _give_slots_back(arena, [where for _, where in written], [keys[i] for i, _ in written], exc, out)
        return
    ok: list[tuple[int, tuple[str, int]]] = []
    for (i, where), err in zip(written, errors):
        if err is None:
            ok.append((i, where))
        else:
            arena.release(*where)
            _count_failed(out, keys[i], err)
    if pool.fsync:  # one fsync per slab written, before any reference names its slots
        unsynced: dict[str, OSError] = {}
        for slab in {where[0] for _, where in ok}:
            try:
                pool.ops.fsync(arena.slab_fd(slab)[0])
            except OSError as exc:
                unsynced[slab] = exc
        for i, where in ok:
            if where[0] in unsynced:
                arena.release(*where)
                out.failed.append((keys[i], _cause(unsynced[where[0]])))
        ok = [(i, where) for i, where in ok if where[0] not in unsynced]
    if ok:
        _publish_slots(pool, [keys[i] for i, _ in ok], [where for _, where in ok], now, out)


def _publish_slots(pool: BlockPool, todo_keys: list[bytes], slots: list[tuple[str, int]], now: int,
                   out: SaveOutcome) -> None:
    """One reference file per slab for slots whose records are written; a slot no name refers to
    (lost race, failed link) is freed at once."""
    arena = pool.arena
    assert arena is not None
    # SlotRefs made by C iterators (tuple.__new__ over zipped fields), grouped by slab in runs:
    # a batch's slots nearly always come from one slab, and this is per-block GIL-held time.
    refs_all = list(map(tuple.__new__, itertools.repeat(SlotRef),
                        zip(todo_keys, map(_FIRST, slots), map(_SECOND, slots), itertools.repeat(now))))
    by_slab = [(slab, list(group)) for slab, group in itertools.groupby(refs_all, _SLAB)]
    for slab, refs in by_slab:
        outcomes = pool.publish_refs(slab, refs)
        published = refs if outcomes.count(True) == len(refs) else \
            [r for r, outcome in zip(refs, outcomes) if outcome is True]
        if len(published) < len(refs):
            for r, outcome in zip(refs, outcomes):
                if outcome is True:
                    continue
                arena.release(r.slab, r.slot)  # no name refers to it
                if outcome is False:
                    out.already_present += 1
                else:
                    out.failed.append((r.key, _cause(outcome)))
        arena.published(published)
        out.published += len(published)
        out.bytes_written += len(published) * pool.payload_len


def pin_blocks(pool: BlockPool, keys: list[bytes]) -> list[Pin]:
    """Pin every key or none; raises LoadFailure for the first that cannot be opened."""
    pins: list[Pin] = []
    try:
        try:
            pool.pin_all(keys, pins)
        except FileNotFoundError:
            key = keys[len(pins)]
            pool.forget(key)
            raise LoadFailure(key, pool.path_for(key), "file vanished before it could be opened") from None
        except (FormatError, EOFError) as exc:  # pool.pin has quarantined the file already
            key = keys[len(pins)]
            raise LoadFailure(key, pool.path_for(key), str(exc)) from None
        except OSError as exc:
            key = keys[len(pins)]
            moved = "; moved out of the pool (quarantined), so no owner meets it again" \
                if exc.errno in FILE_FAULT_ERRNOS else ""
            raise LoadFailure(key, pool.path_for(key), f"open failed: {exc}{moved}") from None
    except BaseException:
        pool.unpin_all(pins)
        raise
    return pins


def load_blocks(pool: BlockPool, engine: IoEngine, pins: list[Pin], views: list[torch.Tensor], *,
                verify: bool, retries: int, deadline: float, in_time: InTime | None = None) -> int:
    """Read pinned blocks into views and verify them; raises LoadFailure. Returns bytes read.
    With ``in_time``, reads not started once it returns False are skipped and the load raises
    :class:`LoadStopped` (the blocks will not be used, so they are neither read nor checked)."""
    if in_time is not None and not in_time():
        raise LoadStopped(len(pins))
    expected: list[int] = [0] * len(pins)  # payload checksum each header promises
    arena = pool.arena
    slot_pins = [n for n, pin in enumerate(pins) if pin.slot is not None]
    mapped_pins = slot_pins if arena is not None and arena.mapped else []
    if mapped_pins:
        addrs, fields, sums = _check_slots(pool, [pins[n] for n in mapped_pins])
        if len(mapped_pins) == len(pins):
            expected = sums
        else:
            for n, csum in zip(mapped_pins, sums):
                expected[n] = csum
        engine.copy_from_host([(a + HEADER_SIZE, views[n]) for n, a in zip(mapped_pins, addrs)], pool.file_size)
        changed = native.first_changed(addrs, fields)
        if changed >= 0:
            pin = pins[mapped_pins[changed]]
            arena.forget(pin.key)  # type: ignore[union-attr]
            raise LoadFailure(pin.key, pin.path, "arena slot was reused while it was being loaded")
    # Block files and slots of slabs on disk: header and payload read together (one I/O where the
    # engine can), the header checked after; a failed load is reported either way, before any KV is used.
    read_pins = [n for n, pin in enumerate(pins) if pin.slot is None] if mapped_pins else list(range(len(pins)))
    headers = {n: bytearray(HEADER_SIZE) for n in read_pins}
    _read_pinned(pool, engine, pins, views, headers, read_pins, retries, deadline, in_time)
    for n in read_pins:
        pin = pins[n]
        try:
            expected[n] = _checked_header(pool, pin, headers[n])
        except FormatError as exc:
            if pin.slot is None:
                pool.quarantine(pin.key, str(exc), pin.ino)
                raise LoadFailure(pin.key, pin.path, f"bad header: {exc}") from None
            expected[n] = _reread_moved_slot(pool, engine, pin, views[n], exc, retries, deadline)
    if slot_pins:
        arena.touch([pins[n].slot for n in slot_pins if pins[n].slot is not None])  # type: ignore[union-attr,misc]
    # Slots on disk are always verified: a slot reused while it was read shows as a payload that
    # does not match the header read with it (see arena.py).
    if verify or (slot_pins and not mapped_pins):
        sums = engine.checksums(views, load=True)
        if sums == expected:  # one C comparison; the loop below only names the first mismatch
            return len(pins) * pool.payload_len
        for pin, want, got in zip(pins, expected, sums):
            if got != want:
                if pin.slot is not None:
                    arena.forget(pin.key)  # type: ignore[union-attr]
                    raise LoadFailure(pin.key, pin.path, f"arena slot payload checksum mismatch (header "
                                      f"{want:#018x}, data {got:#018x}): damaged or reused")
                pool.quarantine(pin.key, "checksum mismatch", pin.ino)
                raise LoadFailure(pin.key, pin.path,
                                  f"payload checksum mismatch (header {want:#018x}, data {got:#018x})")
    return len(pins) * pool.payload_len


def _read_pinned(pool: BlockPool, engine: IoEngine, pins: list[Pin], views: list[torch.Tensor],
                 headers: dict[int, bytearray], which: list[int], retries: int, deadline: float,
                 in_time: InTime | None = None) -> None:
    """Read header and payload of ``pins[n]`` for n in ``which``, retrying transient errors after
    a growing pause (RETRY_PAUSE_S); :class:`LoadStopped` once ``in_time`` stopped a read."""
    items: dict[int, TransferItem] = {}
    for n in which:
        pin = pins[n]
        if pin.slot is None:
            items[n] = TransferItem(pin.fd, HEADER_SIZE, views[n], headers[n])
            continue
        arena = pool.arena
        assert arena is not None
        try:
            fd, nslots = arena.slab_fd(pin.slot.slab)
        except (OSError, FormatError, ValueError) as exc:
            arena.forget(pin.key)
            # a slab goes only once no reference names it, and one of a bad size or name never becomes a
            # slab: a reference naming such a slab can never load again, and left in place it would keep
            # matching (as _repin_stale_slot for mapped slabs)
            if pin.ino != 0 and isinstance(exc, (FileNotFoundError, FormatError, ValueError)):
                pool.quarantine(pin.key, f"arena slab {pin.slot.slab}: {exc}", pin.ino)
            raise LoadFailure(pin.key, pin.path, f"arena slab {pin.slot.slab}: {exc}") from None
        if not 0 <= pin.slot.slot < nslots:
            arena.forget(pin.key)
            why = f"slot {pin.slot.slot} outside slab {pin.slot.slab} of {nslots}"
            if pin.ino != 0:  # slabs never shrink: the reference (or the slab) is damaged for good
                pool.quarantine(pin.key, why, pin.ino)
            raise LoadFailure(pin.key, pin.path, why)
        items[n] = TransferItem(fd, arena.payload_offset(pin.slot.slot), views[n], headers[n])
    attempt = 0
    pending = which
    while pending:
        errors = engine.read([items[n] for n in pending], in_time)
        failed = [(n, e) for n, e in zip(pending, errors) if e is not None]
        if not failed:
            return
        stopped = sum(isinstance(e, ReadStopped) for _, e in failed)
        if stopped:
            raise LoadStopped(stopped)
        n, err = failed[0]
        transient = isinstance(err, OSError) and err.errno in TRANSIENT_ERRNOS
        if not transient or attempt >= retries or time.monotonic() >= deadline:
            raise _read_failure(pool, pins[n], err)
        attempt += 1
        log.info("retrying %d block read(s) after %s (attempt %d of %d)", len(failed), err, attempt, retries)
        time.sleep(max(0.0, min(RETRY_PAUSE_S * 2 ** (attempt - 1), deadline - time.monotonic())))
        pending = [n for n, _ in failed]


def _read_failure(pool: BlockPool, pin: Pin, err: BaseException) -> LoadFailure:
    """The failure of a read that its retries did not cure.  A block file that ended early or keeps
    failing for a reason of its own (FILE_FAULT_ERRNOS: EIO) is quarantined first: every restarted
    owner would match it and die on it again.  A slot's slab is not the reference's fault."""
    fault = isinstance(err, EOFError) or (isinstance(err, OSError) and err.errno in FILE_FAULT_ERRNOS)
    if not fault or pin.slot is not None:
        return LoadFailure(pin.key, pin.path, f"payload read failed: {err}")
    pool.quarantine(pin.key, "truncated" if isinstance(err, EOFError) else f"read {_cause(err)}", pin.ino)
    return LoadFailure(pin.key, pin.path, f"payload read failed: {err}; moved out of the pool (quarantined)")


def _checked_header(pool: BlockPool, pin: Pin, raw: bytearray) -> int:
    """The payload checksum a pinned block's header promises, after checking the header against
    the pool and the key (and, for a slot, the reference's creation time); raises FormatError."""
    h = pool.check_header(pin, raw)
    if pin.slot is not None and h.created_ns != pin.slot.created_ns:
        raise FormatError(f"slot {pin.slot.slab}#{pin.slot.slot} holds a block created at {h.created_ns}, "
                          f"not {pin.slot.created_ns}: reused")
    return h.checksum


def _reread_moved_slot(pool: BlockPool, engine: IoEngine, pin: Pin, view: torch.Tensor, err: FormatError,
                       retries: int, deadline: float) -> int:
    """A disk slot's header did not match its reference.  A reference read from the pool is
    damaged or stale: quarantined, LoadFailure.  A location this process remembered may be out of
    date (evicted by another owner, slot reused): the key is resolved afresh and read once more."""
    assert pool.arena is not None
    fresh = _repin_stale_slot(pool, pin, err)
    header = bytearray(HEADER_SIZE)
    try:
        _read_pinned(pool, engine, [fresh], [view], {0: header}, [0], retries, deadline)
        try:
            return _checked_header(pool, fresh, header)
        except FormatError as exc:
            if fresh.slot is None:
                pool.quarantine(fresh.key, str(exc), fresh.ino)
            else:
                pool.arena.forget(fresh.key)
            raise LoadFailure(fresh.key, fresh.path, f"bad header: {exc}") from None
    finally:
        pool.unpin(fresh)
        pin.slot, pin.ino = fresh.slot, fresh.ino


def _repin_stale_slot(pool: BlockPool, pin: Pin, err: Exception) -> Pin:
    """A slot pin whose header failed its check (``err``): the location is forgotten; a reference
    read from the pool is quarantined (when the slot's bytes were wrong, or its slab is gone: no
    load through it can succeed again, and a reference left in place keeps matching) and the load
    fails; a location this process remembered is resolved afresh from the pool instead."""
    assert pool.arena is not None and pin.slot is not None
    pool.arena.forget(pin.key)
    if pin.ino != 0:
        if isinstance(err, (FormatError, FileNotFoundError)):
            pool.quarantine(pin.key, f"arena slot: {err}", pin.ino)
        raise LoadFailure(pin.key, pin.path, f"arena slot {pin.slot.slab}#{pin.slot.slot}: {err}")
    try:
        return pool.pin(pin.key)
    except (OSError, FormatError, EOFError) as again:
        raise LoadFailure(pin.key, pin.path, f"arena slot gone and no usable reference: {again}") from None


def _check_slots(pool: BlockPool, pins: list[Pin]) -> tuple[list[int], bytes, list[int]]:
    """Slot addresses, header field bytes and payload checksums of pinned arena slots, after
    checking each header (arena.check_records).  A stale or damaged reference is dropped
    (quarantined) so the key stops matching, then reported as a LoadFailure; a location this
    process remembered (not read from the pool) is looked up afresh once instead."""
    arena = pool.arena
    assert arena is not None
    addrs: list[int] = []
    fields: list[bytes] = []
    sums: list[int] = []
    lo = 0
    while lo < len(pins):
        a, f, s, bad, err = arena.check_records([p.slot for p in pins[lo:]])
        addrs += a
        fields.append(f)
        sums += s
        if bad < 0:
            break
        pin = pins[lo + bad]
        assert err is not None  # check_records names the error of the slot it stopped at
        fresh = _repin_stale_slot(pool, pin, err)
        if fresh.slot is None:
            pool.unpin(fresh)
            raise LoadFailure(pin.key, pin.path, "arena slot gone; the key now names a block file")
        pin.slot, pin.ino = fresh.slot, fresh.ino
        lo += bad  # check this pin again at its fresh location, then the rest
    return addrs, b"".join(fields), sums


def _count_failed(out: SaveOutcome, key: bytes, err: BaseException) -> None:
    if isinstance(err, WriteExpired):
        out.expired += 1
    else:
        out.failed.append((key, _cause(err)))


def _cause(exc: BaseException) -> str:
    """A short, stable cause label for counting and once-per-cause logging."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return errno.errorcode.get(exc.errno, str(exc.errno))
    return type(exc).__name__
