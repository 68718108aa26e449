"""What the workers need from their leaves.

A generation engine turns prompts into completions with per-token logprobs and
takes new weights; a training engine takes a table of trajectories and their
advantages, updates the policy and exports its weights by HF parameter name.
The simulated backend (pipeline/engines/sim.py) and the real one (vLLM,
DeepSpeed) implement these.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Protocol

import pyarrow as pa


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    answer: str = ""


@dataclass(frozen=True)
class Completion:
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    logprobs: tuple[float, ...]  # one per response token, from the generating engine
    text: str


# One row per completion. Rows of one prompt group share batch_id and prompt_id.
TRAJECTORY_SCHEMA = pa.schema([
    ("batch_id", pa.string()),
    ("target", pa.int32()),
    ("version", pa.int32()),
    ("prompt_id", pa.string()),
    ("prompt_ids", pa.list_(pa.int32())),
    ("response_ids", pa.list_(pa.int32())),
    ("logprobs", pa.list_(pa.float32())),
    ("text", pa.string()),
    ("reward", pa.float32()),
    # Why the reward function raised on this sample, or "" (see GeneratorWorker._score).
    ("reward_error", pa.string()),
])


def sample_seeds(run_seed: int, batch_id: str, prompts: list[Prompt], n: int) -> list[list[int]]:
    """One sampler seed per (run seed, batch, prompt position, prompt, sample).

    A batch's samples then depend on what the batch is, never on which engine
    call or which position in a call it landed in, so a run replays exactly
    whatever the timing. The seeds are hashes, not seed + i: vLLM seeds the
    i-th sample of a request with seed + i, and consecutive seeds would give
    two requests overlapping streams.
    """
    def seed(i: int, prompt: Prompt, j: int) -> int:
        key = f"{run_seed}|{batch_id}|{i}|{prompt.id}|{j}".encode()
        return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1
    return [[seed(i, p, j) for j in range(n)] for i, p in enumerate(prompts)]


class GenerationEngine(Protocol):
    def sample(self, prompts: list[Prompt], seeds: list[list[int]]) -> list[list[Completion]]:
        """len(seeds[i]) completions of prompt i, sample j drawn with seeds[i][j]."""

    def greedy(self, prompts: list[Prompt]) -> list[Completion]:
        """One greedy completion per prompt."""

    def load_weights(self, weights: Any) -> None:
        """Replace the weights in place; caches that depend on them are reset."""


class TrainingEngine(Protocol):
    def train_step(self, table: pa.Table, advantages: pa.Table) -> dict[str, float]:
        """One policy update on a table with TRAJECTORY_SCHEMA; `advantages`, row i
        for row i, has an `advantages` column of one float per response token
        (pipeline/algos/grpo.py, ppo.py). Returns metrics."""

    def export_weights(self) -> Any:
        """The current weights, by HF parameter name, ready for load_weights."""

    def save(self, path: str) -> None:
        """An HF-format checkpoint that transformers can load."""
