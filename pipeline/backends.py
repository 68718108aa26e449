"""Which leaves a run uses: simulated or real (vLLM + DeepSpeed).

Called inside the actors, so that vLLM and DeepSpeed are imported only in the
processes that run them.
"""
from __future__ import annotations

from typing import Callable

from pipeline.config import Config
from pipeline.engines import GenerationEngine, Prompt, TrainingEngine


def generation_engine(cfg: Config, index: int, incarnation: int = 0) -> GenerationEngine:
    # Only the sim's latency jitter draws from this seed: every rollout sample is
    # seeded from its batch (pipeline.engines.sample_seeds), so a restarted or
    # resumed generator replays exactly what its predecessor would have drawn.
    seed = cfg.run.seed * 1000 + index + 100 * incarnation
    if cfg.backend == "sim":
        from pipeline.sim import SimGenerationEngine
        faulty = index == cfg.sim.fault_worker and incarnation < cfg.sim.fault_incarnations
        return SimGenerationEngine(cfg.sim, seed=seed, max_new_tokens=cfg.generation.max_new_tokens,
                                   faulty=faulty)
    from pipeline.vllm_engine import VllmGenerationEngine
    g = cfg.generation
    return VllmGenerationEngine(cfg.model.path, seed=seed, max_new_tokens=g.max_new_tokens,
                                temperature=g.temperature, top_p=g.top_p)


def training_engine(cfg: Config) -> TrainingEngine:
    if cfg.backend == "sim":
        from pipeline.sim import SimTrainingEngine
        return SimTrainingEngine(cfg.sim, seed=cfg.run.seed * 1000 + 999)
    from pipeline.deepspeed_engine import DeepSpeedTrainingEngine
    t, g = cfg.training, cfg.grpo
    return DeepSpeedTrainingEngine(cfg.model.path, zero_stage=t.zero_stage, dtype=t.dtype,
                                   micro_batch_size=t.micro_batch_size, grad_accum=t.grad_accum, lr=t.lr,
                                   clip_eps=g.clip_eps, kl_coef=g.kl_coef, is_clip=g.is_clip,
                                   group_size=g.group_size, seed=cfg.run.seed,
                                   temperature=cfg.generation.temperature)


def reward_function(cfg: Config) -> Callable[[Prompt, str], float]:
    if cfg.backend == "sim":
        from pipeline.sim import faulty_sim_reward, sim_reward
        return faulty_sim_reward(cfg.sim) if cfg.sim.fault == "reward_raise" else sim_reward
    from pipeline.rewards import load_reward
    return load_reward(cfg.data.reward)


def train_prompts(cfg: Config) -> list[Prompt]:
    if cfg.backend == "sim":
        from pipeline.sim import sim_prompts
        return sim_prompts(max(64, cfg.grpo.prompts_per_step), "train")
    from pipeline.data import load_prompts
    return load_prompts(cfg.data.train, kind="train")


def val_prompts(cfg: Config) -> list[Prompt]:
    if cfg.backend == "sim":
        from pipeline.sim import sim_prompts
        return sim_prompts(cfg.sim.num_val_prompts, "val")
    if not cfg.data.val:
        return []
    from pipeline.data import load_prompts
    return load_prompts(cfg.data.val, kind="val")


def preflight(cfg: Config) -> None:
    """Check the model, data and reward before any worker starts, so that bad
    input is an error naming the path or spec, not a worker's traceback."""
    if cfg.backend == "sim":
        return
    from pipeline.data import DataError, load_prompts
    from pipeline.rewards import RewardError, load_reward
    from pipeline.tiny import ModelError, check_model_dir

    def check(key: str, fn: Callable, *args, **kwargs):
        # Prefix the recipe key, so the error also says which setting named the bad path or spec.
        try:
            return fn(*args, **kwargs)
        except (DataError, ModelError, RewardError) as exc:
            raise type(exc)(f"{key}: {exc}") from None

    check("model.path", check_model_dir, cfg.model.path)
    if cfg.algorithm == "ppo" and cfg.ppo.critic_model:
        check("ppo.critic_model", check_model_dir, cfg.ppo.critic_model, tokenizer_dir=cfg.model.path)
    # Empty files are DataErrors inside load_prompts. data.val is read whenever it is
    # set: the generators load it at start-up even when no validation is scheduled.
    check("data.train", load_prompts, cfg.data.train, kind="train")
    if cfg.data.val:
        check("data.val", load_prompts, cfg.data.val, kind="val")
    check("data.reward", load_reward, cfg.data.reward)


def critic_engine(cfg: Config):
    """PPO's critic: values of response tokens and a value-loss update."""
    if cfg.backend == "sim":
        from pipeline.sim import SimCriticEngine
        return SimCriticEngine(cfg.sim, seed=cfg.run.seed * 1000 + 998)
    from pipeline.critic_engine import DeepSpeedCriticEngine
    t, p = cfg.training, cfg.ppo
    return DeepSpeedCriticEngine(p.critic_model or cfg.model.path, zero_stage=p.critic_zero_stage,
                                 dtype=t.dtype, micro_batch_size=t.micro_batch_size, grad_accum=t.grad_accum,
                                 lr=p.critic_lr, value_clip=p.value_clip, seed=cfg.run.seed)
