"""vLLM's CPU mixture-of-experts layers, made to repack their experts after
every weight load (the generator's refits), not only the first."""
from __future__ import annotations

from typing import Any


def repack_experts_on_reload(model: Any) -> int:
    """Make each of vLLM's CPU MoE layers repack its experts' weights after every
    load, not only the first; returns how many layers there are.

    On CPU vLLM keeps the experts' weights prepacked into its grouped-gemm
    layout (CPUUnquantizedExperts.process_weights_after_loading), in tensors of
    the checkpoint's shape. A refit wrote the checkpoint's layout into them and
    nothing packed it: UnquantizedFusedMoEMethod runs the experts' post-load
    step only while it has no kernel yet (the first load), and a load through
    the model's loaders (RefitPlan.record) runs no post-load step at all. The
    kernel then read unpacked weights as packed: on a tiny Qwen3-MoE, logprobs
    0.04 off the trainer's after a refit of unchanged weights, 5e-7 (as before
    any refit) with the experts packed again."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    n = 0
    for module in model.modules() if model is not None else ():
        method = getattr(module, "quant_method", None)
        if isinstance(getattr(getattr(method, "moe_kernel", None), "fused_experts", None), CPUUnquantizedExperts):
            method.__class__ = _repacking_method(type(method))
            n += 1
    return n


_REPACKING: dict = {}


def _repacking_method(cls: type) -> type:
    """`cls` (vLLM's unquantized MoE method) with a post-load step that, on a
    weight update too, runs the experts' own (padding and prepacking)."""
    if getattr(cls, "repacks_on_reload", False):
        return cls
    if cls not in _REPACKING:
        def process_weights_after_loading(self, layer):
            update = self.moe_kernel is not None
            cls.process_weights_after_loading(self, layer)
            if update:
                self.moe_kernel.fused_experts.process_weights_after_loading(layer)
        _REPACKING[cls] = type(f"Repacking{cls.__name__}", (cls,), {
            "repacks_on_reload": True, "process_weights_after_loading": process_weights_after_loading})
    return _REPACKING[cls]
