"""The recipe's algorithm sections: the policy loss, DAPO's overlong shaping and
dynamic sampling, the KL in the reward and PPO's keys (pipeline/algos/ reads them)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pipeline.config.keys import _key


@dataclass(frozen=True)
class PolicyLossConfig:
    """The clipped policy loss, for GRPO and PPO alike."""
    clip_eps: float = _key(0.2, "clip range of the probability ratio", gt=0, le=1)
    kl_coef: float = _key(0.0, "weight of the KL to the initial policy; 0 = none (verl: kl_loss_coef; TRL: beta)",
                          ge=0)
    kl_estimator: Literal["k1", "k2", "k3"] = _key(
        "k3", "the loss's per-token KL estimate (pipeline/algos/kl.py): k1 = lp - ref, k2 = (lp - ref)^2 / 2 "
        "(verl: mse), k3 = exp(ref - lp) - (ref - lp) - 1 (verl: low_var_kl, TRL's)")
    kl_clamp: float = _key(0.0, "bound each token's KL estimate to [-kl_clamp, kl_clamp]; 10 with k3 = verl's "
                           "low_var_kl; 0 = none", ge=0)
    is_clip: float = _key(2.0, "cap of the token-level importance weight for stale samples", gt=0)
    decoupled: bool = _key(True, "decoupled PPO (AReaL): clip the ratio to the policy before this step's update "
                           "and weight by its ratio to the behaviour policy; false: clip the ratio to the "
                           "behaviour policy itself (classic PPO)")
    mode: Literal["clip", "gspo", "cispo", "sapo", "gmpo", "clip_cov", "kl_cov"] = _key(
        "clip", "clip: PPO's token ratio; gspo: the sequence's length-normalised ratio, clipped per sequence; "
        "cispo: a clipped, stop-gradient IS weight on every token's log-prob; sapo: a soft sigmoid gate for the "
        "clip; gmpo: the geometric mean of the token ratios, clipped in log space; clip_cov / kl_cov: PPO's clip "
        "(kl_cov: none) with the highest-covariance tokens detached / KL-penalised (verl's policy_loss.loss_mode)")
    sapo_tau_pos: float = _key(1.0, "sapo: the gate's temperature where A > 0 (verl: actor.tau_pos)", gt=0)
    sapo_tau_neg: float = _key(1.05, "sapo: the gate's temperature where A <= 0 (verl: actor.tau_neg)", gt=0)
    clip_cov_ratio: float = _key(0.0002, "clip_cov: share of a micro-batch's tokens detached", gt=0, le=1)
    clip_cov_lb: float = _key(1.0, "clip_cov: a detached token's covariance lies above this")
    clip_cov_ub: float = _key(5.0, "clip_cov: ... and below this")
    kl_cov_ratio: float = _key(0.0002, "kl_cov: share of a micro-batch's tokens KL-penalised", gt=0, le=1)
    kl_cov_coef: float = _key(0.1, "kl_cov: the penalty's weight on |lp - old| (verl: policy_loss.ppo_kl_coef)",
                              ge=0)
    clip_eps_high: float = _key(0.0, "upper clip range (DAPO's clip-higher: ratio up to 1 + this); 0 = clip_eps",
                                ge=0)
    dual_clip: float = _key(0.0, "dual-clip bound c > 1: a negative advantage's loss is capped at c x |A|; 0 = off",
                            ge=0)
    is_level: Literal["token", "sequence"] = _key(
        "token", "staleness IS weight per token, or per sequence (is_sequence_form)")
    is_sequence_form: Literal["geometric_mean", "product"] = _key(
        "geometric_mean", "a sequence's IS weight (is_level sequence, is_reject_*): the geometric mean of its token "
        "weights, or their product (verl: rollout_is sequence)")
    is_reject_low: float = _key(0.0, "a sequence whose IS weight is below this leaves the loss (metric "
                                "is_rejected_frac; verl: rollout_rs); 0 = no lower bound", ge=0, le=1)
    is_reject_high: float = _key(0.0, "a sequence whose IS weight is above this leaves the loss; 0 = no upper "
                                 "bound", ge=0)
    is_mode: Literal["truncate", "mask"] = _key(
        "truncate", "an IS weight above is_clip is capped at it (truncate) or its tokens leave the loss (mask)")
    aggregation: Literal["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum",
                         "seq-mean-token-sum-norm"] = _key(
        "token-mean", "how token losses become the batch's (verl's loss_agg_mode); token-sum: their sum; "
        "seq-mean-token-sum-norm divides by sequences x the longest response (Dr. GRPO)")
    entropy_coef: float = _key(0.0, "weight of the entropy bonus (subtracted from the loss); 0 = none", ge=0)


@dataclass(frozen=True)
class OverlongConfig:
    """DAPO's handling of responses near or at generation.max_new_tokens
    (pipeline/algos/overlong.py); single-turn, critic-free algorithms."""
    buffer: int = _key(0, "soft overlong penalty: the last `buffer` tokens before max_new_tokens cost up to "
                       "`penalty` of reward, linearly; 0 = off", ge=0)
    penalty: float = _key(1.0, "the reward a response of max_new_tokens tokens loses", ge=0)
    mask_truncated: bool = _key(False, "leave responses cut at max_new_tokens out of the loss")


@dataclass(frozen=True)
class DynamicSamplingConfig:
    """DAPO's dynamic sampling (verl: algorithm.filter_groups): a group whose
    rewards are all equal has no advantage to learn from; leave it out and
    launch more prompts for the step until it holds schedule.prompts_per_step
    informative groups. The step graph states the rounds (dags/step_graph.py)."""
    max_rounds: int = _key(0, "extra launch rounds per step, each after the step's earlier rollouts are in "
                           "(verl: max_num_gen_batches - 1); 0 = off: flat groups are trained as they are", ge=0)
    max_prompts: int = _key(0, "prompts one extra round launches at most; 0 = schedule.prompts_per_step", ge=0)


@dataclass(frozen=True)
class RewardKLConfig:
    """The KL to the initial policy in the reward, for every critic-free algorithm
    (verl: algorithm.use_kl_in_reward; pipeline/algos/reward_kl.py)."""
    coef: float = _key(0.0, "each model token's reward less coef x its KL to the initial policy (the rollout's "
                       "logprob against the reference's): reinforce_pp whitens the returns-to-go over the "
                       "batch's tokens, grpo/dr_grpo/rloo take each sample's reward less coef x its summed KL "
                       "(verl: use_kl_in_reward, kl_ctrl.kl_coef); 0 = none", ge=0)
    estimator: Literal["k1", "k2", "k3", "abs"] = _key(
        "k1", "the reward's per-token KL estimate (pipeline/algos/kl.py; verl: algorithm.kl_penalty kl, mse, "
        "low_var_kl, abs)")
    ctrl: Literal["fixed", "adaptive"] = _key(
        "fixed", "fixed: coef throughout; adaptive: coef is the start, moved after each batch towards "
        "target (verl: kl_ctrl.type; metric reward_kl_coef, kept across a resume)")
    target: float = _key(0.1, "adaptive: the KL per token (mean over samples) the coefficient steers to "
                         "(verl: kl_ctrl.target_kl)", gt=0)
    horizon: float = _key(10000.0, "adaptive: samples over which the coefficient moves by at most e^0.2 "
                          "(verl: kl_ctrl.horizon)", gt=0)


@dataclass(frozen=True)
class PpoConfig:
    """PPO's critic and advantages; the policy loss is policy_loss's, as for GRPO."""
    gamma: float = _key(1.0, "discount", ge=0, le=1)
    lam: float = _key(0.95, "GAE lambda; 1 = Monte-Carlo returns", ge=0, le=1)
    value_clip: float = _key(0.2, "clip range of the value loss", gt=0)
    critic_warmup: int = _key(0, "first steps that train only the critic", ge=0)
    critic_model: str = _key("", "critic backbone directory; empty = model.path")
    critic_lr: float = _key(1e-4, "critic learning rate (AdamW)", gt=0)
    critic_epochs: int = _key(1, "value-loss updates per batch, each over the whole batch (verl: critic "
                              "ppo_epochs)", ge=1)
    whiten_advantages: bool = _key(True, "scale advantages to unit variance per batch")
    critic_ranks: int = _key(1, "data-parallel critic ranks, one DeepSpeed engine each", ge=1)
