"""Counters every owner keeps; thread-safe, cheap on the hot path, readable as a plain dict."""

from __future__ import annotations

import threading
from collections import Counter


class Stats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._c: Counter[str] = Counter()

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._c[name] += n

    def add_many(self, **counts: int) -> None:
        with self._lock:
            for k, v in counts.items():
                if v:
                    self._c[k] += v

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._c)
