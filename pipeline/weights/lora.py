"""LoRA (training.lora): peft adapters on the policy, and the adapter's files.

The trainer wraps its model with peft and trains only the adapters; a refit
moves the adapter tensors alone, named as peft saves them
(`base_model.model.<module>.lora_A.weight`), and the generator serves them
through vLLM's LoRA support, base weights untouched. A checkpoint's policy
directory is a peft adapter directory; `python -m pipeline export`
(pipeline/tools/export.py) merges it into the base model as a plain HF model.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterable, Mapping

from pipeline.inputs.images import VISION_PREFIXES

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# What a generator hands vLLM on each refit: safetensors 0.8's get_tensor, which
# vLLM's adapter loader calls per tensor, keeps two Python ints a tensor for
# good (3.6 KB a load of the 58-tensor adapter on the 4.2M model, 2000 loads
# measured); torch.load of the same tensors keeps nothing.
ADAPTER_WEIGHTS_TORCH = "adapter_model.bin"
# vLLM's max_lora_rank takes only these values (vllm.config.lora.MaxLoRARanks).
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# peft's exclude_modules for a vision-language model (a full match of a module's name): its vision
# tower and projector take no adapter, so a target name they share (Qwen2.5-VL's vision MLP has
# gate_proj, up_proj, down_proj) adapts the language model alone. vLLM serves adapters there only
# with enable_tower_connector_lora, which also changes how it feeds the picture encodings.
VISION_TOWER = "|".join(re.escape(prefix) + ".*" for prefix in VISION_PREFIXES)


class LoraError(ValueError):
    """A LoRA setting or adapter directory that cannot be used; the message names it."""


def is_adapter(names: Iterable[str]) -> bool:
    """Whether a state dict's names are an adapter's (every one a lora_A or lora_B)."""
    names = list(names)
    return bool(names) and all(".lora_A." in n or ".lora_B." in n for n in names)


def vllm_max_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds `rank`."""
    for allowed in VLLM_RANKS:
        if allowed >= rank:
            return allowed
    raise LoraError(f"training.lora.rank: {rank} is above vLLM's largest max_lora_rank ({VLLM_RANKS[-1]})")


def peft_config(lora: Any, model_path: str | Path):
    """peft's LoraConfig for a training.lora section on the model in `model_path`."""
    from peft import LoraConfig

    from pipeline.inputs.models import is_vision_model
    return LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                      target_modules=list(lora.target_modules), bias="none", task_type="CAUSAL_LM",
                      exclude_modules=VISION_TOWER if is_vision_model(model_path) else None)


def _linear_names(model: Any, *, vision: bool) -> set[str]:
    """The last name of each linear layer of `model` in (or outside) its vision tower."""
    return {name.rsplit(".", 1)[-1] for name, m in model.named_modules()
            if type(m).__name__ == "Linear" and name.startswith(VISION_PREFIXES) == vision}


def wrap(model: Any, lora: Any, model_path: str | Path):
    """`model` with adapters on lora.target_modules (outside a vision tower), only
    they trainable; B starts at zero, so the wrapped model computes what the base
    model does."""
    from peft import get_peft_model
    linear, tower = _linear_names(model, vision=False), _linear_names(model, vision=True)
    missing = [t for t in lora.target_modules if t not in linear]
    in_tower = [t for t in missing if t in tower]
    if in_tower:
        raise LoraError(f"training.lora.target_modules: {in_tower} name only layers of the vision tower of "
                        f"{str(model_path)!r}, which takes no adapter (vLLM would not serve it); its language "
                        f"model's linear layers: {', '.join(sorted(linear))}")
    if missing:
        raise LoraError(f"training.lora.target_modules: {missing} name no linear layer of {str(model_path)!r} "
                        f"(its linear layers: {', '.join(sorted(linear))})")
    return get_peft_model(model, peft_config(lora, model_path))


def adapter_state(model: Any) -> dict[str, Any]:
    """The adapter tensors by their saved names (the model's own tensors, not copies)."""
    from peft import get_peft_model_state_dict
    # peft would add the whole lm_head when it is a target ("embedding layers"): the adapter alone is wanted.
    return get_peft_model_state_dict(model, save_embedding_layers=False)


def zero_adapter(model_path: str | Path, config: dict) -> dict[str, Any]:
    """An adapter of `config`'s shapes for the model in `model_path`, all zeros:
    served, it computes exactly what the base model does (an engine serves it
    before the first refit, so that every request carries the adapter). Built
    on the trainer's model class, so the names are the trainer's."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig

    from pipeline.inputs.models import policy_model_class
    with torch.device("meta"):
        model = policy_model_class(model_path).from_config(AutoConfig.from_pretrained(model_path))
        shapes = {name: t.shape for name, t in adapter_state(get_peft_model(model, LoraConfig(
            r=config["r"], lora_alpha=config["lora_alpha"], target_modules=config["target_modules"],
            exclude_modules=config.get("exclude_modules")))).items()}
    return {name: torch.zeros(shape) for name, shape in shapes.items()}


def adapter_config(lora: Any, base_path: str | Path) -> dict:
    """adapter_config.json as peft writes it, naming the base model directory."""
    config = peft_config(lora, base_path).to_dict()
    config["base_model_name_or_path"] = str(Path(base_path).resolve())
    config["target_modules"] = sorted(config["target_modules"])
    return config


def write_adapter(path: str | Path, tensors: Mapping[str, Any], config: dict, *,
                  weights_file: str = ADAPTER_WEIGHTS) -> Path:
    """An adapter directory (the weights and adapter_config.json) that peft and
    vLLM load; `weights_file` ADAPTER_WEIGHTS_TORCH writes them with torch.save."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    state = {name: t.detach().contiguous() for name, t in tensors.items()}
    if weights_file == ADAPTER_WEIGHTS_TORCH:
        import torch
        torch.save(state, out / weights_file)
    else:
        from safetensors.torch import save_file
        save_file(state, str(out / weights_file))
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    return out
