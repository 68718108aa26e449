"""Model directories: whether one can be used, before an engine or a run starts on it.

A model directory is what `save_pretrained` writes: config.json, the weights
and, for a model that tokenizes, its tokenizer files. The checks raise
ModelError naming the directory, so bad input is an error about the path
rather than a loader's traceback. `check_model_files` is quick (the files,
the weights' headers, config.json's JSON); `check_model_loads` imports
transformers to check the config's model type and load the tokenizer;
`check_model_dir` runs both.

transformers' Auto classes import torch (seconds of CPU; the driver runs these
checks beside Ray's start). Where a directory's files say what AutoConfig and
AutoTokenizer would conclude, `check_model_loads` and `load_tokenizer` read
them instead; anything else goes through the Auto classes.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

# Every file of a tokenizer that transformers may write: one of them marks a
# directory that tokenizes, and a saved checkpoint carries all it finds.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "tokenizer.model", "spiece.model", "chat_template.jinja",
    "chat_template.json",
)


class ModelError(ValueError):
    """A model directory that cannot be used; the message names the path."""


def _weight_files(p: Path) -> list[Path]:
    """The weight files a loader would read: the shards an index names, else
    any *.safetensors / pytorch_model*.bin. Raises ModelError for a shard that
    an index names but the directory lacks (an interrupted download)."""
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = p / index_name
        if index.is_file():
            try:
                shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
                if not all(isinstance(s, str) for s in shards):
                    raise TypeError("weight_map values must be file names")
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise ModelError(f"model directory {str(p)!r}: {index_name} is not a valid weight index "
                                 f"({type(exc).__name__}: {exc})") from None
            missing = [s for s in shards if not (p / s).is_file()]
            if missing:
                raise ModelError(f"model directory {str(p)!r}: {index_name} names weight files that are "
                                 f"missing: {', '.join(missing)}")
            return [p / s for s in shards]
    return sorted([*p.glob("*.safetensors"), *p.glob("pytorch_model*.bin")])


def _how_to_build(p: Path) -> str:
    """How to build a missing model directory that the working directory's
    Makefile builds (the tiny models under models/), else ''."""
    makefile, cwd = Path("Makefile"), Path.cwd().resolve()
    if not makefile.is_file() or not p.resolve().is_relative_to(cwd):
        return ""
    target = f"{p.resolve().relative_to(cwd).as_posix()}/config.json"
    if not re.search(rf"^{re.escape(target)}\s*:", makefile.read_text(), re.M):
        return ""
    return f"; build it with `make {target}`"


def check_model_files(path: str | Path, *, own_tokenizer: bool = True) -> Path:
    """The quick part of check_model_dir: the directory, its files, the
    weights' headers and config.json's JSON.

    `own_tokenizer`: whether the directory must hold tokenizer files. A critic
    reads the policy's token ids, and a training engine reads token ids from
    its table; neither tokenizes.
    """
    p = Path(path)
    if not p.exists():
        # Relative paths are read from the working directory, not from the recipe's.
        cwd = "" if p.is_absolute() else f" (relative to the working directory {str(Path.cwd())!r})"
        raise ModelError(f"model directory {str(p)!r} does not exist{cwd}{_how_to_build(p)}")
    if not p.is_dir():
        raise ModelError(f"model directory {str(p)!r} is not a directory")
    missing = []
    if not (p / "config.json").is_file():
        missing.append("config.json")
    if own_tokenizer and not any((p / name).is_file() for name in TOKENIZER_FILES):
        missing.append(f"tokenizer files (expected one of {', '.join(TOKENIZER_FILES)})")
    weights = _weight_files(p)
    if not weights:
        missing.append("weights (model.safetensors, pytorch_model.bin or a sharded *.index.json)")
    if missing:
        raise ModelError(f"model directory {str(p)!r} has no {' and no '.join(missing)}")
    from safetensors import safe_open
    for f in (w for w in weights if w.suffix == ".safetensors"):
        # Reads only the header, which also records the size: a truncated copy fails here.
        # "np", not "pt": the same header check without importing torch.
        try:
            with safe_open(str(f), "np"):
                pass
        except Exception as exc:  # noqa: BLE001 - SafetensorError has no importable base class
            raise ModelError(f"model directory {str(p)!r}: {f.name} is not a readable safetensors file "
                             f"(truncated or corrupt?): {exc}") from None
    try:
        config = json.loads((p / "config.json").read_text())
    except (ValueError, OSError) as exc:
        raise ModelError(f"model directory {str(p)!r}: config.json is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ModelError(f"model directory {str(p)!r}: config.json must hold a JSON object, "
                         f"got {type(config).__name__}")
    model_vocab = _config_vocab(config)
    if model_vocab is not None and (isinstance(model_vocab, bool) or not isinstance(model_vocab, int)):
        raise ModelError(f"model directory {str(p)!r}: config.json's vocab_size is {model_vocab!r}, "
                         "not an integer")
    return p


def check_model_dir(path: str | Path, *, tokenizer_dir: str | Path | None = None) -> Path:
    """Raise ModelError naming `path` unless it holds a loadable HF model
    (config.json, weights, a tokenizer) whose vocabulary covers the tokenizer.

    `tokenizer_dir`: where the token ids come from, if not from this directory.
    A critic reads the policy's token ids, so it needs no tokenizer of its own
    but an embedding table that covers the policy's tokenizer.
    """
    check_model_files(path, own_tokenizer=tokenizer_dir is None)
    return check_model_loads(path, tokenizer_dir=tokenizer_dir)


def check_model_loads(path: str | Path, *, tokenizer_dir: str | Path | None = None) -> Path:
    """The part of check_model_dir that needs transformers: its config names a
    model type transformers knows, its tokenizer loads, and the vocabulary
    covers the tokenizer."""
    p = Path(path)
    config = model_config(p)
    model_vocab = _config_vocab(config)
    if not _known_model_type(config):
        from transformers import AutoConfig
        try:
            AutoConfig.from_pretrained(str(p))
        except Exception as exc:  # noqa: BLE001 - any load failure is a bad directory
            raise ModelError(f"model directory {str(p)!r}: transformers cannot read config.json: {exc}") from None
    source = Path(tokenizer_dir) if tokenizer_dir is not None else p
    try:
        tokenizer = load_tokenizer(source)
    except Exception as exc:  # noqa: BLE001 - any load failure is a bad directory
        raise ModelError(f"model directory {str(source)!r}: cannot load the tokenizer: {exc}") from None
    if model_vocab is not None and len(tokenizer) > model_vocab:
        whose = "the tokenizer" if tokenizer_dir is None else f"the tokenizer of {str(source)!r}"
        raise ModelError(f"model directory {str(p)!r}: {whose} has {len(tokenizer)} tokens "
                         f"but the model's vocab_size is {model_vocab}")
    return p


def _known_model_type(config: dict) -> bool:
    """Whether config.json names a model type of transformers' own, without
    custom code: AutoConfig then builds that type's config class. False
    sends the directory through AutoConfig, which knows every other case."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or "auto_map" in config:
        return False
    try:
        # The generated table AutoConfig reads, importable without torch.
        from transformers.models.auto.auto_mappings import CONFIG_MAPPING_NAMES
    except ImportError:
        return False
    return model_type in CONFIG_MAPPING_NAMES


def load_tokenizer(path: str | Path):
    """The tokenizer of model directory `path`, as AutoTokenizer loads it.
    A tokenizer_config.json that transformers' tokenizers backend saved names
    the class AutoTokenizer picked for it, so that class loads it directly;
    any other directory goes through AutoTokenizer."""
    p = Path(path)
    try:
        saved = json.loads((p / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        saved = None
    name = saved.get("tokenizer_class") if isinstance(saved, dict) else None
    if isinstance(name, str) and saved.get("backend") == "tokenizers" and "auto_map" not in saved:
        import transformers
        tokenizer_class = getattr(transformers, name, None)
        if tokenizer_class is not None:
            return tokenizer_class.from_pretrained(str(p))
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(p))


def check_same_tokenizer(student: str | Path, teacher: str | Path) -> None:
    """The teacher's tokenizer is the student's: the same vocabulary (token
    to id) and special tokens. Distillation compares the two models' logprobs
    of one token id at a time, so any other tokenizer would compare
    different strings."""
    ours, theirs = (load_tokenizer(p) for p in (student, teacher))
    vocab, other = ours.get_vocab(), theirs.get_vocab()
    if vocab != other:
        moved = sorted(t for t in vocab.keys() & other.keys() if vocab[t] != other[t])
        detail = (f"{len(vocab)} and {len(other)} tokens" if len(vocab) != len(other) else
                  f"token {moved[0]!r} is {vocab[moved[0]]} and {other[moved[0]]}" if moved else
                  f"token {sorted(vocab.keys() - other.keys())[0]!r} is only the student's")
    elif ours.special_tokens_map != theirs.special_tokens_map:
        detail = f"special tokens {ours.special_tokens_map} and {theirs.special_tokens_map}"
    else:
        return
    raise ModelError(f"the teacher's tokenizer ({str(teacher)!r}) is not the student's (model.path {str(student)!r}): "
                     f"{detail}; distillation compares the logprobs of each token id, so both need one tokenizer")


def model_config(path: str | Path) -> dict:
    """The model directory's config.json."""
    return json.loads((Path(path) / "config.json").read_text())


def is_vision_model(path: str | Path) -> bool:
    """A vision-language model: its config.json has a vision_config."""
    return "vision_config" in model_config(path)


def policy_model_class(path: str | Path):
    """The Auto class a policy in `path` loads with: image-text-to-text for a VLM, else a causal LM."""
    import transformers
    return transformers.AutoModelForImageTextToText if is_vision_model(path) else transformers.AutoModelForCausalLM


# What VllmGenerationEngine gives vLLM as max_model_len unless told otherwise:
# it sizes the KV cache, and vLLM refuses a prompt that does not fit it.
DEFAULT_MAX_MODEL_LEN = 512


def check_reward_model(path: str | Path, kind: str) -> None:
    """A reward model's config.json fits its kind (reward_model.kind): a
    classifier is a *ForSequenceClassification with one label (its logit is
    the score); a judge is a causal LM that vLLM serves."""
    config = model_config(path)
    architectures = config.get("architectures") or []
    if kind == "classifier":
        if not any(a.endswith("ForSequenceClassification") for a in architectures):
            raise ModelError(f"model directory {str(path)!r}: a classifier reward model is a sequence classifier "
                             f"(save one with AutoModelForSequenceClassification); its architectures are "
                             f"{architectures}")
        labels = config.get("num_labels") or len(config.get("id2label") or {}) or 2
        if labels != 1:
            raise ModelError(f"model directory {str(path)!r}: a classifier reward model has one label (its logit "
                             f"is the score); this one has {labels}")
    elif not any(a.endswith(("ForCausalLM", "ForConditionalGeneration")) for a in architectures):
        raise ModelError(f"model directory {str(path)!r}: a judge is a causal language model that generates its "
                         f"verdict; its architectures are {architectures}")


def _config_vocab(config: dict):
    """config.json's vocab_size (a multimodal model's, its text_config's); None where it names none."""
    return config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")


def vocab_size(path: str | Path) -> int | None:
    """The model directory's vocabulary size as its config.json says (None: it says none)."""
    return _config_vocab(model_config(path))


def check_vision_policy(path: str | Path, unsupported: dict[str, bool]) -> None:
    """A vision-language policy (config.json with a vision_config) is refused with
    a setting it does not run with yet: `unsupported` maps each setting's key to
    whether the recipe sets it (a critic and a teacher load the model as a text
    model; an agent's requests carry no pictures)."""
    on = [key for key, set_ in unsupported.items() if set_]
    if on and is_vision_model(path):
        raise ModelError(f"model directory {str(path)!r} is a vision-language model, which trains without "
                         f"{', '.join(on)} for now; unset it")


def context_length(path: str | Path, max_model_len: int = DEFAULT_MAX_MODEL_LEN) -> int:
    """The tokens a generator's vLLM engine holds per sequence, prompt and
    completion together: max_model_len capped at the model's
    max_position_embeddings, as VllmGenerationEngine does."""
    config = model_config(path)
    positions = (config.get("text_config") or config).get("max_position_embeddings")
    return min(max_model_len, int(positions)) if positions else max_model_len
