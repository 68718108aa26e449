"""Distillation beside the other ways a run trains, on the real stack: a LoRA
student trains on a full teacher's advantage; multi-turn (a tool env) and
agent samples are taught on the model's tokens only.

A student taught by its own initial weights at age 0 is the sharpest check of
where the teacher's logprobs land: on every model token the teacher's logprob
is the one the student sampled with, so the step-0 KL is round-off, and an
environment's or a tool's token (logprob 0 in the rollout, far from 0 under
the teacher) counted in it, or a teacher logprob one token off, would make it
order 1. Data-parallel ranks: tests/distill/test_distill_ranks.py."""
from __future__ import annotations

import json

import pytest

from pipeline.config import load_config
from pipeline.core.events import load_events
from pipeline.inputs.tiny import build_tiny_model
from pipeline.run.driver import train
from pipeline.tools.check import check_events

pytestmark = pytest.mark.real

# vLLM's sampling logprob against the teacher's transformers forward, both fp32.
ROUND_OFF_KL = 1e-3
RUN = ["run.checkpoint_every=0", "validation.period=0", "validation.at_end=false", "metrics.tensorboard=false"]


def run_steps(recipe: str, tmp_path, *overrides: str) -> list[dict]:
    """Train the recipe; every step's metrics, after the event log passed check-events."""
    cfg = load_config(recipe, [f"run.output_dir={tmp_path}", "run.name=d", *RUN, *overrides])
    summary = train(cfg, quiet=True)
    assert summary["error"] is None and summary["teacher_restarts"] == 0
    violations = check_events(load_events(tmp_path / "d"))
    assert violations == [], "\n".join(v.message for v in violations)
    lines = (tmp_path / "d" / "metrics.jsonl").read_text().splitlines()
    return [m for m in map(json.loads, lines) if m["step"] >= 0]


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("teacher") / "teacher", seed=1)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny_chat", chat_template="plain")


@pytest.mark.parametrize("loss,metric,apart", [("sampled_reverse_kl", "distill/kl", 0.01),
                                                ("topk_kl", "distill/topk_kl", 1e-4)])
def test_a_lora_student_trains_on_a_full_teacher_alone(tmp_path, ray_session, tiny_model, teacher, loss, metric,
                                                      apart):
    # Pure distillation with no task reward and no KL term in the loss: the teacher's advantage
    # (sampled_reverse_kl) or its top-k term (topk_kl) is the only gradient, so every step's adapter
    # update is the teacher's doing. (The KL to a teacher falls over tens of steps,
    # docs/distillation.md; a test's few steps move it by noise, LoRA or not.)
    steps = run_steps("examples/tiny_grpo_lora.yaml", tmp_path, f"model.path={tiny_model}",
                      f"distill.teacher={teacher}", f"distill.loss={loss}", "distill.task_reward=false",
                      "data.reward=", "policy_loss.kl_coef=0", "run.steps=3")
    assert len(steps) == 3 and steps[0][metric] > apart, steps  # two random models, apart
    assert all(m["grad_norm"] > 0 for m in steps), steps


def test_a_tool_env_is_taught_on_the_models_tokens_only(tmp_path, ray_session, tiny_model):
    # The untrained tiny model's turns are malformed: the env answers each, up to 3 turns.
    steps = run_steps("examples/tiny_tool_grpo.yaml", tmp_path, f"model.path={tiny_model}",
                      f"distill.teacher={tiny_model}", "schedule.max_age=0", "run.steps=2")
    first = steps[0]
    assert first["model_tokens"] < first["response_tokens"]  # the env's observations are in the samples
    assert abs(first["distill/kl"]) < ROUND_OFF_KL, first["distill/kl"]


def test_an_agent_is_taught_on_the_models_tokens_only(tmp_path, ray_session, chat_model):
    steps = run_steps("examples/tiny_grpo.yaml", tmp_path, f"model.path={chat_model}",
                      f"distill.teacher={chat_model}", "agent.function=tests.agents.agents_for_tests:two_turns",
                      "generation.max_new_tokens=8", "schedule.max_age=0", "run.steps=2")
    first = steps[0]
    assert first["model_tokens"] < first["response_tokens"]  # the rendered follow-up is in the samples
    assert abs(first["distill/kl"]) < ROUND_OFF_KL, first["distill/kl"]
