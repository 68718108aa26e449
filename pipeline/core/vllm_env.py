"""What every in-process vLLM engine of a run needs (a generator's, a judge's):
its process's environment, set before vllm is imported, its logging, and the
KV cache's size on a CPU, which vLLM would otherwise make 4 GiB, allocated and
zeroed at start-up."""
from __future__ import annotations

import logging
import os

# vLLM's loggers that log INFO at every refit: a line per generator per step in a job's log.
PER_REFIT_LOGGERS = ("vllm.v1.core.block_pool",)  # "Successfully reset prefix cache"


def set_vllm_environment() -> None:
    """Before vllm's import, which reads these once: no engine-core process of
    its own (on CPU it would cost cores we do not have, and an in-process
    engine is driven from the actor's threads), no pinning of cores that other
    workers share, a bound on oneDNN's matmul cache. setdefault: a caller's
    explicit choice wins."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    # vLLM's CPU linear layers build a oneDNN matmul for each batch size they meet
    # (0.28 MB each on a 4.2M model): vLLM keeps 32 per weight shape, and oneDNN's
    # own cache kept 1024 more, so a generator grew for as long as new sizes came.
    # With 64 the bound is reached at start-up (VllmGenerationEngine._probe).
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
    quiet_per_refit_logs()


class _WarningsAndErrors(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING


def quiet_per_refit_logs() -> None:
    """Keep the INFO lines vLLM logs at every refit out of the logs, and its
    warnings and errors in. A filter, not a level: vLLM's logging setup
    (dictConfig, run again by an engine's start) resets the levels of the
    loggers under `vllm`, never their filters."""
    for name in PER_REFIT_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _WarningsAndErrors) for f in logger.filters):
            logger.addFilter(_WarningsAndErrors())


def kv_cache_bytes(config: dict, max_model_len: int, seqs: int, dtype: str) -> int:
    """Bytes of keys and values for `seqs` sequences of max_model_len tokens, at least 16 MiB."""
    import torch
    text = config.get("text_config") or config
    heads = text.get("num_attention_heads", 1)
    head_dim = text.get("head_dim") or text.get("hidden_size", 0) // heads
    per_token = 2 * text.get("num_hidden_layers", 1) * text.get("num_key_value_heads", heads) * head_dim
    kind = getattr(torch, str(dtype), None)
    width = torch.finfo(kind).bits // 8 if isinstance(kind, torch.dtype) else 4  # "auto": assume fp32
    return max(per_token * width * max_model_len * seqs, 16 * 2**20)
