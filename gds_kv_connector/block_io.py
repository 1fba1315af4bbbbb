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

import torch

from .checksum import CHECKSUM_ALGO
from . import native
from .engines.base import IoEngine, TransferItem
from .pool import BlockPool, Pin, PoolError
from .pool_format import HEADER_SIZE, ZERO_KEY, BlockHeader, FormatError, SlotRef

log = logging.getLogger(__name__)

TRANSIENT_ERRNOS = {errno.EIO, errno.EAGAIN, errno.EINTR, errno.ETIMEDOUT}
_FIRST, _SECOND, _SLAB = operator.itemgetter(0), operator.itemgetter(1), operator.attrgetter("slab")


@dataclass
class SaveOutcome:
    published: int = 0
    already_present: int = 0
    lost_race: int = 0
    failed: list[tuple[bytes, str]] = field(default_factory=list)  # (key, cause)
    bytes_written: int = 0
    arena_fallback: int = 0  # saved as block files because the arena had no free slot


class LoadFailure(RuntimeError):
    """A promised block could not be loaded; ``key``/``path``/``reason`` say which and why."""

    def __init__(self, key: bytes, path: str, reason: str) -> None:
        super().__init__(f"block {key.hex()} ({path}): {reason}")
        self.key, self.path, self.reason = key, path, reason
        self.request_id: int | None = None  # set by the transfer layer when the batch held several requests


def save_blocks(pool: BlockPool, engine: IoEngine, keys: list[bytes], parents: list[bytes],
                views: list[torch.Tensor]) -> SaveOutcome:
    """Publish each (key, view) not yet in the pool; ``parents[i]`` is the key of the block before."""
    out = SaveOutcome()
    if pool.arena is not None:
        # Only the in-memory index, no stat per key: a key published meanwhile loses at link(2) and
        # is counted as already present, so the check costs no system call per block.
        todo = pool.not_indexed(keys)
    else:
        todo = [i for i, k in enumerate(keys) if not pool.contains(k)]
    out.already_present = len(keys) - len(todo)
    if not todo:
        return out
    sums = engine.checksums(views if len(todo) == len(keys) else [views[i] for i in todo])
    now = time.time_ns()
    if pool.arena is not None:
        slots = pool.arena.alloc(len(todo))
        if slots:
            _save_to_arena(pool, engine, keys, parents, views, todo[:len(slots)], sums[:len(slots)], slots, now,
                           out)
            todo, sums = todo[len(slots):], sums[len(slots):]
            if not todo:
                return out
        out.arena_fallback = len(todo)
    opened: list[tuple[int, int, str]] = []  # (index, fd, tmp) not yet published or discarded
    packed: list[bytes] = []  # each opened file's header, written with its payload in one I/O
    try:
        for i, csum in zip(todo, sums):
            header = BlockHeader(pool.fingerprint, keys[i], pool.payload_len, csum, CHECKSUM_ALGO,
                                 pool.tokens_per_block, now, parents[i] or ZERO_KEY)
            try:
                fd, tmp = pool.create_tmp(keys[i], None)  # the header goes with the payload
            except (OSError, PoolError) as exc:  # PoolError: a directory was replaced by a file
                out.failed.append((keys[i], _cause(exc)))
                continue
            opened.append((i, fd, tmp))
            packed.append(header.pack())
        errors = engine.write([TransferItem(fd, HEADER_SIZE, views[i], raw)
                               for (i, fd, _), raw in zip(opened, packed)])
        while opened:
            (i, fd, tmp), err = opened.pop(0), errors.pop(0)
            if err is not None:
                pool.discard_tmp(fd, tmp)
                out.failed.append((keys[i], _cause(err)))
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


def _save_to_arena(pool: BlockPool, engine: IoEngine, keys: list[bytes], parents: list[bytes],
                   views: list[torch.Tensor], todo: list[int], sums: list[int], slots: list[tuple[str, int]],
                   now: int, out: SaveOutcome) -> None:
    """Headers cleared, payloads copied, headers written, then one reference file per slab."""
    arena = pool.arena
    assert arena is not None
    addrs = arena.slot_addrs(slots)
    try:
        native.clear_headers(addrs)
        engine.copy_to_host([(a + HEADER_SIZE, views[i]) for i, a in zip(todo, addrs)], arena.slot_bytes)
    except BaseException as exc:
        for slab, slot in slots:
            arena.release(slab, slot)
        if not isinstance(exc, Exception):
            raise
        out.failed.extend((keys[i], _cause(exc)) for i in todo)
        return
    todo_keys = keys if len(todo) == len(keys) else [keys[i] for i in todo]
    native.write_headers(addrs, pool.fingerprint, todo_keys, [parents[i] or ZERO_KEY for i in todo],
                         sums, pool.payload_len, CHECKSUM_ALGO, pool.tokens_per_block, now)
    # SlotRefs made by C iterators (tuple.__new__ over zipped fields), grouped by slab in runs:
    # a batch's slots nearly always come from one slab, and this is per-block GIL-held time.
    refs_all = list(map(tuple.__new__, itertools.repeat(SlotRef),
                        zip(todo_keys, map(_FIRST, slots), map(_SECOND, slots), itertools.repeat(now))))
    by_slab = [(slab, list(group)) for slab, group in itertools.groupby(refs_all, _SLAB)]
    for slab, refs in by_slab:
        outcomes = pool.publish_refs(slab, refs)
        published = [r for r, outcome in zip(refs, outcomes) if outcome is True]
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
        for key in keys:
            try:
                pins.append(pool.pin(key))
            except FileNotFoundError:
                pool.forget(key)
                raise LoadFailure(key, pool.path_for(key), "file vanished before it could be opened") from None
            except FormatError as exc:  # pool.pin has quarantined the file already
                raise LoadFailure(key, pool.path_for(key), str(exc)) from None
            except OSError as exc:
                raise LoadFailure(key, pool.path_for(key), f"open failed: {exc}") from None
    except BaseException:
        for p in pins:
            pool.unpin(p)
        raise
    return pins


def load_blocks(pool: BlockPool, engine: IoEngine, pins: list[Pin], views: list[torch.Tensor], *,
                verify: bool, retries: int, deadline: float) -> int:
    """Read pinned blocks into views and verify them; raises LoadFailure. Returns bytes read."""
    expected: list[int] = [0] * len(pins)  # payload checksum each header promises
    attempt = 0
    slot_pins = [n for n, pin in enumerate(pins) if pin.slot is not None]
    if slot_pins:
        addrs, fields, sums = _check_slots(pool, [pins[n] for n in slot_pins])
        if len(slot_pins) == len(pins):
            expected = sums
        else:
            for n, csum in zip(slot_pins, sums):
                expected[n] = csum
    file_pins = [n for n, pin in enumerate(pins) if pin.slot is None]
    if slot_pins:
        engine.copy_from_host([(a + HEADER_SIZE, views[n]) for n, a in zip(slot_pins, addrs)], pool.file_size)
        changed = native.first_changed(addrs, fields)
        if changed >= 0:
            pin = pins[slot_pins[changed]]
            pool.arena.forget(pin.key)
            raise LoadFailure(pin.key, pin.path, "arena slot was reused while it was being loaded")
        pool.arena.touch([pins[n].slot for n in slot_pins])
    # Header and payload of a block file are read together (one I/O where the engine can) and
    # the header is checked after; a failed load is reported either way, before any KV is used.
    headers = {n: bytearray(HEADER_SIZE) for n in file_pins}
    pending = file_pins
    while pending:
        errors = engine.read([TransferItem(pins[i].fd, HEADER_SIZE, views[i], headers[i]) for i in pending])
        failed = [(i, e) for i, e in zip(pending, errors) if e is not None]
        if not failed:
            break
        i, err = failed[0]
        transient = isinstance(err, OSError) and err.errno in TRANSIENT_ERRNOS
        if not transient or attempt >= retries or time.monotonic() >= deadline:
            if isinstance(err, EOFError):
                pool.quarantine(pins[i].key, "truncated", pins[i].ino)
            raise LoadFailure(pins[i].key, pins[i].path, f"payload read failed: {err}")
        attempt += 1
        log.info("retrying %d block read(s) after %s (attempt %d of %d)", len(failed), err, attempt, retries)
        pending = [i for i, _ in failed]
    for n in file_pins:
        pin = pins[n]
        try:
            expected[n] = pool.check_header(pin, headers[n]).checksum
        except FormatError as exc:
            pool.quarantine(pin.key, str(exc), pin.ino)
            raise LoadFailure(pin.key, pin.path, f"bad header: {exc}") from None
    if verify:
        sums = engine.checksums(views)
        if sums == expected:  # one C comparison; the loop below only names the first mismatch
            return len(pins) * pool.payload_len
        for pin, want, got in zip(pins, expected, sums):
            if got != want:
                if pin.slot is not None:
                    pool.arena.forget(pin.key)
                    raise LoadFailure(pin.key, pin.path, f"arena slot payload checksum mismatch (header "
                                      f"{want:#018x}, data {got:#018x}): damaged or reused")
                pool.quarantine(pin.key, "checksum mismatch", pin.ino)
                raise LoadFailure(pin.key, pin.path,
                                  f"payload checksum mismatch (header {want:#018x}, data {got:#018x})")
    return len(pins) * pool.payload_len


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
        arena.forget(pin.key)
        if pin.ino != 0:
            if isinstance(err, FormatError):
                pool.quarantine(pin.key, f"arena slot: {err}", pin.ino)
            raise LoadFailure(pin.key, pin.path, f"arena slot {pin.slot.slab}#{pin.slot.slot}: {err}")
        try:
            fresh = pool.pin(pin.key)
        except (OSError, FormatError) as again:
            raise LoadFailure(pin.key, pin.path, f"arena slot gone and no usable reference: {again}") from None
        if fresh.slot is None:
            pool.unpin(fresh)
            raise LoadFailure(pin.key, pin.path, "arena slot gone; the key now names a block file")
        pin.slot, pin.ino = fresh.slot, fresh.ino
        lo += bad  # check this pin again at its fresh location, then the rest
    return addrs, b"".join(fields), sums


def _cause(exc: BaseException) -> str:
    """A short, stable cause label for counting and once-per-cause logging."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return errno.errorcode.get(exc.errno, str(exc.errno))
    return type(exc).__name__
