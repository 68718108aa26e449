"""DeepSpeedPolicyEngine on a tiny random Llama, single process, CPU (or GPU if present):
GRPO's group advantages and PPO's per-token ones, micro-batches, ZeRO, bf16,
the KL reference, checkpoints and exact resume.

All engines share one process group (world size 1, set up by the first one).
"""
from __future__ import annotations

import importlib
import math

import pyarrow as pa
import pytest
import torch
from tests.support.training_helpers import (  # noqa: F401  (model_dir is a fixture)
    continue_after_resume,
    engine_config,
    make_table,
    max_diff,
    model_dir,
    per_token,
    sequence_logprobs,
    weights,
)

from pipeline.algos.advantages import critic_free_advantages
from pipeline.algos.ppo import ADVANTAGE_SCHEMA
from pipeline.trainer.deepspeed_policy import DeepSpeedPolicyEngine

pytestmark = pytest.mark.real

torch.set_num_threads(1)
CUDA = torch.cuda.is_available()


def make_engine(model_dir, *overrides):
    return DeepSpeedPolicyEngine(engine_config(model_dir, "training.micro_batch_size=4", "training.lr=1e-3",
                                               "schedule.group_size=2", *overrides))


def grpo_step(engine, table, group_size=2):
    """One update with the group advantages the trainer actor would pass."""
    return engine.train_step(table, critic_free_advantages(table, group_size))


def on_policy(table, lp):
    """`table` with `lp` as the generator's logprobs: IS weight 1."""
    return table.set_column(table.schema.get_field_index("logprobs"), "logprobs",
                            pa.array(lp, pa.list_(pa.float32())))


def test_train_step_updates_weights_with_finite_metrics(model_dir):
    e = make_engine(model_dir)
    if not CUDA:  # the private hook is in place: no shared-memory op gets built
        assert importlib.import_module("deepspeed.comm.torch").build_shm_op() is None
    before = weights(e)
    table = make_table()
    m = grpo_step(e, table)
    # 6 rows in micro-batches of 4 -> 4 + 2, still exactly one optimizer step
    assert e.steps == 1 and m["micro_batches"] == 2.0 and m["step"] == 1.0
    assert m["tokens"] == sum(len(r) for r in table.column("response_ids").to_pylist())
    assert all(math.isfinite(v) for v in m.values()), m
    assert m["grad_norm"] > 0 and "reward_mean" not in m  # the trainer actor reports the rewards
    assert m["ratio"] == pytest.approx(1.0) and m["clip_frac"] == 0.0 and m["kl"] == 0.0
    assert max_diff(weights(e), before) > 1e-4
    e.close()


def test_remainder_micro_batch_equals_one_batch(model_dir):
    # 4 + 2 rows versus all 6 at once.
    table = make_table()
    split, whole = make_engine(model_dir), make_engine(model_dir, "training.micro_batch_size=8")
    ms, mw = grpo_step(split, table), grpo_step(whole, table)
    assert whole.steps == 1 and mw["micro_batches"] == 1.0
    assert ms["loss"] == pytest.approx(mw["loss"], abs=1e-7)
    assert ms["grad_norm"] == pytest.approx(mw["grad_norm"], rel=1e-5)
    # The two sum the gradient in a different order: on some hosts' vector units
    # (measured: 1.7e-6 on one, under 1e-6 on another) that rounds an lr 1e-3 step apart.
    assert max_diff(weights(split), weights(whole)) < 5e-6
    split.close(), whole.close()


def test_rewarded_response_becomes_more_likely(model_dir):
    e = make_engine(model_dir, "training.lr=3e-3")
    good, bad = [7, 8, 9], [20, 21, 22]
    probe = make_table(groups=1, responses=[good, bad], rewards=[1.0, 0.0])
    start = [sum(x) for x in sequence_logprobs(e, probe)]
    for _ in range(4):
        # on-policy: generator logprobs = trainer logprobs, IS weight 1
        m = grpo_step(e, on_policy(probe, sequence_logprobs(e, probe)))
        assert m["is_weight"] == pytest.approx(1.0, abs=1e-4)
    end = [sum(x) for x in sequence_logprobs(e, probe)]
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
    grpo_step(e, make_table())
    check_save_roundtrip(e, tmp_path / "ckpt", atol=1e-5)
    e.close()


def test_zero3_matches_zero0(model_dir, tmp_path):
    # Same data, same fp32 math: only the parameter layout differs.
    table = make_table()
    z0, z3 = make_engine(model_dir, "training.zero_stage=0"), make_engine(model_dir, "training.zero_stage=3")
    m0, m3 = grpo_step(z0, table), grpo_step(z3, table)
    assert m3["loss"] == pytest.approx(m0["loss"], abs=1e-6)
    assert m3["grad_norm"] == pytest.approx(m0["grad_norm"], rel=1e-4)
    w0, w3 = weights(z0), weights(z3)
    assert list(w3) == list(w0) and max_diff(w0, w3) < 1e-5
    assert grpo_step(z3, table)["loss"] == pytest.approx(grpo_step(z0, table)["loss"], abs=1e-5)
    check_save_roundtrip(z3, tmp_path / "z3", atol=1e-5)  # gathered under ZeRO-3
    z0.close(), z3.close()


def test_bf16_trains_and_zero0_matches_zero2(model_dir):
    # bf16 without ZeRO goes through deepspeed's FP16_UnfusedOptimizer, which
    # advanced Adam's step count at init; the engine undoes that, so its first
    # update equals the ZeRO-2 one.
    table = make_table()
    b0 = make_engine(model_dir, "training.dtype=bf16")
    b2 = make_engine(model_dir, "training.dtype=bf16", "training.zero_stage=2")
    m0, m2 = grpo_step(b0, table), grpo_step(b2, table)
    assert all(math.isfinite(v) for v in m0.values()), m0
    assert m0["loss"] == pytest.approx(m2["loss"], abs=1e-6)
    w0 = b0.export_weights()
    assert all(v.dtype == torch.bfloat16 for v in w0.values())
    assert max_diff(weights(b0), weights(b2)) == 0.0
    b0.close(), b2.close()


@pytest.mark.parametrize("micro,share", [(4, 7 / 46), (6, 15 / 54)])
def test_pad_token_share_counts_the_padding_the_micro_batches_ran_on(model_dir, micro, share):
    # make_table's rows are 4, 5, 6, 7, 8 and 9 tokens (prompt + response). Micro-batches
    # of 4: widths 7 (4 rows, 6 pads) and 9 (2 rows, 1 pad), 7 pads in 46 positions;
    # one micro-batch of 6: width 9, 54 - 39 = 15 pads.
    engine = make_engine(model_dir, f"training.micro_batch_size={micro}")
    assert grpo_step(engine, make_table())["pad_token_share"] == pytest.approx(share)
    engine.close()


@pytest.mark.parametrize("batching", [["training.max_tokens_per_micro_batch=24"],
                                      ["training.max_tokens_per_micro_batch=40", "training.packing=true"]])
def test_a_token_budget_or_packing_takes_the_same_step_with_less_padding(model_dir, batching):
    """Rows by length into micro-batches of at most 24 padded tokens, or packed
    into sequences of at most 40 without padding (position ids restarting per
    row), take the step that 2-row micro-batches in table order take: the loss
    is the batch's token mean either way; per-row outputs (the KL reference's
    logprobs) stay in table order."""
    # Long-tailed responses in table order: 2, 12, 3, 11, 4, 10 tokens after 2-4 prompt tokens.
    table = make_table(responses=[[5] * n for n in (2, 12, 3, 11, 4, 10)])
    rows_engine = make_engine(model_dir, "training.micro_batch_size=2", "policy_loss.kl_coef=0.1")
    engine = make_engine(model_dir, "training.micro_batch_size=2", "policy_loss.kl_coef=0.1", *batching)
    assert engine.batching.packed == ("training.packing=true" in batching) and engine.packing_off == ""
    ref_rows, ref = rows_engine.reference_logprobs(table), engine.reference_logprobs(table)
    assert [len(r) for r in ref] == [2, 12, 3, 11, 4, 10]
    assert max(abs(a - b) for r, q in zip(ref_rows, ref) for a, b in zip(r, q)) < 1e-5
    by_rows, other = grpo_step(rows_engine, table), grpo_step(engine, table)
    assert other["loss"] == pytest.approx(by_rows["loss"], abs=1e-6)
    assert other["grad_norm"] == pytest.approx(by_rows["grad_norm"], rel=1e-5)
    assert other["entropy"] == pytest.approx(by_rows["entropy"], rel=1e-5)
    assert max_diff(weights(rows_engine), weights(engine)) < 1e-5
    assert other["pad_token_share"] < by_rows["pad_token_share"] / 2, (other, by_rows)
    if engine.batching.packed:
        assert other["pad_token_share"] == 0.0
    rows_engine.close(), engine.close()


def test_packing_falls_back_to_padding_where_attention_sees_across_rows(model_dir, monkeypatch):
    """A model whose attention would let packed rows see each other (here: position ids that never
    restart, so transformers sees one sequence) is trained padded, and says why."""
    import pipeline.trainer.rows as rows

    def leaky(rows_, lens, device):
        out = packed(rows_, lens, device)
        return {**out, "positions": torch.arange(out["ids"].shape[1]).unsqueeze(0)}
    packed = rows._packed
    monkeypatch.setattr(rows, "_packed", leaky)
    engine = make_engine(model_dir, "training.micro_batch_size=2", "training.packing=true")
    assert not engine.batching.packed and "does not keep packed rows apart" in engine.packing_off
    assert grpo_step(engine, make_table())["pad_token_share"] > 0
    engine.close()


def test_dtype_auto_trains_in_what_this_machine_has(model_dir):
    """training.dtype auto through the trainer's own engine builder: bf16 on a
    CPU with AMX-BF16 or AVX-512 BF16 (or a GPU with bf16), fp32 elsewhere."""
    from pipeline.config import load_config
    from pipeline.core.precision import cpu_bf16_flags
    from pipeline.trainer.engines import training_engine
    cfg = load_config("examples/tiny_grpo.yaml", [f"model.path={model_dir}", "training.dtype=auto",
                                                  "schedule.group_size=2", "training.micro_batch_size=4"])
    has_bf16 = torch.cuda.is_bf16_supported() if CUDA else bool(cpu_bf16_flags())
    engine = training_engine(cfg)
    assert engine.dtype == ("bf16" if has_bf16 else "fp32")
    metrics = grpo_step(engine, make_table())
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    exported = engine.export_weights()
    assert {v.dtype for v in exported.values()} == {torch.bfloat16 if has_bf16 else torch.float32}
    engine.close()


def test_kl_to_frozen_reference(model_dir):
    e = make_engine(model_dir, "policy_loss.kl_coef=0.1", "training.lr=1e-2")
    table = make_table()
    assert grpo_step(e, table)["kl"] == pytest.approx(0.0, abs=1e-7)  # policy == reference
    assert grpo_step(e, table)["kl"] > 1e-5
    e.close()


def test_reference_logprobs_for_the_reward_stay_the_initial_policys(model_dir):
    """The KL in the reward (reward_kl; reference=True, no KL in the loss): the
    reference scores every row as the untrained policy did, micro-batch by
    micro-batch (6 rows in micro-batches of 4), after updates too."""
    def apart(a, b):
        return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))

    e = make_engine(model_dir, "algorithm=reinforce_pp", "reward_kl.coef=0.01", "training.lr=1e-2")
    table = make_table()
    before = sequence_logprobs(e, table)
    assert apart(e.reference_logprobs(table), before) < 1e-6
    m = grpo_step(e, table)
    assert m["kl"] == 0.0   # nothing of it in the loss
    assert apart(e.reference_logprobs(table), before) < 1e-6
    assert apart(sequence_logprobs(e, table), before) > 1e-4
    e.close()


def test_coupled_loss_clips_the_ratio_to_the_behaviour_policy(model_dir):
    """policy_loss.decoupled false is classic PPO: the ratio to the engine's
    logprobs (-4 here, far from the model's) is clipped and nothing reweights it;
    decoupled (the default) clips to the policy before the update (ratio 1) and
    carries the staleness in the capped importance weight."""
    coupled, decoupled = make_engine(model_dir, "policy_loss.decoupled=false"), make_engine(model_dir)
    try:
        c, d = grpo_step(coupled, make_table()), grpo_step(decoupled, make_table())
    finally:
        coupled.close()
        decoupled.close()
    assert c["is_weight"] == 1.0 and c["ratio"] != pytest.approx(1.0, abs=1e-3) and c["clip_frac"] > 0.1
    assert d["ratio"] == pytest.approx(1.0) and d["clip_frac"] == 0.0 and d["is_weight"] != pytest.approx(1.0)


# ------------------------------------------------- PPO: per-token advantages

def test_ppo_step_with_group_advantages_per_token_equals_grpo(model_dir):
    # GRPO rewards per group [0, 1] -> group advantages -+0.5 / (0.5 + 1e-6); the
    # same numbers repeated on every token must give the same update.
    table = make_table()
    a = 0.5 / (0.5 + 1e-6)
    g, p = make_engine(model_dir), make_engine(model_dir)
    mg = grpo_step(g, table)
    mp = p.train_step(table, per_token(table, [-a, a] * 3))
    assert mp["loss"] == pytest.approx(mg["loss"], abs=1e-7)
    assert mp["grad_norm"] == pytest.approx(mg["grad_norm"], rel=1e-5)
    assert p.steps == 1 and max_diff(weights(g), weights(p)) < 1e-7
    g.close(), p.close()


def test_per_token_advantages_move_their_own_tokens(model_dir):
    # One response [7, 8, 9] with advantages [+1, 0, -1]: on-policy steps must raise
    # token 7's logprob and lower token 9's. A shifted alignment would move others.
    e = make_engine(model_dir, "training.lr=3e-3")
    probe = make_table(groups=1, group_size=1, responses=[[7, 8, 9]], rewards=[0.0])
    adv = pa.table({"advantages": [[1.0, 0.0, -1.0]], "returns": [[0.0] * 3], "values": [[0.0] * 3]},
                   schema=ADVANTAGE_SCHEMA)
    start = sequence_logprobs(e, probe)[0]
    for _ in range(4):
        e.train_step(on_policy(probe, sequence_logprobs(e, probe)), adv)
    end = sequence_logprobs(e, probe)[0]
    assert end[0] > start[0] + 0.3 and end[2] < start[2] - 0.3, (start, end)
    e.close()


def test_ppo_rows_need_no_groups_but_must_align(model_dir):
    e = make_engine(model_dir)
    table = make_table().slice(0, 5)  # 5 rows: not groups of 2, fine for PPO
    bad = per_token(make_table(), [1.0] * 6).slice(0, 5)
    rows = bad.to_pylist()
    rows[3]["advantages"] = rows[3]["advantages"][:-1]
    with pytest.raises(ValueError, match="advantages: row 3 has"):
        e.train_step(table, pa.Table.from_pylist(rows, schema=ADVANTAGE_SCHEMA))
    with pytest.raises(ValueError, match="4 rows for a batch of 5"):
        e.train_step(table, bad.slice(0, 4))
    assert e.steps == 0
    m = e.train_step(table, bad)
    assert e.steps == 1 and math.isfinite(m["loss"])
    e.close()


def test_policy_save_state_continues_identically(model_dir, tmp_path):
    table = make_table()
    ma, mb, wa, wb, a, b = continue_after_resume(lambda: make_engine(model_dir), lambda e: grpo_step(e, table),
                                                 tmp_path)
    assert mb["loss"] == ma["loss"] and mb["grad_norm"] == ma["grad_norm"]
    assert max_diff(wa, wb) == 0.0
    with pytest.raises(FileNotFoundError, match="no engine state"):
        b.load_state(str(tmp_path / "missing"))
    a.close(), b.close()


def test_tokens_outside_the_loss_mask_are_not_trained(model_dir):
    """Multi-turn: an environment's observation tokens (loss_mask 0) change
    nothing, whatever their advantages; a mask of the wrong length is refused."""
    table = make_table()
    lengths = [len(r) for r in table.column("response_ids").to_pylist()]
    masks = [[1] + [0] * (n - 1) for n in lengths]
    masked = table.set_column(table.schema.get_field_index("loss_mask"), "loss_mask",
                              pa.array(masks, pa.list_(pa.int8())))
    advantages = [[1.0] + [float(k) for k in range(n - 1)] for n in lengths]
    other = [[1.0] + [-5.0] * (n - 1) for n in lengths]
    results = []
    for adv in (advantages, other):
        engine = make_engine(model_dir)
        m = engine.train_step(masked, pa.table({"advantages": adv}))
        results.append((weights(engine), m))
    assert max_diff(results[0][0], results[1][0]) == 0.0
    assert results[0][1]["tokens"] == len(lengths)  # one trained token per row
    bad = table.set_column(table.schema.get_field_index("loss_mask"), "loss_mask",
                           pa.array([[1]] * table.num_rows, pa.list_(pa.int8())))
    with pytest.raises(ValueError, match="loss_mask must hold a 0 or 1 for each of its"):
        make_engine(model_dir).train_step(bad, pa.table({"advantages": advantages}))


@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_sequence_aggregations_are_the_batchs_whatever_the_micro_batches(model_dir, aggregation):
    # 4 + 2 rows versus all 6 at once: each micro-batch divides by the whole batch's sequence count.
    table = make_table()
    options = (f"policy_loss.aggregation={aggregation}", "generation.max_new_tokens=8")  # the horizon: 8
    split = make_engine(model_dir, *options)
    whole = make_engine(model_dir, "training.micro_batch_size=8", *options)
    ms, mw = grpo_step(split, table), grpo_step(whole, table)
    assert ms["loss"] == pytest.approx(mw["loss"], abs=1e-7)
    assert ms["grad_norm"] == pytest.approx(mw["grad_norm"], rel=1e-5)
    token_mean = grpo_step(make_engine(model_dir, "training.micro_batch_size=8"), table)
    assert mw["grad_norm"] != pytest.approx(token_mean["grad_norm"], rel=1e-3)  # the option took effect
    split.close(), whole.close()


def test_entropy_is_reported_and_its_bonus_trains(model_dir):
    table = make_table()
    plain = make_engine(model_dir)
    bonus = make_engine(model_dir, "policy_loss.entropy_coef=0.5")
    mp, mb = grpo_step(plain, table), grpo_step(bonus, table)
    # The tiny model starts near uniform over its vocabulary: entropy close to ln(vocab).
    assert 0 < mp["entropy"] <= math.log(plain.engine.module.config.vocab_size) + 1e-4
    assert mb["entropy"] == pytest.approx(mp["entropy"], rel=1e-6)
    assert mb["loss"] == pytest.approx(mp["loss"] - 0.5 * mp["entropy"], abs=1e-5)
    assert max_diff(weights(plain), weights(bonus)) > 0
    plain.close(), bonus.close()


def test_lr_warmup_and_schedule_follow_the_step_and_survive_a_resume(model_dir, tmp_path):
    optimizer = ("training.lr_schedule=linear", "training.lr_warmup_steps=2", "run.steps=6",
                 "training.grad_clip=0.5", "training.weight_decay=0.1")
    table = make_table()
    ma, mb, wa, wb, a, b = continue_after_resume(lambda: make_engine(model_dir, *optimizer),
                                                 lambda e: grpo_step(e, table), tmp_path)
    assert mb["lr"] == ma["lr"] and max_diff(wa, wb) == 0.0
    assert a.ds_config["gradient_clipping"] == 0.5
    assert a.ds_config["optimizer"]["params"]["weight_decay"] == 0.1
    # Updates 0 and 1 warm up (1/3, 2/3 of 1e-3); update 2, the one after the resume, is the
    # first at the full rate; then linear decay to 0 at update 6: 1 - (s - 2) / 4 for s = 3, 4, 5.
    assert ma["lr"] == pytest.approx(1e-3)
    lrs = [grpo_step(a, table)["lr"] for _ in range(3)]
    assert lrs == pytest.approx([0.75e-3, 0.5e-3, 0.25e-3])
    a.close(), b.close()


def test_several_updates_split_whole_groups_and_take_one_optimizer_step_each(model_dir):
    # Classic clipping reads no old logprobs, so 1 epoch of 2 mini-batches (groups {0, 1}, {2})
    # must equal one update on rows 0-3 followed by one on rows 4-5.
    table = make_table()
    split = make_engine(model_dir, "policy_loss.decoupled=false", "training.mini_batches=2")
    m = grpo_step(split, table)
    assert split.steps == 2 and m["updates"] == 2.0
    assert m["tokens"] == sum(len(r) for r in table.column("response_ids").to_pylist())
    by_hand = make_engine(model_dir, "policy_loss.decoupled=false")
    grpo_step(by_hand, table.slice(0, 4)), grpo_step(by_hand, table.slice(4, 2))
    assert max_diff(weights(split), weights(by_hand)) == 0.0
    with pytest.raises(ValueError, match="cannot make 4 mini-batches of whole groups"):
        grpo_step(make_engine(model_dir, "training.mini_batches=4"), table)
    split.close(), by_hand.close()


def test_epochs_clip_against_the_weights_before_the_first_update(model_dir):
    # On-policy rows (gen = the engine's own logprobs): the decoupled loss's old logprobs,
    # scored before the first update, are then the behaviour logprobs the classic loss
    # clips against, so two epochs of each give the same weights. The second epoch's
    # ratio has left 1: the clip has something to do.
    probe = make_engine(model_dir)
    table = on_policy(make_table(), sequence_logprobs(probe, make_table()))
    runs = {}
    for decoupled in (True, False):
        e = make_engine(model_dir, "training.lr=1e-2", f"policy_loss.decoupled={str(decoupled).lower()}",
                        "training.epochs=2")
        runs[decoupled] = (grpo_step(e, table), weights(e))
        assert e.steps == 2
    (m, w), (_, w_classic) = runs[True], runs[False]
    assert max_diff(w, w_classic) < 1e-5
    assert abs(m["ratio"] - 1.0) > 1e-4 and m["updates"] == 2.0
    one = make_engine(model_dir, "training.lr=1e-2")
    grpo_step(one, table), grpo_step(one, table)  # ratio 1 each time: a different update
    assert max_diff(w, weights(one)) > 1e-5
    probe.close()
