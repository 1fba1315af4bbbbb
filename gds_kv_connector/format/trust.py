"""Which writers a pool believes (docs/format.md, "Trust"): the rule a file's or directory's lstat or
fstat must pass, shared by the pool's own checks and the stat loops of the match."""

from __future__ import annotations

import os
import stat
from collections.abc import Container


def why_untrusted(uids: Container[int], gids: Container[int], st: os.stat_result) -> str | None:
    """Why a writer outside ``uids`` and ``gids`` could have made or changed what ``st`` describes; None
    when only they could: it belongs to a trusted uid or group, and no one else may write it (no write
    bit for others, none for a group that is not trusted)."""
    if st.st_uid not in uids and st.st_gid not in gids:
        return f"owned by uid {st.st_uid}, which may not write this pool"
    if st.st_mode & stat.S_IWOTH:
        return "writable by every user"
    if st.st_mode & stat.S_IWGRP and st.st_gid not in gids:
        return f"writable by group {st.st_gid}, which is not the pool's share group"
    return None
