"""`python -m pipeline eval`: a recipe's validation sets on a checkpoint or any
HF model directory (a LoRA adapter's too), on one in-process vLLM engine,
without Ray or a trainer. The sets, seeds, rewards and metrics are the
in-run eval's (pipeline/evaluation/), so the numbers are the run's on the
same weights and run.seed. Everything a recipe names is checked before the
engine starts."""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from pipeline.config import Config, ConfigError, load_config
from pipeline.evaluation.scores import add_sums, val_metrics
from pipeline.evaluation.sets import EvalSet, load_sets, set_specs
from pipeline.weights.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS


def model_dirs(model: str | Path) -> tuple[Path, Path | None]:
    """(the model directory vLLM loads, the adapter directory or None): `model`
    is a run (its latest checkpoint), a checkpoint step_<k>, its policy/, an HF
    model directory, or a peft adapter directory (its base model from adapter_config.json)."""
    from pipeline.run.checkpoint import policy_dir
    src = policy_dir(model, "eval --model")
    if not (src / ADAPTER_CONFIG).is_file():
        return src, None
    try:
        base = Path(json.loads((src / ADAPTER_CONFIG).read_text())["base_model_name_or_path"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"eval --model: {str(src / ADAPTER_CONFIG)!r} is unreadable: {exc}") from None
    return base, src


def eval_config(recipe: str, overrides: list[str], model: Path, names: list[str]) -> Config:
    """The recipe with model.path the model evaluated and only the sets named
    (all when none are); refused here, before any engine, when it cannot run."""
    cfg = load_config(recipe, overrides)
    known = [s.name for s in cfg.validation.sets]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ConfigError(f"eval --sets: {', '.join(map(repr, unknown))} is not a set of {recipe} "
                          f"(its validation.sets: {', '.join(known) or 'none'})")
    sets = tuple(s for s in cfg.validation.sets if not names or s.name in names)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(model)),
                              validation=dataclasses.replace(cfg.validation, sets=sets))
    if cfg.backend != "real":
        raise ConfigError(f"eval: {recipe} is a simulated recipe (backend sim); eval decodes with vLLM")
    if cfg.env.class_ or cfg.agent.function:
        raise ConfigError("eval: env.class / agent.function: multi-turn sets need the generator's episodes; "
                          "eval decodes single-turn sets only")
    if not cfg.validation.sets and not cfg.data.val:
        raise ConfigError(f"eval: {recipe} has neither validation.sets nor data.val: nothing to evaluate")
    for spec in set_specs(cfg):
        if cfg.reward_model.kind and not (spec.reward or cfg.validation.reward):
            key = f"validation.sets[{spec.name}].reward" if spec.name else "validation.reward"
            raise ConfigError(f"eval: {key}: not set, so the set is scored by the reward model, which eval "
                              "does not start; give the set a reward function")
        if not (spec.reward or cfg.validation.reward or cfg.data.reward):
            raise ConfigError(f"eval: set {spec.name or 'data.val'!r} has no reward to score it with")
    return cfg


def check_inputs(cfg: Config) -> None:
    """Each set's file and reward, and the model's files, as a run's preflight checks them."""
    from pipeline.inputs.datasets import check_prompts, data_columns
    from pipeline.inputs.models import check_model_files
    from pipeline.inputs.preflight import check_val_sets
    from pipeline.rewards.specs import check_routes, load_reward
    check_val_sets(cfg)
    if not cfg.validation.sets:
        checked = check_prompts(cfg.data.val, kind="val", columns=data_columns(cfg))
        check_routes(load_reward(cfg.validation.reward or cfg.data.reward), cfg.data.val, checked.sources)
    check_model_files(cfg.model.path, own_tokenizer=True)


def decode(engine, sets: list[EvalSet], progress: bool) -> list[list]:
    """Every set's samples in one batch of requests, as a generator's validate
    sends them; each set's completions in its requests' order."""
    from tqdm import tqdm
    requests = [(i, r) for i, s in enumerate(sets) for r in s.requests()]
    for key, (_, (prompt, seed, temperature)) in enumerate(requests):
        engine.add(f"val/{key}", prompt, seed, temperature=temperature)
    done = {}
    with tqdm(total=len(requests), unit="sample", desc="eval", file=sys.stderr, disable=not progress) as bar:
        while engine.busy():
            finished = engine.step()
            done.update(finished)
            bar.update(len(finished))
    return [[done[f"val/{key}"] for key, (i, _) in enumerate(requests) if i == which] for which in range(len(sets))]


def evaluate(cfg: Config, adapter: Path | None, progress: bool = True) -> dict[str, float]:
    """The metrics of every set of `cfg` on cfg.model.path (with `adapter` served)."""
    from pipeline.generator.engines import vllm_engine
    from pipeline.rewards.scoring import score_sample
    sets = load_sets(cfg)
    training_reward = None
    if cfg.data.reward:
        from pipeline.rewards.specs import load_reward
        training_reward = load_reward(cfg.data.reward)
    config = json.loads((adapter / ADAPTER_CONFIG).read_text()) if adapter is not None else None
    engine = vllm_engine(cfg, cfg.run.seed * 1000, config)
    try:
        if adapter is not None:
            from safetensors.torch import load_file
            engine.load_weights(load_file(str(adapter / ADAPTER_WEIGHTS)))
        completions = decode(engine, sets, progress)
    finally:
        engine.close()
    sums = []
    for s, mine in zip(sets, completions):
        prompts = [p for p, _, _ in s.requests()]
        sums.append(s.sums(mine, [score_sample(p, c, s.reward_fn or training_reward) for p, c in zip(prompts, mine)]))
    return val_metrics(add_sums(sums))


def table(metrics: dict[str, float]) -> str:
    """The metrics as aligned `name value` lines."""
    width = max(map(len, metrics), default=0)
    return "\n".join(f"{name:<{width}}  {value:.4f}" if "count" not in name and "failed" not in name
                     else f"{name:<{width}}  {value:g}" for name, value in metrics.items())


def eval_main(recipe: str, overrides: list[str], model: str, out: str, names: list[str], progress: bool) -> int:
    model_dir, adapter = model_dirs(model)
    cfg = eval_config(recipe, overrides, model_dir, names)
    check_inputs(cfg)
    metrics = evaluate(cfg, adapter, progress)
    result = {"model": str(model), "recipe": str(recipe), "seed": cfg.run.seed,
              "sets": [dataclasses.asdict(s) for s in cfg.validation.sets], "metrics": metrics}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    print(table(metrics))
    print(f"wrote {out}")
    return 0
