"""Simulated leaves: the timing and events of real workers without a model.

Latencies come from `sim` in the config, fixed or jittered from a seed. The
"weights" are just the update count, so a refit is observable: completions
carry the version they were generated with and the reward rises with it.
"""
from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import pyarrow as pa

from pipeline.engines.interface import Completion, Prompt
from pipeline.io.config import SimConfig


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
    """A fault injected by `sim.fault`."""


def _maybe_fault(cfg: SimConfig, kind: str, calls: int) -> None:
    if calls < cfg.fault_after or cfg.fault not in (f"{kind}_raise", f"{kind}_hang", f"{kind}_exit"):
        return
    if cfg.fault.endswith("_raise"):
        raise SimFault(f"injected fault: {cfg.fault} after {cfg.fault_after} calls")
    if cfg.fault.endswith("_exit"):
        os._exit(17)  # the process dies as a crash or an OOM kill would: no cleanup, no reply
    time.sleep(3600)  # a stuck leaf: only the run's deadlines can end this


class SimGenerationEngine:
    def __init__(self, cfg: SimConfig, *, seed: int, max_new_tokens: int, faulty: bool = True):
        # A generator that sim.fault does not target (another index, or a restart
        # past sim.fault_incarnations) runs clean.
        self.cfg = cfg if faulty else SimConfig(**{**cfg.__dict__, "fault": ""})
        self.latency = _Latency(cfg, seed)
        self.max_new_tokens = max_new_tokens
        self.weights_version = 0
        self.calls = 0

    def sample(self, prompts: list[Prompt], seeds: list[list[int]]) -> list[list[Completion]]:
        _maybe_fault(self.cfg, "generate", self.calls)
        self.calls += 1
        self.latency.spend(self.cfg.generate_s)
        return [[self._completion(random.Random(seed)) for seed in group] for group in seeds]

    def greedy(self, prompts: list[Prompt]) -> list[Completion]:
        self.latency.spend(self.cfg.validate_s)
        return [self._completion(random.Random(p.id)) for p in prompts]

    def _completion(self, rng: random.Random) -> Completion:
        ids = tuple(rng.randrange(256) for _ in range(self.max_new_tokens))
        logprobs = tuple(-rng.random() for _ in ids)
        return Completion((1, 2, 3), ids, logprobs, f"v{self.weights_version}")

    def load_weights(self, weights: dict) -> None:
        self.latency.spend(self.cfg.refit_s)
        self.weights_version = weights["sim_updates"]


class SimTrainingEngine:
    def __init__(self, cfg: SimConfig, *, seed: int, faulty: bool = True):
        self.latency = _Latency(cfg, seed)
        # A rank that sim.fault does not target (another rank) runs clean.
        self.cfg = cfg if faulty else SimConfig(**{**cfg.__dict__, "fault": ""})
        self.updates = 0

    def train_step(self, table: pa.Table, advantages: pa.Table, shard=None) -> dict[str, float]:
        """`shard` (data-parallel ranks) changes nothing here: each rank's stand-in
        counts the same updates."""
        _maybe_fault(self.cfg, "train", self.updates)
        # The real engine refuses a misaligned table; so must the stand-in.
        _check_token_column(table, advantages, "advantages")
        self.latency.spend(self.cfg.train_s)
        self.updates += 1
        return {"loss": 1.0 / self.updates, "rows": float(table.num_rows)}

    def save_state(self, path: str) -> None:
        _write_state(path, {"updates": self.updates})

    def load_state(self, path: str) -> None:
        self.updates = int(_read_state(path)["updates"])

    def export_weights(self) -> dict:
        return {"sim_updates": self.updates}

    def save(self, path: str) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "sim_weights.json").write_text(json.dumps(self.export_weights()))


def sim_reward(prompt: Prompt, completion_text: str) -> float:
    """Rises with the weight version the text was generated with: v0 -> 0, v10 -> 0.5."""
    version = int(completion_text.lstrip("v"))
    return version / (version + 10)


def faulty_sim_reward(cfg: SimConfig):
    """sim_reward that raises on every `fault_after`-th sample (sim.fault: reward_raise)."""
    calls = 0
    every = max(cfg.fault_after, 1)

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
