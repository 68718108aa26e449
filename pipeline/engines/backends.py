"""Which leaves a run uses: simulated or real (vLLM + DeepSpeed).

Called inside the actors, so that vLLM and DeepSpeed are imported only in the
processes that run them.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from pipeline.engines.interface import GenerationEngine, Prompt, TrainingEngine
from pipeline.io.config import Config
from pipeline.run.spans import span


def generation_engine(cfg: Config, index: int, incarnation: int = 0) -> GenerationEngine:
    # Only the sim's latency jitter draws from this seed: every rollout sample is
    # seeded from its batch (pipeline.engines.interface.sample_seeds), so a restarted or
    # resumed generator replays exactly what its predecessor would have drawn.
    seed = cfg.run.seed * 1000 + index + 100 * incarnation
    if cfg.backend == "sim":
        from pipeline.engines.sim import SimGenerationEngine
        faulty = index == cfg.sim.fault_worker and incarnation < cfg.sim.fault_incarnations
        return SimGenerationEngine(cfg.sim, seed=seed, max_new_tokens=cfg.generation.max_new_tokens,
                                   faulty=faulty)
    with span("import vllm"):
        from pipeline.engines.vllm_generator import VllmGenerationEngine
    g = cfg.generation
    # One collect starts at most max_age + 1 batches: size the KV cache for all their samples at once.
    prompts = -(-cfg.schedule.prompts_per_step // g.num_generators)
    requests = prompts * cfg.schedule.group_size * (cfg.schedule.max_age + 1)
    with span("vllm.start"):
        return VllmGenerationEngine(cfg.model.path, seed=seed, max_new_tokens=g.max_new_tokens,
                                    temperature=g.temperature, top_p=g.top_p, kv_cache_seqs=max(requests, 32))


def training_engine(cfg: Config) -> TrainingEngine:
    if cfg.backend == "sim":
        from pipeline.engines.sim import SimTrainingEngine
        return SimTrainingEngine(cfg.sim, seed=cfg.run.seed * 1000 + 999)
    from pipeline.engines.deepspeed_policy import DeepSpeedPolicyEngine
    t, g = cfg.training, cfg.policy_loss
    with span("deepspeed.start"):  # deepspeed itself is imported in here, not at module level
        return DeepSpeedPolicyEngine(cfg.model.path, zero_stage=t.zero_stage, dtype=t.dtype,
                                     micro_batch_size=t.micro_batch_size, grad_accum=t.grad_accum,
                                     lr=t.lr, clip_eps=g.clip_eps, kl_coef=g.kl_coef, is_clip=g.is_clip,
                                     seed=cfg.run.seed, temperature=cfg.generation.temperature)


def reward_function(cfg: Config) -> Callable[[Prompt, str], float]:
    if cfg.backend == "sim":
        from pipeline.engines.sim import faulty_sim_reward, sim_reward
        return faulty_sim_reward(cfg.sim) if cfg.sim.fault == "reward_raise" else sim_reward
    from pipeline.io.rewards import load_reward
    return load_reward(cfg.data.reward)


def train_prompts(cfg: Config) -> list[Prompt]:
    if cfg.backend == "sim":
        from pipeline.engines.sim import sim_prompts
        return sim_prompts(max(64, cfg.schedule.prompts_per_step), "train")
    from pipeline.io.data import load_prompts
    return load_prompts(cfg.data.train, kind="train")


def val_prompts(cfg: Config) -> list[Prompt]:
    if cfg.backend == "sim":
        from pipeline.engines.sim import sim_prompts
        return sim_prompts(cfg.sim.num_val_prompts, "val")
    if not cfg.data.val:
        return []
    from pipeline.io.data import load_prompts
    return load_prompts(cfg.data.val, kind="val")


def preflight(cfg: Config) -> Future | None:
    """Check the model, data and reward before any worker starts, so that bad
    input is an error naming the path or spec, not a worker's traceback.

    The quick checks raise here. Whether transformers can load the model's
    config and tokenizer takes seconds of imports, so it runs on a thread while
    the caller starts Ray: the returned future's result() raises what it found,
    and must be called before any worker starts (None: nothing to wait for)."""
    if cfg.backend == "sim":
        return None
    from pipeline.io.data import DataError, load_prompts
    from pipeline.io.models import ModelError, check_model_files, check_model_loads
    from pipeline.io.rewards import RewardError, load_reward

    def check(key: str, fn: Callable, *args, **kwargs):
        # Prefix the recipe key, so the error also says which setting named the bad path or spec.
        try:
            return fn(*args, **kwargs)
        except (DataError, ModelError, RewardError) as exc:
            raise type(exc)(f"{key}: {exc}") from None

    models = [("model.path", cfg.model.path, None)]
    if cfg.algorithm == "ppo" and cfg.ppo.critic_model:
        models.append(("ppo.critic_model", cfg.ppo.critic_model, cfg.model.path))
    for key, path, tokenizer_dir in models:
        check(key, check_model_files, path, own_tokenizer=tokenizer_dir is None)
    # Empty files are DataErrors inside load_prompts. data.val is read whenever it is
    # set: the generators load it at start-up even when no validation is scheduled.
    check("data.train", load_prompts, cfg.data.train, kind="train")
    if cfg.data.val:
        check("data.val", load_prompts, cfg.data.val, kind="val")
    check("data.reward", load_reward, cfg.data.reward)

    def loads() -> None:
        for key, path, tokenizer_dir in models:
            check(key, check_model_loads, path, tokenizer_dir=tokenizer_dir)
    pool = ThreadPoolExecutor(1, thread_name_prefix="preflight")
    try:
        return pool.submit(loads)
    finally:
        pool.shutdown(wait=False)


def critic_engine(cfg: Config):
    """PPO's critic: values of response tokens and a value-loss update."""
    if cfg.backend == "sim":
        from pipeline.engines.sim import SimCriticEngine
        return SimCriticEngine(cfg.sim, seed=cfg.run.seed * 1000 + 998)
    from pipeline.engines.deepspeed_critic import DeepSpeedCriticEngine
    t, p = cfg.training, cfg.ppo
    with span("deepspeed.start"):  # deepspeed itself is imported in here, not at module level
        return DeepSpeedCriticEngine(p.critic_model or cfg.model.path, zero_stage=t.zero_stage,
                                     dtype=t.dtype, micro_batch_size=t.micro_batch_size,
                                     grad_accum=t.grad_accum, lr=p.critic_lr, value_clip=p.value_clip,
                                     seed=cfg.run.seed)
