"""Typed run configuration: YAML recipe + dotted command-line overrides.

Every section is a frozen dataclass; the loader checks unknown keys, types and
ranges and names the offending key in its error.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A recipe or override that cannot be used; the message names the key."""


def _key(default: Any, help: str, *, ge: float | None = None, gt: float | None = None,
         le: float | None = None, shown: str | None = None) -> Any:
    """A config key: its default, bounds and the one line the README's table shows
    (`shown`: the table's default, for a key whose recipe default load_config infers)."""
    return field(default=default, metadata={"ge": ge, "gt": gt, "le": le, "help": help, "shown": shown})


@dataclass(frozen=True)
class RunConfig:
    name: str = _key("run", "run directory name under output_dir")
    seed: int = _key(0, "seeds the prompt order, every sample and the trainer")
    steps: int = _key(20, "training steps", ge=1)
    output_dir: str = _key("runs", "where run directories go")
    dag_mode: Literal["auto", "compiled", "classic"] = _key(
        "auto", "compiled Ray graphs or classic; auto: compiled only where each graph actor owns a spare core")
    deadline_s: float = _key(60.0, "longest wait for any node, rollout or recovery; a dead worker is noticed "
                             "within it", gt=0)
    startup_deadline_s: float = _key(600.0, "longest wait for workers to start", gt=0)
    ray_address: str = _key("", "Ray cluster to join (else RAY_ADDRESS, else a local Ray)")
    num_cpus: int = _key(0, "logical CPUs for a local Ray; 0 = enough for the actors", ge=0)
    checkpoint_every: int = _key(0, "checkpoint every N steps (and after the last); 0 = only after the last",
                                 ge=0)


@dataclass(frozen=True)
class ScheduleConfig:
    """What the launch schedule needs: how stale a batch may be and how big a step is."""
    max_age: int = _key(1, "most steps a batch's weights may lag the trainer's; 0 = synchronous", ge=0)
    prompts_per_step: int = _key(8, "prompts in one step's batch", ge=1)
    group_size: int = _key(4, "samples per prompt (GRPO compares them)", ge=1)


@dataclass(frozen=True)
class ValidationConfig:
    period: int = _key(0, "validate after every period-th step; 0 = never", ge=0)
    at_start: bool = _key(False, "validate the initial weights")
    at_end: bool = _key(False, "validate after the last step")


@dataclass(frozen=True)
class PolicyLossConfig:
    """The clipped policy loss, for GRPO and PPO alike."""
    clip_eps: float = _key(0.2, "clip range of the probability ratio", gt=0, le=1)
    kl_coef: float = _key(0.0, "weight of the KL to the initial policy; 0 = none", ge=0)
    is_clip: float = _key(2.0, "cap of the token-level importance weight for stale samples", gt=0)
    decoupled: bool = _key(True, "decoupled PPO (AReaL): clip the ratio to the policy before this step's update "
                           "and weight by its ratio to the behaviour policy; false: clip the ratio to the "
                           "behaviour policy itself (classic PPO)")


@dataclass(frozen=True)
class GenerationConfig:
    num_generators: int = _key(1, "vLLM engines, one actor each", ge=1)
    max_new_tokens: int = _key(16, "longest completion", ge=1)
    temperature: float = _key(1.0, "sampling temperature (the trainer scores at the same)", ge=0)
    top_p: float = _key(1.0, "nucleus sampling mass", gt=0, le=1)
    tensor_parallel_size: int = _key(1, "GPUs per vLLM engine (tensor parallel), each in a bundle of its "
                                     "generator; 1 on CPU", ge=1)
    weight_sync: Literal["object_store", "collective"] = _key(
        "object_store", "how a refit moves weights: the object store, or a broadcast from trainer rank 0 to the "
        "engines over a process group (gloo on CPU, through a /dev/shm arena when all share one node; NCCL on GPU)")
    sync_bucket_mb: float = _key(16.0, "collective weight sync: size of one broadcast bucket (through /dev/shm: "
                                 "of one signalled chunk) in MiB", gt=0)
    refit_mode: Literal["drain", "inflight"] = _key(
        "drain", "drain: a refit waits for the engine's rollouts to finish; inflight: it loads the weights between "
        "two decoding steps and the rollouts go on with them (a sample then holds tokens of several versions)")
    inflight_kv: Literal["keep", "recompute"] = _key(
        "recompute", "inflight refits: keep the KV cache of the requests in flight (cheap; their next tokens attend "
        "to keys of the old weights) or recompute it with the new weights")


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters on the policy (peft): only they are trained and synced;
    the base weights stay frozen in the trainer and in vLLM. The critic stays full."""
    rank: int = _key(0, "adapter rank; 0 = full fine-tuning (vLLM serves ranks up to 512)", ge=0, le=512)
    alpha: float = _key(16.0, "adapter scale numerator (the update is alpha / rank * B A)", gt=0)
    dropout: float = _key(0.0, "dropout on the adapters' input in the trainer's forward (the generator "
                          "samples without it)", ge=0, le=0.9)
    target_modules: tuple[str, ...] = _key(
        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"),
        "linear layers (by name suffix) that get adapters; lm_head included: behind a frozen final norm, "
        "the output layer bounds how far the logits can move")


@dataclass(frozen=True)
class TrainingConfig:
    """The DeepSpeed engines: the policy's, and PPO's critic's."""
    zero_stage: int = _key(0, "DeepSpeed ZeRO stage", ge=0, le=3)
    dtype: Literal["fp32", "bf16"] = _key("fp32", "training dtype")
    micro_batch_size: int = _key(8, "rows per forward/backward; one optimizer step per batch", ge=1)
    grad_accum: int = _key(1, "DeepSpeed's nominal accumulation (train_batch_size = micro x accum)", ge=1)
    lr: float = _key(1e-4, "policy learning rate (AdamW)", gt=0)
    num_workers: int = _key(1, "data-parallel policy ranks, one DeepSpeed engine (and trainer actor) each; "
                            "whole prompt groups are sharded across them", ge=1)
    lora: LoraConfig = LoraConfig()


@dataclass(frozen=True)
class PpoConfig:
    """PPO's critic and advantages; the policy loss is policy_loss's, as for GRPO."""
    gamma: float = _key(1.0, "discount", ge=0, le=1)
    lam: float = _key(0.95, "GAE lambda; 1 = Monte-Carlo returns", ge=0, le=1)
    value_clip: float = _key(0.2, "clip range of the value loss", gt=0)
    critic_warmup: int = _key(0, "first steps that train only the critic", ge=0)
    critic_model: str = _key("", "critic backbone directory; empty = model.path")
    critic_lr: float = _key(1e-4, "critic learning rate (AdamW)", gt=0)
    whiten_advantages: bool = _key(True, "scale advantages to unit variance per batch")
    critic_num_workers: int = _key(1, "data-parallel critic ranks, one DeepSpeed engine each", ge=1)


@dataclass(frozen=True)
class FaultConfig:
    max_restarts: int = _key(2, "restarts per generator before the run stops", ge=0)
    max_reward_failures: int = _key(0, "samples whose reward may raise before the run stops", ge=0)
    max_nonfinite_steps: int = _key(3, "optimizer steps in a row skipped for a non-finite loss or gradient norm "
                                    "that stop the run", ge=1)


@dataclass(frozen=True)
class RoleResources:
    """What one actor of a role asks Ray for: its bundle in the run's placement group."""
    num_cpus: float = _key(0.5, "logical CPUs of one actor of this role", ge=0)
    num_gpus: float = _key(0.0, "GPUs of one actor of this role (a generator: of each of its "
                           "tensor_parallel_size bundles)", ge=0)
    node_resource: str = _key("", "a custom resource the role's bundles ask a token amount of: pins the role "
                              "to the nodes started with it (ray start --resources)")


@dataclass(frozen=True)
class ResourcesConfig:
    """The placement group: one bundle per actor (a generator: one per tensor-parallel rank)."""
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = _key(
        "PACK", "Ray placement strategy of the run's bundles")
    trainer: RoleResources = RoleResources()
    generator: RoleResources = RoleResources()
    critic: RoleResources = RoleResources()
    controller: RoleResources = RoleResources()


@dataclass(frozen=True)
class MetricsConfig:
    tensorboard: bool = _key(True, "write TensorBoard event files in the run directory")
    wandb: bool = _key(False, "log to Weights & Biases (pip install dagrl[wandb])")
    wandb_project: str = _key("dagrl", "W&B project")
    progress: bool = _key(True, "show a progress bar")


@dataclass(frozen=True)
class ModelConfig:
    path: str = _key("", "HF model directory (save_pretrained); required with backend real")


@dataclass(frozen=True)
class DataConfig:
    train: str = _key("", "training prompts, JSONL or Parquet; required with backend real")
    val: str = _key("", "validation prompts; required when validation is scheduled")
    reward: str = _key("", "reward function as module:function; required with backend real")
    filter_overlong: bool = _key(True, "leave out (and count, on the console and in summary.json) prompts whose "
                                 "tokens + generation.max_new_tokens exceed the model's context; false: refuse "
                                 "the run, naming the file and line")


@dataclass(frozen=True)
class SimConfig:
    """The simulated workers (backend sim): latencies in seconds, each drawn from
    uniform(t * (1 - jitter), t * (1 + jitter)) with the run's seed."""
    generate_s: float = _key(0.05, "time to decode max_new_tokens tokens (one engine step: generate_s / "
                             "max_new_tokens, whatever the number of sequences)", ge=0)
    response_len: Literal["fixed", "lognormal"] = _key(
        "fixed", "response lengths: all max_new_tokens, or lognormal with median max_new_tokens / tail_ratio "
        "(capped at max_new_tokens)")
    tail_ratio: float = _key(4.0, "lognormal lengths: p99 / p50", gt=1)
    train_s: float = _key(0.05, "one train step's time", ge=0)
    refit_s: float = _key(0.01, "one weight load's time", ge=0)
    validate_s: float = _key(0.02, "one validation's time", ge=0)
    jitter: float = _key(0.0, "relative spread of every latency", ge=0, le=1)
    num_val_prompts: int = _key(8, "validation prompts", ge=1)
    # Fault injection, for the tests and the soak: *_exit ends the worker's process
    # as a crash or an OOM kill would; *_hang waits until the run's deadlines catch it.
    fault: Literal["", "train_raise", "train_hang", "train_exit", "generate_raise", "generate_hang",
                   "generate_exit", "reward_raise", "train_nonfinite"] = _key(
        "", "inject this fault after fault_after good calls (train_nonfinite: every later step's loss is NaN, "
        "on every rank)")
    fault_after: int = _key(0, "good calls before the fault (reward_raise: every N-th sample raises)", ge=0)
    fault_worker: int = _key(0, "generator index that generate_* faults hit, trainer rank that train_* faults hit",
                             ge=0)
    fault_incarnations: int = _key(1, "a replaced generator faults again only while its restart count is below "
                                   "this", ge=1)


@dataclass(frozen=True)
class EnvConfig:
    """Multi-turn environments (pipeline/envs/interface.py): without a class, a
    sample is one completion scored by data.reward."""
    class_: str = _key("", "environment as module:Class (one instance per sample, Class(**env.args)); empty: "
                       "single-turn, scored by data.reward")
    args: dict = field(default_factory=dict, metadata={"help": "keyword arguments of the environment class"})
    max_turns: int = _key(1, "model turns per sample at most (each of up to generation.max_new_tokens)", ge=1)
    step_timeout_s: float = _key(30.0, "longest environment reset or step; a slower one ends its sample as failed",
                                 gt=0)
    observation_format: str = _key("{observation}", "how an observation is appended to the context (its tokens "
                                   "are masked out of the loss)")
    num_workers: int = _key(0, "Ray actors per generator that run the environments, one step at a time each; "
                            "0: threads in the generator's process", ge=0)
    worker_cpus: float = _key(0.0, "logical CPUs each environment worker asks Ray for", ge=0)
    threads: int = _key(64, "env.num_workers 0: environment calls that run at once in a generator", ge=1)


# Config fields whose recipe key is a Python keyword.
YAML_NAMES = {"class_": "class"}
FIELD_NAMES = {v: k for k, v in YAML_NAMES.items()}


@dataclass(frozen=True)
class Config:
    run: RunConfig = RunConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    validation: ValidationConfig = ValidationConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    algorithm: Literal["grpo", "ppo"] = _key("grpo", "grpo, or ppo with a critic")
    policy_loss: PolicyLossConfig = PolicyLossConfig()
    ppo: PpoConfig = PpoConfig()
    training: TrainingConfig = TrainingConfig()
    backend: Literal["sim", "real"] = _key("sim", "real: vLLM and DeepSpeed; sim: simulated workers, no model; "
                                           "not set: real when model.path is set, else sim", shown="inferred")
    generation: GenerationConfig = GenerationConfig()
    sim: SimConfig = SimConfig()
    fault: FaultConfig = FaultConfig()
    resources: ResourcesConfig = ResourcesConfig()
    metrics: MetricsConfig = MetricsConfig()
    env: EnvConfig = EnvConfig()

    def to_dict(self) -> dict:
        """The recipe's keys and values (what load_config reads back)."""
        def keys(tree: dict) -> dict:
            # Lists, not tuples: the dict is written as YAML and JSON and compared with what they read back.
            return {YAML_NAMES.get(k, k): keys(v) if isinstance(v, dict) and k != "args"
                    else list(v) if isinstance(v, tuple) else v for k, v in tree.items()}
        return keys(dataclasses.asdict(self))

    @property
    def critic_ranks(self) -> int:
        """Critic actors the run starts: ppo.critic_num_workers under PPO, none under GRPO."""
        return self.ppo.critic_num_workers if self.algorithm == "ppo" else 0


# Keys of earlier releases and where they went: a recipe that still uses one gets told.
MOVED = {
    "grpo.max_age": "schedule.max_age", "grpo.prompts_per_step": "schedule.prompts_per_step",
    "grpo.group_size": "schedule.group_size", "grpo.val_period": "validation.period",
    "grpo.val_at_start": "validation.at_start", "grpo.val_at_end": "validation.at_end",
    "grpo.clip_eps": "policy_loss.clip_eps", "grpo.kl_coef": "policy_loss.kl_coef",
    "grpo.is_clip": "policy_loss.is_clip", "reward.max_failures": "fault.max_reward_failures",
    "fault.deadline_s": "run.deadline_s", "ppo.critic_zero_stage": "training.zero_stage",
}


def _moved(dotted: str) -> str | None:
    """Why an unknown key is unknown, if an earlier release had it."""
    if dotted in MOVED:
        new = MOVED[dotted]
        return f"{dotted!r} was removed" if new is None else f"{dotted!r} is now {new!r}"
    inside = sorted(f"{old.split('.', 1)[1]} -> {new}" for old, new in MOVED.items()
                    if new and old.startswith(dotted + "."))
    if inside:
        return f"section {dotted!r} is gone; its keys moved: " + ", ".join(inside)
    return None


def _coerce(key: str, value: Any, typ: Any, meta: dict) -> Any:
    origin = typing.get_origin(typ)
    if origin is Literal:
        allowed = typing.get_args(typ)
        if value not in allowed:
            raise ConfigError(f"{key}: {value!r} is not allowed; choose one of {', '.join(map(repr, allowed))}")
        return value
    if typ is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
    elif typ is float:
        if isinstance(value, str):
            # YAML 1.1 reads "1e-4" (no dot) as a string.
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        value = float(value)
        # NaN passes every bound below (all comparisons are false), and an
        # infinite deadline or rate only fails later, inside a worker.
        if not math.isfinite(value):
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
    elif typ is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    elif typ == tuple[str, ...]:
        # An override gives "a,b"; a recipe a list.
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not items or not all(isinstance(v, str) and v.strip()
                                                                        for v in items):
            raise ConfigError(f"{key}: expected a non-empty list of names, got {value!r}")
        return tuple(v.strip() for v in items)
    elif typ is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{key}: expected a mapping of names to values, got {value!r}")
        return dict(value)
    bounds = [(meta.get("ge"), ">=", value < (meta.get("ge") or 0)),
              (meta.get("gt"), ">", value <= (meta.get("gt") or 0)),
              (meta.get("le"), "<=", value > (meta.get("le") or 0))]
    for bound, op, bad in bounds:
        if bound is not None and bad:
            raise ConfigError(f"{key}: {value!r} is out of range; it must be {op} {bound}")
    return value


def _build(cls: type, data: Any, prefix: str) -> Any:
    """The dataclass `cls` from a mapping. A ConfigError carries `.key`, the
    dotted key it is about, so load_config can blame an override or the file."""
    if not isinstance(data, dict):
        err = ConfigError(f"{prefix or 'config'}: expected a mapping of keys, got {data!r}")
        err.key = prefix
        raise err
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        key = FIELD_NAMES.get(key, key)
        try:
            if key not in fields:
                moved = _moved(dotted)
                if moved is not None:
                    raise ConfigError(f"unknown key {dotted!r}: {moved}")
                close = difflib.get_close_matches(str(key), fields, n=1)
                hint = f"; did you mean {(f'{prefix}.' if prefix else '') + close[0]!r}?" if close else ""
                allowed = ", ".join(YAML_NAMES.get(f, f) for f in fields)
                raise ConfigError(f"unknown key {dotted!r}; allowed keys here: {allowed}{hint}")
            typ = hints[key]
            if dataclasses.is_dataclass(typ):
                kwargs[key] = _build(typ, value, dotted)
            else:
                kwargs[key] = _coerce(dotted, value, typ, dict(fields[key].metadata))
        except ConfigError as err:
            if not hasattr(err, "key"):
                err.key = dotted
            raise
    return cls(**kwargs)


def _apply_override(tree: dict, override: str) -> None:
    if "=" not in override:
        raise ConfigError(f"override {override!r}: expected key=value, e.g. schedule.max_age=2")
    key, raw = override.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {key}: cannot parse value {raw!r}: {exc}") from None
    parts = key.split(".")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {key}: {part!r} is not a section")
    node[parts[-1]] = value


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """The recipe at `path` (None: defaults) with `overrides` applied. Every
    error is a ConfigError that starts with the file (and line, for YAML
    errors) or the override it comes from, and names the key."""
    tree: dict = {}
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} is not a file")
        try:
            text = p.read_bytes().decode("utf-8")
        except OSError as exc:
            raise ConfigError(f"config file {str(p)!r} cannot be read: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            line = p.read_bytes()[:exc.start].count(b"\n") + 1
            raise ConfigError(f"{p}: line {line}: not UTF-8 text") from None

        def at(mark) -> str:
            return f"line {mark.line + 1}, column {mark.column + 1}"

        def check_duplicates(node, prefix: str) -> None:
            # safe_load keeps the last of two equal keys: a second `schedule:` section
            # would silently replace the first one's settings.
            if isinstance(node, yaml.MappingNode):
                first: dict = {}
                for key_node, value_node in node.value:
                    key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
                    dotted = f"{prefix}.{key}" if prefix else str(key)
                    if key is not None and key != "<<":
                        if key in first:
                            raise ConfigError(f"{p}: {at(key_node.start_mark)}: duplicate key {dotted!r} "
                                              f"(first set at line {first[key]})")
                        first[key] = key_node.start_mark.line + 1
                    check_duplicates(value_node, dotted)
            elif isinstance(node, yaml.SequenceNode):
                for item in node.value:
                    check_duplicates(item, prefix)

        try:
            check_duplicates(yaml.compose(text, Loader=yaml.SafeLoader), "")
            loaded = yaml.safe_load(text)
        except yaml.MarkedYAMLError as exc:
            problem = exc.problem or "cannot parse"
            if exc.context:
                problem += f" ({exc.context}" + (f" at {at(exc.context_mark)})" if exc.context_mark else ")")
            where = f"{at(exc.problem_mark)}: " if exc.problem_mark else ""
            raise ConfigError(f"{p}: {where}not valid YAML: {problem}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"{p}: not valid YAML: {exc}") from None
        if loaded is None:
            raise ConfigError(f"config file {str(p)!r} is empty; a recipe sets at least one section")
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(p)!r}: the top level must be a mapping of sections, "
                              f"got a {type(loaded).__name__}")
        tree = loaded
    for override in overrides:
        _apply_override(tree, override)
    inferred = "backend" not in tree
    try:
        if inferred:
            tree["backend"] = _infer_backend(tree)
        return _check_cross_fields(_build(Config, tree, ""), inferred)
    except ConfigError as exc:
        key = getattr(exc, "key", "") or ""

        def touches(override: str) -> bool:
            # An override sets this key, a key under it, or a section that holds it.
            k = override.split("=", 1)[0]
            return bool(key) and (k == key or k.startswith(key + ".") or key.startswith(k + "."))

        # The last override that touched the key decides its value, so blame it, not the file.
        culprit = next((o for o in reversed(overrides) if touches(o)), None)
        where = f"override {culprit!r}: " if culprit else (f"{path}: " if path is not None else "")
        raise ConfigError(f"{where}{exc}") from None


def _infer_backend(tree: dict) -> str:
    """A recipe without `backend`: real when it names a model, else sim. A sim
    run trains nothing, so a model's recipe must never fall to it by default."""
    model = tree.get("model")
    named = isinstance(model, dict) and bool(model.get("path"))
    if named and "sim" in tree:
        err = ConfigError("backend: not set, but the recipe sets both model.path (a real run) and the sim section "
                          "(simulated workers); set backend: real or backend: sim")
        err.key = "backend"
        raise err
    return "real" if named else "sim"


def _check_cross_fields(cfg: Config, inferred: bool = False) -> Config:
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
        if not env.class_:  # an environment scores its own samples
            needed.append(("data.reward", cfg.data.reward))
        for key, value in needed:
            if not value:
                raise fail(key, "not set; it is required when backend is 'real'" + (
                    " (backend is not set: model.path makes it real; set backend: sim for simulated workers)"
                    if inferred else ""))
        if validates and not cfg.data.val:
            raise fail("data.val", "not set, but validation is scheduled (validation.period / at_start / "
                       "at_end); give validation data or turn validation off")
        if cfg.generation.temperature == 0:
            # The trainer divides its logits by the sampling temperature to match vLLM's logprobs.
            raise fail("generation.temperature", "0 (greedy) cannot be trained on; the trainer's logprobs "
                       "are taken at the sampling temperature, so it must be > 0")
    g = cfg.generation
    if g.weight_sync == "collective" and cfg.backend != "real":
        raise fail("generation.weight_sync", "'collective' broadcasts tensors between the DeepSpeed trainer and "
                   "the vLLM engines; it needs backend 'real'")
    if g.tensor_parallel_size > 1 and cfg.resources.generator.num_gpus == 0:
        raise fail("generation.tensor_parallel_size", f"{g.tensor_parallel_size} needs GPUs "
                   "(resources.generator.num_gpus > 0): on CPU each vLLM engine runs in its generator's process")
    if cfg.algorithm == "grpo" and cfg.schedule.group_size < 2:
        raise fail("schedule.group_size", f"{cfg.schedule.group_size} gives every sample a zero advantage (GRPO "
                   "compares the samples of one prompt); it must be >= 2 with algorithm 'grpo'")
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
        for key, value, default in (("env.max_turns", env.max_turns, 1), ("env.num_workers", env.num_workers, 0),
                                    ("env.args", env.args, {})):
            if value != default:
                raise fail(key, f"{value!r} needs an environment; set env.class (module:Class)")
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
