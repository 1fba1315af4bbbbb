"""Where a ``gds-kv verify`` run stands, so a stopped run goes on where it stopped (docs/format.md,
"Verify state").

A pool's blocks lie in shard directories ``<root>/gdskv-v1/<fp16>/<kk>/``: 256 per fingerprint, one
per first byte of the key.  :class:`Shard` ``I/N`` gives process ``I`` of ``N`` the directories whose
``kk`` is ``I`` modulo ``N``, in every fingerprint and root: the same rule whichever fingerprints
exist or appear, so ``N`` processes on any nodes verify every directory once, and keys (hashes) fill
the directories evenly, so each gets an equal part.

The state is one small JSON file, replaced whole (:func:`~.atomic_file.atomic_write`): which
directories are done, the name reached in the one being walked (a directory's names are verified in
sorted order), and the running totals.  Reading it is bounded and checked like any shared file: a
file that is not a state of this version, or one of other roots, shard or quarantine choice, is a
one-line error, never a guess.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gds_kv_connector.maintenance.pool_scan import NotRegularFile, open_regular, owners_dir
from gds_kv_connector.util.atomic_file import atomic_write

STATE_KIND = "gds-kv verify state"
STATE_VERSION = 1
SHARD_DIRS = 256  # key directories per fingerprint: one per first byte of the key
MAX_STATE_BYTES = 16 << 20  # far above a state's size (a few KiB, and at most 1000 listed bad files)
MAX_LISTED_BAD = 1000  # bad files listed individually per root; the rest only counted
COUNTS = ("checked", "ok", "bad", "vanished", "quarantined", "bytes_read", "unreadable_entries")
_SHARD_RE = re.compile(r"([0-9]{1,3})/([0-9]{1,3})")
_HEX_KK = re.compile(r"[0-9a-f]{2}")
_KEY_HEX = re.compile(r"[0-9a-f]{64}")


class StateError(ValueError):
    """A state file that cannot be resumed from: not a state, or another run's."""


@dataclass(frozen=True)
class Shard:
    """Process ``index`` of ``count`` (from 0): the key directories ``kk`` with ``int(kk, 16) % count
    == index``, in every fingerprint and root."""

    index: int = 0
    count: int = 1

    @classmethod
    def parse(cls, text: str) -> Shard:
        m = _SHARD_RE.fullmatch(text.strip())
        if not m or not int(m[1]) < int(m[2]) <= SHARD_DIRS:
            raise ValueError(f"must be I/N with 0 <= I < N <= {SHARD_DIRS} (process I of N, from 0), got {text!r}")
        return cls(int(m[1]), int(m[2]))

    def owns(self, kk: str) -> bool:
        return int(kk, 16) % self.count == self.index

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


WHOLE_POOL = Shard()


def default_state_path(roots: Sequence[str], shard: Shard) -> str:
    """``owners/verify-<I>-of-<N>.json`` in the first root: every node that mounts the pool sees it,
    so a run stopped on one node goes on from another, and rerunning the same command resumes."""
    return os.path.join(owners_dir(roots[0]), f"verify-{shard.index}-of-{shard.count}.json")


def new_totals() -> dict[str, Any]:
    """One root's running totals, in the shape of verify's per-root result."""
    return {**dict.fromkeys(COUNTS, 0), "reasons": {}, "bad_files": [], "duration_s": 0.0}


@dataclass
class VerifyState:
    roots: list[str]  # absolute, in the order given
    shard: Shard
    quarantine: bool
    started_ns: int = field(default_factory=time.time_ns)
    # "<root index>/<fp16>" -> bit kk set once directory kk of that fingerprint is verified whole
    done: dict[str, int] = field(default_factory=dict)
    entries_done: int = 0  # names in the directories done (for the estimate of the total)
    # the directory being walked and the last name verified in it: (root index, fp16, kk, key hex)
    current: tuple[int, str, str, str] | None = None
    totals: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.totals = self.totals or [new_totals() for _ in self.roots]

    def is_done(self, root: int, fp: str, kk: str) -> bool:
        return bool(self.done.get(f"{root}/{fp}", 0) >> int(kk, 16) & 1)

    def mark_done(self, root: int, fp: str, kk: str, entries: int) -> None:
        name = f"{root}/{fp}"
        self.done[name] = self.done.get(name, 0) | 1 << int(kk, 16)
        self.entries_done += entries
        self.current = None

    @property
    def shards_done(self) -> int:
        return sum(bits.bit_count() for bits in self.done.values())

    def to_json(self) -> bytes:
        return json.dumps({
            "kind": STATE_KIND, "version": STATE_VERSION, "roots": self.roots, "shard": str(self.shard),
            "quarantine": self.quarantine, "started_ns": self.started_ns, "updated_ns": time.time_ns(),
            "done": {k: f"{v:064x}" for k, v in sorted(self.done.items())}, "entries_done": self.entries_done,
            "current": list(self.current) if self.current else None, "totals": self.totals,
        }, indent=1).encode()


def save_state(path: str, state: VerifyState) -> None:
    atomic_write(path, state.to_json())


def remove_state(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def load_state(path: str, roots: Sequence[str], shard: Shard, quarantine: bool) -> VerifyState | None:
    """The state at ``path`` for this run, or None where there is none.  Raises :class:`StateError`
    for a file that is not a state of this version or is another run's (other roots, ``--shard``
    or quarantine choice), OSError where it cannot be read."""
    again = "pass the same options, another --state, or --restart to start over"
    try:
        fd, _ = open_regular(path)
    except FileNotFoundError:
        return None
    except NotRegularFile:
        raise StateError(f"state file {path} is not a regular file") from None
    with os.fdopen(fd, "rb") as fh:
        raw = fh.read(MAX_STATE_BYTES + 1)
    try:
        if len(raw) > MAX_STATE_BYTES:
            raise ValueError(f"over {MAX_STATE_BYTES} bytes")
        data = json.loads(raw)
        if not isinstance(data, dict) or data.get("kind") != STATE_KIND or data.get("version") != STATE_VERSION:
            raise ValueError(f"not a {STATE_KIND!r} of version {STATE_VERSION}")
        state = _parse(data)
    except (ValueError, TypeError, KeyError) as exc:
        raise StateError(f"state file {path} cannot be resumed from ({exc}): --restart starts over") from None
    if state.roots != [os.path.abspath(r) for r in roots]:
        raise StateError(f"state file {path} is of pool root(s) {':'.join(state.roots)}, not "
                         f"{':'.join(map(os.path.abspath, roots))}: {again}")
    if state.shard != shard:
        raise StateError(f"state file {path} is of --shard {state.shard}, not {shard}: {again}")
    if state.quarantine != quarantine:
        raise StateError(f"state file {path} is of a run {'without' if state.quarantine else 'with'} "
                         f"--no-quarantine: {again}")
    return state


def _parse(data: dict[str, Any]) -> VerifyState:
    """A state from its JSON, every field checked (ValueError, TypeError or KeyError if one is off)."""
    roots = data["roots"]
    _check(isinstance(roots, list) and roots and all(isinstance(r, str) for r in roots), "roots")
    done = {}
    for name, bits in _dict(data["done"], "done").items():
        root, _, fp = name.partition("/")
        _check(root.isdigit() and int(root) < len(roots) and re.fullmatch(r"[0-9a-f]{16}", fp) is not None
               and isinstance(bits, str) and re.fullmatch(r"[0-9a-f]{64}", bits) is not None, "done")
        done[name] = int(bits, 16)
    current = data["current"]
    if current is not None:
        _check(isinstance(current, list) and len(current) == 4 and 0 <= _int(current[0]) < len(roots)
               and all(isinstance(c, str) for c in current[1:]) and _HEX_KK.fullmatch(current[2]) is not None
               and _KEY_HEX.fullmatch(current[3]) is not None, "current")
        current = tuple(current)
    totals = data["totals"]
    _check(isinstance(totals, list) and len(totals) == len(roots), "totals")
    for t in totals:
        _check(all(_int(_dict(t, "totals")[k]) >= 0 for k in COUNTS), "totals")
        _check(all(isinstance(k, str) and _int(v) >= 0 for k, v in _dict(t["reasons"], "reasons").items()), "reasons")
        _check(isinstance(t["bad_files"], list) and len(t["bad_files"]) <= MAX_LISTED_BAD
               and all(isinstance(f, dict) for f in t["bad_files"]), "bad_files")
        _check(isinstance(t["duration_s"], (int, float)) and t["duration_s"] >= 0, "duration_s")
    return VerifyState(roots, Shard.parse(data["shard"]), _bool(data["quarantine"]), _int(data["started_ns"]),
                       done, _int(data["entries_done"]), current, totals)


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"bad {what!r}")


def _int(v: Any) -> int:
    _check(type(v) is int, "number")
    return v


def _bool(v: Any) -> bool:
    _check(type(v) is bool, "flag")
    return v


def _dict(v: Any, what: str) -> dict:
    _check(isinstance(v, dict), what)
    return v
