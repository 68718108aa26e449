"""`python -m pipeline export`: a LoRA run's adapter merged into its base model
as a plain HF model (a full fine-tune's checkpoint is one already)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from pipeline.weights.lora import ADAPTER_CONFIG, LoraError
from pipeline.run.checkpoint import policy_dir


def export_merged(source: str | Path, out: str | Path) -> Path:
    """A plain HF model in `out`: the adapter directory `source` merged into the
    base model it names, with the base's tokenizer files (or the adapter's)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from pipeline.inputs.models import TOKENIZER_FILES, check_model_files
    src = Path(source)
    config_path = src / ADAPTER_CONFIG
    if not config_path.is_file():
        raise LoraError(f"{str(src)!r} holds no {ADAPTER_CONFIG}: not a LoRA adapter directory "
                        "(a checkpoint's policy/ of a run with training.lora.rank > 0)")
    try:
        base = Path(json.loads(config_path.read_text())["base_model_name_or_path"])
    except (ValueError, KeyError, TypeError) as exc:
        raise LoraError(f"{str(config_path)!r} is unreadable: {type(exc).__name__}: {exc}") from None
    base = check_model_files(base, own_tokenizer=False)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, src).merge_and_unload()
    dest = Path(out)
    dest.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(dest)
    for name in TOKENIZER_FILES:
        for where in (src, base):
            if (where / name).is_file():
                shutil.copy2(where / name, dest / name)
                break
    return dest


def export_main(source: str, out: str) -> int:
    """`python -m pipeline export`: a checkpoint (step dir or its policy/) or a run
    directory (its latest checkpoint) to a merged HF model."""
    src = policy_dir(source, "export")
    if not (src / ADAPTER_CONFIG).is_file():
        # A full fine-tune's checkpoint is already a plain HF model.
        shutil.copytree(src, out, dirs_exist_ok=True)
        print(f"copied the full model {src} to {out}")
        return 0
    export_merged(src, out)
    print(f"merged the adapter {src} into its base model: {out}")
    return 0
