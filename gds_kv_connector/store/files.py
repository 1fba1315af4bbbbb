"""Blocks kept one file per block: written to a temporary file, published under the key's name by
link or rename, read with its header and verified against the header's checksum."""

from __future__ import annotations

import errno
import logging
import time

import torch

from gds_kv_connector.engines.base import InTime, Once, ReadStopped, TransferItem
from gds_kv_connector.format.checksum import CHECKSUM_ALGO
from gds_kv_connector.format.records import HEADER_SIZE, ZERO_KEY, BlockHeader, FormatError
from gds_kv_connector.store.base import (BlockStore, LoadFailure, LoadStopped, SaveOutcome, cause,
                                         count_failed)
from gds_kv_connector.store.pool import FILE_FAULT_ERRNOS, Pin, PoolError

log = logging.getLogger(__name__)

TRANSIENT_ERRNOS = {errno.EIO, errno.EAGAIN, errno.EINTR, errno.ETIMEDOUT}  # worth a retry
# Pause before the first retry of a transient read error, doubled for each further one (cut at the
# deadline): retries at once would all land inside a storage hiccup of a few milliseconds.
RETRY_PAUSE_S = 0.01


class FileStore(BlockStore):
    """Blocks of the pool as block files."""

    # -- save -------------------------------------------------------------------------------------
    def _save(self, keys: list[bytes], parents: list[bytes], views: list[torch.Tensor], in_time: InTime | None,
              views_read: Once) -> SaveOutcome:
        todo = self._absent(keys)
        out, sums, now = self._start_save(keys, views, todo, in_time)
        if sums:
            self._save_files(keys, parents, views, todo, sums, now, out, in_time, views_read)
        return out

    def _absent(self, keys: list[bytes]) -> list[int]:
        """Indices of the keys whose block is not in the pool (one stat each)."""
        contains = self.pool.contains
        return [i for i, k in enumerate(keys) if not contains(k)]

    def _start_save(self, keys: list[bytes], views: list[torch.Tensor], todo: list[int],
                    in_time: InTime | None) -> tuple[SaveOutcome, list[int], int]:
        """The outcome so far, the payload checksums of the blocks to write (``todo``, less the repeats
        of a key, updated in place) and the creation time; no checksum when nothing is to be written."""
        out = SaveOutcome()
        if len(todo) > 1 and len(set(keys if len(todo) == len(keys) else map(keys.__getitem__, todo))) < len(todo):
            todo[:] = _first_of_each_key(keys, todo)
        out.already_present = len(keys) - len(todo)
        if not todo:
            return out, [], 0
        if in_time is not None and not in_time():  # stopped (a fence) before it read a page
            out.expired = len(todo)
            return out, [], 0
        sums = self.engine.checksums(views if len(todo) == len(keys) else [views[i] for i in todo])
        return out, sums, time.time_ns()

    def _save_files(self, keys: list[bytes], parents: list[bytes], views: list[torch.Tensor], todo: list[int],
                    sums: list[int], now: int, out: SaveOutcome, in_time: InTime | None,
                    views_read: Once | None) -> None:
        """Write each block of ``todo`` to a temporary file (header and payload in one I/O), then
        publish it under its key; a write that failed leaves no temporary file behind."""
        pool = self.pool
        opened: list[tuple[int, int, str]] = []  # (index, fd, tmp) not yet published or discarded
        packed: list[bytes] = []  # each opened file's header, written with its payload in one I/O
        try:
            for i, csum in zip(todo, sums):
                header = self.header(keys[i], parents[i], csum, now)
                try:
                    fd, tmp = pool.create_tmp(keys[i], None)  # the header goes with the payload
                except (OSError, PoolError) as exc:  # PoolError: a directory was replaced by a file
                    out.failed.append((keys[i], cause(exc)))
                    continue
                opened.append((i, fd, tmp))
                packed.append(header.pack())
            errors = self.engine.write([TransferItem(fd, HEADER_SIZE, views[i], raw)
                                        for (i, fd, _), raw in zip(opened, packed)], in_time, views_read)
            while opened:
                (i, fd, tmp), err = opened.pop(0), errors.pop(0)
                if err is not None:
                    pool.discard_tmp(fd, tmp)
                    count_failed(out, keys[i], err)
                    continue
                try:
                    if pool.publish(fd, tmp, keys[i]):
                        out.published += 1
                        out.bytes_written += pool.payload_len
                    else:
                        out.lost_race += 1
                except OSError as exc:
                    out.failed.append((keys[i], cause(exc)))
        finally:
            # Only reached with entries left when something unexpected escaped (a bug, an interrupt):
            # never leave their temporary files behind.
            for _i, fd, tmp in opened:
                pool.discard_tmp(fd, tmp)

    def header(self, key: bytes, parent: bytes, csum: int, now: int) -> BlockHeader:
        """The header a block file or disk slot is written with (mapped slots get the same bytes from
        native.write_headers)."""
        pool = self.pool
        return BlockHeader(pool.fingerprint, key, pool.payload_len, csum, CHECKSUM_ALGO, pool.tokens_per_block, now,
                           parent or ZERO_KEY)

    # -- load -------------------------------------------------------------------------------------
    def load(self, pins: list[Pin], views: list[torch.Tensor], *, verify: bool, retries: int, deadline: float,
             in_time: InTime | None = None) -> int:
        if in_time is not None and not in_time():
            raise LoadStopped(len(pins))
        which = list(range(len(pins)))
        expected = self._read_checked(pins, views, which, retries, deadline, in_time)
        if verify:
            self.verify(pins, views, expected)
        return len(pins) * self.pool.payload_len

    def _read_checked(self, pins: list[Pin], views: list[torch.Tensor], which: list[int], retries: int,
                      deadline: float, in_time: InTime | None, expected: list[int] | None = None) -> list[int]:
        """Header and payload of ``pins[n]`` for n in ``which`` read together (one I/O where the engine
        can), each header checked after; the payload checksum each promises, at its index of
        ``expected`` (made here when None).  A failed load is reported before any KV is used."""
        expected = expected if expected is not None else [0] * len(pins)
        headers = {n: bytearray(HEADER_SIZE) for n in which}
        self.read_pinned(pins, views, headers, which, retries, deadline, in_time)
        for n in which:
            pin = pins[n]
            try:
                expected[n] = self.checked_header(pin, headers[n])
            except FormatError as exc:
                expected[n] = self._bad_header(pin, views[n], exc, retries, deadline)
        return expected

    def _bad_header(self, pin: Pin, view: torch.Tensor, err: FormatError, retries: int, deadline: float) -> int:
        """A block file whose header does not match its key or the pool: quarantined, LoadFailure."""
        self.pool.quarantine(pin.key, str(err), pin.ino)
        raise LoadFailure(pin.key, pin.path, f"bad header: {err}") from None

    def verify(self, pins: list[Pin], views: list[torch.Tensor], expected: list[int]) -> None:
        """Every loaded payload against its header's checksum, in one engine call; a mismatch names
        the first block that differs (:meth:`_mismatch`)."""
        sums = self.engine.checksums(views, load=True)
        if sums == expected:  # one C comparison; the loop below only names the first mismatch
            return
        for pin, want, got in zip(pins, expected, sums):
            if got != want:
                raise self._mismatch(pin, want, got)

    def _mismatch(self, pin: Pin, want: int, got: int) -> LoadFailure:
        """A block file whose payload differs from its header's checksum: quarantined first."""
        self.pool.quarantine(pin.key, "checksum mismatch", pin.ino)
        return LoadFailure(pin.key, pin.path, f"payload checksum mismatch (header {want:#018x}, data {got:#018x})")

    def read_pinned(self, pins: list[Pin], views: list[torch.Tensor], headers: dict[int, bytearray],
                    which: list[int], retries: int, deadline: float, in_time: InTime | None = None) -> None:
        """Read header and payload of ``pins[n]`` for n in ``which``, retrying transient errors after
        a growing pause (RETRY_PAUSE_S); :class:`LoadStopped` once ``in_time`` stopped a read."""
        items = {n: self._read_item(pins[n], views[n], headers[n]) for n in which}
        attempt = 0
        pending = which
        while pending:
            errors = self.engine.read([items[n] for n in pending], in_time)
            failed = [(n, e) for n, e in zip(pending, errors) if e is not None]
            if not failed:
                return
            stopped = sum(isinstance(e, ReadStopped) for _, e in failed)
            if stopped:
                raise LoadStopped(stopped)
            n, err = failed[0]
            transient = isinstance(err, OSError) and err.errno in TRANSIENT_ERRNOS
            if not transient or attempt >= retries or time.monotonic() >= deadline:
                raise self._read_failure(pins[n], err)
            attempt += 1
            log.info("retrying %d block read(s) after %s (attempt %d of %d)", len(failed), err, attempt, retries)
            time.sleep(max(0.0, min(RETRY_PAUSE_S * 2 ** (attempt - 1), deadline - time.monotonic())))
            pending = [n for n, _ in failed]

    def _read_item(self, pin: Pin, view: torch.Tensor, header: bytearray) -> TransferItem:
        """The read of one pinned block: its file, header first."""
        return TransferItem(pin.fd, HEADER_SIZE, view, header)

    def _read_failure(self, pin: Pin, err: BaseException) -> LoadFailure:
        """The failure of a read that its retries did not cure.  A block file that ended early or keeps
        failing for a reason of its own (FILE_FAULT_ERRNOS: EIO) is quarantined first: every restarted
        owner would match it and die on it again."""
        fault = isinstance(err, EOFError) or (isinstance(err, OSError) and err.errno in FILE_FAULT_ERRNOS)
        if not fault:
            return LoadFailure(pin.key, pin.path, f"payload read failed: {err}")
        self.pool.quarantine(pin.key, "truncated" if isinstance(err, EOFError) else f"read {cause(err)}", pin.ino)
        return LoadFailure(pin.key, pin.path, f"payload read failed: {err}; moved out of the pool (quarantined)")

    def checked_header(self, pin: Pin, raw: bytearray) -> int:
        """The payload checksum a pinned block's header promises, after checking the header against
        the pool and the key; raises FormatError."""
        return self.pool.check_header(pin, raw).checksum


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
