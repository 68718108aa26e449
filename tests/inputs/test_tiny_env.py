"""The tiny repeat task as a one-turn environment, which the distillation teacher is warmed up on
(pipeline/inputs/tiny_env.py; no Ray, no vLLM)."""
from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.core.types import Prompt
from pipeline.inputs.tiny_env import RepeatEnv
from pipeline.inputs.datasets import load_prompts
from pipeline.rewards.rules import tiny_reward

pytestmark = pytest.mark.unit

DATA = Path(__file__).resolve().parents[2] / "data"


@pytest.mark.parametrize("action", ["1111", "1101", "", "0 0", "x"])
def test_one_turn_pays_the_tasks_reward(action):
    prompt = Prompt("r", "repeat: 1 1 1 1 1 1 1 1", "1")
    env = RepeatEnv()
    assert env.reset(prompt) == prompt.text
    assert env.step(action) == ("", tiny_reward(prompt, action), True, {"valid": True})
    with pytest.raises(RuntimeError, match="before reset"):
        env.step(action)


def test_bad_lengths_are_refused():
    with pytest.raises(ValueError, match="shortest 0 and longest 4"):
        RepeatEnv(shortest=0, longest=4)
    with pytest.raises(ValueError, match="shortest 9 and longest 8"):
        RepeatEnv(shortest=9, longest=8)


def test_every_training_prompts_demonstration_is_a_run_that_fits_and_scores_1(tiny_model):
    from transformers import AutoTokenizer

    from pipeline.trainer.warmup import expert_episode
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    lengths = set()
    for prompt in load_prompts(DATA / "tiny_train.jsonl", kind="train"):
        ep = expert_episode(RepeatEnv, {}, prompt, tokenizer)  # refuses a turn over 16 tokens with </s>
        context = tokenizer(prompt.text).input_ids
        turn = ep.ids[len(context):]
        assert ep.ids[:len(context)] == context and ep.mask == [0] * len(context) + [1] * len(turn)
        assert turn[-1] == tokenizer.eos_token_id and (ep.reward, ep.turns, ep.done) == (1.0, 1, True)
        text = tokenizer.decode(turn, skip_special_tokens=True)
        assert set(text) == {prompt.answer}
        lengths.add(len(text))
    assert min(lengths) == 32 and max(lengths) == 48
