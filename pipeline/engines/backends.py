"""Which leaves a run uses: simulated or real (vLLM + DeepSpeed).

Called inside the actors, so that vLLM and DeepSpeed are imported only in the
processes that run them.
"""
from __future__ import annotations

from typing import Callable

from pipeline.engines.interface import GenerationEngine, Prompt, TrainingEngine
from pipeline.io.config import Config
from pipeline.run.placement import vllm_llm_kwargs
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
    # One collect starts at most max_age + 1 batches: size the KV cache for all their samples at once
    # (inflight refits: one batch more, the one a refit finds still decoding).
    prompts = -(-cfg.schedule.prompts_per_step // g.num_generators)
    batches = cfg.schedule.max_age + 1 + (g.refit_mode == "inflight")
    requests = prompts * cfg.schedule.group_size * batches
    adapter = None
    if cfg.training.lora.rank:
        from pipeline.engines.lora import adapter_config
        adapter = adapter_config(cfg.training.lora, cfg.model.path)
    with span("vllm.start"):
        # T > 1: vLLM's TP workers go into this generator's bundles (pipeline/run/placement.py).
        return VllmGenerationEngine(cfg.model.path, seed=seed, max_new_tokens=g.max_new_tokens,
                                    temperature=g.temperature, top_p=g.top_p, kv_cache_seqs=max(requests, 32),
                                    inflight_kv=g.inflight_kv, adapter_config=adapter,
                                    **vllm_llm_kwargs(cfg))


def training_engine(cfg: Config, rank: int = 0, rendezvous=None) -> TrainingEngine:
    """Rank `rank` of the policy's data-parallel group (`rendezvous`: where the ranks meet)."""
    if cfg.backend == "sim":
        from pipeline.engines.sim import SimTrainingEngine
        return SimTrainingEngine(cfg.sim, seed=cfg.run.seed * 1000 + 999, faulty=rank == cfg.sim.fault_worker)
    from pipeline.engines.deepspeed_policy import DeepSpeedPolicyEngine
    t, g = cfg.training, cfg.policy_loss
    with span("deepspeed.start"):  # deepspeed itself is imported in here, not at module level
        return DeepSpeedPolicyEngine(cfg.model.path, zero_stage=t.zero_stage, dtype=t.dtype,
                                     micro_batch_size=t.micro_batch_size, grad_accum=t.grad_accum,
                                     lr=t.lr, clip_eps=g.clip_eps, kl_coef=g.kl_coef, is_clip=g.is_clip,
                                     decoupled=g.decoupled, lora=t.lora if t.lora.rank else None,
                                     seed=cfg.run.seed, temperature=cfg.generation.temperature,
                                     rank=rank, rendezvous=rendezvous)


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
    from pipeline.io.data import run_prompts
    return list(run_prompts(cfg, "train").prompts)  # what the driver's preflight kept (data.filter_overlong)


def val_prompts(cfg: Config) -> list[Prompt]:
    if cfg.backend == "sim":
        from pipeline.engines.sim import sim_prompts
        return sim_prompts(cfg.sim.num_val_prompts, "val")
    if not cfg.data.val:
        return []
    from pipeline.io.data import run_prompts
    return list(run_prompts(cfg, "val").prompts)


def critic_engine(cfg: Config, rank: int = 0, rendezvous=None):
    """PPO's critic: values of response tokens and a value-loss update; rank
    `rank` of its data-parallel group (`rendezvous`: where the ranks meet)."""
    if cfg.backend == "sim":
        from pipeline.engines.sim import SimCriticEngine
        return SimCriticEngine(cfg.sim, seed=cfg.run.seed * 1000 + 998)
    from pipeline.engines.deepspeed_critic import DeepSpeedCriticEngine
    t, p = cfg.training, cfg.ppo
    with span("deepspeed.start"):  # deepspeed itself is imported in here, not at module level
        return DeepSpeedCriticEngine(p.critic_model or cfg.model.path, zero_stage=t.zero_stage,
                                     dtype=t.dtype, micro_batch_size=t.micro_batch_size,
                                     grad_accum=t.grad_accum, lr=p.critic_lr, value_clip=p.value_clip,
                                     seed=cfg.run.seed, rank=rank, rendezvous=rendezvous)
