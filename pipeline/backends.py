"""Which leaves a run uses: simulated or real (vLLM + DeepSpeed).

Called inside the actors, so that vLLM and DeepSpeed are imported only in the
processes that run them.
"""
from __future__ import annotations

from typing import Callable

from pipeline.config import Config
from pipeline.engines import GenerationEngine, Prompt, TrainingEngine


def generation_engine(cfg: Config, index: int, incarnation: int = 0) -> GenerationEngine:
    # A restarted generator draws a new sample stream, as a new process would.
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
    from pipeline.rewards import load_reward
    from pipeline.tiny import check_model_dir
    check_model_dir(cfg.model.path)
    if not train_prompts(cfg):
        raise ValueError(f"data.train {cfg.data.train!r} holds no prompts")
    validates = cfg.grpo.val_period > 0 or cfg.grpo.val_at_start or cfg.grpo.val_at_end
    if validates and not val_prompts(cfg):
        raise ValueError(f"data.val {cfg.data.val!r} holds no prompts, but validation is scheduled")
    load_reward(cfg.data.reward)
