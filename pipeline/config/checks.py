"""Rules between keys, checked once every key has its value."""
from __future__ import annotations

import re
import string

from pipeline.config.algo_sections import PolicyLossConfig, RewardKLConfig
from pipeline.config.sections import Config, ConfigError, DistillConfig, InjectConfig, RewardModelConfig

# A validation set's name, as it goes into its metrics' names (val/<name>/...).
SET_NAME = re.compile(r"[A-Za-z0-9_.-]+")
# What a judge's template may fill in (pipeline/reward_model/judge.py).
JUDGE_FIELDS = ("prompt", "completion", "answer")


def check_cross_fields(cfg: Config, inferred: bool = False) -> Config:
    """Rules between keys. Errors carry `.key` like _build's, for load_config to place."""
    def fail(key: str, message: str) -> ConfigError:
        err = ConfigError(f"{key}: {message}")
        err.key = key
        return err

    v = cfg.validation
    validates = v.period > 0 or v.at_start or v.at_end
    env = cfg.env
    if cfg.backend == "real":
        needed = [("model.path", cfg.model.path), ("data.train", cfg.data.train)]
        # An environment, an agent or a reward model scores the samples; pure distillation needs no score.
        if not env.class_ and not cfg.agent.function and not cfg.reward_model.kind and not _pure_distillation(cfg):
            needed.append(("data.reward", cfg.data.reward))
        for key, value in needed:
            if not value:
                raise fail(key, "not set; it is required when backend is 'real'" + (
                    " (backend is not set: model.path makes it real; set backend: sim for simulated workers)"
                    if inferred else ""))
        if validates and not cfg.data.val and not v.sets:
            raise fail("data.val", "not set, but validation is scheduled (validation.period / at_start / "
                       "at_end); give validation data or turn validation off")
        if cfg.generation.temperature == 0:
            # The trainer divides its logits by the sampling temperature to match vLLM's logprobs.
            raise fail("generation.temperature", "0 (greedy) cannot be trained on; the trainer's logprobs "
                       "are taken at the sampling temperature, so it must be > 0")
    if cfg.inject != InjectConfig() and cfg.backend != "sim":
        changed = next(k for k, v in vars(cfg.inject).items() if v != getattr(InjectConfig(), k))
        raise fail(f"inject.{changed}", "fault injection drives the simulated workers of the recovery tests; it "
                   "needs backend 'sim'")
    g = cfg.generation
    if g.weight_sync == "collective" and cfg.backend != "real":
        raise fail("generation.weight_sync", "'collective' broadcasts tensors between the DeepSpeed trainer and "
                   "the vLLM engines; it needs backend 'real'")
    if g.tensor_parallel_size > 1 and cfg.resources.generator.num_gpus == 0:
        raise fail("generation.tensor_parallel_size", f"{g.tensor_parallel_size} needs GPUs "
                   "(resources.generator.num_gpus > 0): on CPU each vLLM engine runs in its generator's process")
    if cfg.algorithm in ("grpo", "dr_grpo", "rloo") and cfg.schedule.group_size < 2 and not _pure_distillation(cfg):
        raise fail("schedule.group_size", f"{cfg.schedule.group_size} gives every sample a zero advantage "
                   f"({cfg.algorithm} compares the samples of one prompt); it must be >= 2 with algorithm "
                   f"{cfg.algorithm!r}")
    if cfg.grpo_std != "population" and cfg.algorithm != "grpo":
        raise fail("grpo_std", f"divides GRPO's advantages; algorithm {cfg.algorithm!r} does not read it")
    _check_policy_loss(cfg.policy_loss, fail)
    o = cfg.overlong
    if o.buffer or o.mask_truncated:
        key = "overlong.buffer" if o.buffer else "overlong.mask_truncated"
        if cfg.algorithm == "ppo":
            raise fail(key, "shapes the outcome rewards of the critic-free algorithms; with ppo the critic's "
                       "GAE reads the environment's token rewards, which it does not change")
        if env.class_ or cfg.agent.function:
            raise fail(key, "needs single-turn samples: a multi-turn sample has a limit per turn ("
                       f"{'env.class' if env.class_ else 'agent.function'} is set)")
        if o.buffer >= g.max_new_tokens:
            raise fail("overlong.buffer", f"{o.buffer} must be below generation.max_new_tokens "
                       f"({g.max_new_tokens}): the penalty starts buffer tokens before the limit")
    if cfg.reward_kl.coef:
        if cfg.algorithm == "ppo":
            raise fail("reward_kl.coef", "puts the KL in the rewards of the critic-free algorithms; ppo's GAE "
                       "reads the critic's token rewards, which it does not change: use policy_loss.kl_coef "
                       "(the KL in the loss)")
        if _pure_distillation(cfg):
            raise fail("reward_kl.coef", "shapes the task reward's advantage, which distill.task_reward false "
                       "leaves out; set it to 0 or distill.task_reward: true")
        if cfg.backend != "real":
            raise fail("reward_kl.coef", "needs the initial policy's logprobs, which only backend 'real' has")
        if cfg.training.lora.rank and cfg.training.zero_stage == 3 and cfg.training.ranks > 1:
            raise fail("reward_kl.coef", "with LoRA the reference is the base model inside the ZeRO-3 "
                       "engine, which every rank would have to score in lockstep; use one rank or ZeRO 0-2")
    _check_kl(cfg, fail)
    if cfg.dynamic_sampling.max_rounds and cfg.algorithm == "ppo":
        raise fail("dynamic_sampling.max_rounds", "leaves out groups whose rewards are all equal, which the "
                   "critic-free estimators cannot learn from; ppo's critic gives them advantages, so it needs "
                   "a critic-free algorithm")
    t = cfg.training
    if t.mini_batches * t.ranks > cfg.schedule.prompts_per_step:
        raise fail("training.mini_batches", f"{t.mini_batches} mini-batches of whole prompt groups for "
                   f"{t.ranks} rank(s) need schedule.prompts_per_step >= {t.mini_batches * t.ranks}, "
                   f"got {cfg.schedule.prompts_per_step}")
    if t.lr_schedule != "constant" and t.lr_warmup_steps >= cfg.run.steps:
        raise fail("training.lr_warmup_steps", f"{t.lr_warmup_steps} leaves no step of the {t.lr_schedule} "
                   f"schedule in a run of {cfg.run.steps} (run.steps)")
    if env.class_:
        from pipeline.envs.interface import EnvError, load_env_class
        try:
            load_env_class(env.class_, env.args)
        except EnvError as exc:
            raise fail("env.class", str(exc).removeprefix("env.class ")) from None
        if cfg.data.reward:
            raise fail("data.reward", f"{cfg.data.reward!r} is set, but env.class {env.class_!r} gives the rewards "
                       "(step's reward); leave data.reward empty")
        try:
            env.observation_format.format(observation="")
        except (KeyError, IndexError, ValueError) as exc:
            raise fail("env.observation_format", f"{env.observation_format!r} is not a format with one "
                       f"{{observation}} field: {type(exc).__name__}: {exc}") from None
    else:
        for key, value, default in (("env.max_turns", env.max_turns, 1), ("env.actors", env.actors, 0),
                                    ("env.args", env.args, {})):
            if value != default:
                raise fail(key, f"{value!r} needs an environment; set env.class (module:Class)")
    _check_agent(cfg, fail)
    _check_reward_model(cfg, fail)
    _check_distill(cfg, fail)
    if v.reward and (cfg.backend != "real" or env.class_):
        raise fail("validation.reward", "scores single-turn validations on the real stack; " + (
            "an environment scores its own (env.class is set)" if env.class_ else "backend is 'sim'"))
    _check_sets(cfg, fail)
    _check_routing_replay(cfg, fail)
    lora = cfg.training.lora
    if lora.rank and cfg.backend != "real":
        raise fail("training.lora.rank", f"{lora.rank} puts peft adapters on a model; it needs backend 'real'")
    r = cfg.resources
    if lora.rank and g.weight_sync == "collective" and r.trainer.num_gpus > 0 and r.generator.num_gpus > 0:
        # The nccl path receives inside vLLM's worker straight into its weights by name; adapters are no weights there.
        raise fail("training.lora.rank", "adapters over a GPU collective sync (nccl) are not built; use "
                   "generation.weight_sync object_store (an adapter is megabytes), or gloo ranks on CPU")
    name = cfg.run.name
    # The run directory is output_dir/name: '..' would move the parent directory aside.
    if not name.strip() or name in (".", "..") or any(c in name for c in "/\\\0"):
        raise fail("run.name", f"{name!r} must be a non-empty name without '/' or '\\', "
                   "other than '.' and '..'")
    return cfg


def _check_routing_replay(cfg: Config, fail) -> None:
    """Routing replay records routes inside an in-process vLLM engine (pipeline/moe/capture.py),
    stitched over a multi-turn sample's requests (pipeline/core/stitched_routes.py); whether the model has routing to replay, preflight reads from its config."""
    if not cfg.training.routing_replay:
        return
    if cfg.backend != "real":
        raise fail("training.routing_replay", "it replays the routes of a vLLM engine; backend is 'sim'")
    if cfg.generation.tensor_parallel_size > 1:
        raise fail("training.routing_replay", "the routes are recorded where the engine's model runs in the "
                   "generator's process; generation.tensor_parallel_size > 1 runs it in vLLM's workers")


# policy_loss keys read by one mode only.
MODE_KEYS = {"sapo": ("sapo_tau_pos", "sapo_tau_neg"), "clip_cov": ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"),
             "kl_cov": ("kl_cov_ratio", "kl_cov_coef")}


def _check_policy_loss(loss: PolicyLossConfig, fail) -> None:
    default = PolicyLossConfig()
    for mode, keys in MODE_KEYS.items():
        changed = next((k for k in keys if getattr(loss, k) != getattr(default, k)), None)
        if changed and loss.mode != mode:
            raise fail(f"policy_loss.{changed}", f"is mode {mode}'s setting; policy_loss.mode is {loss.mode!r}")
    if loss.dual_clip and loss.dual_clip <= 1:
        raise fail("policy_loss.dual_clip", f"{loss.dual_clip} must be > 1 (the cap is dual_clip x |A|, above the "
                   "clipped term), or 0 for none")
    if loss.dual_clip and loss.mode == "cispo":
        raise fail("policy_loss.dual_clip", "cispo clips the IS weight, not the loss; dual_clip needs mode clip "
                   "or gspo")
    if loss.dual_clip and loss.mode not in ("clip", "gspo"):
        raise fail("policy_loss.dual_clip", f"mode {loss.mode} has no dual-clip (verl applies clip_ratio_c in its "
                   "vanilla loss only); it needs mode clip or gspo")
    if loss.clip_eps_high and loss.mode in ("sapo", "kl_cov"):
        raise fail("policy_loss.clip_eps_high", f"mode {loss.mode} has no clip band; leave it 0")
    if loss.clip_cov_lb >= loss.clip_cov_ub:
        raise fail("policy_loss.clip_cov_lb", f"{loss.clip_cov_lb} must be below clip_cov_ub ({loss.clip_cov_ub})")
    if loss.mode == "gmpo" and loss.aggregation != "seq-mean-token-mean":
        raise fail("policy_loss.aggregation", f"{loss.aggregation!r}: gmpo's loss is one term per sequence, "
                   "averaged over sequences (verl ignores loss_agg_mode for it); set seq-mean-token-mean")
    if loss.mode == "gmpo" and loss.is_level != "sequence":
        raise fail("policy_loss.is_level", "'token': gmpo weighs each sequence by one IS weight (verl: the "
                   "geometric mean of its token weights); set is_level: sequence")
    rejects = loss.is_reject_low or loss.is_reject_high
    if loss.is_sequence_form != default.is_sequence_form and loss.is_level != "sequence" and not rejects:
        raise fail("policy_loss.is_sequence_form", "forms a sequence's IS weight, which only is_level sequence "
                   "and is_reject_low / is_reject_high read")
    if loss.is_reject_high and loss.is_reject_high <= max(loss.is_reject_low, 1.0):
        raise fail("policy_loss.is_reject_high", f"{loss.is_reject_high} must be above 1 and is_reject_low: an "
                   "on-policy sample (weight 1) must pass")
    if loss.is_reject_low == 1.0:
        raise fail("policy_loss.is_reject_low", "1 rejects every sample a little older than the policy; it must "
                   "be below 1 (or 0 for none)")


def _check_kl(cfg: Config, fail) -> None:
    """A KL's estimator or controller keys need its coefficient."""
    loss, loss_default = cfg.policy_loss, PolicyLossConfig()
    if not loss.kl_coef:
        for key in ("kl_estimator", "kl_clamp"):
            if getattr(loss, key) != getattr(loss_default, key):
                raise fail(f"policy_loss.{key}", "shapes the KL in the loss, which is off (policy_loss.kl_coef 0); "
                           "set kl_coef > 0")
    rkl, rkl_default = cfg.reward_kl, RewardKLConfig()
    if not rkl.coef:
        for key in ("estimator", "ctrl", "target", "horizon"):
            if getattr(rkl, key) != getattr(rkl_default, key):
                raise fail(f"reward_kl.{key}", "shapes the KL in the reward, which is off (reward_kl.coef 0); "
                           "set coef > 0 (with ctrl adaptive: the coefficient it starts from)")
    elif rkl.ctrl == "fixed":
        for key in ("target", "horizon"):
            if getattr(rkl, key) != getattr(rkl_default, key):
                raise fail(f"reward_kl.{key}", "steers an adaptive coefficient; set reward_kl.ctrl: adaptive")


def _check_sets(cfg: Config, fail) -> None:
    """validation.sets: names unique and usable in a metric's name, k within n,
    sampling where n asks for several samples."""
    seen: set[str] = set()
    for i, s in enumerate(cfg.validation.sets):
        if not SET_NAME.fullmatch(s.name):
            raise fail(f"validation.sets[{i}].name", f"{s.name!r} must be a non-empty name of letters, digits, "
                       "'_', '.' or '-' (it goes into the metrics' names: val/<name>/...)")
        if s.name in seen:
            raise fail(f"validation.sets[{s.name}].name", f"{s.name!r} names two sets; give each its own name")
        seen.add(s.name)
        key = f"validation.sets[{s.name}]"
        if cfg.backend == "real" and not s.data:
            raise fail(f"{key}.data", "not set; each set needs its prompts' file when backend is 'real'")
        if s.n > 1 and s.temperature == 0:
            raise fail(f"{key}.n", f"{s.n} greedy samples (temperature 0) are one sample {s.n} times; set "
                       "temperature > 0 or n: 1")
        over = [k for k in s.k if k > s.n]
        if over:
            raise fail(f"{key}.k", f"{over[0]} is more than the set's n ({s.n}): pass@k and maj@k choose k of "
                       "a prompt's n samples; raise n or lower k")
        if s.vote_on and not s.k:
            raise fail(f"{key}.vote_on", f"{s.vote_on!r} is set, but k is empty: maj@k is reported for each k")
        if s.reward and (cfg.backend != "real" or cfg.env.class_):
            raise fail(f"{key}.reward", "scores single-turn validations on the real stack; " + (
                "an environment scores its own (env.class is set)" if cfg.env.class_ else "backend is 'sim'"))
        episodes = cfg.env.class_ or cfg.agent.function
        if episodes and s.temperature and s.temperature != cfg.generation.temperature:
            raise fail(f"{key}.temperature", f"{s.temperature:g}: multi-turn samples decode at "
                       f"generation.temperature ({cfg.generation.temperature:g}); set that, or 0 for greedy")


def _check_agent(cfg: Config, fail) -> None:
    agent = cfg.agent
    if not agent.function:
        for key, value, default in (("agent.tool_parser", agent.tool_parser, ""),):
            if value != default:
                raise fail(key, f"{value!r} needs an agent; set agent.function (module:function)")
        return
    if cfg.env.class_:
        raise fail("agent.function", f"{agent.function!r} and env.class {cfg.env.class_!r} both drive the samples; "
                   "set one")
    from pipeline.agents.contract import AgentError, load_agent_function
    try:
        load_agent_function(agent.function)
    except AgentError as exc:
        raise fail("agent.function", str(exc)) from None
    if agent.tool_parser and cfg.backend != "real":
        raise fail("agent.tool_parser", f"{agent.tool_parser!r} reads a model's text; backend 'sim' has none")


def _check_reward_model(cfg: Config, fail) -> None:
    rm, default = cfg.reward_model, RewardModelConfig()
    if not rm.kind:
        changed = next((k for k in vars(rm) if getattr(rm, k) != getattr(default, k)), None)
        if changed:
            raise fail(f"reward_model.{changed}", "is set, but reward_model.kind is empty (no reward model); set "
                       "kind: classifier or judge")
        if cfg.inject.fault == "score_exit":
            raise fail("inject.fault", "score_exit ends the reward model's process; set reward_model.kind")
        return
    if cfg.backend == "real" and not rm.path:
        raise fail("reward_model.path", f"not set; reward_model.kind {rm.kind!r} needs the model's directory")
    if cfg.env.class_:
        raise fail("reward_model.kind", f"{rm.kind!r} scores single-turn completions, but env.class "
                   f"{cfg.env.class_!r} gives the rewards; leave reward_model.kind empty")
    judge_keys = ("template", "output_regex", "score_pattern", "max_new_tokens")
    if rm.kind == "classifier":
        changed = next((k for k in judge_keys if getattr(rm, k) != getattr(default, k)), None)
        if changed:
            raise fail(f"reward_model.{changed}", "is a judge's setting; reward_model.kind is 'classifier'")
        return
    try:
        names = {name for _, name, _, _ in string.Formatter().parse(rm.template) if name is not None}
    except ValueError as exc:
        raise fail("reward_model.template", f"{rm.template!r} is not a format string ({exc}); write a literal "
                   "brace as {{ or }}") from None
    unknown = sorted(n for n in names if n not in JUDGE_FIELDS)
    if unknown:
        raise fail("reward_model.template", f"has the field(s) {', '.join('{' + n + '}' for n in unknown)}; it may "
                   f"use {', '.join('{' + f + '}' for f in JUDGE_FIELDS)} (a literal brace is {{{{ or }}}})")
    if "completion" not in names:
        raise fail("reward_model.template", "has no {completion} field: the judge would never see what it scores")
    for key, pattern in (("score_pattern", rm.score_pattern), ("output_regex", rm.output_regex)):
        try:
            re.compile(pattern)
        except re.error as exc:
            raise fail(f"reward_model.{key}", f"{pattern!r} is not a regular expression: {exc}") from None


def _pure_distillation(cfg: Config) -> bool:
    """The teacher's advantage alone: no task reward is trained on."""
    return bool(cfg.distill.teacher) and not cfg.distill.task_reward


def _check_distill_loss(d: DistillConfig, default: DistillConfig, fail) -> None:
    """Each loss's own keys are refused under the other, so that no setting silently does nothing."""
    own = {"topk_kl": ("topk", "kl_type", "mixed_kl_weight"), "sampled_reverse_kl": ("kl_clip",)}
    for loss, keys in own.items():
        changed = next((k for k in keys if getattr(d, k) != getattr(default, k)), None)
        if changed and d.loss != loss:
            raise fail(f"distill.{changed}", f"is set, but it is read only with distill.loss {loss} "
                       f"(distill.loss is {d.loss}); set distill.loss: {loss} or leave it out")
    if d.mixed_kl_weight != default.mixed_kl_weight and d.kl_type != "mixed":
        raise fail("distill.mixed_kl_weight", f"is set, but it is read only with distill.kl_type mixed "
                   f"(distill.kl_type is {d.kl_type}); set kl_type: mixed or leave it out")


def _check_distill(cfg: Config, fail) -> None:
    d, default = cfg.distill, DistillConfig()
    if not d.teacher:
        changed = next((k for k in vars(d) if getattr(d, k) != getattr(default, k)), None)
        if changed:
            raise fail(f"distill.{changed}", "is set, but distill.teacher is empty (no distillation); set "
                       "distill.teacher to the teacher model's directory")
        if cfg.inject.fault == "teach_exit":
            raise fail("inject.fault", "teach_exit ends the teacher's process; set distill.teacher")
        return
    _check_distill_loss(d, default, fail)
    if not d.task_reward and d.coef == 0:
        raise fail("distill.coef", "0 with distill.task_reward false leaves no advantage to learn from; set "
                   "coef > 0 (1: pure distillation) or task_reward: true")
    if not d.task_reward and cfg.algorithm == "ppo":
        raise fail("distill.task_reward", "false leaves ppo's critic no reward to learn values of; use a "
                   "critic-free algorithm (grpo) for pure distillation")
    if not d.task_reward and cfg.dynamic_sampling.max_rounds:
        raise fail("dynamic_sampling.max_rounds", "leaves out groups whose task rewards are all equal, but "
                   "distill.task_reward is false: the teacher's advantage needs no reward spread; set it to 0")
