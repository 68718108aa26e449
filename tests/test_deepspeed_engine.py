"""DeepSpeedTrainingEngine on a tiny random Llama, single process, CPU (or GPU if present).

All engines share one process group (world size 1, set up by the first one).
"""
from __future__ import annotations

import importlib
import math

import pyarrow as pa
import pytest
import torch

from pipeline.engines.deepspeed_policy import DeepSpeedTrainingEngine, ModelPathError
from pipeline.engines.interface import TRAJECTORY_SCHEMA

torch.set_num_threads(1)
CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=64)
    path = tmp_path_factory.mktemp("tiny")
    LlamaForCausalLM(cfg).save_pretrained(path)
    (path / "tokenizer_config.json").write_text("{}")  # save() must carry it over
    return path


def make_engine(model_dir, **kw):
    args = dict(zero_stage=0, dtype="fp32", micro_batch_size=4, grad_accum=1, lr=1e-3,
                clip_eps=0.2, kl_coef=0.0, is_clip=2.0, group_size=2, seed=0)
    args.update(kw)
    return DeepSpeedTrainingEngine(str(model_dir), **args)


def make_table(groups=3, group_size=2, gen_lp=-4.0, responses=None, rewards=None):
    """`groups` prompt groups with different prompt and response lengths."""
    rows = []
    for g in range(groups):
        prompt = [1, 2 + g, 3, 4][:2 + g % 3]
        for j in range(group_size):
            i = g * group_size + j
            resp = responses[i] if responses else [5 + j + g] * (2 + j + g)
            rows.append(dict(batch_id="b0", target=1, version=0, prompt_id=f"p{g}", prompt_ids=prompt,
                             response_ids=resp, logprobs=[gen_lp] * len(resp), text="",
                             reward=rewards[i] if rewards else float(j)))
    return pa.Table.from_pylist(rows, schema=TRAJECTORY_SCHEMA)


def weights(engine):
    return {k: v.float() for k, v in engine.export_weights().items()}


def max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_train_step_updates_weights_with_finite_metrics(model_dir):
    e = make_engine(model_dir)
    if not CUDA:  # the private hook is in place: no shared-memory op gets built
        assert importlib.import_module("deepspeed.comm.torch").build_shm_op() is None
    before = weights(e)
    table = make_table()
    m = e.train_step(table)
    # 6 rows in micro-batches of 4 -> 4 + 2, still exactly one optimizer step
    assert e.steps == 1 and m["micro_batches"] == 2.0 and m["step"] == 1.0
    assert m["tokens"] == sum(len(r) for r in table.column("response_ids").to_pylist())
    assert all(math.isfinite(v) for v in m.values()), m
    assert m["grad_norm"] > 0 and m["reward_mean"] == 0.5 and m["reward_std"] == 0.5
    assert m["ratio"] == pytest.approx(1.0) and m["clip_frac"] == 0.0 and m["kl"] == 0.0
    assert max_diff(weights(e), before) > 1e-4
    e.close()


def test_remainder_micro_batch_equals_one_batch(model_dir):
    # 4 + 2 rows versus all 6 at once (grad_accum 4 is nominal: still one step).
    table = make_table()
    split, whole = make_engine(model_dir, micro_batch_size=4), make_engine(model_dir, micro_batch_size=8,
                                                                           grad_accum=4)
    ms, mw = split.train_step(table), whole.train_step(table)
    assert whole.steps == 1 and mw["micro_batches"] == 1.0
    assert ms["loss"] == pytest.approx(mw["loss"], abs=1e-7)
    assert ms["grad_norm"] == pytest.approx(mw["grad_norm"], rel=1e-5)
    assert max_diff(weights(split), weights(whole)) < 1e-6
    split.close(), whole.close()


def test_rewarded_response_becomes_more_likely(model_dir):
    e = make_engine(model_dir, lr=3e-3)
    good, bad = [7, 8, 9], [20, 21, 22]
    probe = make_table(groups=1, responses=[good, bad], rewards=[1.0, 0.0])
    start = [sum(x) for x in e.sequence_logprobs(probe)]
    for _ in range(4):
        # on-policy: generator logprobs = trainer logprobs, IS weight 1
        lp = e.sequence_logprobs(probe)
        table = probe.set_column(probe.schema.get_field_index("logprobs"), "logprobs",
                                 pa.array(lp, pa.list_(pa.float32())))
        m = e.train_step(table)
        assert m["is_weight"] == pytest.approx(1.0, abs=1e-4)
    end = [sum(x) for x in e.sequence_logprobs(probe)]
    assert end[0] > start[0] + 0.5, (start, end)
    assert end[1] < start[1] - 0.5, (start, end)
    e.close()


def test_export_weights_match_hf_state_dict(model_dir):
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    e = make_engine(model_dir)
    w = e.export_weights()
    assert list(w) == list(ref)
    assert {k: tuple(v.shape) for k, v in w.items()} == {k: tuple(v.shape) for k, v in ref.items()}
    assert w["lm_head.weight"].shape[0] == 64  # HF vocabulary, not padded
    assert all(v.device.type == "cpu" and not v.requires_grad for v in w.values())
    w["lm_head.weight"].zero_()  # a copy: the engine is untouched
    assert e.export_weights()["lm_head.weight"].abs().sum() > 0
    e.close()


def engine_logits(e, ids):
    with torch.no_grad():
        return e.engine(input_ids=ids.to(e.device), use_cache=False).logits.float().cpu()


def check_save_roundtrip(e, out, atol):
    from transformers import AutoModelForCausalLM
    e.save(str(out))
    assert (out / "tokenizer_config.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.tensor([[1, 5, 9, 13, 2, 7]])
    with torch.no_grad():
        got = loaded(input_ids=ids).logits
    diff = (got - engine_logits(e, ids)).abs().max().item()
    assert diff <= atol, diff
    return diff


def test_save_loads_in_transformers_with_same_logits(model_dir, tmp_path):
    e = make_engine(model_dir)
    e.train_step(make_table())
    check_save_roundtrip(e, tmp_path / "ckpt", atol=1e-5)
    e.close()


def test_zero3_matches_zero0(model_dir, tmp_path):
    # Same data, same fp32 math: only the parameter layout differs.
    table = make_table()
    z0, z3 = make_engine(model_dir, zero_stage=0), make_engine(model_dir, zero_stage=3)
    m0, m3 = z0.train_step(table), z3.train_step(table)
    assert m3["loss"] == pytest.approx(m0["loss"], abs=1e-6)
    assert m3["grad_norm"] == pytest.approx(m0["grad_norm"], rel=1e-4)
    w0, w3 = weights(z0), weights(z3)
    assert list(w3) == list(w0) and max_diff(w0, w3) < 1e-5
    assert z3.train_step(table)["loss"] == pytest.approx(z0.train_step(table)["loss"], abs=1e-5)
    check_save_roundtrip(z3, tmp_path / "z3", atol=1e-5)  # gathered under ZeRO-3
    z0.close(), z3.close()


def test_bf16_trains_and_zero0_matches_zero2(model_dir):
    # bf16 without ZeRO goes through deepspeed's FP16_UnfusedOptimizer, which
    # advanced Adam's step count at init; the engine undoes that, so its first
    # update equals the ZeRO-2 one.
    table = make_table()
    b0, b2 = make_engine(model_dir, dtype="bf16"), make_engine(model_dir, dtype="bf16", zero_stage=2)
    m0, m2 = b0.train_step(table), b2.train_step(table)
    assert all(math.isfinite(v) for v in m0.values()), m0
    assert m0["loss"] == pytest.approx(m2["loss"], abs=1e-6)
    w0 = b0.export_weights()
    assert all(v.dtype == torch.bfloat16 for v in w0.values())
    assert max_diff(weights(b0), weights(b2)) == 0.0
    b0.close(), b2.close()


def test_kl_to_frozen_reference(model_dir):
    e = make_engine(model_dir, kl_coef=0.1, lr=1e-2)
    table = make_table()
    assert e.train_step(table)["kl"] == pytest.approx(0.0, abs=1e-7)  # policy == reference
    assert e.train_step(table)["kl"] > 1e-5
    e.close()


def test_misordered_groups_are_rejected(model_dir):
    e = make_engine(model_dir)
    rows = make_table().to_pylist()
    rows[1], rows[2] = rows[2], rows[1]
    with pytest.raises(ValueError, match="must be one prompt group"):
        e.train_step(pa.Table.from_pylist(rows, schema=TRAJECTORY_SCHEMA))
    with pytest.raises(ValueError, match="groups of 2"):
        e.train_step(make_table().slice(0, 5))
    assert e.steps == 0
    e.close()


def test_missing_model_dir_and_config(tmp_path):
    with pytest.raises(ModelPathError, match="does not exist") as err:
        make_engine(tmp_path / "nope")
    assert str(tmp_path / "nope") in str(err.value) and isinstance(err.value, ValueError)
    with pytest.raises(ModelPathError, match="no config.json") as err:
        make_engine(tmp_path)
    assert str(tmp_path) in str(err.value)
