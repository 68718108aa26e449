"""Multi-turn rollouts: model turns and environment steps, sample by sample.

The engine loop (pipeline/generator/engine_loop.py) owns the engine; this keeps,
for each sample in flight, its environment and the tokens so far. A sample's
turn that the engine finished goes to its environment's step; the step's
answer comes back to the loop as a command, and the next turn is added to the
engine then, whatever the other samples of its batch are doing. So a slow
tool holds up its own sample, never the engine.

Environment steps run off the loop's thread: in this process on daemon threads
(env.actors 0, pipeline/envs/threads.py), or in a pool of Ray actors
(pipeline/envs/workers.py), each taking one step at a time. A step that raises,
returns something malformed or outlives env.step_timeout_s ends its sample with
a recorded failure (the row's reward_error), not the run; the controller counts
these like reward failures.

Tokens: the first turn's prompt is the encoded first observation; each turn's
tokens and each observation's (formatted by env.observation_format) go on the
sample's response. A prompt's pictures go with every turn's request: each
request holds one placeholder per picture (the first observation's), which
vLLM widens to the picture's tokens; the sample's prompt ids are the first
turn's widened ones, and each later turn must have seen exactly those plus the
response so far. An observation may not hold a placeholder. The loss mask is
1 on model tokens only, the logprobs of observation tokens are 0, each turn's
reward sits on its last model token (token_rewards), and an observation token
carries the version of the weights loaded when it was appended (it is never
older than the token before it).

Routes (training.routing_replay) are stitched from the turns' requests
(pipeline/core/stitched_routes.py).
"""
from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from pipeline.core.stitched_routes import StitchedRoutes
from pipeline.core.types import Completion, GenerationEngine, Prompt, turn_seed
from pipeline.envs.interface import check_step_result, load_env_class
from pipeline.envs.threads import DaemonThreads


@dataclass
class Episode:
    key: str
    prompt: Prompt
    seed: int | None
    env: Any = None                 # the instance (in process) or the worker index (pool)
    prompt_ids: tuple[int, ...] = ()  # as the engine saw them (each picture widened to its tokens)
    request_ids: tuple[int, ...] = ()  # the first turn's, as sent (one placeholder per picture)
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    token_rewards: list[float] = field(default_factory=list)
    text: str = ""                  # the model's turns, as text, one line each
    transcript: list[dict] = field(default_factory=list)  # every turn, the environment's too (Completion)
    turns: int = 0
    reward: float = 0.0
    error: str = ""
    actions: list[str] = field(default_factory=list)  # the model's turns, as handed to step
    pending: tuple[str, Any] | None = None  # a call waiting for its worker
    lost: bool = False              # its environment died with its worker: rebuild it by replaying `actions`
    waiting: int = 0                # which env call the loop waits for; a later answer is ignored
    deadline: float | None = None
    routes: StitchedRoutes = field(default_factory=StitchedRoutes)


class Episodes:
    """The multi-turn samples of one engine loop. Everything here runs on the
    loop's thread except the environment calls; `post(key, call, outcome)`
    hands an answer back to it (as an `env` command)."""

    def __init__(self, env_cfg, engine: GenerationEngine, post: Callable[[str, int, tuple], None],
                 emit: Callable[..., None], workers=None):
        self.cfg = env_cfg
        self.engine = engine
        self._post, self._emit = post, emit
        self._cls = load_env_class(env_cfg.class_, env_cfg.args)
        self._workers = workers            # pipeline/envs/workers.EnvWorkers, or None: in process
        self._threads = None if workers else DaemonThreads(env_cfg.threads, "env")
        self._live: dict[str, Episode] = {}
        self._requests: dict[str, str] = {}  # engine request key -> sample key
        self._queues: dict[int, deque[str]] = {}  # env.actors > 0: each worker's samples waiting for it
        self._running: dict[int, str] = {}         # ... and the one whose call it runs
        self._calls = 0

    # -- the loop's side ---------------------------------------------------------
    def start(self, key: str, prompt: Prompt, seed: int | None) -> None:
        episode = Episode(key, prompt, seed)
        self._live[key] = episode
        self._call(episode, "reset", prompt)

    def owns(self, request_key: str) -> bool:
        return request_key in self._requests

    def on_turn(self, request_key: str, completion: Completion) -> None:
        """The engine finished a model turn: append it, hand its text to the environment."""
        episode = self._live[self._requests.pop(request_key)]
        if not episode.prompt_ids:
            episode.prompt_ids = completion.prompt_ids
        elif episode.prompt.images and completion.prompt_ids != episode.prompt_ids + tuple(episode.response):
            # The sample is trained on its stitched tokens, pictures widened as at turn 1: they must be
            # what this turn was sampled after.
            raise RuntimeError(f"sample {episode.key}: turn {episode.turns + 1}'s context is not the prompt and "
                               "the turns before it as the sample holds them (its pictures widened differently?)")
        n = len(completion.response_ids)
        episode.response += completion.response_ids
        episode.logprobs += completion.logprobs
        episode.versions += completion.versions or (0,) * n
        episode.mask += [1] * n
        episode.token_rewards += [0.0] * n
        episode.routes.add(completion)
        episode.text += ("\n" if episode.turns else "") + completion.text
        episode.transcript.append({"role": "model", "text": completion.text, "reward": None})
        episode.turns += 1
        self._call(episode, "step", completion.text)

    def on_env(self, key: str, call: int, outcome: tuple, version: int) -> tuple[str, Completion] | None:
        """An environment's answer (`outcome`: ("ok", value) or ("error", reason));
        the sample's final Completion when it is over."""
        if key is None:  # worker `call` was replaced and its successor is up: it takes its queue
            self._running.pop(call, None)
            self._dispatch(call)
            return None
        episode = self._live.get(key)
        if episode is None or call != episode.waiting:
            return None  # the answer of a step that timed out, or of an aborted sample
        episode.deadline = None
        self._free(episode)
        status, value = outcome
        what = "reset" if episode.turns == 0 else f"step of turn {episode.turns}"
        if status == "error":
            return self._end(episode, f"environment {what}: {value}")
        if episode.turns == 0:
            if not isinstance(value, str):
                return self._end(episode, f"environment reset: returned a {type(value).__name__}; expected the "
                                          "first observation as str")
            episode.transcript.append({"role": "env", "text": value, "reward": None})
            episode.request_ids = tuple(self.engine.encode(value))
            return self._next_turn(episode, Prompt(episode.prompt.id, value, episode.prompt.answer,
                                                   token_ids=episode.request_ids, images=episode.prompt.images))
        try:
            observation, reward, done, _info = check_step_result(value)
        except (TypeError, ValueError) as exc:
            return self._end(episode, f"environment {what}: {exc}")
        if episode.token_rewards:
            episode.token_rewards[-1] += reward  # on the turn's last model token
        episode.transcript[-1]["reward"] = reward
        episode.reward += reward
        self._emit("env_step", batch=key.rpartition("/")[0], sample=key, turn=episode.turns, reward=reward,
                   done=done)
        if done or episode.turns >= self.cfg.max_turns:
            return self._end(episode, "")
        shown = self.cfg.observation_format.format(observation=observation)
        try:
            ids = self.engine.encode_continuation(shown)
        except ValueError as exc:  # a picture's placeholder
            return self._end(episode, f"environment {what}: its observation {exc}")
        episode.transcript.append({"role": "env", "text": shown, "reward": None})
        episode.response += ids
        episode.logprobs += [0.0] * len(ids)
        episode.versions += [version] * len(ids)
        episode.mask += [0] * len(ids)
        episode.token_rewards += [0.0] * len(ids)
        # The request's pictures are placeholders again: vLLM widens a prompt's placeholders whatever it holds.
        return self._next_turn(episode, Prompt(episode.prompt.id, "", episode.prompt.answer,
                                               token_ids=episode.request_ids + tuple(episode.response),
                                               images=episode.prompt.images))

    def expire(self, now: float) -> list[tuple[str, Completion]]:
        """Samples whose environment call outlived env.step_timeout_s, ended."""
        late = [e for e in self._live.values() if e.deadline is not None and e.deadline <= now]
        ended = []
        for episode in late:
            if episode.key not in self._live:
                continue  # ended with its worker, a moment ago
            what = "reset" if episode.turns == 0 else f"step of turn {episode.turns}"
            if self._workers is not None:
                # A stuck sandbox would hold up every call queued on its worker: replace it; the
                # other samples it held rebuild their environments by replaying their actions.
                worker = episode.env
                for other in self._workers.replace(worker):
                    if other != episode.key and other in self._live:
                        self._live[other].lost = True
                # Its queue waits for the new worker's start: a start-up is not a slow step.
                self._running[worker] = ""
                self._workers.ready(worker).add_done_callback(lambda _f, w=worker: self._post(None, w, ("ok", None)))
            ended.append(self._end(episode, f"environment {what} timed out after {self.cfg.step_timeout_s:g} s "
                                            "(env.step_timeout_s)"))
        return ended

    def next_deadline(self) -> float | None:
        return min((e.deadline for e in self._live.values() if e.deadline is not None), default=None)

    def tokens_so_far(self, key: str) -> int:
        """Response tokens of the sample before its current turn."""
        episode = self._live.get(key)
        return len(episode.response) if episode else 0

    def segment_of(self, key: str) -> int:
        """An episode is one context throughout."""
        return 1

    def current_request(self, key: str) -> str | None:
        return next((r for r, k in self._requests.items() if k == key), None)

    def abort_all(self) -> None:
        """The engine's requests are gone: forget every sample (late answers are ignored)."""
        for episode in self._live.values():
            self._release(episode)
        self._live.clear()
        self._requests.clear()
        self._queues.clear()
        self._running.clear()

    def close(self) -> None:
        self.abort_all()
        if self._threads is not None:
            self._threads.shutdown()
        if self._workers is not None:
            self._workers.close()

    # -- inside -------------------------------------------------------------------
    def _next_turn(self, episode: Episode, prompt: Prompt) -> tuple[str, Completion] | None:
        request = f"{episode.key}#{episode.turns}"
        try:
            self.engine.add(request, prompt, turn_seed(episode.seed, episode.turns))
        except Exception as exc:  # noqa: BLE001 - e.g. the context outgrew the engine's max_model_len
            return self._end(episode, f"turn {episode.turns + 1} could not start: {type(exc).__name__}: {exc}")
        self._requests[request] = episode.key
        return None

    def _end(self, episode: Episode, error: str) -> tuple[str, Completion]:
        """Only while the sample waits for its environment, or could not start a turn:
        none of its requests is in the engine."""
        self._live.pop(episode.key, None)
        self._release(episode)
        if error:
            self._emit("env_failed", batch=episode.key.rpartition("/")[0], sample=episode.key, reason=error)
        prompt_ids = episode.prompt_ids or self._unseen_prompt(episode)
        return episode.key, Completion(
            prompt_ids=prompt_ids, response_ids=tuple(episode.response), logprobs=tuple(episode.logprobs),
            text=episode.text, versions=tuple(episode.versions), loss_mask=tuple(episode.mask),
            token_rewards=tuple(episode.token_rewards), reward=episode.reward, error=error, turns=episode.turns,
            transcript=tuple(episode.transcript), routes=episode.routes.whole(len(prompt_ids) + len(episode.response)))

    def _unseen_prompt(self, episode: Episode) -> tuple[int, ...]:
        """The prompt ids of a sample that ended before its first turn: without its
        pictures' placeholders, which no engine widened (its row carries no pictures)."""
        return tuple(t for t in self.engine.encode(episode.prompt.text) if t not in self.engine.placeholders)

    def _release(self, episode: Episode) -> None:
        episode.waiting = -1
        if self._workers is not None and episode.env is not None:
            self._workers.forget(episode.env, episode.key)

    def _call(self, episode: Episode, method: str, arg: Any) -> None:
        self._calls += 1
        episode.waiting = self._calls
        if method == "step":
            episode.actions.append(arg)
        episode.pending = (method, arg)
        if self._workers is None:
            self._start(episode)
            return
        if episode.env is None:
            episode.env = self._workers.assign(episode.key)
        self._queues.setdefault(episode.env, deque()).append(episode.key)
        self._dispatch(episode.env)

    def _dispatch(self, worker: int) -> None:
        """Start `worker`'s next queued call once it is free: a worker takes one
        call at a time, and a call's timeout runs from when it starts."""
        queued = self._queues.get(worker, deque())
        while worker not in self._running and queued:
            episode = self._live.get(queued.popleft())
            if episode is not None and episode.pending is not None:
                self._running[worker] = episode.key
                self._start(episode)

    def _free(self, episode: Episode) -> None:
        """Its call was answered: its worker takes the next."""
        if self._workers is not None and self._running.get(episode.env) == episode.key:
            del self._running[episode.env]
            self._dispatch(episode.env)

    def _start(self, episode: Episode) -> None:
        (method, arg), episode.pending = episode.pending, None
        call, key = episode.waiting, episode.key
        episode.deadline = time.monotonic() + self.cfg.step_timeout_s
        if self._workers is not None:
            if episode.lost and method == "step":
                method, arg = "replay", (episode.prompt, episode.actions[:-1], arg)
            episode.lost = False
            future = self._workers.call(episode.env, key, method, arg)
        else:
            future = self._threads.submit(self._in_process, episode, method, arg)
        future.add_done_callback(lambda f: self._post(key, call, _outcome(f)))

    def _in_process(self, episode: Episode, method: str, arg: Any) -> Any:
        if method == "reset":
            episode.env = self._cls(**self.cfg.args)
        return getattr(episode.env, method)(arg)


def _outcome(future: Future) -> tuple[str, Any]:
    exc = future.exception()
    if exc is None:
        return "ok", future.result(timeout=0)  # done: it waits for nothing
    return "error", f"{type(exc).__name__}: {exc}"
