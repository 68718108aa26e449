"""What the workers need from their leaves.

A generation engine turns prompts into completions with per-token logprobs and
takes new weights; a training engine takes a table of trajectories, updates
the policy and exports its weights by HF parameter name. The simulated
backend (pipeline/sim.py) and the real one (vLLM, DeepSpeed) implement these.
"""
from __future__ import annotations

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


class GenerationEngine(Protocol):
    def generate(self, prompts: list[Prompt], n: int, greedy: bool = False) -> list[list[Completion]]:
        """n completions per prompt, in prompt order."""

    def load_weights(self, weights: Any) -> None:
        """Replace the weights in place; caches that depend on them are reset."""


class TrainingEngine(Protocol):
    def train_step(self, table: pa.Table) -> dict[str, float]:
        """One policy update on a table with TRAJECTORY_SCHEMA; returns metrics."""

    def export_weights(self) -> Any:
        """The current weights, by HF parameter name, ready for load_weights."""

    def save(self, path: str) -> None:
        """An HF-format checkpoint that transformers can load."""
