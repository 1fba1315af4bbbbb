"""Which mount holds a path, from /proc/mounts: the doctor reports it, the arena requires tmpfs, and a
pool on a shared filesystem checks its hits through the server (:func:`is_shared_fs`)."""

from __future__ import annotations

import os
import re
from typing import Any

# Filesystems whose clients cache names, attributes or data of their own, so that one node can see a file
# another node already changed or removed (fuse.* covers GlusterFS, sshfs, JuiceFS and other FUSE clients)
SHARED_FS_TYPES = ("nfs", "nfs4", "cifs", "smb3", "lustre", "gpfs", "ceph", "glusterfs", "beegfs", "wekafs",
                   "9p", "afs", "orangefs", "panfs")


def mount_of(path: str) -> dict[str, Any]:
    """The mount holding ``path``: the longest mount point that is a prefix of its real path;
    among equal ones the last listed, which is the one on top."""
    real = os.path.realpath(path)
    best: dict[str, Any] = {"fs_type": "unknown", "mount_point": None, "mount_source": None}
    best_len = -1
    try:
        with open("/proc/mounts") as f:
            mounts = f.read().splitlines()
    except OSError:
        return best
    for line in mounts:
        parts = line.split()
        if len(parts) < 3:
            continue
        source, point, fs_type = _unescape(parts[0]), _unescape(parts[1]), parts[2]
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= best_len:
            best = {"fs_type": fs_type, "mount_point": point, "mount_source": source}
            best_len = len(point)
    return best


def fs_type(path: str) -> str:
    """Filesystem type of the mount holding ``path`` ("unknown" when /proc/mounts is unreadable)."""
    return mount_of(path)["fs_type"]


def is_shared_fs(path: str) -> bool:
    """Whether ``path`` lies on a filesystem of :data:`SHARED_FS_TYPES` or a FUSE client."""
    kind = fs_type(path)
    return kind in SHARED_FS_TYPES or kind.startswith("fuse")


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)
