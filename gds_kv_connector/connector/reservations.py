"""Prefix reservations kept out of every owner's eviction until TensorRT-LLM releases them.

The newest TensorRT-LLM manager reserves a prefix at admission (``reserve_prefix``) and loads it
later, maybe much later: the request may wait in the queue for pages.  A block is kept from
eviction, by this owner's evictor, other owners' and ``gds-kv gc``, while its recency is newer than
their grace (``TLLM_GDS_KV_EVICT_GRACE_S``); one touch at the reservation would protect it for one
grace only.  The keeper touches every reserved block again each quarter of the grace, from a
thread of its own, so a reservation stays protected for as long as it is held, even while the
executor runs no callback, and stops being protected a grace after its release.
"""

from __future__ import annotations

import threading
from typing import Callable, Sequence


class ReservationKeeper:
    """The keys each live reservation protects, touched again every ``period_s`` seconds."""

    def __init__(self, touch: Callable[[list[bytes]], None], period_s: float) -> None:
        self._touch = touch
        self._period_s = period_s
        self._held: dict[int, Sequence[bytes]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def hold(self, reservation_id: int, keys: Sequence[bytes]) -> None:
        """Protect ``keys`` for ``reservation_id`` from now on (touched once now by the caller's promise)."""
        with self._lock:
            self._held[reservation_id] = keys
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="gdskv-reservations", daemon=True)
                self._thread.start()

    def keep(self, reservation_id: int, keys: Sequence[bytes]) -> None:
        """Protect only ``keys`` of the reservation from now on; none: the reservation is released."""
        with self._lock:
            if keys:
                self._held[reservation_id] = keys
            else:
                self._held.pop(reservation_id, None)

    def held(self) -> dict[int, Sequence[bytes]]:
        with self._lock:
            return dict(self._held)

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            keys = [k for ks in self.held().values() for k in ks]
            if keys:
                self._touch(keys)
