"""The recipe's sections: one frozen dataclass each, and Config that holds them.

A key's default, bounds and one-line help live on its field (`_key`); the
loader (load.py) checks values against them and the README's table
(pipeline/tools/config_table.py) is read off them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from pipeline.config.algo_sections import (
    DynamicSamplingConfig, OverlongConfig, PolicyLossConfig, PpoConfig, RewardKLConfig,
)
from pipeline.config.distill_section import DistillConfig
from pipeline.config.keys import _key


class ConfigError(ValueError):
    """A recipe or override that cannot be used; the message names the key."""


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
    stop_grace_s: float = _key(25.0, "after SIGINT or SIGTERM: how long the step in progress and its checkpoint "
                               "may take before the run stops at once (SLURM and Kubernetes kill 30 s after "
                               "SIGTERM by default)", gt=0)


@dataclass(frozen=True)
class ScheduleConfig:
    """What the launch schedule needs: how stale a batch may be and how big a step is."""
    max_age: int = _key(1, "most steps a batch's weights may lag the trainer's; 0 = synchronous", ge=0)
    prompts_per_step: int = _key(8, "prompts in one step's batch", ge=1)
    group_size: int = _key(4, "samples per prompt (GRPO compares them)", ge=1)


@dataclass(frozen=True)
class ValSetConfig:
    """One named evaluation set of validation.sets (docs/evaluation.md): its
    prompts, reward and decoding, and the metrics reported on it."""
    name: str = _key("", "the set's name in its metrics (val/<name>/...): letters, digits, _ . -")
    data: str = _key("", "its prompts, JSONL or Parquet, read as data.val is (data.prompt_key, answer_key, "
                     "system_prompt, filter_overlong); required with backend real")
    reward: str | dict = _key("", "its reward, as data.reward; empty: validation.reward, else the training reward")
    n: int = _key(1, "samples per prompt (mean@n averages them)", ge=1)
    temperature: float = _key(0.0, "sampling temperature; 0 = greedy, which needs n 1", ge=0)
    k: tuple[int, ...] = _key((), "pass@k (unbiased estimator) and, with vote_on, maj@k for each k; each <= n")
    period: int = _key(0, "validate this set after every period-th step; 0 = validation.period", ge=0)
    vote_on: Literal["", "last_number", "boxed", "text"] = _key(
        "", "the answer maj@k votes on: the completion's last number (GSM8K), its last \\boxed{} (MATH), or its "
        "whole stripped text; empty: no maj@k")
    correct_at: float = _key(1.0, "a sample is correct (pass@k, maj@k) when its reward is at least this")


@dataclass(frozen=True)
class ValidationConfig:
    period: int = _key(0, "validate after every period-th step; 0 = never", ge=0)
    at_start: bool = _key(False, "validate the initial weights")
    at_end: bool = _key(False, "validate after the last step")
    reward: str | dict = _key("", "validation's reward, as data.reward (a verifier while training on a reward "
                              "model's score, say); empty: the training reward (data.reward's plus the reward "
                              "model's)")
    sets: tuple[ValSetConfig, ...] = _key((), "named evaluation sets, each with its data, reward, n, temperature "
                                          "and k (keys below); empty: data.val, greedy, as val_reward")


@dataclass(frozen=True)
class GenerationConfig:
    num_generators: int = _key(1, "vLLM engines, one actor each", ge=1)
    max_new_tokens: int = _key(16, "longest completion", ge=1)
    temperature: float = _key(1.0, "sampling temperature (the trainer scores at the same)", ge=0)
    top_p: float = _key(1.0, "nucleus sampling mass", gt=0, le=1)
    dtype: Literal["fp32", "bf16", "auto"] = _key(
        "fp32", "vLLM's dtype; auto: bf16 where the generator's device has it (as training.dtype auto), else fp32")
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
    dtype: Literal["fp32", "bf16", "auto"] = _key(
        "fp32", "training dtype (fp32 master weights either way); auto: bf16 where the trainer's device has it "
        "(a GPU with bf16, a CPU with AMX-BF16 or AVX-512 BF16), else fp32 (pipeline/core/precision.py)")
    micro_batch_size: int = _key(8, "rows per forward/backward; one optimizer step per batch", ge=1)
    max_tokens_per_micro_batch: int = _key(
        0, "a token budget per forward/backward instead of micro_batch_size rows: rows longest first, as many "
        "as fit once padded to the longest (pad_token_share shows the padding left); 0 = off", ge=0)
    packing: bool = _key(
        False, "pack a micro-batch's rows into one sequence without padding, position ids restarting per row (rows "
        "in order, their tokens within max_tokens_per_micro_batch, or micro_batch_size rows); each engine checks "
        "at start that its model's attention keeps packed rows apart, else pads")
    lr: float = _key(1e-4, "policy learning rate (AdamW)", gt=0)
    weight_decay: float = _key(0.0, "AdamW's decoupled weight decay (policy and critic)", ge=0)
    grad_clip: float = _key(1.0, "largest global gradient norm of an update; 0 = no clipping", ge=0)
    lr_schedule: Literal["constant", "linear", "cosine"] = _key(
        "constant", "learning rate after the warm-up: constant, or linear / cosine down to 0 at run.steps")
    lr_warmup_steps: int = _key(0, "steps whose rate ramps linearly up to lr (and critic_lr)", ge=0)
    epochs: int = _key(1, "passes of the policy over each step's batch (PPO epochs); the old logprobs are "
                       "scored once, before the first", ge=1)
    mini_batches: int = _key(1, "policy optimizer steps per pass, each on a run of whole prompt groups", ge=1)
    ranks: int = _key(1, "data-parallel policy ranks, one DeepSpeed engine (and trainer actor) each; "
                      "whole prompt groups are sharded across them", ge=1)
    routing_replay: bool = _key(
        False, "MoE models (Qwen3-MoE): the generator records the experts vLLM routed each token to, and the "
        "policy's forward uses them instead of its routers' top-k, gates from the current router (docs/moe.md)")
    lora: LoraConfig = LoraConfig()


@dataclass(frozen=True)
class RewardModelConfig:
    """A model that scores every rollout on an actor of its own, between the
    rollout's end and the buffer (dags/step_graph.py build_delivery_graph):
    a sequence classifier, or an LLM judge on a vLLM engine of its own. Its
    weights never change. The reward is data.reward's (if set) plus weight x
    its score."""
    kind: Literal["", "classifier", "judge"] = _key(
        "", "classifier: AutoModelForSequenceClassification with one label, its logit the score; judge: a causal "
        "LM served by vLLM that answers `template`, its score parsed by `score_pattern`; empty: none")
    path: str = _key("", "the reward model's HF directory (backend real)")
    weight: float = _key(1.0, "the reward is data.reward's (0 when unset) + weight x the model's score")
    batch_size: int = _key(16, "classifier: samples per forward (like lengths together); judge: prompts per "
                           "generate call", ge=1)
    dtype: Literal["fp32", "bf16", "auto"] = _key(
        "fp32", "the reward model's dtype; auto: bf16 where its device has it (as training.dtype auto)")
    template: str = _key(
        "Question: {prompt}\nAnswer: {completion}\nRate the answer from 0 (wrong) to 9 (right). Rating: ",
        "judge: the prompt it answers; {prompt}, {completion} and {answer} (the row's reference) are filled in, "
        "then the judge's chat template applied if it has one")
    output_regex: str = _key("", "judge: constrain the answer to this regex (vLLM structured outputs), so it "
                             "always parses; empty: free text")
    score_pattern: str = _key(r"-?\d+(?:\.\d+)?", "judge: the score is the first match in the answer (its first "
                              "group if it has one); no match is that sample's reward failure")
    max_new_tokens: int = _key(8, "judge: longest answer", ge=1)


@dataclass(frozen=True)
class FaultConfig:
    max_restarts: int = _key(2, "restarts per generator, and of the reward model, before the run stops", ge=0)
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
    reward_model: RoleResources = RoleResources()
    teacher: RoleResources = RoleResources()


@dataclass(frozen=True)
class MetricsConfig:
    tensorboard: bool = _key(True, "write TensorBoard event files in the run directory")
    wandb: bool = _key(False, "log to Weights & Biases (pip install dagrl[wandb])")
    wandb_project: str = _key("dagrl", "W&B project")
    progress: bool = _key(True, "show a progress bar")
    samples: int = _key(4, "prompts of each step's batch (with all their group's completions) and of each "
                        "validation written as text to samples.jsonl, TensorBoard and W&B; 4: enough to see what "
                        "the policy does, few enough to read and to carry on the step's tokens; 0 = off", ge=0)


@dataclass(frozen=True)
class ModelConfig:
    path: str = _key("", "HF model directory (save_pretrained); required with backend real")
    freeze_vision: bool = _key(True, "a vision-language model's vision tower and projector are not trained (nor "
                               "sent to the generators at a refit); false: trained with the language model")


@dataclass(frozen=True)
class DataConfig:
    train: str = _key("", "training prompts, JSONL or Parquet; required with backend real")
    val: str = _key("", "validation prompts; required when validation is scheduled")
    reward: str | dict = _key("", "reward function as module:function, or file.py:function by the file's path, "
                              "or a map from data_source to one with a `default` entry for the others; required "
                              "with backend real")
    prompt_key: str = _key("", "the field that holds the prompt (text or chat messages); empty: `prompt`, or "
                           "GSM8K's `question`")
    answer_key: str = _key("", "the field that holds the answer (`a.b`: key b inside object field a); empty: "
                           "`answer`, or verl's `reward_model.ground_truth`")
    system_prompt: str = _key("", "a system message put first in every chat-format prompt (a list of "
                              "messages) that has none")
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
    score_s: float = _key(0.01, "the simulated reward model's (reward_model.kind) and teacher's (distill.teacher) "
                          "time per batch", ge=0)
    jitter: float = _key(0.0, "relative spread of every latency", ge=0, le=1)
    num_val_prompts: int = _key(8, "validation prompts", ge=1)
    flat_share: float = _key(1.0, "share of prompts whose samples all score the same; the others' rewards "
                             "vary by sample (a test bed for dynamic_sampling)", ge=0, le=1)


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
    actors: int = _key(0, "Ray actors per generator that run the environments, one step at a time each; "
                       "0: threads in the generator's process", ge=0)
    worker_cpus: float = _key(0.0, "logical CPUs each environment worker asks Ray for", ge=0)
    threads: int = _key(64, "env.actors 0: environment calls that run at once in a generator", ge=1)


@dataclass(frozen=True)
class AgentConfig:
    """Agents through the OpenAI-compatible gateway (docs/agents.md): without a
    function, samples are single-turn or env.class episodes."""
    function: str = _key("", "agent as module:function, called as function(client, prompt) for every sample with "
                         "an openai client bound to the sample's session; empty: no agent")
    tool_parser: str = _key("", "vLLM tool parser that turns the model's text into message.tool_calls (e.g. "
                            "pythonic); empty: the text is the message's content")
    timeout_s: float = _key(300.0, "longest an agent may run for one sample; a slower one fails its sample", gt=0)
    threads: int = _key(256, "agents written as plain def: how many run at once in a generator (one thread each)",
                        ge=1)
    actors: int = _key(0, "Ray actors per generator that run its agents (for isolation); 0: in the generator's "
                       "process", ge=0)
    worker_cpus: float = _key(0.0, "logical CPUs each agent actor asks Ray for", ge=0)


@dataclass(frozen=True)
class InjectConfig:
    """Fault injection for the recovery tests and the soak, on the simulated
    workers (backend sim) only; no user's setting, so the README's table leaves
    it out. *_exit ends the worker's process as a crash or an OOM kill would;
    *_hang waits until the run's deadlines catch it."""
    fault: Literal["", "train_raise", "train_hang", "train_exit", "generate_raise", "generate_hang",
                   "generate_exit", "reward_raise", "train_nonfinite", "score_exit", "teach_exit"] = _key(
        "", "inject this fault after `after` good calls (train_nonfinite: every later step's loss is NaN, "
        "on every rank)")
    after: int = _key(0, "good calls before the fault (reward_raise: every N-th sample raises; score_exit, "
                       "teach_exit: the reward model's or teacher's process exits on its N+1-th batch)", ge=0)
    worker: int = _key(0, "generator index that generate_* faults hit, trainer rank that train_* faults hit", ge=0)
    incarnations: int = _key(1, "a replaced generator (or a restarted reward model or teacher) faults again only "
                               "while its restart count is below this", ge=1)


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
    reward_model: RewardModelConfig = RewardModelConfig()
    distill: DistillConfig = DistillConfig()
    algorithm: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "ppo"] = _key(
        "grpo", "the advantage estimator (pipeline/algos/advantages.py): grpo, dr_grpo (no std division), rloo "
        "(leave-one-out), reinforce_pp (batch-normalised), or ppo (GAE with a critic)")
    grpo_std: Literal["population", "sample"] = _key(
        "population", "algorithm grpo's group std: population (squares summed / G) or sample (/ (G - 1): verl's "
        "and TRL's, sqrt(G / (G - 1)) larger, 15 % at G = 4, the advantages that factor smaller)")
    policy_loss: PolicyLossConfig = PolicyLossConfig()
    overlong: OverlongConfig = OverlongConfig()
    dynamic_sampling: DynamicSamplingConfig = DynamicSamplingConfig()
    reward_kl: RewardKLConfig = RewardKLConfig()
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
    agent: AgentConfig = AgentConfig()
    # Last, and out of the README's table (metadata "test_only"): the recovery tests' switches.
    inject: InjectConfig = field(default=InjectConfig(), metadata={"test_only": True})

    def to_dict(self) -> dict:
        """The recipe's keys and values (what load_config reads back)."""
        def keys(tree: dict) -> dict:
            # Lists, not tuples: the dict is written as YAML and JSON and compared with what they read back.
            return {YAML_NAMES.get(k, k): keys(v) if isinstance(v, dict) and k not in ("args", "reward")
                    else [keys(x) if isinstance(x, dict) else x for x in v] if isinstance(v, tuple) else v
                    for k, v in tree.items()}
        return keys(dataclasses.asdict(self))

    @property
    def train_graph(self) -> str:
        """The training sub-graph (dags/ TRAIN_SUBGRAPHS): ppo's with its critic, else
        the one every critic-free estimator shares."""
        return "actor_critic" if self.algorithm == "ppo" else "critic_free"

    @property
    def critic_actors(self) -> int:
        """Critic actors the run starts: ppo.critic_ranks under PPO, none under a critic-free algorithm."""
        return self.ppo.critic_ranks if self.algorithm == "ppo" else 0
