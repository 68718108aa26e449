"""Check what a recipe names (model, data, reward) before any worker starts.

Bad input is then an error naming the recipe key and the path or spec, not a
worker's traceback minutes into a run.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from pipeline.config import Config


def preflight(cfg: Config) -> Future | None:
    """Check the model, data and reward before any worker starts, so that bad
    input is an error naming the path or spec, not a worker's traceback.

    The quick checks raise here. Whether transformers knows the model's type
    and loads its tokenizer takes a second or more of imports
    (pipeline/inputs/models.py), so it runs on a thread while
    the caller starts Ray: the returned future's result() raises what it found,
    and must be called before any worker starts (None: nothing to wait for).
    The same thread then counts every prompt's tokens with the model's
    tokenizer (data.filter_overlong); the result is the datasets as the run
    uses them, {"train": Fitted, "val": Fitted (when data.val is set)}."""
    if cfg.backend == "sim":
        return None
    from pipeline.inputs.datasets import DataError, check_prompts, data_columns, run_prompts
    from pipeline.inputs.models import (
        ModelError, check_model_files, check_model_loads, check_reward_model, check_same_tokenizer,
        check_vision_policy, context_length, vocab_size)
    from pipeline.rewards.specs import RewardError, check_routes, load_reward

    def check(key: str, fn: Callable, *args, **kwargs):
        # Prefix the recipe key, so the error also says which setting named the bad path or spec.
        try:
            return fn(*args, **kwargs)
        except (DataError, ModelError, RewardError) as exc:
            raise type(exc)(f"{key}: {exc}") from None

    models = [("model.path", cfg.model.path, None)]
    if cfg.algorithm == "ppo" and cfg.ppo.critic_model:
        models.append(("ppo.critic_model", cfg.ppo.critic_model, cfg.model.path))
    if cfg.reward_model.kind:
        models.append(("reward_model.path", cfg.reward_model.path, None))
    if cfg.distill.teacher:
        models.append(("distill.teacher", cfg.distill.teacher, None))
    for key, path, tokenizer_dir in models:
        check(key, check_model_files, path, own_tokenizer=tokenizer_dir is None)
    check("model.path", check_vision_policy, cfg.model.path,
          {"algorithm ppo": cfg.algorithm == "ppo", "distill.teacher": bool(cfg.distill.teacher),
           # The gateway serves text messages: a prompt's pictures never reach an agent's requests.
           "agent.function": bool(cfg.agent.function)})
    if cfg.reward_model.kind:
        check("reward_model.path", check_reward_model, cfg.reward_model.path, cfg.reward_model.kind)
    # Empty files are DataErrors inside check_prompts. data.val is read whenever it is
    # set: the generators load it at start-up even when no validation is scheduled.
    columns = data_columns(cfg)
    datasets = {"train": (cfg.data.train, check("data.train", check_prompts, cfg.data.train, kind="train",
                                                columns=columns))}
    if cfg.data.val:
        datasets["val"] = (cfg.data.val, check("data.val", check_prompts, cfg.data.val, kind="val", columns=columns))
    # Each reward, and the datasets it scores: a reward routed by data_source needs a route for each of theirs.
    rewards = [("data.reward", cfg.data.reward, ["train"] if cfg.validation.reward else ["train", "val"]),
               ("validation.reward", cfg.validation.reward, ["val"])]
    for key, spec, kinds in rewards:
        if not spec:  # no data.reward: an environment's steps give the rewards, or a reward model
            continue
        fn = check(key, load_reward, spec)
        for path, checked in (datasets[kind] for kind in kinds if kind in datasets):
            check(key, check_routes, fn, path, checked.sources)

    check_val_sets(cfg)
    if cfg.training.routing_replay:
        from pipeline.moe.routes import RoutingError, route_layout
        try:
            route_layout(cfg.model.path)
        except RoutingError as exc:
            raise ModelError(f"training.routing_replay: {exc}") from None

    context, new = context_length(cfg.model.path), cfg.generation.max_new_tokens
    if new >= context:
        raise ModelError(f"generation.max_new_tokens: {new} leaves no room for a prompt in the context of "
                         f"{context} tokens of model.path {cfg.model.path!r}")

    d = cfg.distill
    if d.teacher and d.loss == "topk_kl" and d.topk > (vocab_size(d.teacher) or d.topk):
        raise ModelError(f"distill.topk: {d.topk} is more tokens than the vocabulary of distill.teacher "
                         f"{d.teacher!r} ({vocab_size(d.teacher)}); set distill.topk to at most that (16-64 is usual)")

    def loads() -> dict:
        for key, path, tokenizer_dir in models:
            check(key, check_model_loads, path, tokenizer_dir=tokenizer_dir)
        if cfg.distill.teacher:
            check("distill.teacher", check_same_tokenizer, cfg.model.path, cfg.distill.teacher)
        kinds = ["train", "val"] if cfg.data.val else ["train"]
        fitted = {kind: check(f"data.{kind}", run_prompts, cfg, kind) for kind in kinds}
        for s in cfg.validation.sets:
            check(f"validation.sets[{s.name}].data", run_prompts, cfg, s.name, s.data)
        return fitted
    pool = ThreadPoolExecutor(1, thread_name_prefix="preflight")
    try:
        return pool.submit(loads)
    finally:
        pool.shutdown(wait=False)


def check_val_sets(cfg: Config) -> None:
    """Each of validation.sets: its data file readable as prompts, and its reward
    (its own, else validation.reward, else data.reward) loadable, with a route
    for each data_source of its prompts. Errors name the set and the key."""
    from pipeline.inputs.datasets import DataError, check_prompts, data_columns
    from pipeline.rewards.specs import RewardError, check_routes, load_reward
    for s in cfg.validation.sets:
        key = f"validation.sets[{s.name}]"
        try:
            checked = check_prompts(s.data, kind=s.name, columns=data_columns(cfg))
        except DataError as exc:
            raise DataError(f"{key}.data: {exc}") from None
        reward_key, spec = next(((k, v) for k, v in ((f"{key}.reward", s.reward),
                                                      ("validation.reward", cfg.validation.reward),
                                                      ("data.reward", cfg.data.reward)) if v), ("", ""))
        if not spec:
            continue  # an environment, an agent or the reward model scores it
        try:
            check_routes(load_reward(spec), s.data, checked.sources)
        except RewardError as exc:
            raise RewardError(f"{reward_key}: {exc}" + ("" if reward_key.startswith(key) else f" (scoring {key})")) \
                from None
