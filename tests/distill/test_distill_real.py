"""Distillation on the real stack: the teacher's forward gives each response
token's logprob whatever the batching; a tiny student learns from a tiny
teacher (another seed, the same tokenizer) end to end; a teacher whose
tokenizer is not the student's is refused before any worker starts; the
top-k loss trains end to end."""
from __future__ import annotations

import json
import math

import pytest

from pipeline.config import load_config
from pipeline.core.events import load_events
from pipeline.inputs.models import ModelError
from pipeline.inputs.preflight import preflight
from pipeline.inputs.tiny import build_tiny_model, build_tokenizer
from pipeline.run.driver import train
from pipeline.tools.check import check_events

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("teacher") / "teacher", seed=1)


def test_the_teachers_logprobs_do_not_depend_on_its_batch(teacher):
    import torch
    from pipeline.distill.forward import TeacherForward
    forward = TeacherForward(str(teacher), batch_size=2, topk=4)
    prompts, responses = [[1, 5, 6], [1, 7], [1, 8, 9, 10]], [[11, 12], [13, 14, 15, 16], []]
    batched = forward.score(prompts, responses)
    alone = [TeacherForward(str(teacher), batch_size=1, topk=4).score([p], [r]) for p, r in zip(prompts, responses)]
    assert [len(r) for r in batched.logprobs] == [len(r) for r in batched.topk_ids] == [2, 4, 0]
    assert all(math.isfinite(x) and x < 0 for row in batched.logprobs for x in row)
    for i, one in enumerate(alone):
        assert batched.logprobs[i] == pytest.approx(one.logprobs[0], abs=1e-5)
        assert batched.topk_ids[i] == one.topk_ids[0]
    # The first response token's logprob and top-k by hand: the logits after the whole prompt.
    with torch.inference_mode():
        logits = forward.model(input_ids=torch.tensor([prompts[0] + responses[0]])).logits[0]
    logp = torch.log_softmax(logits[2], -1)
    assert batched.logprobs[0][0] == pytest.approx(logp[11].item(), abs=1e-5)
    assert batched.topk_ids[0][0] == logp.topk(4).indices.tolist()
    assert batched.topk_logprobs[0][0] == pytest.approx(logp.topk(4).values.tolist(), abs=1e-5)
    assert TeacherForward(str(teacher)).score(prompts, responses).topk_ids is None


def test_a_student_learns_from_the_teacher_end_to_end(tmp_path, ray_session, tiny_model, teacher):
    cfg = load_config("examples/tiny_grpo.yaml", [
        f"model.path={tiny_model}", f"distill.teacher={teacher}", "distill.kl_clip=5", f"run.output_dir={tmp_path}",
        "run.name=distill", "run.steps=3", "run.checkpoint_every=0", "validation.period=0", "validation.at_end=false"])
    summary = train(cfg, quiet=True)
    events = load_events(tmp_path / "distill")
    violations = check_events(events)
    assert violations == [], "\n".join(v.message for v in violations)
    assert summary["error"] is None and summary["teacher_restarts"] == 0
    taught = {e["batch"] for e in events if e["ev"] == "teach_end"}
    assert {b for e in events if e["ev"] == "train_start" for b in e["batches"]} <= taught
    metrics = [json.loads(line) for line in (tmp_path / "distill" / "metrics.jsonl").read_text().splitlines()]
    kls = [m["distill/kl"] for m in metrics if "distill/kl" in m]
    # Two different random models: the student's sampled tokens are far likelier under itself.
    assert len(kls) == 3 and all(math.isfinite(k) and k > 0 for k in kls)
    ready = [e for e in events if e["ev"] == "worker_ready" and e["worker"] == "teacher"]
    checked = [e for e in events if e["ev"] == "weights_checked" and e["worker"] == "teacher"]
    assert [e["weights"] for e in checked] == [ready[0]["weights"]]


def test_a_teacher_with_another_tokenizer_is_refused_before_any_worker_starts(tmp_path, tiny_model):
    other = build_tiny_model(tmp_path / "other", seed=1)
    build_tokenizer(vocab_size=300).save_pretrained(other)  # fewer tokens than the model's 384: it still loads
    cfg = load_config("examples/tiny_grpo.yaml", [f"model.path={tiny_model}", f"distill.teacher={other}"])
    with pytest.raises(ModelError, match=rf"distill.teacher: the teacher's tokenizer \('{other}'\) is not the "
                                         rf"student's \(model.path '{tiny_model}'\)"):
        preflight(cfg).result(timeout=120)


def test_the_top_k_loss_trains_end_to_end(tmp_path, ray_session, tiny_model, teacher):
    cfg = load_config("examples/tiny_grpo.yaml", [
        f"model.path={tiny_model}", f"distill.teacher={teacher}", "distill.loss=topk_kl", "distill.topk=8",
        "distill.task_reward=false", f"run.output_dir={tmp_path}", "run.name=topk", "run.steps=2",
        "run.checkpoint_every=0", "validation.period=0", "validation.at_end=false", "training.packing=true"])
    summary = train(cfg, quiet=True)
    assert summary["error"] is None, summary
    violations = check_events(load_events(tmp_path / "topk"))
    assert violations == [], "\n".join(v.message for v in violations)
    metrics = [json.loads(line) for line in (tmp_path / "topk" / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in metrics if "distill/topk_kl" in m]
    # With no task reward the advantages are 0 and the loss is the KL itself (coef 1, token means both).
    kls = [(m["distill/topk_kl"], m["loss"]) for m in trained]
    assert len(kls) == 2 and all(math.isfinite(kl) and kl > 0 for kl, _ in kls), kls
    assert all(loss == pytest.approx(kl, rel=1e-4) for kl, loss in kls), kls


def test_a_top_k_larger_than_the_vocabulary_is_refused_naming_the_key(tiny_model, teacher):
    cfg = load_config("examples/tiny_grpo.yaml", [f"model.path={tiny_model}", f"distill.teacher={teacher}",
                                                   "distill.loss=topk_kl", "distill.topk=385"])
    with pytest.raises(ModelError, match=r"distill.topk: 385 is more tokens than the vocabulary of distill.teacher "
                                         r".* \(384\)"):
        preflight(cfg)
