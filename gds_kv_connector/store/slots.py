"""Blocks kept in the slot arena (store/arena.py): a slot each, in slabs mapped into host memory
(copied by DMA) or on disk (written and read with O_DIRECT at the slot's offset), published by one
reference file per slab and batch.  A block that gets no slot is saved as a block file, so a batch
loaded from this store may hold both kinds; the block-file part is the :class:`FileStore`'s."""

from __future__ import annotations

import itertools
import operator

import torch

from gds_kv_connector.engines.base import InTime, Once, TransferItem
from gds_kv_connector.format import native
from gds_kv_connector.format.checksum import CHECKSUM_ALGO
from gds_kv_connector.format.records import HEADER_SIZE, ZERO_KEY, FormatError, SlotRef
from gds_kv_connector.store.arena import SlotArena
from gds_kv_connector.store.base import LoadFailure, LoadStopped, SaveOutcome, cause, count_failed
from gds_kv_connector.store.files import FileStore
from gds_kv_connector.store.pool import Pin

_FIRST, _SECOND, _SLAB = operator.itemgetter(0), operator.itemgetter(1), operator.attrgetter("slab")


class SlotStore(FileStore):
    """Blocks of the pool in its arena's slots, block files where no slot was free."""

    @property
    def arena(self) -> SlotArena:
        arena = self.pool.arena
        assert arena is not None
        return arena

    # -- save -------------------------------------------------------------------------------------
    def _absent(self, keys: list[bytes]) -> list[int]:
        # Only the in-memory index, no stat per key: a key published meanwhile loses at link(2) and
        # is counted as already present, so the check costs no system call per block.
        return self.pool.not_indexed(keys)

    def _save(self, keys: list[bytes], parents: list[bytes], views: list[torch.Tensor], in_time: InTime | None,
              views_read: Once) -> SaveOutcome:
        todo = self._absent(keys)
        out, sums, now = self._start_save(keys, views, todo, in_time)
        if not sums:
            return out
        slots = self.arena.alloc(len(todo))
        if slots:
            if self.arena.mapped:  # a copy into host memory: nothing slow enough to stop
                self._save_mapped(keys, parents, views, todo[:len(slots)], sums[:len(slots)], slots, now, out)
            else:  # the last write where every block got a slot; block files for the rest read views later
                self._save_slab_files(keys, parents, views, todo[:len(slots)], sums[:len(slots)], slots, now, out,
                                      in_time, views_read if len(slots) == len(todo) else None)
            todo, sums = todo[len(slots):], sums[len(slots):]
            if not todo:
                return out
        out.arena_fallback = len(todo)
        self._save_files(keys, parents, views, todo, sums, now, out, in_time, views_read)
        return out

    def _save_mapped(self, keys: list[bytes], parents: list[bytes], views: list[torch.Tensor], todo: list[int],
                     sums: list[int], slots: list[tuple[str, int]], now: int, out: SaveOutcome) -> None:
        """Headers cleared, payloads copied, headers written, then one reference file per slab."""
        arena = self.arena
        addrs = arena.slot_addrs(slots)
        every = len(todo) == len(keys)  # the common batch: no key of it was in the pool
        try:
            native.clear_headers(addrs)
            todo_views = views if every else map(views.__getitem__, todo)
            self.engine.copy_to_host(list(zip(map(HEADER_SIZE.__add__, addrs), todo_views)), arena.slot_bytes)
        except BaseException as exc:
            self._give_slots_back(slots, [keys[i] for i in todo], exc, out)
            return
        todo_keys = keys if every else [keys[i] for i in todo]
        todo_parents = parents if every else [parents[i] for i in todo]
        if not all(todo_parents):  # b"" stands for no parent
            todo_parents = [p or ZERO_KEY for p in todo_parents]
        pool = self.pool
        native.write_headers(addrs, pool.fingerprint, todo_keys, todo_parents,
                             sums, pool.payload_len, CHECKSUM_ALGO, pool.tokens_per_block, now)
        self._publish_slots(todo_keys, slots, now, out)

    def _give_slots_back(self, slots: list[tuple[str, int]], failed_keys: list[bytes], exc: BaseException,
                         out: SaveOutcome) -> None:
        """A slot write that raised before any reference named its slots: every slot back to the arena
        (else it is neither free nor used, lost to the arena for good) and every block counted failed;
        an interrupt (not an Exception) goes on up once the slots are back."""
        for slab, slot in slots:
            self.arena.release(slab, slot)
        if not isinstance(exc, Exception):
            raise exc
        out.failed.extend((k, cause(exc)) for k in failed_keys)

    def _save_slab_files(self, keys: list[bytes], parents: list[bytes], views: list[torch.Tensor], todo: list[int],
                         sums: list[int], slots: list[tuple[str, int]], now: int, out: SaveOutcome,
                         in_time: InTime | None, views_read: Once | None) -> None:
        """Slabs on disk: each slot's header and payload in one write at its offset (the engine joins
        adjacent slots into larger I/Os), then one reference file per slab.  A slot whose write failed
        is freed and its block counted failed."""
        arena, pool = self.arena, self.pool
        items: list[TransferItem] = []
        written: list[tuple[int, tuple[str, int]]] = []  # (index, slot) of the items made
        for i, csum, (slab, slot) in zip(todo, sums, slots):
            try:
                fd, nslots = arena.slab_fd(slab)
            except (OSError, FormatError, ValueError) as exc:
                arena.release(slab, slot)
                out.failed.append((keys[i], cause(exc)))
                continue
            header = self.header(keys[i], parents[i], csum, now)
            items.append(TransferItem(fd, arena.payload_offset(slot), views[i], header.pack()))
            written.append((i, (slab, slot)))
        try:
            errors = self.engine.write(items, in_time, views_read) if items else []
        except BaseException as exc:  # an engine that raises (staging registration, MemoryError): no slot written
            self._give_slots_back([where for _, where in written], [keys[i] for i, _ in written], exc, out)
            return
        ok: list[tuple[int, tuple[str, int]]] = []
        for (i, where), err in zip(written, errors):
            if err is None:
                ok.append((i, where))
            else:
                arena.release(*where)
                count_failed(out, keys[i], err)
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
                    out.failed.append((keys[i], cause(unsynced[where[0]])))
            ok = [(i, where) for i, where in ok if where[0] not in unsynced]
        if ok:
            self._publish_slots([keys[i] for i, _ in ok], [where for _, where in ok], now, out)

    def _publish_slots(self, todo_keys: list[bytes], slots: list[tuple[str, int]], now: int,
                       out: SaveOutcome) -> None:
        """One reference file per slab for slots whose records are written; a slot no name refers to
        (lost race, failed link) is freed at once."""
        arena, pool = self.arena, self.pool
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
                        out.failed.append((r.key, cause(outcome)))
            arena.published(published)
            out.published += len(published)
            out.bytes_written += len(published) * pool.payload_len

    # -- load -------------------------------------------------------------------------------------
    def load(self, pins: list[Pin], views: list[torch.Tensor], *, verify: bool, retries: int, deadline: float,
             in_time: InTime | None = None) -> int:
        if in_time is not None and not in_time():
            raise LoadStopped(len(pins))
        expected: list[int] = [0] * len(pins)  # payload checksum each header promises
        arena = self.arena
        slot_pins = [n for n, pin in enumerate(pins) if pin.slot is not None]
        mapped_pins = slot_pins if arena.mapped else []
        if mapped_pins:
            self._copy_mapped(pins, views, mapped_pins, expected)
        # Block files and slots of slabs on disk: header and payload read together (one I/O where the
        # engine can), the header checked after; a failed load is reported either way, before any KV is used.
        read_pins = [n for n, pin in enumerate(pins) if pin.slot is None] if mapped_pins else list(range(len(pins)))
        self._read_checked(pins, views, read_pins, retries, deadline, in_time, expected)
        if slot_pins:
            arena.touch([pins[n].slot for n in slot_pins if pins[n].slot is not None])  # type: ignore[misc]
        # Slots on disk are always verified: a slot reused while it was read shows as a payload that
        # does not match the header read with it (see arena.py).
        if verify or (slot_pins and not mapped_pins):
            self.verify(pins, views, expected)
        return len(pins) * self.pool.payload_len

    def _copy_mapped(self, pins: list[Pin], views: list[torch.Tensor], mapped_pins: list[int],
                     expected: list[int]) -> None:
        """Copy mapped slots' payloads into their views, their headers checked before and after (a
        slot reused meanwhile fails the load); each header's checksum at its index of ``expected``."""
        arena = self.arena
        addrs, fields, sums = self._check_slots([pins[n] for n in mapped_pins])
        for n, csum in zip(mapped_pins, sums):
            expected[n] = csum
        self.engine.copy_from_host([(a + HEADER_SIZE, views[n]) for n, a in zip(mapped_pins, addrs)],
                                   self.pool.file_size)
        changed = native.first_changed(addrs, fields)
        if changed >= 0:
            pin = pins[mapped_pins[changed]]
            arena.forget(pin.key)
            raise LoadFailure(pin.key, pin.path, "arena slot was reused while it was being loaded")

    def _read_item(self, pin: Pin, view: torch.Tensor, header: bytearray) -> TransferItem:
        """A slot of a slab on disk is read at its offset; a block file as the file store reads it."""
        if pin.slot is None:
            return super()._read_item(pin, view, header)
        arena, pool = self.arena, self.pool
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
        return TransferItem(fd, arena.payload_offset(pin.slot.slot), view, header)

    def _read_failure(self, pin: Pin, err: BaseException) -> LoadFailure:
        """A slot read that failed is not its reference's fault: nothing is quarantined for it."""
        if pin.slot is None:
            return super()._read_failure(pin, err)
        return LoadFailure(pin.key, pin.path, f"payload read failed: {err}")

    def checked_header(self, pin: Pin, raw: bytearray) -> int:
        """A slot's header is checked as a file's, and its creation time against the reference's: a
        slot freed and written again since holds another block."""
        if pin.slot is None:
            return super().checked_header(pin, raw)
        h = self.pool.check_header(pin, raw)
        if h.created_ns != pin.slot.created_ns:
            raise FormatError(f"slot {pin.slot.slab}#{pin.slot.slot} holds a block created at {h.created_ns}, "
                              f"not {pin.slot.created_ns}: reused")
        return h.checksum

    def _bad_header(self, pin: Pin, view: torch.Tensor, err: FormatError, retries: int, deadline: float) -> int:
        """A disk slot's header did not match its reference.  A reference read from the pool is
        damaged or stale: quarantined, LoadFailure.  A location this process remembered may be out of
        date (evicted by another owner, slot reused): the key is resolved afresh and read once more."""
        if pin.slot is None:
            return super()._bad_header(pin, view, err, retries, deadline)
        pool = self.pool
        fresh = self._repin_stale_slot(pin, err)
        header = bytearray(HEADER_SIZE)
        try:
            self.read_pinned([fresh], [view], {0: header}, [0], retries, deadline)
            try:
                return self.checked_header(fresh, header)
            except FormatError as exc:
                if fresh.slot is None:
                    pool.quarantine(fresh.key, str(exc), fresh.ino)
                else:
                    self.arena.forget(fresh.key)
                raise LoadFailure(fresh.key, fresh.path, f"bad header: {exc}") from None
        finally:
            pool.unpin(fresh)
            pin.slot, pin.ino = fresh.slot, fresh.ino

    def _mismatch(self, pin: Pin, want: int, got: int) -> LoadFailure:
        """A slot whose payload differs from its header's checksum was damaged or reused: forgotten
        (the reference is still good if the slot was reused after it was read); a block file is
        quarantined as the file store does."""
        if pin.slot is None:
            return super()._mismatch(pin, want, got)
        self.arena.forget(pin.key)
        return LoadFailure(pin.key, pin.path, f"arena slot payload checksum mismatch (header {want:#018x}, data "
                           f"{got:#018x}): damaged or reused")

    def _repin_stale_slot(self, pin: Pin, err: Exception) -> Pin:
        """A slot pin whose header failed its check (``err``): the location is forgotten; a reference
        read from the pool is quarantined (when the slot's bytes were wrong, or its slab is gone: no
        load through it can succeed again, and a reference left in place keeps matching) and the load
        fails; a location this process remembered is resolved afresh from the pool instead."""
        assert pin.slot is not None
        pool = self.pool
        self.arena.forget(pin.key)
        if pin.ino != 0:
            if isinstance(err, (FormatError, FileNotFoundError)):
                pool.quarantine(pin.key, f"arena slot: {err}", pin.ino)
            raise LoadFailure(pin.key, pin.path, f"arena slot {pin.slot.slab}#{pin.slot.slot}: {err}")
        try:
            return pool.pin(pin.key)
        except (OSError, FormatError, EOFError) as again:
            raise LoadFailure(pin.key, pin.path, f"arena slot gone and no usable reference: {again}") from None

    def _check_slots(self, pins: list[Pin]) -> tuple[list[int], bytes, list[int]]:
        """Slot addresses, header field bytes and payload checksums of pinned arena slots, after
        checking each header (arena.check_records).  A stale or damaged reference is dropped
        (quarantined) so the key stops matching, then reported as a LoadFailure; a location this
        process remembered (not read from the pool) is looked up afresh once instead."""
        arena = self.arena
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
            fresh = self._repin_stale_slot(pin, err)
            if fresh.slot is None:
                self.pool.unpin(fresh)
                raise LoadFailure(pin.key, pin.path, "arena slot gone; the key now names a block file")
            pin.slot, pin.ino = fresh.slot, fresh.ino
            lo += bad  # check this pin again at its fresh location, then the rest
        return addrs, b"".join(fields), sums
