"""The only layer that sees TensorRT-LLM: its callbacks, the scheduler and worker halves,
per-request state and the metadata between them."""
