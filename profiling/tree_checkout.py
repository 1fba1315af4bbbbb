"""``--tree DIR`` for the probes that time another checkout's package beside this one's (trees
alternated in the shell).  Kept apart from ``bench_common``: a probe that imports the tree's own
``profiling/`` must not have loaded this checkout's copy of it first.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def add_tree_argument(ap: argparse.ArgumentParser, what: str = "package") -> None:
    ap.add_argument("--tree", default=os.path.dirname(HERE), help=f"checkout whose {what} is imported")


def use_tree(tree: str, script: str, its_profiling: bool = False) -> str:
    """Put ``tree``'s package first on the import path, with its ``profiling/`` where ``its_profiling``
    (the tree's own bench code) or else this checkout's (one rig times every tree), and stop with
    an error if the package then imported is not the tree's (one loaded earlier, or an install).
    Returns the tree's absolute path."""
    tree = os.path.abspath(tree)
    sys.path[:0] = [os.path.join(tree, "profiling"), tree] if its_profiling else [tree, HERE]
    import gds_kv_connector
    if not os.path.realpath(gds_kv_connector.__file__).startswith(os.path.realpath(tree)):
        raise SystemExit(f"{script}: imported {gds_kv_connector.__file__}, not the package of {tree}")
    return tree
