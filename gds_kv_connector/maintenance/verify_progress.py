"""How far a long ``gds-kv verify`` is: names done of the total, rate and time left.

On a terminal, a bar redrawn in place at most twice a second; elsewhere (a log file, a pod's log),
one plain line every ``every_s`` seconds, so a run of hours shows it is alive without filling the
log.  The total is known only once every shard directory is listed, and listing all of them first
would cost a walk of the whole pool, so until then it is an estimate, shown with ``~``: the names of
the directories listed so far, per directory, times the directories to do (keys are hashes, so
directories fill alike, and the walk takes every fingerprint's directory of one ``kk`` in turn).
"""

from __future__ import annotations

import time
from typing import TextIO

BAR_WIDTH = 24
BAR_EVERY_S = 0.5


class VerifyProgress:
    def __init__(self, stream: TextIO | None, *, bar: bool, every_s: float = 10.0) -> None:
        """``stream``: where to write (None: nowhere); ``bar``: redraw in place (a terminal)."""
        self.stream, self.bar = stream, bar
        self.every_s = BAR_EVERY_S if bar else every_s
        self.t0 = self.last = time.monotonic()
        self.done0: int | None = None  # names done before this run (a resumed state's)
        self.drawn = False

    def update(self, done: int, total: int, estimated: bool, *, final: bool = False) -> None:
        """``done`` names of ``total`` (``estimated``: not every directory listed yet)."""
        if self.done0 is None:
            self.done0 = done
        now = time.monotonic()
        if self.stream is None or not (final or now - self.last >= self.every_s):
            return
        if final and not self.drawn and (not self.bar or done == 0):
            return  # nothing shown yet: a short run in a log needs no last line, an empty pool no bar
        self.last, self.drawn = now, True
        line = self.line(done, total, estimated, now - self.t0)
        self.stream.write(f"\r{line}\033[K" + ("\n" if final else "") if self.bar else line + "\n")
        self.stream.flush()

    def line(self, done: int, total: int, estimated: bool, elapsed: float) -> str:
        total = max(total, done)
        rate = (done - (self.done0 or 0)) / elapsed if elapsed > 0 else 0.0
        left = f"ETA {_clock((total - done) / rate)}" if rate > 0 and total > done else \
            "ETA ?" if total > done else "done"
        share = done / total if total else 1.0
        bar = f"[{'#' * round(share * BAR_WIDTH):<{BAR_WIDTH}}] " if self.bar else ""
        of = f"~{total}" if estimated else f"{total}"
        return (f"verify: {bar}{done}/{of} blocks ({share:.1%}), {rate:.0f} blocks/s, {left}"
                + (" (total estimated from the shard directories listed so far)" if estimated and not self.bar
                   else ""))


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
