"""What the connector reads from TensorRT-LLM's ``llm_args``, in one place, with safe defaults."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EngineConfig:
    tokens_per_block: int
    tp_size: int
    attention_dp: bool
    model_id: str
    # The configured precision (model dtype, KV cache dtype, KV quantization), for pools whose
    # tensor is bytes (a V2 layout): fp16 and bf16 KV have equal block sizes and must not share keys.
    precision: str = "model=auto kv=auto kv_quant=none"
    # NVFP4 KV keeps per-block scales in a pool of its own, which the connector does not move
    kv_fp4: bool = False
    # context parallelism: each rank holds part of a sequence's KV (and the TP shard is no longer
    # the MPI rank modulo tp_size), so a block keyed by its prefix would be a fragment
    cp_size: int = 1
    # pipeline parallelism: each rank holds some layers' KV; TensorRT-LLM refuses connectors with it
    pp_size: int = 1

    @property
    def sharded_attention(self) -> bool:
        """Each rank holds a head shard only under plain TP; ADP owners hold whole KV."""
        return self.tp_size > 1 and not self.attention_dp


def read_llm_args(llm_args: Any, model_id_override: str = "") -> EngineConfig:
    """The engine's shape as the connector needs it.  The model identity is ``llm_args.model`` and,
    when one is set, ``@`` and ``llm_args.revision`` (two checkpoints of one model name must never
    share KV); ``model_id_override`` (TLLM_GDS_KV_MODEL_ID) replaces all of it."""
    kv_cfg = getattr(llm_args, "kv_cache_config", None)
    tpb = getattr(kv_cfg, "tokens_per_block", None)
    if tpb is None:
        tpb = getattr(llm_args, "tokens_per_block", None)
    if tpb is None:
        tpb = 32
    tp = getattr(llm_args, "tensor_parallel_size", None)
    if tp is None:
        tp = getattr(getattr(llm_args, "parallel_config", None), "tp_size", 1)
    adp = bool(getattr(llm_args, "enable_attention_dp", False))
    cp = getattr(llm_args, "context_parallel_size", None)
    if cp is None:
        cp = getattr(getattr(llm_args, "parallel_config", None), "cp_size", 1)
    pp = getattr(llm_args, "pipeline_parallel_size", None)
    if pp is None:
        pp = getattr(getattr(llm_args, "parallel_config", None), "pp_size", 1)
    model = model_id_override
    if not model:
        model = str(getattr(llm_args, "model", "") or "unknown-model")
        revision = getattr(llm_args, "revision", None)
        if revision:
            model = f"{model}@{revision}"
    if int(tpb) <= 0:
        raise ValueError(f"tokens_per_block must be positive, got {tpb}")
    precision = _precision(llm_args, kv_cfg)
    kv_part = precision.split(" ", 1)[1].lower()  # "kv=... kv_quant=...": the model dtype is not the KV's
    return EngineConfig(int(tpb), int(tp or 1), adp, model, precision, "fp4" in kv_part, int(cp or 1),
                        int(pp or 1))


def check_parallelism(cfg: EngineConfig) -> None:
    """Refuse pipeline and context parallelism in one line: a rank's block would hold some layers'
    KV (PP) or a fragment of the sequence's (CP), which a key naming the whole prefix cannot name."""
    if cfg.pp_size != 1 or cfg.cp_size != 1:
        raise ValueError(f"gds-kv-connector supports pp_size 1 and cp_size 1 only (got pp_size={cfg.pp_size}, "
                         f"cp_size={cfg.cp_size}): a rank's KV block would be part of the prefix's KV")


def _precision(llm_args: Any, kv_cfg: Any) -> str:
    """``llm_args.dtype``, ``kv_cache_config.dtype`` and ``quant_config.kv_cache_quant_algo`` as
    configured ("auto" resolves from the checkpoint, which the model identity names)."""
    algo = getattr(getattr(llm_args, "quant_config", None), "kv_cache_quant_algo", None)
    algo = getattr(algo, "value", algo)  # QuantAlgo is a str enum
    return (f"model={getattr(llm_args, 'dtype', None) or 'auto'} kv={getattr(kv_cfg, 'dtype', None) or 'auto'} "
            f"kv_quant={algo or 'none'}")
