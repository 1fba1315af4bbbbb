"""What a host charges for the system calls a match makes, to compare executor figures between hosts.

    python profiling/syscall_probe.py

A new prompt's match stats its first block's file and finds it absent: on the CI VM that stat is a
quarter of the match, and the GPU hosts lent to this project differ from one another in it.  Prints,
for /dev/shm and the temporary directory, the cost of ``os.path.exists`` on an absent file, of a
trivial system call (``getppid``) and of an empty Python call, each the best of five loops.
"""

from __future__ import annotations

import os
import tempfile
import timeit

N = 200_000


def best_us(fn) -> float:
    return min(timeit.repeat(fn, number=N, repeat=5)) / N * 1e6


def main() -> None:
    for d in ("/dev/shm", tempfile.gettempdir()):
        if not os.path.isdir(d):
            continue
        absent = os.path.join(d, "gdskv-absent-probe-file")
        print(f"{d}: absent-file exists() {best_us(lambda: os.path.exists(absent)):.2f} us, "
              f"getppid() {best_us(os.getppid):.2f} us, empty lambda {best_us(lambda: None):.3f} us")


if __name__ == "__main__":
    main()
