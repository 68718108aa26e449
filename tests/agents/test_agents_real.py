"""Agents on the real CPU stack: vLLM behind the gateway, DeepSpeed training on the
sessions' tokens, the tiny model with a chat template."""
from __future__ import annotations

import json

import pytest

from pipeline.config import load_config
from pipeline.core.events import load_events
from pipeline.run.driver import train
from pipeline.tools.check import check_events

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    from pipeline.inputs.tiny import build_tiny_model
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny_chat", chat_template="plain")


def agent_run(tmp_path, chat_model, *overrides: str) -> tuple[dict, list[dict], list[dict]]:
    cfg = load_config("examples/tiny_grpo.yaml", [
        f"model.path={chat_model}", f"run.output_dir={tmp_path}", "run.name=agent", "run.steps=3",
        "run.checkpoint_every=0", "validation.period=0", "validation.at_end=true", "metrics.tensorboard=false",
        "agent.function=tests.agents.agents_for_tests:two_turns", "generation.max_new_tokens=8", *overrides])
    summary = train(cfg, quiet=True)
    run_dir = tmp_path / "agent"
    metrics = [m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]
    return summary, metrics, load_events(run_dir)


def test_an_agent_run_trains_the_sampled_tokens_with_the_engines_logprobs(tmp_path, ray_session, chat_model):
    summary, metrics, events = agent_run(tmp_path, chat_model, "schedule.max_age=0")
    assert summary["error"] is None and summary["steps"] == 3
    assert check_events(events) == []
    steps = [m for m in metrics if m["step"] >= 0]
    # At age 0 the trainer's logprob of every model token is vLLM's; the rendered follow-ups are masked out.
    assert steps[0]["age_max"] == 0 and steps[0]["is_weight"] == pytest.approx(1.0, abs=1e-5)
    assert all(m["tokens"] == m["model_tokens"] < m["response_tokens"] for m in steps)
    assert [m["reward_failures"] for m in steps] == [0.0] * 3
    requests = [e for e in events if e["ev"] == "agent_request_end"]
    assert requests and {e["request"] for e in requests} == {1, 2}
    assert "val_reward" in metrics[-1]


def test_a_lora_agent_run_with_inflight_refits_samples_only_adapter_versions_it_loaded(tmp_path, ray_session,
                                                                                       chat_model):
    """vLLM's labels of an adapter's versions, as check-events reads them: a
    LoRA run with inflight refits passes (requests that decode across an adapter
    refit among them, when the timing gives some), and a token relabelled with
    an adapter version never loaded while its request decoded is caught."""
    summary, _, events = agent_run(tmp_path, chat_model, "training.lora.rank=8", "training.lr=0.01",
                                   "generation.refit_mode=inflight", "schedule.max_age=1", "run.steps=4")
    assert summary["error"] is None and check_events(events) == []
    # A token relabelled with an adapter version loaded only after its request ended.
    ends = [e for e in events if e["ev"] == "agent_request_end" and e.get("batch") != "val"]
    last = max(e["version"] for e in events if e["ev"] == "refit_end")
    ends[0]["token_versions"][-1][0] = last + 1
    found = check_events(events)
    assert [v.invariant for v in found] == [2] and "which its generator never held while it decoded" in \
        found[0].message


def test_agents_train_with_ppo_on_two_data_parallel_ranks(tmp_path, ray_session, chat_model):
    summary, metrics, events = agent_run(tmp_path, chat_model, "algorithm=ppo", "training.ranks=2",
                                         "schedule.max_age=1")
    assert summary["error"] is None and summary["steps"] == 3
    assert check_events(events) == []
    steps = [m for m in metrics if m["step"] >= 0]
    assert all(m["tokens"] == m["model_tokens"] < m["response_tokens"] for m in steps)
    assert steps[0]["is_weight"] == pytest.approx(1.0, abs=1e-5)  # step 0 trains version-0 samples


# The presets whose losses or sampling read the rows beyond an outcome advantage: token-level
# IS clipping, sequence-level ratios, dynamic sampling, a batch-normalised KL, PPO epochs.
# (dr_grpo and rloo change only the per-sample advantage, which every row has.)
PRESETS = ["tiny_cispo", "tiny_dapo", "tiny_gspo", "tiny_ppo_epochs", "tiny_reinforce_pp"]


@pytest.mark.parametrize("preset", PRESETS)
def test_every_algorithm_preset_trains_an_agent(tmp_path, ray_session, chat_model, preset):
    cfg = load_config(f"examples/{preset}.yaml", [
        f"model.path={chat_model}", f"run.output_dir={tmp_path}", "run.name=p", "run.steps=2",
        "run.checkpoint_every=0", "validation.period=0", "validation.at_end=false", "metrics.tensorboard=false",
        "agent.function=tests.agents.agents_for_tests:two_turns", "generation.max_new_tokens=8"])
    summary = train(cfg, quiet=True)
    assert summary["error"] is None and summary["steps"] == 2
    assert check_events(load_events(tmp_path / "p")) == []


@pytest.fixture(scope="module")
def calling_model(tmp_path_factory):
    """The tiny model with the tool template, warmed up briefly on transcripts that all call the tool."""
    from pipeline.envs.calculator_agent import write_calculator_transcripts
    from pipeline.inputs.tiny import build_tiny_model
    from pipeline.trainer.transcripts import warmup_on_transcripts
    tmp = tmp_path_factory.mktemp("calling")
    base = build_tiny_model(tmp / "base", chat_template="tools")
    write_calculator_transcripts("data/tool_train.jsonl", tmp / "calls.jsonl", guesses=0)
    warmup_on_transcripts(base, tmp / "calls.jsonl", tmp / "model", steps=50, lr=2e-3, batch_size=16,
                          max_new_tokens=32)
    return tmp / "model"


def test_the_agent_recipe_calls_the_tool_through_the_parser_and_trains(tmp_path, ray_session, calling_model):
    cfg = load_config("examples/tiny_agent_grpo.yaml", [
        f"model.path={calling_model}", f"run.output_dir={tmp_path}", "run.name=calc", "run.steps=3",
        "run.checkpoint_every=0", "validation.period=0", "validation.at_end=false", "metrics.samples=4"])
    summary = train(cfg, quiet=True)
    assert summary["error"] is None and summary["steps"] == 3
    events = load_events(tmp_path / "calc")
    assert check_events(events) == []
    finishes = [e["finish"] for e in events if e["ev"] == "agent_request_end"]
    assert finishes.count("tool_calls") >= 8  # sampled calls that the parser read
    samples = [json.loads(line) for line in (tmp_path / "calc" / "samples.jsonl").read_text().splitlines()]
    roles = [[t["role"] for t in c["turns"]] for s in samples for c in s["completions"]]
    assert any(r[:4] == ["user", "model", "tool", "model"] for r in roles), roles[:4]
