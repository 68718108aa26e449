"""A supervised warm-up on an environment's format, before RL
(`python -m pipeline warmup`).

A random tiny model never writes "calc 3+4" or "guess 4" followed by </s>,
so RL on a multi-turn env would start from a reward of exactly 0, with no
signal. The warm-up plays training prompts with the env's expert_action(),
lays each episode out in tokens exactly as the rollout does, and trains
cross-entropy on the model-turn tokens only, so that the format is learned
but the task is not: RL must have room to raise the reward.

Token layout (the rollout's, pipeline/generator/episodes.py):
- context = tokenizer(env.reset(prompt)).input_ids (with the BOS it adds);
- a model turn = at most max_new_tokens (16) tokens, ending in </s> when the
  model stops; the env gets tokenizer.decode(turn, skip_special_tokens=True);
- unless done, tokenizer(observation, add_special_tokens=False).input_ids are
  appended verbatim (observation_format "{observation}"); the last
  observation is not; at most max_turns model turns;
- the loss mask is 1 on model-turn tokens (</s> included), 0 elsewhere.

The same bytes on every x86 CPU: the fit is portable_fit's (float64, one
thread, every step rounded; pipeline/inputs/portable_fit.py) with the loss
taken on the float64 logits, no dropout in the tiny Llama, and the batch
order drawn from random.Random(seed). The evaluations before and after
decode in float32 with the CPU's own kernels: their figures (warmup.json,
not in model_digest) are not covered.

Why few prompts trained to convergence, not all prompts for a few steps:
RL samples at temperature 1 and validation decodes greedily, and a
half-trained model is far worse sampled than greedy (a stray token breaks
the format), so RL would get almost no signal. Trained to a low loss on the
first `prompts` rows, the model writes the format almost always, and its
reward is capped by how far it generalises from so few problems: a plateau,
not a point on a steep curve, so the result does not hinge on the step
count, and RL on all the training prompts has the rest to learn. What the
built models score is in warmup.json beside each, and what RL makes of them
in docs/results.md (tool_seeds).
"""
from __future__ import annotations

import json
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeline.core.types import Prompt

MAX_NEW_TOKENS = 16
# For an env class without warmup_steps / warmup_prompts attributes.
DEFAULT_STEPS = 250
DEFAULT_LR = 2e-3
DEFAULT_BATCH = 16


@dataclass
class Episode:
    """One env episode, laid out in tokens as the rollout lays it out."""
    env: Any
    tokenizer: Any
    max_turns: int
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)  # 1 on model-turn tokens
    turns: int = 0
    reward: float = 0.0
    done: bool = False
    ended_by_env: bool = False
    all_valid: bool = True  # every step's info said "valid" (or did not say)

    @classmethod
    def start(cls, env: Any, prompt: Prompt, tokenizer: Any, max_turns: int) -> Episode:
        ep = cls(env, tokenizer, max_turns)
        observation = env.reset(prompt)
        ep.ids = list(tokenizer(observation).input_ids)
        ep.mask = [0] * len(ep.ids)
        return ep

    def play(self, turn_ids: list[int]) -> None:
        """Append a model turn (as sampled: </s> included if it stopped) and step the env."""
        if self.done:
            raise RuntimeError("Episode.play() after the episode ended")
        self.ids += turn_ids
        self.mask += [1] * len(turn_ids)
        self.turns += 1
        from pipeline.envs.interface import check_step_result
        action = self.tokenizer.decode(turn_ids, skip_special_tokens=True)
        observation, reward, done, info = check_step_result(self.env.step(action))
        # The sum of step rewards: the envs here pay only on the last step.
        self.reward += reward
        self.all_valid = self.all_valid and bool(info.get("valid", True))
        self.ended_by_env = done
        if done or self.turns >= self.max_turns:
            self.done = True
            return
        obs_ids = list(self.tokenizer(observation, add_special_tokens=False).input_ids)
        self.ids += obs_ids
        self.mask += [0] * len(obs_ids)


def _env_max_turns(env: Any, max_turns: int | None) -> int:
    """The rollout's env.max_turns, given or else the env's own (4 if it has none)."""
    return max_turns if max_turns is not None else int(getattr(env, "max_turns", 4))


def expert_episode(env_cls: type, env_args: dict, prompt: Prompt, tokenizer: Any, *,
                   max_turns: int | None = None, max_new_tokens: int = MAX_NEW_TOKENS) -> Episode:
    """The env played by its expert_action(); each turn is the action's tokens
    plus </s>, as the model would sample it."""
    env = env_cls(**env_args)
    demonstrate = getattr(env, "warmup_action", None)
    if not callable(demonstrate) and not callable(getattr(env, "expert_action", None)):
        raise ValueError(f"{env_cls.__name__} has no expert_action(): the warm-up needs one to demonstrate the task")
    # An env may demonstrate the format with choices RL is left to improve (warmup_action).
    rng = random.Random(f"warmup|{prompt.id}")
    ep = Episode.start(env, prompt, tokenizer, _env_max_turns(env, max_turns))
    while not ep.done:
        action = demonstrate(rng) if callable(demonstrate) else env.expert_action()
        turn = list(tokenizer(action, add_special_tokens=False).input_ids) + [tokenizer.eos_token_id]
        if len(turn) > max_new_tokens:
            # The rollout would cut it off: the model could never sample it.
            raise ValueError(f"{env_cls.__name__}: expert action {action!r} is {len(turn)} tokens with </s>, "
                             f"over max_new_tokens {max_new_tokens}")
        ep.play(turn)
    return ep


@dataclass
class EvalResult:
    reward: float       # mean episode reward
    formatted: float    # fraction of episodes the env ended with every turn valid
    episodes: list[Episode]


def _decode_turns(model: Any, contexts: list[list[int]], *, eos_id: int, pad_id: int, max_new_tokens: int,
                  temperature: float = 0.0, generator: Any = None) -> list[list[int]]:
    """One turn for each context: greedy at temperature 0, else sampled.
    Right padding and no KV cache: causal attention never lets a real token
    see the pads after it, so positions and results are those of each
    context alone (and at these lengths recomputing is cheap)."""
    import torch
    seqs = [list(c) for c in contexts]
    turns: list[list[int]] = [[] for _ in contexts]
    live = list(range(len(contexts)))
    for _ in range(max_new_tokens):
        if not live:
            break
        width = max(len(seqs[i]) for i in live)
        batch = torch.tensor([seqs[i] + [pad_id] * (width - len(seqs[i])) for i in live])
        with torch.inference_mode():
            logits = model(input_ids=batch).logits
            last = logits[torch.arange(len(live)), torch.tensor([len(seqs[i]) - 1 for i in live])]
            if temperature == 0:
                nxt = last.argmax(-1).tolist()
            else:
                probs = torch.softmax(last.float() / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator).squeeze(1).tolist()
        for i, tok in zip(live, nxt):
            seqs[i].append(tok)
            turns[i].append(tok)
        live = [i for i, tok in zip(live, nxt) if tok != eos_id]
    return turns


def play(model: Any, tokenizer: Any, env_cls: type, env_args: dict, prompts: list[Prompt], *,
         max_turns: int | None = None, max_new_tokens: int = MAX_NEW_TOKENS, temperature: float = 0.0,
         samples: int = 1, seed: int = 0) -> EvalResult:
    """Play every prompt (`samples` times each) with the model in the
    rollout's layout: greedy at temperature 0, else sampled from a generator
    seeded with `seed`."""
    import torch
    episodes = []
    for prompt in prompts:
        for _ in range(samples):
            env = env_cls(**env_args)
            episodes.append(Episode.start(env, prompt, tokenizer, _env_max_turns(env, max_turns)))
    generator = torch.Generator().manual_seed(seed) if temperature > 0 else None
    was_training = model.training
    model.eval()
    try:
        while live := [ep for ep in episodes if not ep.done]:
            turns = _decode_turns(model, [ep.ids for ep in live], eos_id=tokenizer.eos_token_id,
                                  pad_id=tokenizer.pad_token_id, max_new_tokens=max_new_tokens,
                                  temperature=temperature, generator=generator)
            for ep, turn in zip(live, turns):
                ep.play(turn)
    finally:
        model.train(was_training)
    n = max(len(episodes), 1)
    return EvalResult(reward=sum(ep.reward for ep in episodes) / n,
                      formatted=sum(ep.ended_by_env and ep.all_valid for ep in episodes) / n,
                      episodes=episodes)


def greedy_eval(model: Any, tokenizer: Any, env_cls: type, env_args: dict, prompts: list[Prompt],
                **kwargs: Any) -> EvalResult:
    """Play every prompt once with the model, greedy (as validation does)."""
    return play(model, tokenizer, env_cls, env_args, prompts, temperature=0.0, samples=1, **kwargs)


def train_on(model: Any, episodes: list[Episode], *, steps: int, lr: float, batch_size: int,
             seed: int, pad_id: int) -> list[float]:
    """AdamW on cross-entropy over the model-turn tokens, fitted with
    portable_fit (the same bytes on every x86 CPU); the per-step losses."""
    import torch

    from pipeline.inputs.portable_fit import portable_fit
    rng = random.Random(seed)
    order: list[int] = []
    model.train()
    losses = []
    with portable_fit(model, lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=0.0)) as optimizer:
        for _ in range(steps):
            if len(order) < batch_size:  # a fresh shuffled epoch, so every transcript is seen as often
                epoch = list(range(len(episodes)))
                rng.shuffle(epoch)
                order += epoch
            batch, order = [episodes[i] for i in order[:batch_size]], order[batch_size:]
            width = max(len(ep.ids) for ep in batch)
            ids = torch.tensor([ep.ids + [pad_id] * (width - len(ep.ids)) for ep in batch])
            # -100 is ignored by the loss: context, observations and padding.
            labels = torch.tensor([[t if m else -100 for t, m in zip(ep.ids, ep.mask)]
                                   + [-100] * (width - len(ep.ids)) for ep in batch])
            # Not the model's own loss: it upcasts the logits to float32, whose kernels round per CPU.
            logits = model(input_ids=ids).logits[:, :-1]
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            losses.append(loss.item())
    return losses


@dataclass
class WarmupReport:
    steps: int
    seconds: float          # the training steps alone
    loss_first: float       # mean of the first 10 steps' losses
    loss_last: float        # mean of the last 10
    prompts: int            # training prompts demonstrated
    before: EvalResult | None         # greedy, as validation decodes
    after: EvalResult | None
    after_sampled: EvalResult | None  # temperature 1, as RL samples
    out: Path

    def summary(self) -> dict:
        def ev(r: EvalResult | None) -> dict | None:
            return None if r is None else {"reward": round(r.reward, 4), "formatted": round(r.formatted, 4)}
        return {"steps": self.steps, "prompts": self.prompts, "seconds": round(self.seconds, 1),
                "loss_first": round(self.loss_first, 4), "loss_last": round(self.loss_last, 4),
                "val_greedy_before": ev(self.before), "val_greedy_after": ev(self.after),
                "val_sampled_after": ev(self.after_sampled)}


def _save(model: Any, source: Path, out: Path, meta: dict) -> None:
    """Write into a scratch directory, then move the files in with config.json
    last: a killed run leaves no config.json, which make and the loaders
    treat as "not built". The tokenizer files are the source's, copied
    byte for byte (a re-save adds load-time keys to tokenizer_config.json)."""
    from pipeline.inputs.models import TOKENIZER_FILES
    out.mkdir(parents=True, exist_ok=True)
    scratch = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(scratch, ignore_errors=True)
    try:
        model.save_pretrained(scratch)
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copyfile(source / name, scratch / name)
        (scratch / "warmup.json").write_text(json.dumps(meta, indent=2) + "\n")
        (out / "config.json").unlink(missing_ok=True)
        names = sorted(p.name for p in scratch.iterdir())
        for name in [n for n in names if n != "config.json"] + ["config.json"]:
            os.replace(scratch / name, out / name)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def warmup(model_dir: str | Path, env_spec: str, data: str | Path, out: str | Path, *,
           val: str | Path | None = None, steps: int | None = None, prompts: int | None = None,
           lr: float = DEFAULT_LR, batch_size: int = DEFAULT_BATCH, seed: int = 0,
           env_args: dict | None = None, max_turns: int | None = None, samples: int = 4,
           max_new_tokens: int = MAX_NEW_TOKENS, log: Any = None) -> WarmupReport:
    """Warm `model_dir` up on `env_spec`'s expert transcripts of the first
    `prompts` rows of `data` and save it to `out`. With `val`: the greedy
    reward before and after, and after, the reward of `samples` samples per
    prompt at temperature 1 (not before: a random model's samples run to the
    token limit every turn, 10 s of decoding for a known 0)."""
    from pipeline.envs.interface import load_env_class
    from pipeline.inputs.datasets import load_prompts
    from pipeline.inputs.models import check_model_files

    env_args = dict(env_args or {})
    model_path, out_path = Path(model_dir), Path(out)
    # The quick checks first, so bad input fails in a second, not after loading.
    check_model_files(model_path)
    if out_path.resolve() == model_path.resolve():
        raise ValueError(f"--out {str(out_path)!r} is the input model directory; write the warmed-up model elsewhere")
    env_cls = load_env_class(env_spec, env_args)
    if steps is None:
        steps = int(getattr(env_cls, "warmup_steps", DEFAULT_STEPS))
    if prompts is None:
        prompts = getattr(env_cls, "warmup_prompts", None)
    for name, value in (("steps", steps), ("batch size", batch_size), ("prompts", prompts)):
        if value is not None and value < 1:
            raise ValueError(f"warm-up {name} must be at least 1, got {value}")
    if not lr > 0:
        raise ValueError(f"warm-up lr must be positive, got {lr}")
    train_prompts = load_prompts(data, kind="train")[:prompts]
    val_prompts = load_prompts(val, kind="val") if val is not None else None
    import torch  # seconds of imports: after the checks
    from transformers import AutoTokenizer, LlamaForCausalLM
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        transcripts = [expert_episode(env_cls, env_args, p, tokenizer, max_turns=max_turns,
                                      max_new_tokens=max_new_tokens) for p in train_prompts]
        model = LlamaForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)

        def evaluate(when: str, sampled: bool) -> tuple[EvalResult | None, EvalResult | None]:
            if val_prompts is None:
                return None, None
            kw = dict(max_turns=max_turns, max_new_tokens=max_new_tokens)
            greedy = greedy_eval(model, tokenizer, env_cls, env_args, val_prompts, **kw)
            line = f"val reward {when}: greedy {greedy.reward:.3f} (formatted {greedy.formatted:.2f})"
            drawn = None
            if sampled:
                drawn = play(model, tokenizer, env_cls, env_args, val_prompts, temperature=1.0, samples=samples,
                             seed=seed, **kw)
                line += f", sampled {drawn.reward:.3f} (formatted {drawn.formatted:.2f})"
            if log:
                log(line)
            return greedy, drawn

        before, _ = evaluate("before", sampled=False)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            t0 = time.perf_counter()
            losses = train_on(model, transcripts, steps=steps, lr=lr, batch_size=batch_size, seed=seed,
                              pad_id=tokenizer.pad_token_id)
            seconds = time.perf_counter() - t0
        after, after_sampled = evaluate("after ", sampled=True)
    finally:
        torch.set_num_threads(threads)
    report = WarmupReport(steps=steps, seconds=seconds, loss_first=sum(losses[:10]) / len(losses[:10]),
                          loss_last=sum(losses[-10:]) / len(losses[-10:]), prompts=len(train_prompts),
                          before=before, after=after, after_sampled=after_sampled, out=out_path)
    meta = {"base_model": str(model_path), "env": env_spec, "env_args": env_args, "data": str(data),
            "val": None if val is None else str(val), "lr": lr, "batch_size": batch_size, "seed": seed,
            "max_new_tokens": max_new_tokens, **report.summary()}
    _save(model, model_path, out_path, meta)
    if log:
        log(f"{steps} steps on {len(train_prompts)} prompts in {seconds:.1f} s, "
            f"loss {report.loss_first:.3f} -> {report.loss_last:.3f}; wrote {out_path}")
    return report
