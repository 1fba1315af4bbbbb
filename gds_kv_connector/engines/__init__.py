"""I/O engines: move block payloads between a KV pool tensor and open files (``select.make_engine``
picks one), and the system calls they and the store make (``fileops``).  Nothing is imported here,
so the store's use of ``fileops`` does not load torch for commands that never move a payload."""
