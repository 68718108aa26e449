"""The training engines a trainer runs, simulated or DeepSpeed: the policy and
PPO's critic. Called inside the actor, so that DeepSpeed is imported only in
the processes that run it."""
from __future__ import annotations

from pipeline.core.precision import device_dtype
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
    loss_options = dict(mode=g.mode, clip_eps_high=g.clip_eps_high or None, dual_clip=g.dual_clip,
                        is_level=g.is_level, is_mode=g.is_mode, aggregation=g.aggregation,
                        entropy_coef=g.entropy_coef,
                        # The longest response a sample can have: Dr. GRPO's constant normaliser.
                        horizon=cfg.generation.max_new_tokens * cfg.env.max_turns)
    with span("deepspeed.start"):  # deepspeed itself is imported in here, not at module level
        return DeepSpeedPolicyEngine(cfg.model.path, zero_stage=t.zero_stage,
                                     dtype=device_dtype(t.dtype, "training.dtype"),
                                     micro_batch_size=t.micro_batch_size, max_tokens=t.max_tokens_per_micro_batch,
                                     packing=t.packing,
                                     grad_accum=t.grad_accum,
                                     lr=t.lr, clip_eps=g.clip_eps, kl_coef=g.kl_coef, is_clip=g.is_clip,
                                     reference=g.kl_coef > 0 or cfg.reinforce_pp.kl_coef > 0,
                                     decoupled=g.decoupled, loss_options=loss_options,
                                     lora=t.lora if t.lora.rank else None, optimizer=optimizer(cfg),
                                     epochs=t.epochs, mini_batches=t.mini_batches,
                                     group_size=cfg.schedule.group_size,
                                     seed=cfg.run.seed, temperature=cfg.generation.temperature,
                                     rank=rank, rendezvous=rendezvous)


def optimizer(cfg: Config):
    """training's optimiser controls, for the policy and the critic alike."""
    from pipeline.trainer.optim import Optimizer
    t = cfg.training
    return Optimizer(weight_decay=t.weight_decay, grad_clip=t.grad_clip, schedule=t.lr_schedule,
                     warmup_steps=t.lr_warmup_steps, total_steps=cfg.run.steps)


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
                                     dtype=device_dtype(t.dtype, "training.dtype"),
                                     micro_batch_size=t.micro_batch_size, max_tokens=t.max_tokens_per_micro_batch,
                                     packing=t.packing,
                                     grad_accum=t.grad_accum, lr=p.critic_lr, value_clip=p.value_clip,
                                     epochs=p.critic_epochs,
                                     optimizer=optimizer(cfg), seed=cfg.run.seed, rank=rank, rendezvous=rendezvous)
