"""Save and load batches of blocks: checksum, header, payload transfer, publication, verification.

Runs on transfer threads.  Per-block failures are returned, not raised, so one bad file or
one full disk never takes down the batch of another request; the caller decides what a
failure means (a dropped save is counted, a failed promised load is fatal).
"""

from __future__ import annotations

import errno
import logging
import time
from dataclasses import dataclass, field

import torch

from .checksum import CHECKSUM_ALGO
from .engines.base import IoEngine, TransferItem
from .pool import BlockPool, Pin, PoolError
from .pool_format import HEADER_SIZE, ZERO_KEY, BlockHeader, FormatError

log = logging.getLogger(__name__)

TRANSIENT_ERRNOS = {errno.EIO, errno.EAGAIN, errno.EINTR, errno.ETIMEDOUT}


@dataclass
class SaveOutcome:
    published: int = 0
    already_present: int = 0
    lost_race: int = 0
    failed: list[tuple[bytes, str]] = field(default_factory=list)  # (key, cause)
    bytes_written: int = 0


class LoadFailure(RuntimeError):
    """A promised block could not be loaded; ``key``/``path``/``reason`` say which and why."""

    def __init__(self, key: bytes, path: str, reason: str) -> None:
        super().__init__(f"block {key.hex()} ({path}): {reason}")
        self.key, self.path, self.reason = key, path, reason


def save_blocks(pool: BlockPool, engine: IoEngine, keys: list[bytes], parents: list[bytes],
                views: list[torch.Tensor]) -> SaveOutcome:
    """Publish each (key, view) not yet in the pool; ``parents[i]`` is the key of the block before."""
    out = SaveOutcome()
    todo = [i for i, k in enumerate(keys) if not pool.contains(k)]
    out.already_present = len(keys) - len(todo)
    if not todo:
        return out
    sums = engine.checksums([views[i] for i in todo])
    opened: list[tuple[int, int, str]] = []  # (index, fd, tmp) not yet published or discarded
    now = time.time_ns()
    try:
        for i, csum in zip(todo, sums):
            header = BlockHeader(pool.fingerprint, keys[i], pool.payload_len, csum, CHECKSUM_ALGO,
                                 pool.tokens_per_block, now, parents[i] or ZERO_KEY)
            try:
                fd, tmp = pool.create_tmp(keys[i], header)
            except (OSError, PoolError) as exc:  # PoolError: a directory was replaced by a file
                out.failed.append((keys[i], _cause(exc)))
                continue
            opened.append((i, fd, tmp))
        errors = engine.write([TransferItem(fd, HEADER_SIZE, views[i]) for i, fd, _ in opened])
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
    headers: list[BlockHeader] = []
    attempt = 0
    for pin in pins:
        while True:
            try:
                headers.append(pool.read_header(pin))
                break
            except FormatError as exc:
                pool.quarantine(pin.key, str(exc), pin.ino)
                raise LoadFailure(pin.key, pin.path, f"bad header: {exc}") from None
            except EOFError as exc:
                pool.quarantine(pin.key, "truncated", pin.ino)
                raise LoadFailure(pin.key, pin.path, f"header read failed: {exc}") from None
            except OSError as exc:
                if exc.errno not in TRANSIENT_ERRNOS or attempt >= retries or time.monotonic() >= deadline:
                    raise LoadFailure(pin.key, pin.path, f"header read failed: {exc}") from None
                attempt += 1
                log.info("retrying a block header read after %s (attempt %d of %d)", exc, attempt, retries)
    pending = list(range(len(pins)))
    while pending:
        errors = engine.read([TransferItem(pins[i].fd, HEADER_SIZE, views[i]) for i in pending])
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
    if verify:
        sums = engine.checksums(views)
        for pin, header, got in zip(pins, headers, sums):
            if got != header.checksum:
                pool.quarantine(pin.key, "checksum mismatch", pin.ino)
                raise LoadFailure(pin.key, pin.path,
                                  f"payload checksum mismatch (header {header.checksum:#018x}, data {got:#018x})")
    return len(pins) * pool.payload_len


def _cause(exc: BaseException) -> str:
    """A short, stable cause label for counting and once-per-cause logging."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return errno.errorcode.get(exc.errno, str(exc.errno))
    return type(exc).__name__
