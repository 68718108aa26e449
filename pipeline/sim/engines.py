"""Simulated leaves: the timing and events of real workers without a model.

Latencies come from `sim` in the config, fixed or jittered from a seed; the
faults of the recovery tests from `inject`. The
"weights" are just the update count, so a refit is observable: completions
carry the version they were generated with and the reward rises with it.
"""
from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from pipeline.core.types import Completion, Prompt, TeacherScores
from pipeline.config import InjectConfig, SimConfig


class _Latency:
    def __init__(self, cfg: SimConfig, seed: int):
        self.jitter = cfg.jitter
        self.rng = random.Random(seed)

    def spend(self, seconds: float) -> None:
        if self.jitter:
            seconds *= self.rng.uniform(1 - self.jitter, 1 + self.jitter)
        # Simulated work: this sleep stands for compute, it orders nothing.
        time.sleep(seconds)


class SimFault(RuntimeError):
    """A fault injected by `inject.fault`."""


def _maybe_fault(inject: InjectConfig, kind: str, calls: int) -> None:
    if calls < inject.after or inject.fault not in (f"{kind}_raise", f"{kind}_hang", f"{kind}_exit"):
        return
    if inject.fault.endswith("_raise"):
        raise SimFault(f"injected fault: {inject.fault} after {inject.after} calls")
    if inject.fault.endswith("_exit"):
        os._exit(17)  # the process dies as a crash or an OOM kill would: no cleanup, no reply
    time.sleep(3600)  # a stuck leaf: only the run's deadlines can end this


@dataclass
class _SimRequest:
    rng: random.Random
    length: int
    greedy: bool
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    weights: int = -1  # the weights of its first token: its text, which sim_reward scores
    bonus: str = ""    # "+k": k hundredths of reward more (sim.flat_share)


class SimGenerationEngine:
    """Decodes like an engine with room for every request: a step gives each
    running request one token and takes generate_s / max_new_tokens (a memory
    bound decode: the same for one sequence or many), or validate_s /
    max_new_tokens while only validation requests run. Response lengths are
    max_new_tokens or lognormal (sim.response_len), drawn from the request's seed."""

    def __init__(self, cfg: SimConfig, *, seed: int, max_new_tokens: int, inject: InjectConfig = InjectConfig(),
                 faulty: bool = True):
        self.cfg = cfg
        # A generator that inject.fault does not target (another index, or a restart
        # past inject.incarnations) runs clean.
        self.inject = inject if faulty else InjectConfig()
        self.latency = _Latency(cfg, seed)
        self.max_new_tokens = max_new_tokens
        self.weights_version = 0
        self.version = 0
        self.calls = 0     # submissions of rollouts (requests added between two steps): inject.after counts these
        self._stepped = True
        self._running: dict[str, _SimRequest] = {}

    # An agent's chat (pipeline/agents/): one token per byte of a plain rendering, no end-of-turn token.
    max_model_len = 1 << 16
    eos_id = None
    eos_text = ""

    def add(self, key: str, prompt: Prompt, seed: int | None, max_tokens: int | None = None,
            stop: tuple[str, ...] = (), temperature: float | None = None) -> None:
        if seed is not None and self._stepped:
            self.calls += 1
            self._stepped = False
        rng = random.Random(prompt.id if seed is None else seed)
        request = _SimRequest(rng, min(self._length(rng), max_tokens or self.max_new_tokens), greedy=seed is None)
        if seed is not None and random.Random(f"flat:{prompt.id}").random() >= self.cfg.flat_share:
            request.bonus = f"+{rng.randrange(4)}"  # this prompt's samples score apart (sim.flat_share)
        self._running[key] = request

    def _length(self, rng: random.Random) -> int:
        if self.cfg.response_len == "fixed":
            return self.max_new_tokens
        # p99 / p50 = tail_ratio: sigma = ln(tail_ratio) / z_0.99; the median puts p99 at max_new_tokens.
        sigma = math.log(self.cfg.tail_ratio) / 2.3263
        median = self.max_new_tokens / self.cfg.tail_ratio
        return max(1, min(self.max_new_tokens, round(median * math.exp(rng.gauss(0.0, sigma)))))

    def busy(self) -> bool:
        return bool(self._running)

    placeholders: tuple[int, ...] = ()   # a text model's

    def encode(self, text: str) -> list[int]:
        return [1] + list(text.encode()[:64])

    def encode_continuation(self, text: str) -> list[int]:
        """One token per byte: an observation's length sets its share of a sample's tokens."""
        return list(text.encode())

    def step(self) -> list[tuple[str, Completion]]:
        self._stepped = True
        if self.calls:
            # After inject.after good submissions: a fault mid-rollout, as a real engine would fail.
            _maybe_fault(self.inject, "generate", self.calls - 1)
        only_validation = all(r.greedy for r in self._running.values())
        self.latency.spend((self.cfg.validate_s if only_validation else self.cfg.generate_s) / self.max_new_tokens)
        done = []
        for key, r in list(self._running.items()):
            if r.weights < 0:
                r.weights = self.weights_version
            r.ids.append(r.rng.randrange(256))
            r.logprobs.append(-r.rng.random())
            r.versions.append(self.version)
            if len(r.ids) == r.length:
                del self._running[key]
                done.append((key, Completion((1, 2, 3), tuple(r.ids), tuple(r.logprobs), f"v{r.weights}{r.bonus}",
                                             tuple(r.versions))))
        return done

    def progress(self) -> dict[str, int]:
        return {key: len(r.ids) for key, r in self._running.items()}

    def abort_all(self) -> None:
        self._running.clear()

    def abort(self, keys: list[str]) -> None:
        for key in keys:
            self._running.pop(key, None)

    def render_chat(self, messages: list[dict], tools: tuple[dict, ...], add_generation_prompt: bool) -> str:
        text = "".join(f"<{m['role']}>{m.get('content') or ''}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def decode(self, ids) -> str:
        return bytes(i % 256 for i in ids).decode(errors="replace")

    def load_weights(self, weights: dict) -> None:
        self.latency.spend(self.cfg.refit_s)
        self.weights_version = weights["sim_updates"]

    def set_version(self, version: int) -> None:
        self.version = version


class SimTrainingEngine:
    def __init__(self, cfg: SimConfig, *, seed: int, inject: InjectConfig = InjectConfig(), faulty: bool = True):
        self.latency = _Latency(cfg, seed)
        self.cfg = cfg
        # A rank that inject.fault does not target (another rank) runs clean; a non-finite
        # loss hits every rank, as the real ranks agree on each skip.
        self.inject = inject if faulty or inject.fault == "train_nonfinite" else InjectConfig()
        self.updates = 0

    def train_step(self, table: pa.Table, advantages: pa.Table, shard=None) -> dict[str, float]:
        """`shard` (data-parallel ranks) changes nothing here: each rank's stand-in
        counts the same updates."""
        _maybe_fault(self.inject, "train", self.updates)
        # The real engine refuses a misaligned table; so must the stand-in.
        _check_token_column(table, advantages, "advantages")
        self.latency.spend(self.cfg.train_s)
        if self.inject.fault == "train_nonfinite" and self.updates >= self.inject.after:
            # What the real engines report when they skip a step: the weights stay as they are.
            return {"loss": float("nan"), "grad_norm": float("nan"), "nonfinite_skipped": 1.0,
                    "rows": float(table.num_rows)}
        self.updates += 1
        return {"loss": 1.0 / self.updates, "rows": float(table.num_rows), "nonfinite_skipped": 0.0}

    def save_state(self, path: str) -> None:
        _write_state(path, {"updates": self.updates})

    def load_state(self, path: str) -> None:
        self.updates = int(_read_state(path)["updates"])

    def close(self) -> None:
        """Nothing held beyond the process."""

    def export_weights(self) -> dict:
        return {"sim_updates": self.updates}

    def save(self, path: str) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "sim_weights.json").write_text(json.dumps(self.export_weights()))


def sim_reward(prompt: Prompt, completion_text: str) -> float:
    """Rises with the weight version the text was generated with: v0 -> 0, v10 -> 0.5;
    "v3+2" scores 0.02 more than "v3"."""
    version, _, bonus = completion_text.lstrip("v").partition("+")
    return int(version) / (int(version) + 10) + 0.01 * int(bonus or 0)


def faulty_sim_reward(inject: InjectConfig):
    """sim_reward that raises on every `inject.after`-th sample (inject.fault: reward_raise)."""
    calls = 0
    every = max(inject.after, 1)

    def reward(prompt: Prompt, completion_text: str) -> float:
        nonlocal calls
        calls += 1
        if calls % every == 0:
            raise SimFault(f"injected fault: reward_raise on sample {calls} (prompt {prompt.id})")
        return sim_reward(prompt, completion_text)
    return reward


def sim_prompts(count: int, prefix: str) -> list[Prompt]:
    return [Prompt(id=f"{prefix}{i}", text=f"simulated prompt {i}") for i in range(count)]


STATE_FILE = "sim_state.json"


def _write_state(path: str, state: dict) -> None:
    Path(path).mkdir(parents=True, exist_ok=True)
    (Path(path) / STATE_FILE).write_text(json.dumps(state))


def _read_state(path: str) -> dict:
    f = Path(path) / STATE_FILE
    if not f.is_file():
        raise FileNotFoundError(f"no simulated engine state in {str(path)!r} (expected {str(f)!r})")
    return json.loads(f.read_text())


def _check_token_column(table: pa.Table, per_token: pa.Table, column: str) -> list[list[float]]:
    responses = table.column("response_ids").to_pylist()
    values = per_token.column(column).to_pylist()
    if len(values) != len(responses) or any(len(v) != len(r) for v, r in zip(values, responses)):
        raise ValueError(f"{column}: per-token values do not match the batch's response tokens")
    return values


class SimCriticEngine:
    """A critic without a model: one running estimate of the return, the value
    of every token. Each update moves it halfway to the batch's mean return,
    so the values are deterministic and follow the (rising) sim reward."""

    def __init__(self, cfg: SimConfig, *, seed: int):
        self.latency = _Latency(cfg, seed)
        self.cfg = cfg
        self.updates = 0
        self.estimate = 0.0

    def values(self, table: pa.Table, shard=None) -> list[list[float]]:
        if shard is not None:
            table = table.slice(shard.start, shard.stop - shard.start)
        return [[self.estimate] * len(r) for r in table.column("response_ids").to_pylist()]

    def train_step(self, table: pa.Table, targets: pa.Table, shard=None) -> dict[str, float]:
        """The whole batch's returns whatever the shard: every rank's estimate stays the same."""
        returns = [x for row in _check_token_column(table, targets, "returns") for x in row]
        self.latency.spend(self.cfg.train_s)
        mean = sum(returns) / len(returns) if returns else self.estimate
        loss = 0.5 * sum((self.estimate - x) ** 2 for x in returns) / max(len(returns), 1)
        self.estimate += 0.5 * (mean - self.estimate)
        self.updates += 1
        return {"value_loss": loss, "tokens": float(len(returns)), "step": float(self.updates)}

    def save_state(self, path: str) -> None:
        _write_state(path, {"updates": self.updates, "estimate": self.estimate})

    def load_state(self, path: str) -> None:
        state = _read_state(path)
        self.updates, self.estimate = int(state["updates"]), float(state["estimate"])

    def close(self) -> None:
        """Nothing held beyond the process."""


class SimRewardModel:
    """The reward model of backend sim: sim_reward again, sim.score_s per batch.
    inject.fault score_exit ends the process on batch inject.after + 1, as an
    OOM kill would (while its restart count is below inject.incarnations)."""

    def __init__(self, cfg: SimConfig, *, seed: int, inject: InjectConfig = InjectConfig(), faulty: bool = False):
        self.latency = _Latency(cfg, seed)
        self.score_s = cfg.score_s
        self.inject, self.faulty = inject, faulty
        self.calls = 0

    def score(self, prompts: list[Prompt], completions: list[str]) -> list[tuple[float, str]]:
        if self.faulty:
            _maybe_fault(self.inject, "score", self.calls)
        self.calls += 1
        self.latency.spend(self.score_s)
        return [(sim_reward(p, c), "") for p, c in zip(prompts, completions, strict=True)]

    def digest(self) -> str:
        return "sim"

    def close(self) -> None:
        pass


class SimTeacher:
    """The distillation teacher of backend sim: a fixed logprob per token id,
    sim.score_s per batch. inject.fault teach_exit ends the process on batch
    inject.after + 1 (while its restart count is below inject.incarnations)."""

    def __init__(self, cfg: SimConfig, *, inject: InjectConfig = InjectConfig(), faulty: bool = False,
                 topk: int = 0):
        self.latency = _Latency(cfg, seed=997)
        self.score_s = cfg.score_s
        self.inject, self.faulty, self.topk = inject, faulty, topk
        self.calls = 0

    def score(self, prompts: list[list[int]], responses: list[list[int]]):
        """TeacherScores; with topk, the ids 0..k-1 at every position, likeliest first."""
        if self.faulty:
            _maybe_fault(self.inject, "teach", self.calls)
        self.calls += 1
        self.latency.spend(self.score_s)
        logprobs = [[-0.05 - (t % 17) / 10 for t in r] for r in responses]
        if not self.topk:
            return TeacherScores(logprobs)
        top = [-0.05 - j / 10 for j in range(self.topk)]
        return TeacherScores(logprobs, [[list(range(self.topk))] * len(r) for r in responses],
                             [[top] * len(r) for r in responses])

    def digest(self) -> str:
        return "sim"

    def close(self) -> None:
        pass
