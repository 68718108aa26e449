"""A generator's engine loop: the one thread that drives its engine.

The generator's nodes never call the engine; they hand the loop a command and
wait for its answer (a handshake inside the generator's leaf: the order of
refit, validation and rollouts is still the graph's, since only those nodes
send commands):

    submit     collect's batches: added to the engine, rollout_start logged
    wait_idle  a draining refit: answered once no rollout is in flight
    install    a refit's load, run between two engine steps (its spans go back with the answer)
    validate   validation requests (each its seed and temperature), decoded beside whatever else runs
    env        an environment's answer for a multi-turn sample (posted by the
               environment's thread or worker, pipeline/generator/episodes.py):
               its next turn is added, or the sample is complete
    chat       an agent's request from the gateway (pipeline/agents/gateway.py):
               its turn is added to its session's context, answered when decoded
    agent_end  an agent returned or raised (pipeline/agents/runner.py): its sample is complete

Between commands the loop steps the engine while it has requests, so batches
of several collects decode together and a load lands between two steps with
the requests in flight going on (refit_mode inflight). Each finished batch is
handed to `deliver` on this thread, which scores and puts it.

Clocks (pipeline/core/events.py) follow the data, not the loop's turns: the
rollouts log on the loop's lane (`<worker>/rollouts`) after the collect that
submitted them, and a drain's answer carries that lane; a load logs its
refit_start and refit_end on the lane of the refit that sent it. So the
clocks show a rollout after a refit only where the graph put it there, never
because the loop happened to take the two commands in that order.
"""
from __future__ import annotations

import queue
import threading
import time
import traceback
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from dags.tokens import Clock, Launch
from pipeline.generator.episodes import Episodes
from pipeline.core.types import Completion, GenerationEngine
from pipeline.core import spans
from pipeline.core.events import EventLog


@dataclass
class InFlight:
    """A launched batch in the engine: its requests' keys, its completions so far."""
    launch: Launch
    version: int                       # the weights it was launched with
    keys: tuple[str, ...]
    done: dict[str, Completion] = field(default_factory=dict)


class FirstError:
    """The first failure since a refit last took it. Set on the loop's thread,
    taken on a refit's: one lock over both, so a failure set between a read
    and a clear is never lost."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._error: str | None = None

    def record(self, error: str) -> bool:
        """Keep `error` unless an earlier one waits; True if kept."""
        with self._lock:
            if self._error is not None:
                return False
            self._error = error
            return True

    def take(self) -> str | None:
        with self._lock:
            error, self._error = self._error, None
        return error


@dataclass
class _Command:
    kind: str
    payload: Any
    clock: Clock
    lane: str           # the sender's
    reply: Future


class EngineLoop:
    """`deliver(batch, completions, spans)`: a finished batch (completions in
    launch order, the loop's spans since the last delivery); `fail(batch, reason)`: a batch the engine lost. Both run on
    the loop's thread, on its lane."""

    def __init__(self, engine: GenerationEngine, log: EventLog, deliver: Callable, fail: Callable,
                 version: int, group_size: int, env=None, env_workers=None, agents: Callable | None = None):
        """`env` (an EnvConfig with a class): samples are multi-turn episodes
        (pipeline/generator/episodes.py), their environments in `env_workers` or in
        this process. `agents(emit, version)`: samples are agents' sessions
        (pipeline/agents/sessions.py), built with the loop's event emitter and its weights' version."""
        self.engine, self.log = engine, log
        self._deliver, self._fail = deliver, fail
        self.version = version
        self.group_size = group_size
        self.errors = FirstError()
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._batches: dict[str, InFlight] = {}
        self._validation: tuple[list[str], dict[str, Completion], _Command] | None = None
        self._idle_waiters: list[Future] = []
        self._busy_s = 0.0
        self._stopped = False
        self.died: str | None = None
        self.lane = f"{log.worker}/rollouts"
        self.episodes = Episodes(env, engine, self._post_env, self._emit_env, env_workers) if env is not None \
            else agents(self._emit_env, lambda: self.version) if agents is not None else None
        self.thread = threading.Thread(target=self._run, name=self.lane, daemon=True)
        self.thread.start()

    # -- what the nodes call: a command and a wait for its answer ----------------
    def call(self, kind: str, payload: Any, timeout_s: float, what: str) -> Any:
        if self.died is not None:
            raise RuntimeError(f"{what}: the engine loop died: {self.died}")
        reply: Future = Future()
        self._commands.put(_Command(kind, payload, self.log.now(), self.log.current_lane(), reply))
        try:
            answer, clock = reply.result(timeout=timeout_s)
        except TimeoutError:
            raise TimeoutError(f"{what}: the engine loop did not answer within {timeout_s:.0f} s "
                               "(run.deadline_s)") from None
        self.log.merge(clock)
        return answer

    def chat(self, session_id: str, request: Any) -> Future:
        """An agent's request (the gateway's thread): answered once its turn is decoded."""
        reply: Future = Future()
        if self.died is not None:
            reply.set_exception(RuntimeError(f"the engine loop died: {self.died}"))
        else:
            self._commands.put(_Command("chat", (session_id, request), (), self.lane, reply))
        return reply

    def agent_done(self, key: str, outcome: tuple) -> None:
        """An agent returned or raised (its runner's thread)."""
        self._commands.put(_Command("agent_end", (key, outcome), (), self.lane, Future()))

    def in_flight(self) -> int:
        return len(self._batches)

    def stop(self, timeout_s: float) -> None:
        """Abort whatever is in flight (a pooled actor's last run) and end the thread."""
        if self.thread.is_alive():
            self._commands.put(_Command("stop", None, (), self.lane, Future()))
            self.thread.join(timeout=timeout_s)

    # -- the loop ---------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._serve()
        except Exception as exc:  # a bug or a dead controller: every waiting node must hear of it
            traceback.print_exc()  # the actor's log keeps where
            self.died = f"{type(exc).__name__}: {exc}"
            while True:
                try:
                    reply = self._commands.get(block=False).reply
                except queue.Empty:
                    break
                if not reply.cancelled():  # an agent's request whose client went away
                    reply.set_exception(RuntimeError(self.died))
            for reply in self._idle_waiters:
                reply.set_exception(RuntimeError(self.died))

    def _serve(self) -> None:
        with self.log.lane(self.lane):
            while not self._stopped:
                # Block for a command only when there is nothing to decode.
                self._take_commands(block=not self.engine.busy())
                if self.episodes is not None:
                    for key, completion in self.episodes.expire(time.monotonic()):
                        self._finished(key, completion)
                if self._stopped:
                    break
                if self.engine.busy():
                    self._step()
                if not self._batches:
                    self._answer_idle()
            # What is left belongs to a run that is over: its controller is not told.
            self.engine.abort_all()
            if self.episodes is not None:
                self.episodes.close()

    def _take_commands(self, block: bool) -> None:
        while True:
            # An environment call may time out while nothing else happens.
            deadline = self.episodes.next_deadline() if block and self.episodes is not None else None
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                # Not kept in a local past its handling: a refit's command holds that
                # version's weights, which the wait for the next command would pin.
                self._handle(self._commands.get(block=block, timeout=timeout))
            except queue.Empty:
                return
            block = False

    def _handle(self, command: _Command) -> None:
        try:
            answer = getattr(self, f"_on_{command.kind}")(command)
        except Exception as exc:  # the engine's or the user's: the node that asked raises it
            if not command.reply.cancelled():  # an agent's request whose client went away
                command.reply.set_exception(exc)
            return
        if answer is not _LATER:
            command.reply.set_result(answer)

    def _on_stop(self, _command: _Command) -> None:
        self._stopped = True
        return None, ()

    def _on_submit(self, command: _Command) -> tuple[float, Clock]:
        """Add the batches' requests (seeds: one per request) for the weights of
        `version` (collect checked the engine holds them), after the collect;
        answer with the generating time since the last submit, for the Ticket."""
        version, launches = command.payload
        self.log.merge(command.clock)
        for launch, seeds in launches:
            keys = tuple(f"{launch.batch_id}/{i}" for i in range(len(seeds)))
            self.log.emit("rollout_start", step=launch.target, version=version, batch=launch.batch_id,
                          target=launch.target)
            self._batches[launch.batch_id] = InFlight(launch, version, keys)
            try:
                prompts = [p for p in launch.prompts for _ in range(self.group_size)]
                for key, prompt, seed in zip(keys, prompts, seeds):
                    self._add(key, prompt, seed)
            except Exception as exc:
                self._lose_everything(exc)  # this batch and the ones before it; the rest are not added
                break
        busy, self._busy_s = self._busy_s, 0.0
        return busy, self.log.now()

    def _on_wait_idle(self, command: _Command) -> object:
        """Answered, with the rollouts' lane, once no batch is in flight."""
        if self._batches:
            self._idle_waiters.append(command.reply)
            return _LATER
        return None, self.log.now()

    def _on_install(self, command: _Command) -> tuple[dict, Clock]:
        """Load new weights now, between two steps; the requests in flight go on
        with them. Logged with, per batch in flight, the tokens each of its
        requests had when the load landed: those before are the old version's,
        those after the new one's (pipeline/tools/check_order.py checks it)."""
        load, step, version = command.payload
        profile: dict[str, float] = {}   # the load's spans: the refit node's, not the rollouts'
        with self.log.lane(command.lane, command.clock):
            positions = self._positions()
            self.log.emit("refit_start", step=step, version=self.version)
            with spans.apart(profile):
                load()
            self.engine.set_version(version)
            self.version = version
            self.log.emit("refit_end", step=step, version=version, positions=positions, **self._segments())
            return profile, self.log.now()

    def _on_validate(self, command: _Command) -> object:
        """Validation requests, (prompt, seed, temperature) each, decoded beside
        the rollouts; the answer carries the validate node's own clock back:
        the loop's turns order nothing."""
        keys = [f"val/{i}" for i in range(len(command.payload))]
        for key, (prompt, seed, temperature) in zip(keys, command.payload):
            self._add(key, prompt, seed, temperature)
        self._validation = (keys, {}, command)
        return _LATER

    def _on_env(self, command: _Command) -> object:
        """An environment's answer: the sample's next turn is added, or it is over."""
        key, call, outcome = command.payload
        finished = self.episodes.on_env(key, call, outcome, self.version)
        if finished is not None:
            self._finished(*finished)
        return _LATER  # nobody waits for it

    def _on_chat(self, command: _Command) -> object:
        session_id, request = command.payload
        self.episodes.on_chat(session_id, request, command.reply)
        return _LATER  # answered by the session, once decoded (or refused)

    def _on_agent_end(self, command: _Command) -> object:
        finished = self.episodes.on_agent_end(*command.payload)
        if finished is not None:
            self._finished(*finished)
        return _LATER  # nobody waits for it

    def _post_env(self, key: str, call: int, outcome: tuple) -> None:
        self._commands.put(_Command("env", (key, call, outcome), (), self.lane, Future()))

    def _emit_env(self, kind: str, batch: str, **fields) -> None:
        launch = self._batches[batch].launch if batch in self._batches else None
        self.log.emit(kind, step=None if launch is None else launch.target, version=self.version, batch=batch,
                      **fields)

    def _add(self, key: str, prompt, seed: int | None, temperature: float | None = None) -> None:
        """`temperature`: a validation set's (None: generation.temperature); an episode's turns
        decode at generation.temperature, which config checks hold a sampled set's to."""
        if self.episodes is None:
            self.engine.add(key, prompt, seed, temperature=temperature)
        else:
            self.episodes.start(key, prompt, seed)

    def _positions(self) -> dict[str, list[int]]:
        progress = self.engine.progress()

        def tokens(batch: InFlight, key: str) -> int:
            if key in batch.done:
                return len(batch.done[key].response_ids)
            if self.episodes is None:
                return progress.get(key, 0)
            request = self.episodes.current_request(key)
            return self.episodes.tokens_so_far(key) + (progress.get(request, 0) if request else 0)
        return {b.launch.batch_id: [tokens(b, k) for k in b.keys] for b in self._batches.values()}

    def _segments(self) -> dict:
        """An agent's sample may start a new segment after a refit, and only its
        last is trained: the refit's positions count tokens of the segment then
        current, logged beside them where any is past the first."""
        segments = {b.launch.batch_id: [b.done[k].segments if k in b.done else self.episodes.segment_of(k)
                                        for k in b.keys] for b in self._batches.values()} \
            if self.episodes is not None else {}
        return {"segments": segments} if any(n != 1 for each in segments.values() for n in each) else {}

    def _step(self) -> None:
        started = time.perf_counter()
        try:
            finished = self.engine.step()
        except Exception as exc:
            self._lose_everything(exc)
            return
        finally:
            self._busy_s += time.perf_counter() - started
        for key, completion in finished:
            if self.episodes is not None and self.episodes.owns(key):
                self.episodes.on_turn(key, completion)  # its environment decides what comes next
            else:
                self._finished(key, completion)

    def _finished(self, key: str, completion: Completion) -> None:
        """A sample is complete (all its turns): its batch is delivered once every sample is."""
        batch_id = key.rpartition("/")[0]
        if batch_id == "val":
            keys, done, command = self._validation
            done[key] = completion
            if len(done) == len(keys):
                self._validation = None
                command.reply.set_result(([done[k] for k in keys], command.clock))
            return
        batch = self._batches[batch_id]
        batch.done[key] = completion
        if len(batch.done) == len(batch.keys):
            del self._batches[batch_id]
            self._deliver(batch, [batch.done[k] for k in batch.keys], spans.take())

    def _lose_everything(self, exc: Exception) -> None:
        """A failed engine call: every request in flight is lost with it."""
        reason = f"{type(exc).__name__}: {exc}"
        self.errors.record(f"batches {sorted(self._batches)}: {reason}")
        if self._validation is not None:
            self._validation[2].reply.set_exception(exc)
            self._validation = None
        self._abort(f"failed: {reason}")

    def _abort(self, reason: str) -> None:
        self.engine.abort_all()
        if self.episodes is not None:
            self.episodes.abort_all()
        lost, self._batches = list(self._batches.values()), {}
        for batch in lost:
            self._fail(batch, reason)
        self._answer_idle()

    def _answer_idle(self) -> None:
        waiters, self._idle_waiters = self._idle_waiters, []
        for reply in waiters:
            reply.set_result((None, self.log.now()))


_LATER = object()  # a command answered later, from the loop (a drain, a validation)
