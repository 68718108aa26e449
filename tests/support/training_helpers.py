"""What the tests of the algorithms, the DeepSpeed engines and the training
actors share: prompt-group tables, a tiny random Llama, weight comparisons.

`model_dir` is a fixture: a test module imports it to use it.
"""
from __future__ import annotations

import pyarrow as pa
import pytest
import torch

from benchmarks.harness import engine_config  # noqa: F401  (the engine tests build theirs as a benchmark does)
from pipeline.algos.ppo import ADVANTAGE_SCHEMA
from pipeline.trainer.rows import collate
from pipeline.core.types import TRAJECTORY_SCHEMA


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


def per_token(table, values_per_row) -> pa.Table:
    """An advantage table whose `advantages` column repeats one value per row."""
    lengths = [len(r) for r in table.column("response_ids").to_pylist()]
    cols = [[float(v)] * n for v, n in zip(values_per_row, lengths)]
    return pa.table({"advantages": cols, "returns": cols, "values": [[0.0] * n for n in lengths]},
                    schema=ADVANTAGE_SCHEMA)


def weights(engine):
    return {k: v.float() for k, v in engine.export_weights().items()}


def max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def sequence_logprobs(engine, table) -> list[list[float]]:
    """A policy engine's current logprob of each response token of `table` (no update)."""
    pictures = ["images"] if "images" in table.column_names else []
    rows = table.select(["prompt_ids", "response_ids", *pictures]).to_pylist()
    batch = collate(rows, engine.device, token_keys={})
    with torch.no_grad():
        lp = engine.token_logprobs(engine.engine, batch)
    return [lp[i][batch["mask"][i]].tolist() for i in range(len(rows))]


def continue_after_resume(make, train, tmp_path, steps_before=2):
    """Train `steps_before` steps, save, take one more step; a fresh engine that
    loads the state must take the very same step."""
    a = make()
    for _ in range(steps_before):
        train(a)
    a.save_state(str(tmp_path / "state"))
    rng_after_save = torch.rand(4)
    ma, wa = train(a), weights(a)
    b = make()
    assert b.steps == 0
    b.load_state(str(tmp_path / "state"))
    assert b.steps == steps_before
    assert torch.equal(torch.rand(4), rng_after_save)  # the RNG came back too
    mb, wb = train(b), weights(b)
    assert b.steps == a.steps == steps_before + 1
    return ma, mb, wa, wb, a, b


def policy_loss(logprobs, old_logprobs, gen_logprobs, advantages, mask, *, horizon=16, ref_logprobs=None,
                entropy=None, num_tokens=None, num_seqs=None, **options):
    """One call of the PolicyLoss that a policy_loss section with `options` builds."""
    from pipeline.algos.policy_loss import PolicyLoss
    from pipeline.config import PolicyLossConfig
    loss = PolicyLoss(PolicyLossConfig(**options), horizon)
    return loss(logprobs, old_logprobs, gen_logprobs, advantages, mask, ref_logprobs=ref_logprobs, entropy=entropy,
                num_tokens=num_tokens, num_seqs=num_seqs)
