"""Reference executor and deterministic model used by the tests, the demo and the benchmarks."""

from gds_kv_connector.simulator.executor import ExecutorConfig, InvariantViolation, ReferenceExecutor, RunStats, SimRequest, State
from gds_kv_connector.simulator.model import ModelShape, ReferenceModel

__all__ = ["ExecutorConfig", "InvariantViolation", "ModelShape", "ReferenceExecutor", "ReferenceModel", "RunStats",
           "SimRequest", "State", "fake_llm_args"]


def fake_llm_args(tokens_per_block: int, model: str = "reference-model", attention_dp: bool = True,
                  tp_size: int = 1):
    """The slice of TensorRT-LLM's TorchLlmArgs the connector reads."""
    from types import SimpleNamespace
    return SimpleNamespace(kv_cache_config=SimpleNamespace(tokens_per_block=tokens_per_block),
                           tensor_parallel_size=tp_size, enable_attention_dp=attention_dp, model=model)
