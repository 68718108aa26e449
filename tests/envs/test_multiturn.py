"""Multi-turn rollouts (pipeline/generator/episodes.py) on the simulated engine:
the tokens and masks of a sample, environment failures and timeouts in the
generator's process and in a pool of Ray actors, and whole sim runs."""
from __future__ import annotations

import threading
import time

import pytest

from dags.tokens import Launch
from pipeline.generator.engine_loop import EngineLoop
from pipeline.core.types import Prompt
from pipeline.sim.engines import SimGenerationEngine
from pipeline.config import ConfigError, SimConfig, load_config
from pipeline.core.events import EventLog

pytestmark = pytest.mark.sim

SIM_ENV = "pipeline.sim.env:SimToolEnv"


def env_config(args: str, *extra: str):
    return load_config(None, [f"env.class={SIM_ENV}", f"env.args={args}", "env.max_turns=3", *extra])


class Recorder(SimGenerationEngine):
    """The sim engine, noting when each request is added and finished."""

    def __init__(self, **kw):
        super().__init__(SimConfig(generate_s=0.02, response_len="lognormal", tail_ratio=4), seed=0,
                         max_new_tokens=8, **kw)
        self.trace: list[tuple[str, str]] = []

    def add(self, key, prompt, seed):
        self.trace.append(("add", key))
        super().add(key, prompt, seed)

    def step(self):
        done = super().step()
        self.trace += [("done", key) for key, _ in done]
        return done


def roll(tmp_path, cfg, prompts: int = 4, group: int = 2, workers=None, engine=None):
    """One batch through an engine loop; its completions, in sample order."""
    engine = engine or Recorder()
    delivered, finished = {}, threading.Event()

    def deliver(batch, completions, spans):
        delivered["b0"] = completions
        finished.set()

    def fail(batch, reason):
        delivered["failed"] = reason
        finished.set()
    loop = EngineLoop(engine, EventLog(tmp_path, "gen0", time.time()), deliver, fail, 0, group, cfg.env, workers)
    try:
        launch = Launch("b0", 0, 0, tuple(Prompt(f"p{i}", f"prompt {i}") for i in range(prompts)))
        loop.call("submit", (0, [(launch, list(range(100, 100 + prompts * group)))]), 30, "submit")
        assert finished.wait(60), "the batch never finished"
    finally:
        loop.stop(10)
    assert loop.died is None, loop.died
    assert "failed" not in delivered, delivered.get("failed")
    return delivered["b0"], engine


def test_a_sample_holds_its_turns_with_the_observations_masked(tmp_path):
    completions, _ = roll(tmp_path, env_config("{turns: random, max_turns: 3, latency_s: 0.0, observation_tokens: 5}"))
    assert {c.turns for c in completions} <= {1, 2, 3} and len({c.turns for c in completions}) > 1
    for c in completions:
        n = len(c.response_ids)
        assert len(c.loss_mask) == len(c.logprobs) == len(c.versions) == len(c.token_rewards) == n
        assert c.loss_mask.count(0) == 5 * (c.turns - 1)          # one observation between two turns
        assert all(lp == 0.0 for lp, m in zip(c.logprobs, c.loss_mask) if not m)
        assert c.loss_mask[-1] == 1 and c.token_rewards[-1] == c.reward == sum(c.token_rewards)
        assert c.text.count("\n") == c.turns - 1 and not c.error
        # The transcript: reset's observation, then each model turn and the observation after it.
        roles = ["env"] + ["model", "env"] * (c.turns - 1) + ["model"]
        assert [t["role"] for t in c.transcript] == roles
        assert [t["text"] for t in c.transcript if t["role"] == "env"] == [c.transcript[0]["text"]] + ["ooooo"] * (
            c.turns - 1)
        assert "\n".join(t["text"] for t in c.transcript if t["role"] == "model") == c.text
        assert [t["reward"] for t in c.transcript if t["role"] == "model"][-1] == c.reward


def test_a_sample_that_finishes_a_turn_early_goes_on_without_its_batch(tmp_path):
    """Lognormal response lengths: a sample's second turn starts while others of
    its batch still decode their first."""
    _, engine = roll(tmp_path, env_config("{turns: 2, latency_s: 0.0}"))
    trace = engine.trace
    last_first_turn = max(i for i, (what, key) in enumerate(trace) if what == "done" and key.endswith("#0"))
    first_second_turn = min(i for i, (what, key) in enumerate(trace) if what == "add" and key.endswith("#1"))
    assert first_second_turn < last_first_turn


@pytest.mark.parametrize("fail,extra", [("raise", ()), ("hang", ("env.step_timeout_s=0.5",))])
def test_a_failing_or_stuck_environment_ends_only_its_sample(tmp_path, fail, extra):
    cfg = env_config(f"{{turns: 2, latency_s: 0.0, fail: {fail}, fail_every: 2}}", *extra)
    completions, _ = roll(tmp_path, cfg)
    failed = {i // 2 for i, c in enumerate(completions) if c.error}
    assert failed == {0, 2}  # prompts p0 and p2: every second prompt, both of their samples
    for i, c in enumerate(completions):
        if c.error:
            assert ("injected tool failure" in c.error) if fail == "raise" else ("timed out after 0.5 s" in c.error)
            assert c.turns == 1
        else:
            assert c.turns == 2


STUCK_CALL_THEN_EXIT = """
import threading
from pipeline.envs.threads import DaemonThreads
threads = DaemonThreads(4, "env")
stuck = threads.submit(threading.Event().wait)        # a tool call that never returns
assert threads.submit(lambda a, b: a + b, 2, 3).result(10) == 5
threads.shutdown()
print("exiting", flush=True)
"""


def test_a_stuck_in_process_call_does_not_hold_the_process_exit():
    """A stuck step's thread is abandoned (the sample fails at env.step_timeout_s);
    the generator's process must still exit, which a ThreadPoolExecutor's thread,
    joined at interpreter exit, would block for as long as the call hangs."""
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-c", STUCK_CALL_THEN_EXIT], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "exiting" in proc.stdout, proc.stderr


def test_daemon_threads_give_results_errors_and_cancel_what_has_not_started():
    from pipeline.envs.threads import DaemonThreads
    threads, release = DaemonThreads(1, "env"), threading.Event()
    first = threads.submit(release.wait)
    queued = [threads.submit(lambda: "never"), threads.submit(lambda: 1 / 0)]
    threads.shutdown()
    assert all(f.cancelled() for f in queued) and not first.done()
    release.set()
    assert first.result(10) is True
    with pytest.raises(RuntimeError, match="after shutdown"):
        threads.submit(lambda: None)
    threads = DaemonThreads(2, "env")
    try:
        with pytest.raises(ZeroDivisionError):
            threads.submit(lambda: 1 / 0).result(10)
        assert [threads.submit(pow, 2, n).result(10) for n in range(3)] == [1, 2, 4]
    finally:
        threads.shutdown()


class BadStep:
    def reset(self, prompt):
        return prompt.text

    def step(self, action):
        return "not a tuple"


def test_a_malformed_step_result_is_a_failure_naming_the_shape(tmp_path):
    cfg = load_config(None, ["env.class=tests.envs.test_multiturn:BadStep", "env.max_turns=2"])
    completions, _ = roll(tmp_path, cfg, prompts=1)
    assert all("must return (observation, reward, done, info)" in c.error for c in completions)


def test_the_pool_replaces_a_stuck_worker_and_replays_the_others(tmp_path, ray_session):
    from pipeline.envs.workers import EnvWorkers
    cfg = env_config("{turns: 2, latency_s: 0.0, fail: hang, fail_every: 3}", "env.actors=2",
                     "env.step_timeout_s=1")
    workers = EnvWorkers(cfg.env, "gen0")
    workers.wait_ready(60)
    completions, _ = roll(tmp_path, cfg, workers=workers)
    failed = sorted(i for i, c in enumerate(completions) if c.error)
    assert failed == [0, 1, 6, 7]  # p0 and p3; the samples queued behind them finish on the new workers
    assert workers.replaced >= 1
    assert all(c.turns == 2 and c.reward is not None for i, c in enumerate(completions) if i not in failed)


def test_a_bad_env_class_is_a_config_error_naming_it():
    with pytest.raises(ConfigError, match=r"env\.class: 'pipeline\.sim\.env:Nope'.*no attribute 'Nope'"):
        load_config(None, ["env.class=pipeline.sim.env:Nope"])
    with pytest.raises(ConfigError, match=r"env\.class: 'no_such_module:Env'.*cannot import"):
        load_config(None, ["env.class=no_such_module:Env"])
    with pytest.raises(ConfigError, match=r"env\.class.*not a class"):
        load_config(None, ["env.class=pipeline.sim.env:sim_reward"])
    with pytest.raises(ConfigError, match=r"env\.class.*cannot be built with env\.args"):
        load_config(None, [f"env.class={SIM_ENV}", "env.args={nope: 1}"])
    with pytest.raises(ConfigError, match=r"env\.max_turns: 3 needs an environment"):
        load_config(None, ["env.max_turns=3"])
    with pytest.raises(ConfigError, match=r"env\.observation_format"):
        load_config(None, [f"env.class={SIM_ENV}", "env.observation_format={obs}"])


def test_the_cli_refuses_a_bad_env_class_before_any_worker_starts(tmp_path, capsys):
    from pipeline.__main__ import main
    code = main(["train", "--config", "examples/sim_grpo.yaml", "env.class=pipeline.sim.env:Nope",
                 f"run.output_dir={tmp_path}"])
    assert code == 2 and "env.class" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # no run directory: nothing started


def sim_run(tmp_path, name, *overrides):
    from pipeline.run.driver import train
    from pipeline.core.events import load_events
    from pipeline.tools.check import check_events
    cfg = load_config(None, [f"run.output_dir={tmp_path}", f"run.name={name}", "run.deadline_s=30",
                             "run.dag_mode=classic", "metrics.tensorboard=false", "sim.generate_s=0.02",
                             "sim.train_s=0.01", f"env.class={SIM_ENV}", "env.max_turns=3", *overrides])
    summary = train(cfg, quiet=True)
    events = load_events(tmp_path / name)
    violations = check_events(events)
    assert violations == [], "\n".join(v.message for v in violations)
    return summary, events


def test_ppo_inflight_with_a_pool_runs_clean_and_conserves_batches(tmp_path, ray_session):
    summary, events = sim_run(tmp_path, "ppo", "algorithm=ppo", "generation.refit_mode=inflight", "run.steps=5",
                              "schedule.max_age=2", "env.actors=2", "validation.period=2",
                              "env.args={turns: random, max_turns: 3, latency_s: 0.02, latency: lognormal}")
    acc = summary["accounting"]
    assert acc["balanced"] and acc["trained"] == acc["launched"] == 5 and acc["reward_failures"] == 0
    turns = [t for e in events if e["ev"] == "rollout_end" for t in e["turns"]]
    assert set(turns) == {1, 2, 3}
    assert any(e["ev"] == "env_step" and e["batch"] == "val" for e in events)  # validation plays the env too


def test_environment_failures_count_like_reward_failures_then_stop_the_run(tmp_path, ray_session):
    from pipeline.run.runner import PipelineError
    summary, _ = sim_run(tmp_path, "ok", "run.steps=3", "fault.max_reward_failures=100",
                         "env.args={turns: 2, latency_s: 0.0, fail: raise, fail_every: 4}")
    assert summary["accounting"]["reward_failures"] > 0 and summary["error"] is None
    with pytest.raises(PipelineError, match=r"failed on \d+ samples, more than fault.max_reward_failures \(0\).*"
                                            r"injected tool failure"):
        sim_run(tmp_path, "stops", "run.steps=3", "env.args={turns: 2, latency_s: 0.0, fail: raise, fail_every: 4}")


def test_a_multi_turn_sample_is_written_with_its_turns(tmp_path, ray_session):
    """samples.jsonl (metrics.samples) lists each sample's turns in order, who spoke
    and the reward of each action; validation's too, since it plays the environment."""
    import json
    sim_run(tmp_path, "turns", "run.steps=3", "validation.period=2", "metrics.samples=2",
            "env.args={turns: random, max_turns: 3, latency_s: 0.0, observation_tokens: 3}")
    samples = [json.loads(line) for line in (tmp_path / "turns" / "samples.jsonl").read_text().splitlines()]
    assert [(s["step"], s["kind"]) for s in samples] == [(0, "train")] * 2 + [(1, "train")] * 2 + [(1, "val")] * 2 \
        + [(2, "train")] * 2
    counts = set()
    for c in (c for s in samples for c in s["completions"]):
        turns = c["turns"]
        model = [t for t in turns if t["role"] == "model"]
        counts.add(len(model))
        assert [t["role"] for t in turns] == ["env"] + ["model", "env"] * (len(model) - 1) + ["model"]
        assert turns[0]["text"].startswith("simulated prompt ") and all(
            t["text"] == "ooo" for t in turns[1:] if t["role"] == "env")
        assert "\n".join(t["text"] for t in model) == c["text"]
        assert sum(t["reward"] for t in model) == pytest.approx(c["reward"])
    assert counts == {1, 2, 3}


class Routing(Recorder):
    """The sim engine as vLLM answers with routes (training.routing_replay): a
    request's prompt ids are its whole context, and its routes one byte a
    position, the number of the turn whose request computed it, from 1."""

    def __init__(self, refuse_turn: int | None = None):
        super().__init__()
        self.refuse_turn = refuse_turn
        self.contexts: dict[str, tuple[int, ...]] = {}

    def add(self, key, prompt, seed):
        if self.refuse_turn is not None and key.endswith(f"#{self.refuse_turn}"):
            raise ValueError("the context outgrew max_model_len")
        self.contexts[key] = prompt.token_ids or (1, 2, 3)
        super().add(key, prompt, seed)

    def step(self):
        from dataclasses import replace
        out = []
        for key, c in super().step():
            context, turn = self.contexts.pop(key), int(key.rpartition("#")[2]) + 1
            out.append((key, replace(c, prompt_ids=context,
                                     routes=bytes([turn]) * (len(context) + len(c.response_ids) - 1))))
        return out


def test_a_samples_routes_are_stitched_from_its_turns_each_position_as_first_computed(tmp_path):
    completions, _ = roll(tmp_path, env_config("{turns: 3, latency_s: 0.0, observation_tokens: 5}"),
                          engine=Routing())
    for c in completions:
        assert len(c.routes) == len(c.prompt_ids) + len(c.response_ids) - 1
        # Turn t's request first computed its own tokens but the last, and the observation before it.
        turn_ends = [i for i, m in enumerate(c.loss_mask) if m and (i + 1 == len(c.loss_mask) or not c.loss_mask[i + 1])]
        expected, start = [], 0
        for t, end in enumerate(turn_ends, 1):
            stop = len(c.prompt_ids) + end
            expected += [t] * (stop - start)
            start = stop
        assert list(c.routes) == expected


def test_a_sample_whose_next_turn_could_not_start_has_no_routes(tmp_path):
    completions, _ = roll(tmp_path, env_config("{turns: 2, latency_s: 0.0, observation_tokens: 5}"),
                          engine=Routing(refuse_turn=1))
    assert all(c.error.startswith("turn 2 could not start") and c.routes == b"" for c in completions)
