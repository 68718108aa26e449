"""LoRA (training.lora): the DeepSpeed policy trains peft adapters only and
exports, saves and restores them; vLLM serves each new adapter in place and
gives the trainer's logprobs; a checkpoint's adapter merges into an HF model
that transformers loads with the engine's logprobs."""
from __future__ import annotations

import gc
import json
import math
import subprocess
import sys
import tracemalloc

import pyarrow as pa
import pytest
import torch
from tests.support.training_helpers import (
    continue_after_resume,
    engine_config,
    make_table,
    max_diff,
    sequence_logprobs,
    weights,
)

from benchmarks.harness import sample_all
from pipeline.algos.advantages import critic_free_advantages
from pipeline.weights import lora
from pipeline.trainer.deepspeed_policy import DeepSpeedPolicyEngine
from pipeline.core.types import Prompt, sample_seeds
from pipeline.config import ConfigError, LoraConfig, load_config
from pipeline.inputs.tiny import build_tiny_model

pytestmark = pytest.mark.real

torch.set_num_threads(1)
TOL = 1e-5
LORA = LoraConfig(rank=8)  # the default targets: every linear layer, lm_head included


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0)


def make_engine(model_dir, *overrides):
    return DeepSpeedPolicyEngine(engine_config(model_dir, f"training.lora.rank={LORA.rank}",
                                               "training.micro_batch_size=4", "training.lr=1e-2", *overrides))


def tiny_table(engine_or_ids, groups=3):
    """make_table with token ids inside the tiny model's vocabulary."""
    return make_table(groups=groups, responses=[[40 + i, 41, 42 + i, 43][: 2 + i % 3] for i in range(2 * groups)])


def train(engine, table=None):
    table = table if table is not None else tiny_table(engine)
    return engine.train_step(table, critic_free_advantages(table, 2))


# -- config ------------------------------------------------------------------

def test_lora_keys_load_and_refuse_what_cannot_work():
    cfg = load_config("examples/tiny_grpo.yaml", ["training.lora.rank=8", "training.lora.target_modules=q_proj,v_proj"])
    assert cfg.training.lora.rank == 8 and cfg.training.lora.target_modules == ("q_proj", "v_proj")
    assert load_config("examples/tiny_grpo.yaml").training.lora.rank == 0  # off by default
    with pytest.raises(ConfigError, match="training.lora.rank.*backend 'real'"):
        load_config("examples/sim_grpo.yaml", ["training.lora.rank=8"])
    with pytest.raises(ConfigError, match="training.lora.target_modules"):
        load_config("examples/tiny_grpo.yaml", ["training.lora.target_modules=[]"])
    with pytest.raises(ConfigError, match="training.lora.rank: 600 is out of range"):
        load_config("examples/tiny_grpo.yaml", ["training.lora.rank=600"])
    with pytest.raises(ConfigError, match="training.lora.dropout"):
        load_config("examples/tiny_grpo.yaml", ["training.lora.dropout=1.5"])
    assert lora.vllm_max_rank(8) == 8 and lora.vllm_max_rank(9) == 16 and lora.vllm_max_rank(4) == 8


def test_a_target_module_the_model_lacks_is_named(model_dir):
    with pytest.raises(lora.LoraError, match=r"training.lora.target_modules: \['qkv'\]"):
        make_engine(model_dir, "training.lora.target_modules=q_proj,qkv")


def test_a_vlm_adapts_its_language_model_alone(tmp_path):
    """Qwen2.5-VL's vision MLP shares gate_proj, up_proj and down_proj with the language
    model: the default targets adapt the language model alone, in the trainer's wrap and
    in the engine's zero adapter; a name only the vision tower has is refused."""
    from transformers import AutoModelForImageTextToText, Qwen2_5_VLConfig
    Qwen2_5_VLConfig(text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=2, vocab_size=64),
                     vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32,
                                        fullatt_block_indexes=[0])).save_pretrained(tmp_path)
    names = set(lora.zero_adapter(tmp_path, lora.adapter_config(LORA, tmp_path)))
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(Qwen2_5_VLConfig.from_pretrained(tmp_path))
        wrapped = {n for n, p in lora.wrap(model, LORA, tmp_path).named_parameters() if p.requires_grad}
    assert {n.replace(".default", "") for n in wrapped} == names
    assert any(".language_model.layers.0.mlp.gate_proj." in n for n in names)
    assert not any(".visual." in n for n in names)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(Qwen2_5_VLConfig.from_pretrained(tmp_path))
    with pytest.raises(lora.LoraError, match=r"training.lora.target_modules: \['qkv'\] name only layers of the vision"):
        lora.wrap(model, LoraConfig(rank=8, target_modules=("q_proj", "qkv")), tmp_path)


# -- the trainer -------------------------------------------------------------

def test_only_the_adapters_train_and_sync(model_dir):
    e = make_engine(model_dir)
    trainable = {n for n, p in e.engine.module.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    before = weights(e)
    assert lora.is_adapter(before) and all(v.abs().max() == 0 for k, v in before.items() if "lora_B" in k)
    base = {n: p.detach().clone() for n, p in e.engine.module.named_parameters() if not p.requires_grad}
    m = train(e)
    assert all(math.isfinite(v) for v in m.values()) and m["grad_norm"] > 0
    after = weights(e)
    assert set(after) == set(before) and max_diff(after, before) > 1e-4
    assert all(torch.equal(p, base[n]) for n, p in e.engine.module.named_parameters() if not p.requires_grad)
    # Adapter bytes only: 2 * rank * (in + out) per target layer, against the whole model.
    full = sum(p.numel() for p in base.values())
    assert sum(v.numel() for v in after.values()) < 0.2 * full
    assert set(e.live_weights()) == set(after)
    e.close()


def test_zero3_trains_and_exports_the_same_adapter(model_dir, tmp_path):
    """Under ZeRO-3 the adapter is gathered alone (the frozen base stays partitioned)."""
    plain, z3 = make_engine(model_dir), make_engine(model_dir, "training.zero_stage=3")
    train(plain), train(z3)
    a, b = weights(plain), weights(z3)
    # Adam's first step is lr * g / (|g| + eps): where g is within a few eps of zero,
    # ZeRO-3's other reduction order moves the step by up to ~0.2% of lr (1.8e-5 seen).
    assert set(a) == set(b) and max_diff(a, b) < 1e-4
    z3.save(str(tmp_path / "policy"))
    assert sorted(p.name for p in (tmp_path / "policy").iterdir() if p.suffix != ".json") == [lora.ADAPTER_WEIGHTS]
    plain.close(), z3.close()


def test_kl_reference_is_the_base_model(model_dir):
    e = make_engine(model_dir, "policy_loss.kl_coef=0.1")
    assert e.ref is None  # no copy of the model: the adapters are switched off instead
    assert train(e)["kl"] == pytest.approx(0.0, abs=1e-9)  # B = 0: the policy is the base
    assert train(e)["kl"] > 0
    e.close()


def test_resume_continues_the_adapter_exactly(model_dir, tmp_path):
    ma, mb, wa, wb, a, b = continue_after_resume(lambda: make_engine(model_dir), train, tmp_path)
    assert ma == {**mb, "time_s": ma["time_s"]} and max_diff(wa, wb) == 0.0
    # The state holds the adapter and its optimizer, not the frozen base.
    saved = sum(f.stat().st_size for f in (tmp_path / "state").rglob("*") if f.is_file())
    assert saved < 0.5 * sum(p.numel() * 4 for p in a.engine.module.parameters())
    a.close(), b.close()


# -- the engine, and the export ---------------------------------------------

@pytest.fixture(scope="module")
def engine(model_dir):
    from pipeline.generator.vllm_engine import VllmGenerationEngine
    eng = VllmGenerationEngine(model_dir, seed=0, max_new_tokens=16, max_model_len=256,
                               adapter_config=lora.adapter_config(LORA, model_dir))
    try:
        yield eng
    finally:
        eng.close()


PROMPTS = [Prompt(f"p{i}", f"What is {i} plus {i + 1}?", "0") for i in range(3)]


def engine_vs_trainer(engine, trainer, seed_key: str) -> float:
    """Sample from the engine; the largest gap between its logprobs and the trainer's on the same tokens."""
    groups = sample_all(engine, PROMPTS, sample_seeds(0, seed_key, PROMPTS, 2))
    rows = [dict(prompt_ids=list(c.prompt_ids), response_ids=list(c.response_ids)) for g in groups for c in g]
    table = pa.Table.from_pylist(rows)
    ours = sequence_logprobs(trainer, table)
    return max(abs(a - b) for g, o in zip([c for g in groups for c in g], ours) for a, b in zip(g.logprobs, o))


def test_refit_serves_the_trained_adapter_with_the_trainers_logprobs(engine, model_dir, tmp_path):
    trainer = make_engine(model_dir, "training.lr=5e-2")
    try:
        assert engine_vs_trainer(engine, trainer, "v0") < TOL  # the zero adapter is the base model
        for _ in range(3):
            train(trainer)
        stale = engine_vs_trainer(engine, trainer, "v1")
        engine.load_weights(trainer.export_weights())
        engine.set_version(1)
        fresh = engine_vs_trainer(engine, trainer, "v2")
        print(f"\nLoRA refit: gap before the load {stale:.2e}, after {fresh:.2e}")
        assert stale > 100 * TOL and fresh < TOL

        # The checkpoint's adapter, merged by the export command, is a plain HF model
        # that transformers loads and that scores the engine's samples as the engine did.
        trainer.save(str(tmp_path / "policy"))
        assert json.loads((tmp_path / "policy" / lora.ADAPTER_CONFIG).read_text())["r"] == 8
        out = tmp_path / "merged"
        proc = subprocess.run([sys.executable, "-m", "pipeline", "export", str(tmp_path / "policy"), "--out", str(out)],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        from transformers import AutoModelForCausalLM, AutoTokenizer
        merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        assert not any("lora" in n for n in merged.state_dict())
        AutoTokenizer.from_pretrained(out)
        groups = sample_all(engine, PROMPTS, sample_seeds(0, "v3", PROMPTS, 2))
        gap = 0.0
        for c in (c for g in groups for c in g):
            ids = torch.tensor([list(c.prompt_ids) + list(c.response_ids)])
            with torch.no_grad():
                logp = torch.log_softmax(merged(ids).logits[0].float(), dim=-1)
            p = len(c.prompt_ids) - 1
            gap = max(gap, *(abs(lp - logp[p + i, t].item()) for i, (lp, t) in
                             enumerate(zip(c.logprobs, c.response_ids))))
        print(f"merged export vs engine: {gap:.2e}")
        assert gap < 1e-4
    finally:
        engine.load_weights(lora.zero_adapter(model_dir, lora.adapter_config(LORA, model_dir)))
        engine.set_version(0)
        trainer.close()


def test_adapter_loads_keep_no_python_objects(engine, model_dir):
    """A refit a step for days: safetensors' get_tensor, which vLLM's adapter
    loader calls per tensor, kept two ints a tensor on every load (3.6 KB a
    load on the 4.2M model), so the engine hands vLLM the adapter as torch.save's.
    Counted are the objects allocated under vLLM's LoRA loader that are still
    alive: pytest keeps every log record, and vLLM logs on each load."""
    adapter = lora.zero_adapter(model_dir, lora.adapter_config(LORA, model_dir))
    under_loader = [tracemalloc.Filter(True, "*/vllm/lora/*", all_frames=True)]

    def kept() -> int:
        gc.collect()
        return sum(t.size for t in tracemalloc.take_snapshot().filter_traces(under_loader).traces)
    loads = 20
    tracemalloc.start(25)
    try:
        for _ in range(3):  # traced from here: the adapter served now is in both counts
            engine.load_weights(adapter)
        before = kept()
        for _ in range(loads):
            engine.load_weights(adapter)
        grown = kept() - before
    finally:
        tracemalloc.stop()
    print(f"\n{loads} adapter loads of {len(adapter)} tensors: {grown} bytes kept under vLLM's LoRA loader")
    assert grown < loads * 1000, grown  # with the leak 46 KB (2.3 KB a load), without it 9 KB


def test_an_inflight_adapter_refit_labels_each_token_with_its_version(engine, model_dir):
    """The adapter is reloaded in place under one id: requests in flight go on
    with the new one from the next step, as after a full load."""
    trainer = make_engine(model_dir, "training.lr=5e-2")
    try:
        for _ in range(3):
            train(trainer)
        prompt = Prompt("long", "How many apples are left? " + " ".join(["0"] * 20), "0")
        seeds = sample_seeds(0, "inflight", [prompt], 2)[0]
        for j, seed in enumerate(seeds):
            engine.add(f"mid/{j}", prompt, seed)
        done = {}
        for _ in range(5):
            done.update(engine.step())
        engine.load_weights(trainer.export_weights())
        engine.set_version(1)
        while engine.busy():
            done.update(engine.step())
        completions = list(done.values())
        assert all(c.versions[:5] == (0,) * 5 and set(c.versions[5:]) == {1} for c in completions)
        rows = pa.Table.from_pylist([dict(prompt_ids=list(c.prompt_ids), response_ids=list(c.response_ids))
                                     for c in completions])
        trained = sequence_logprobs(trainer, rows)
        gap_new = max(abs(a - b) for c, t in zip(completions, trained) for a, b in zip(c.logprobs[5:], t[5:]))
        assert gap_new < TOL
    finally:
        engine.abort_all()
        engine.load_weights(lora.zero_adapter(model_dir, lora.adapter_config(LORA, model_dir)))
        engine.set_version(0)
        trainer.close()


def test_export_refuses_what_is_not_a_checkpoint(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pipeline", "export", str(tmp_path / "nope"), "--out",
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "nope" in proc.stderr and not (tmp_path / "out").exists()


def test_the_trainer_memory_benchmark_runs_quick(tmp_path):
    """benchmarks.lora_trainer --quick: both modes of the tiny model, and what LoRA keeps small."""
    import os
    proc = subprocess.run([sys.executable, "-m", "benchmarks.lora_trainer", "--quick", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "lora_trainer.json").read_text())
    full, adapter = result["figures"]
    assert (full["mode"], adapter["mode"]) == ("full", "lora") and result["params"]["quick"] is True
    assert adapter["trainable_params"] < 0.2 * full["trainable_params"]
    assert adapter["optimizer_bytes"] < 0.2 * full["optimizer_bytes"] and adapter["export_bytes"] < full["export_bytes"]
    assert all(f["peak_rss_bytes"] > 0 and f["step_s"] > 0 for f in result["figures"])
