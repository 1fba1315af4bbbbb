"""What a worker is asked to move: the loads and saves of one request, as the scheduler plans them
and the transfer manager runs them (the scheduler's metadata carries lists of these)."""

from __future__ import annotations

from typing import NamedTuple


# Named tuples, not frozen dataclasses: the scheduler makes one per request in an admission
# iteration, and a named tuple is made in about half the time and pickles in about 60% of the bytes.
class LoadOp(NamedTuple):
    request_id: int
    keys: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    is_async: bool
    # the prefix reservation whose accepted load this is (``SchedulerOutput.prefix_loads``), reported
    # by ``get_finished_prefix_loads`` once done; 0 for a load answered by get_num_new_matched_tokens
    reservation: int = 0


class SaveOp(NamedTuple):
    request_id: int
    keys: tuple[bytes, ...]
    parents: tuple[bytes, ...]
    block_ids: tuple[int, ...]
