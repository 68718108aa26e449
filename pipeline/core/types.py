"""What the workers need from their leaves.

A generation engine turns prompts into completions with per-token logprobs and
takes new weights; a training engine takes a table of trajectories and their
advantages, updates the policy and exports its weights by HF parameter name.
The simulated backend (pipeline/sim/engines.py) and the real one (vLLM,
DeepSpeed) implement these.
"""
from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import pyarrow as pa


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    answer: str = ""
    # A turn after the first of a multi-turn sample: the context as tokens (text
    # is not re-encoded, so the model sees exactly the tokens it will be trained on).
    token_ids: tuple[int, ...] = ()
    # A chat-format prompt's messages as JSON (the system prompt included), "" for
    # text: a reward model renders the conversation with its own chat template.
    messages: str = ""
    # verl's per-row fields, given to a reward with verl's signature (pipeline/rewards/specs.py):
    # where the row comes from ("" for none; data.reward may route by it), and extra_info as JSON text.
    data_source: str = ""
    extra_info: str = ""
    # The pictures of a vision-language prompt, as their files' bytes, in the order
    # of their placeholders in token_ids (pipeline/inputs/images.py).
    images: tuple[bytes, ...] = ()

    def __post_init__(self):
        # A checkpoint's round trip (Arrow, JSON) hands lists back: equal prompts stay equal.
        object.__setattr__(self, "token_ids", tuple(self.token_ids))
        object.__setattr__(self, "images", tuple(self.images))

    def state(self) -> dict:
        """The prompt as JSON values (a checkpoint's controller.json): pictures as base64 text."""
        return {**self.__dict__, "images": [base64.b64encode(image).decode() for image in self.images]}

    @classmethod
    def from_state(cls, state: dict) -> "Prompt":
        return cls(**{**state, "images": [base64.b64decode(image) for image in state.get("images", ())]})


@dataclass(frozen=True)
class Completion:
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    logprobs: tuple[float, ...]  # one per response token, from the generating engine
    text: str
    versions: tuple[int, ...] = ()  # one per response token: the weight version that sampled it
    # Multi-turn samples (pipeline/generator/episodes.py) only: 1 on model tokens,
    # 0 on the environment's; each turn's reward on its last model token; their
    # sum, and why the environment failed the sample ("" if it did not).
    loss_mask: tuple[int, ...] = ()
    token_rewards: tuple[float, ...] = ()
    reward: float | None = None
    error: str = ""
    turns: int = 1
    # Cut at max_new_tokens (vLLM's finish_reason "length"); None where the engine does not say.
    truncated: bool | None = None
    # Multi-turn only: the turns in order, as the model saw them (TRANSCRIPT_TURN).
    transcript: tuple[dict, ...] = ()
    # Agents only: the contexts the sample's requests made (pipeline/agents/history.py); the last is trained.
    segments: int = 1
    # training.routing_replay only: the experts each token was routed to (pipeline/moe/routes.py).
    routes: bytes = b""


# A multi-turn sample's turn: "env" (an observation, formatted as the model saw it; the first is
# reset's) or "model" (its reward: the environment's answer to that action).
TRANSCRIPT_TURN = pa.struct([("role", pa.string()), ("text", pa.string()), ("reward", pa.float32())])

# One row per completion. Rows of one prompt group share batch_id and prompt_id.
TRAJECTORY_SCHEMA = pa.schema([
    ("batch_id", pa.string()),
    ("target", pa.int32()),
    ("version", pa.int32()),
    ("prompt_id", pa.string()),
    ("prompt_ids", pa.list_(pa.int32())),
    ("response_ids", pa.list_(pa.int32())),
    ("logprobs", pa.list_(pa.float32())),
    # The weight version that sampled each response token: one for all of them
    # under refit_mode drain, rising along the sample under inflight. `version`
    # is the oldest of them: a sample's age is measured from it.
    ("token_versions", pa.list_(pa.int32())),
    ("text", pa.string()),
    ("reward", pa.float32()),
    # Why the reward function or the environment failed this sample, or "" (see pipeline/rewards/scoring.py).
    ("reward_error", pa.string()),
    # 1 where the model sampled the response token, 0 where an environment's
    # observation put it (multi-turn): only the 1s are trained. Null: all 1s.
    ("loss_mask", pa.list_(pa.int8())),
    # The reward of each model turn on its last token, 0 elsewhere; they sum to
    # `reward`. PPO's GAE reads them; null: `reward` on the last token.
    ("token_rewards", pa.list_(pa.float32())),
    # True where generation stopped at max_new_tokens, not at an end-of-text
    # token; null where the engine does not report it (multi-turn, simulated).
    ("truncated", pa.bool_()),
    # A multi-turn sample's turns (TRANSCRIPT_TURN), for reading its samples (metrics.samples):
    # `text` holds only the model's turns. Null for a single-turn sample.
    ("transcript", pa.list_(TRANSCRIPT_TURN)),
    # The distillation teacher's logprob of each response token (distill.teacher;
    # pipeline/distill/), put by the teacher before the buffer takes the batch. Null: no teacher.
    ("teacher_logprobs", pa.list_(pa.float32())),
    # With distill.loss topk_kl, the teacher's distill.topk likeliest token ids at each response
    # token's position, likeliest first, and their logprobs ([tokens, k] each). Null: none kept.
    ("teacher_topk_ids", pa.list_(pa.list_(pa.int32()))),
    ("teacher_topk_logprobs", pa.list_(pa.list_(pa.float32()))),
    # training.routing_replay: the experts the engine routed each token to, the prompt's and the
    # response's but the last (pipeline/moe/routes.py), which the trainer's forward replays. Null: none.
    ("routed_experts", pa.large_binary()),
    # A vision-language prompt's pictures as their files' bytes (Prompt.images): the trainer
    # turns them into the model's pixels with the model's image processor. Null: no pictures.
    ("images", pa.list_(pa.binary())),
])


class TeacherScores(NamedTuple):
    """What a distillation teacher gives a batch (pipeline/distill/), per row: its
    logprob of each response token; with top-k, at each response token its k
    likeliest ids and their logprobs (else None)."""
    logprobs: list[list[float]]
    topk_ids: list[list[list[int]]] | None = None
    topk_logprobs: list[list[list[float]]] | None = None


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


def turn_seed(seed: int | None, turn: int) -> int | None:
    """The sampler seed of a sample's `turn`: the sample's own for the first,
    a hash of it after (vLLM would make seed + 1 the next request's stream)."""
    if seed is None or turn == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}|turn{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class GenerationEngine(Protocol):
    """Driven a step at a time by the generator's engine loop
    (pipeline/generator/engine_loop.py): requests are added whenever, each step
    decodes every running one, weights change only between steps."""

    def add(self, key: str, prompt: Prompt, seed: int | None, *, temperature: float | None = None) -> None:
        """Queue a request under `key`: sampled with `seed` at `temperature` (None: the
        engine's), greedy when `seed` is None."""

    def step(self) -> list[tuple[str, Completion]]:
        """One engine step; the requests it finished, by key."""

    def busy(self) -> bool:
        """Requests are queued or running."""

    def encode(self, text: str) -> list[int]:
        """A first prompt's token ids (with the BOS the model expects)."""

    def encode_continuation(self, text: str) -> list[int]:
        """Token ids of text appended to a context (an environment's observation): no BOS."""

    # The tokens that stand for a picture's encodings in a prompt (a vision-language
    # model's; () for a text model): only a prompt's pictures may bring them.
    placeholders: tuple[int, ...]

    def progress(self) -> dict[str, int]:
        """Tokens sampled so far by each request in flight, by key."""

    def abort_all(self) -> None:
        """Drop every request in flight."""

    def load_weights(self, weights: Any) -> None:
        """Replace the weights in place, between two steps; caches that depend
        on them are reset (requests in flight: generation.inflight_kv)."""

    def set_version(self, version: int) -> None:
        """Label the weights now loaded: tokens sampled from here on carry it."""


class TrainingEngine(Protocol):
    def train_step(self, table: pa.Table, advantages: pa.Table) -> dict[str, float]:
        """One policy update on a table with TRAJECTORY_SCHEMA; `advantages`, row i
        for row i, has an `advantages` column of one float per response token
        (pipeline/algos/advantages.py, ppo.py). Returns metrics."""

    def export_weights(self) -> Any:
        """The current weights, by HF parameter name, ready for load_weights."""

    def save(self, path: str) -> None:
        """An HF-format checkpoint that transformers can load."""

    def close(self) -> None:
        """Release the optimizer state and hooks at the run's end."""
