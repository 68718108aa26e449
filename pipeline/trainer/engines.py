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
    with span("deepspeed.start"):  # deepspeed itself is imported in here, not at module level
        return DeepSpeedPolicyEngine(cfg, rank, rendezvous)


def critic_engine(cfg: Config, rank: int = 0, rendezvous=None):
    """PPO's critic: values of response tokens and a value-loss update; rank
    `rank` of its data-parallel group (`rendezvous`: where the ranks meet)."""
    if cfg.backend == "sim":
        from pipeline.sim.engines import SimCriticEngine
        return SimCriticEngine(cfg.sim, seed=cfg.run.seed * 1000 + 998)
    from pipeline.trainer.deepspeed_critic import DeepSpeedCriticEngine
    with span("deepspeed.start"):  # deepspeed itself is imported in here, not at module level
        return DeepSpeedCriticEngine(cfg, rank, rendezvous)
