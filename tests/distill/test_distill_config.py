"""The distill section: each bad setting is refused naming its key, and a
teacher whose tokenizer is not the student's is refused before any worker
starts, naming both directories."""
from __future__ import annotations

import pytest

from pipeline.config import ConfigError, load_config
from pipeline.inputs.models import ModelError, check_same_tokenizer

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("overrides,message", [
    (["distill.coef=0.5"], "distill.coef: is set, but distill.teacher is empty"),
    (["inject.fault=teach_exit"], "inject.fault: teach_exit ends the teacher's process"),
    (["distill.teacher=t", "distill.task_reward=false", "distill.coef=0"],
     "distill.coef: 0 with distill.task_reward false leaves no advantage"),
    (["distill.teacher=t", "distill.task_reward=false", "algorithm=ppo"],
     "distill.task_reward: false leaves ppo's critic no reward"),
    (["distill.teacher=t", "distill.task_reward=false", "dynamic_sampling.max_rounds=1"],
     "dynamic_sampling.max_rounds: leaves out groups whose task rewards are all equal"),
    (["distill.teacher=t", "distill.kl_clip=-1"], "distill.kl_clip"),
    (["distill.teacher=t", "distill.topk=32"], "distill.topk: is set, but it is read only with distill.loss topk_kl"),
    (["distill.teacher=t", "distill.kl_type=reverse"], "distill.kl_type: is set, but it is read only with "
                                                          "distill.loss topk_kl"),
    (["distill.teacher=t", "distill.loss=topk_kl", "distill.kl_clip=2"],
     "distill.kl_clip: is set, but it is read only with distill.loss sampled_reverse_kl"),
    (["distill.teacher=t", "distill.loss=topk_kl", "distill.mixed_kl_weight=0.2"],
     "distill.mixed_kl_weight: is set, but it is read only with distill.kl_type mixed"),
    (["distill.teacher=t", "distill.loss=topk_kl", "distill.topk=0"], "distill.topk"),
    (["distill.teacher=t", "distill.loss=topk"], "distill.loss"),
    (["distill.loss=topk_kl"], "distill.loss: is set, but distill.teacher is empty"),
])
def test_bad_distill_settings_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_pure_distillation_needs_no_task_reward_and_no_group():
    real = ["model.path=m", "data.train=t.jsonl", "distill.teacher=teacher"]
    cfg = load_config(None, [*real, "distill.task_reward=false", "schedule.group_size=1"])
    assert cfg.data.reward == "" and cfg.distill.teacher == "teacher"
    with pytest.raises(ConfigError, match="data.reward: not set"):
        load_config(None, real)


def test_a_teacher_with_another_tokenizer_is_refused_naming_both(tmp_path):
    from pipeline.inputs.tiny import build_tokenizer
    student, same, other = tmp_path / "student", tmp_path / "same", tmp_path / "other"
    build_tokenizer().save_pretrained(student)
    build_tokenizer().save_pretrained(same)
    build_tokenizer(vocab_size=300).save_pretrained(other)
    check_same_tokenizer(student, same)
    with pytest.raises(ModelError, match=rf"the teacher's tokenizer \('{other}'\) is not the student's "
                                         rf"\(model.path '{student}'\): 384 and 300 tokens"):
        check_same_tokenizer(student, other)


def test_the_top_k_loss_takes_its_own_keys():
    cfg = load_config(None, ["distill.teacher=t", "distill.loss=topk_kl", "distill.topk=32", "distill.kl_type=mixed",
                             "distill.mixed_kl_weight=0.2"])
    assert (cfg.distill.loss, cfg.distill.topk, cfg.distill.kl_type, cfg.distill.mixed_kl_weight) == \
        ("topk_kl", 32, "mixed", 0.2)
