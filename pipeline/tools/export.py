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
    base model it names (loaded as the trainer loads it), with the base's
    tokenizer and image processor files (or the adapter's)."""
    from peft import PeftModel

    from pipeline.inputs.models import TOKENIZER_FILES, check_model_files
    from pipeline.trainer.vision import PROCESSOR_FILES, load_policy_model
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
    merged = PeftModel.from_pretrained(load_policy_model(base), src).merge_and_unload()
    dest = Path(out)
    dest.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(dest)
    for name in (*TOKENIZER_FILES, *PROCESSOR_FILES):
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
