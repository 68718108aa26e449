"""Reward models on the real stack: the classifier's scores do not depend on
how samples are batched and it reads a chat conversation in its own template;
a run scores every batch with a classifier, or with an LLM judge on a second
vLLM engine, end to end; and a reward model that does not fit its kind is
refused before any worker starts."""
from __future__ import annotations

import json

import pytest

from pipeline.config import load_config
from pipeline.core.events import load_events
from pipeline.core.types import Prompt
from pipeline.inputs.models import ModelError
from pipeline.inputs.preflight import preflight
from pipeline.inputs.tiny import build_tiny_model, tiny_prompt
from pipeline.run.driver import train
from pipeline.tools.check import check_events

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("rm") / "classifier", seed=3, classifier=True,
                            chat_template="plain")


def test_a_classifiers_score_does_not_depend_on_its_batch(classifier):
    from pipeline.reward_model.classifier import ClassifierScorer
    prompts = [Prompt(f"p{i}", tiny_prompt(c), c) for i, c in enumerate("01010")]
    texts = ["0 0 0", "1", "0000000000 1 1", "", "11 1 1 1 1 1 1 1 1 1"]
    alone = [ClassifierScorer(str(classifier), batch_size=1).score([p], [t])[0] for p, t in zip(prompts, texts)]
    scorer = ClassifierScorer(str(classifier), batch_size=2)
    before = scorer.digest()
    batched = scorer.score(prompts, texts)
    assert all(error == "" for _, error in batched)
    assert [s for s, _ in batched] == pytest.approx([s for s, _ in alone], abs=1e-6)
    assert len({round(s, 6) for s, _ in batched}) == len(texts)   # a real model, not a constant
    too_long = scorer.score(prompts[:2], ["0 " * 600, "1"])
    assert too_long[0][0] == 0.0
    assert too_long[0][1].startswith("prompt p0: ") and "tokens for the reward model, whose context is 512" in \
        too_long[0][1]
    assert too_long[1][0] == pytest.approx(batched[1][0], abs=1e-6) and too_long[1][1] == ""
    assert scorer.digest() == before


def test_a_chat_prompt_reaches_the_classifier_in_its_own_template(classifier):
    from pipeline.reward_model.classifier import ClassifierScorer
    scorer = ClassifierScorer(str(classifier))
    messages = [{"role": "user", "content": "repeat: 1 1 1"}]
    prompt = Prompt("c", "(the policy's rendering)", "1", messages=json.dumps(messages))
    text = scorer.tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": "111"}], tokenize=False)
    assert "<|assistant|>\n111" in text
    assert scorer._ids(prompt, "111") == scorer.tokenizer(text, add_special_tokens=False).input_ids
    assert scorer._ids(Prompt("t", "repeat: 1", "1"), "11") == scorer.tokenizer("repeat: 111").input_ids


@pytest.mark.parametrize("kind", ["classifier", "judge"])
def test_a_run_scores_every_batch_with_its_reward_model(tmp_path, ray_session, tiny_model, classifier, kind):
    judge = build_tiny_model(tmp_path / "judge", seed=5, chat_template="plain") if kind == "judge" else None
    # The classifier's run validates by the task's rule (validation.reward), the judge's by its training reward.
    overrides = {"classifier": ["reward_model.kind=classifier", f"reward_model.path={classifier}", "data.reward=",
                                "validation.reward=pipeline.rewards.rules:tiny_reward"],
                 "judge": ["reward_model.kind=judge", f"reward_model.path={judge}", "reward_model.weight=0.1",
                           "reward_model.output_regex='[0-9]'", "reward_model.max_new_tokens=2"]}[kind]
    cfg = load_config("examples/tiny_grpo.yaml", [
        f"model.path={tiny_model}", f"run.output_dir={tmp_path}", "run.name=rm", "run.steps=4",
        "run.checkpoint_every=0", "validation.period=2", "validation.at_end=false", *overrides])
    summary = train(cfg, quiet=True)
    events = load_events(tmp_path / "rm")
    violations = check_events(events)
    assert violations == [], "\n".join(v.message for v in violations)
    assert summary["error"] is None and summary["accounting"]["reward_failures"] == 0
    scored = {e["batch"] for e in events if e["ev"] == "score_end"}
    assert {b for e in events if e["ev"] == "train_start" for b in e["batches"]} <= scored
    ready = [e for e in events if e["ev"] == "worker_ready" and e["worker"] == "reward_model"]
    checked = [e for e in events if e["ev"] == "weights_checked"]
    assert [e["kind"] for e in ready] == [kind] and [e["weights"] for e in checked] == [ready[0]["weights"]]
    metrics = [json.loads(line) for line in (tmp_path / "rm" / "metrics.jsonl").read_text().splitlines()]
    assert all(m.get("reward_failures", 0) == 0 for m in metrics) and "val_reward" in metrics[-1]
    if kind == "judge":
        # tiny_reward in [0, 1] plus 0.1 x a digit: every sample got a rating.
        assert all(0.0 <= m["reward_mean"] <= 1.9 for m in metrics if m["step"] >= 0)
    else:
        # tiny_reward of greedy completions: a fraction of 16 characters, never the classifier's raw logit.
        assert all(0.0 <= m["val_reward"] <= 1.0 for m in metrics if "val_reward" in m)


@pytest.mark.parametrize("kind,needle", [
    ("classifier", "a classifier reward model is a sequence classifier"),
    ("judge", "a judge is a causal language model")])
def test_a_reward_model_that_does_not_fit_its_kind_is_refused_before_any_worker(tiny_model, classifier, kind,
                                                                                  needle):
    wrong = tiny_model if kind == "classifier" else classifier
    cfg = load_config("examples/tiny_grpo.yaml", [f"model.path={tiny_model}", f"reward_model.kind={kind}",
                                                  f"reward_model.path={wrong}"])
    with pytest.raises(ModelError, match=f"reward_model.path: model directory .*{needle}"):
        preflight(cfg)
