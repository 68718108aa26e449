"""vLLM 0.32 serving an adapter on lm_head for Qwen2 language models.

vLLM wraps lm_head for LoRA (its LogitsProcessorWithLoRA) only where a module of
the model names it in `embedding_modules`, as its Llama does. Its
Qwen2ForCausalLM, a Qwen2 policy and the language model of Qwen2-VL and
Qwen2.5-VL, names none, so its adapter loader refuses an adapter on lm_head
("expected target modules in ... but received ['language_model.lm_head']").
Declared as Llama declares it, the adapter is served with the trainer's
logprobs (tests/trainer/test_vlm.py). The engine runs in the process that
declares it (VLLM_ENABLE_V1_MULTIPROCESSING=0, pipeline/core/vllm_env.py).
"""
from __future__ import annotations


def serve_lm_head_adapters() -> None:
    """Declare lm_head an adapter target of vLLM's Qwen2ForCausalLM (idempotent)."""
    from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
    if "lm_head" not in Qwen2ForCausalLM.embedding_modules:
        # A new dict on the class: the default is the SupportsLoRA interface's, shared by every model.
        Qwen2ForCausalLM.embedding_modules = {**Qwen2ForCausalLM.embedding_modules, "lm_head": "output_embeddings"}
