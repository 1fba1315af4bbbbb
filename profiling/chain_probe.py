"""How long the key chain of a 128k-token prompt takes on the executor thread (``native.chain_keys``).

    PYTHONPATH=<checkout> python profiling/chain_probe.py

Times the chain of 4096 blocks of 32 tokens (min and median of 7 rounds of 10 calls) and, beside it, one
block of all 131072 tokens: the tokens' conversion plus one SHA-256 pass over 1 MiB, so the rest of the
first figure is the per-block hashing.  The checkout on ``PYTHONPATH`` (with its own built extension) is
the one measured, so two trees compare in one sitting.
"""

from __future__ import annotations

import os
import random
import timeit

import gds_kv_connector
from gds_kv_connector import native


def main() -> None:
    if not native.BUILT:
        raise SystemExit("chain_probe.py: the C extension is not built in this tree")
    rng = random.Random(1)
    tokens = [rng.randrange(32000) for _ in range(131073)]
    chain = [timeit.timeit(lambda: native.chain_keys(bytes(32), tokens, 0, 32, 4096), number=10) / 10 * 1e3
             for _ in range(7)]
    one = [timeit.timeit(lambda: native.chain_keys(bytes(32), tokens, 0, 131072, 1), number=10) / 10 * 1e3
           for _ in range(5)]
    print(f"{os.path.dirname(os.path.dirname(gds_kv_connector.__file__))}: chain of 4096 blocks min "
          f"{min(chain):.3f} ms, median {sorted(chain)[3]:.3f} ms; one 131072-token block (conversion and one "
          f"1 MiB hash) min {min(one):.3f} ms")


if __name__ == "__main__":
    main()
