"""Distillation on the real stack: the teacher's forward gives each response
token's logprob whatever the batching; a tiny student learns from a tiny
teacher (another seed, the same tokenizer) end to end; a teacher whose
tokenizer is not the student's is refused before any worker starts."""
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
    forward = TeacherForward(str(teacher), batch_size=2)
    prompts, responses = [[1, 5, 6], [1, 7], [1, 8, 9, 10]], [[11, 12], [13, 14, 15, 16], []]
    batched = forward.logprobs(prompts, responses)
    alone = [TeacherForward(str(teacher), batch_size=1).logprobs([p], [r])[0] for p, r in zip(prompts, responses)]
    assert [len(r) for r in batched] == [2, 4, 0]
    assert all(math.isfinite(x) and x < 0 for row in batched for x in row)
    for a, b in zip(batched, alone):
        assert a == pytest.approx(b, abs=1e-5)
    # The first response token's logprob by hand: the logits after the whole prompt.
    with torch.inference_mode():
        logits = forward.model(input_ids=torch.tensor([prompts[0] + responses[0]])).logits[0]
    assert batched[0][0] == pytest.approx(torch.log_softmax(logits[2], -1)[11].item(), abs=1e-5)


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
