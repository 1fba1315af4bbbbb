"""Where blocks live: the pool directory of block files and the slot arena, and moving a
batch of blocks in or out of them."""
