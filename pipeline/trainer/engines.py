"""The training engines a trainer runs, simulated or DeepSpeed: the policy and
PPO's critic. Called inside the actor, so that DeepSpeed is imported only in
the processes that run it."""
from __future__ import annotations

from pipeline.core.types import TrainingEngine
from pipeline.config import Config
from pipeline.core.spans import span


def training_engine(cfg: Config, rank: int = 0, rendezvous=None) -> TrainingEngine:
    """Rank `rank` of the policy's data-parallel group (`rendezvous`: where the ranks meet)."""
    if cfg.backend == "sim":
        from pipeline.sim.engines import SimTrainingEngine
        return SimTrainingEngine(cfg.sim, seed=cfg.run.seed * 1000 + 999, inject=cfg.inject,
                                 faulty=rank == cfg.inject.worker)
    from pipeline.trainer.deepspeed_policy import DeepSpeedPolicyEngine
    t, g = cfg.training, cfg.policy_loss
    with span("deepspeed.start"):  # deepspeed itself is imported in here, not at module level
        return DeepSpeedPolicyEngine(cfg.model.path, zero_stage=t.zero_stage, dtype=t.dtype,
                                     micro_batch_size=t.micro_batch_size, grad_accum=t.grad_accum,
                                     lr=t.lr, clip_eps=g.clip_eps, kl_coef=g.kl_coef, is_clip=g.is_clip,
                                     decoupled=g.decoupled, lora=t.lora if t.lora.rank else None,
                                     seed=cfg.run.seed, temperature=cfg.generation.temperature,
                                     rank=rank, rendezvous=rendezvous)


def critic_engine(cfg: Config, rank: int = 0, rendezvous=None):
    """PPO's critic: values of response tokens and a value-loss update; rank
    `rank` of its data-parallel group (`rendezvous`: where the ranks meet)."""
    if cfg.backend == "sim":
        from pipeline.sim.engines import SimCriticEngine
        return SimCriticEngine(cfg.sim, seed=cfg.run.seed * 1000 + 998)
    from pipeline.trainer.deepspeed_critic import DeepSpeedCriticEngine
    t, p = cfg.training, cfg.ppo
    with span("deepspeed.start"):  # deepspeed itself is imported in here, not at module level
        return DeepSpeedCriticEngine(p.critic_model or cfg.model.path, zero_stage=t.zero_stage,
                                     dtype=t.dtype, micro_batch_size=t.micro_batch_size,
                                     grad_accum=t.grad_accum, lr=p.critic_lr, value_clip=p.value_clip,
                                     seed=cfg.run.seed, rank=rank, rendezvous=rendezvous)
