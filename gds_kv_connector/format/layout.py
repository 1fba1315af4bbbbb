"""Names in a pool directory: its layout folder, owners, quarantine, temporary files, block files and
arena slabs (docs/format.md, "Directory layout")."""

from __future__ import annotations

import secrets
import time

from gds_kv_connector.util import host as this_host
from gds_kv_connector.util.host import host_tag

LAYOUT_DIR = "gdskv-v1"  # the pool's folder in each root, named for the format version
QUARANTINE_DIR = "quarantine"
OWNERS_DIR = "owners"
TMP_PREFIX = ".tmp-"
BLOCK_SUFFIX = ".blk"
SLABS_DIR = "slabs"
SLAB_SUFFIX = ".slab"
SLAB_TMP_SUFFIX = ".tmp"  # a slab being created: "." + its name + this, renamed once locked and sized
# In each fingerprint directory on a shared filesystem: blocks an evictor took out of the lookup path, kept
# under their own names until no client's cache can still show them at their key's name
EVICTED_DIR = "evicted"
# How long: twice the longest a client cache shows a name as it was (NFS acdirmax and acregmax, 60 s by
# default; GlusterFS and FUSE about a second), so a load promised from a cached lookup finds its block
EVICTED_KEEP_S = 120.0


def quarantine_name(key_hex: str, reason: str, now_ns: int | None = None) -> str:
    """``<key>.<unix ns>.<rand>.<reason>``: the age must be in the name because rename keeps the
    publication mtime; the random part keeps two quarantines of one key in one tick apart."""
    tag = "".join(c if c.isalnum() else "_" for c in reason)[:40]
    return f"{key_hex}.{now_ns or time.time_ns()}.{secrets.token_hex(2)}.{tag}"


def evicted_path(fp_dir: str, key: bytes) -> str:
    """Where an evictor on a shared filesystem keeps ``key``'s block of the fingerprint directory
    ``fp_dir`` until :data:`EVICTED_KEEP_S` has passed."""
    return f"{fp_dir}/{EVICTED_DIR}/{key.hex()}{BLOCK_SUFFIX}"


def slab_tag() -> str:
    """This host's part of its slab names: the host tag (util.host.host_tag), which tells apart hosts
    whose names share a long prefix (StatefulSet pods ``...-worker-0``, ``...-worker-1``)."""
    return host_tag()


def slab_host_is_this(name: str) -> bool:
    """Whether a slab was created on this host (its name starts with this host's tag).  Only such
    slabs are adopted or removed here: the owner lock is a ``flock``, which some shared filesystems
    keep per node, so a free lock seen from another node does not prove the owner is gone.

    Names made before the tag carried ``this_host.HOST[:32]``.  Such a name is this host's only when it is
    all of ``this_host.HOST`` (a name cut at 32 may be any host sharing those characters); any other is left
    alone as another host's."""
    maker = name.split("-", 1)[0]
    return maker == slab_tag() or maker == this_host.HOST


def slab_host_is_legacy_prefix(name: str) -> bool:
    """Whether a slab was named before host tags (``this_host.HOST[:32]``) by this host or by another whose
    name shares this one's first 32 characters: for a host name longer than 32 the name cannot
    tell, so such slabs are neither adopted nor removed unless the operator says so
    (``gds-kv gc --legacy-slabs``, once no process of the older version runs on any host sharing
    the prefix)."""
    return len(this_host.HOST) > 32 and name.split("-", 1)[0] == this_host.HOST[:32]


def slab_tmp_name(name: str) -> str:
    """The hidden name a slab is created under: it neither ends in SLAB_SUFFIX nor passes
    check_slab_name, so arenas, ``gds-kv stats`` and references never take it for a slab."""
    return f".{name}{SLAB_TMP_SUFFIX}"


def slab_of_tmp_name(name: str) -> str | None:
    """The slab name a temporary name (:func:`slab_tmp_name`) was made for, or None."""
    if name.startswith(".") and name.endswith(SLAB_SUFFIX + SLAB_TMP_SUFFIX):
        return name[1:-len(SLAB_TMP_SUFFIX)]
    return None
