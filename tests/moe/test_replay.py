"""Routing replay in the trainer's forward (pipeline/moe/replay.py) on a tiny
random Qwen3-MoE built in memory: given routes, each MoE block computes
exactly those experts, gated by its router's own softmax at them, the router
gets a gradient, and a position without a route routes as the model would."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.moe.replay import install_replay, replaying
from pipeline.moe.routes import RouteLayout, RoutingError, route_layout
from pipeline.trainer.rows import collate, trajectory_rows

pytestmark = pytest.mark.unit

LAYOUT = RouteLayout(layers=(0, 1), top_k=2, num_experts=4)


def tiny_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    config = Qwen3MoeConfig(vocab_size=40, hidden_size=16, intermediate_size=32, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                            num_experts=4, num_experts_per_tok=2, max_position_embeddings=64, norm_topk_prob=True)
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(config).eval()


def record_blocks(model) -> dict:
    """Each layer's router logits and what its experts are called with (top_k_index, top_k_weights)."""
    seen = {}
    for i, layer in enumerate(model.model.layers):
        layer.mlp.gate.register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(("logits", i), out[0]))
        layer.mlp.experts.register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(("experts", i), a[1:3]))
    return seen


def rows_with_routes(lengths):
    rng = np.random.default_rng(0)
    rows = []
    for prompt, response in lengths:
        routes = np.stack([rng.permutation(4)[:2] for _ in range((prompt + response - 1) * 2)])
        routes = routes.reshape(-1, 2, 2).astype(np.uint8)
        rows.append({"prompt_ids": rng.integers(1, 40, prompt).tolist(),
                     "response_ids": rng.integers(1, 40, response).tolist(), "loss_mask": [1] * response,
                     "routed_experts": LAYOUT.encode(routes), "routes": routes})
    return rows


def forward(model, batch):
    if "positions" in batch:
        return model(input_ids=batch["ids"], position_ids=batch["positions"]).logits
    return model(input_ids=batch["ids"], attention_mask=batch["attn"]).logits


@pytest.mark.parametrize("packed", [False, True])
def test_each_block_computes_exactly_the_replayed_experts_gated_by_its_router(packed):
    model = tiny_moe()
    assert install_replay(model, LAYOUT) == 2
    seen = record_blocks(model)
    rows = rows_with_routes([(3, 4), (5, 2)])
    batch = collate(rows, "cpu", {}, packed=packed)
    with replaying(LAYOUT, batch) as replay:
        logits = forward(model, batch)
    starts = [0, 7] if packed else [0, batch["ids"].shape[1]]
    for slot, layer in enumerate(LAYOUT.layers):
        index, weights = seen[("experts", layer)]
        probs = torch.softmax(seen[("logits", layer)].float(), dim=-1)
        for row, start in zip(rows, starts):
            n = len(row["routes"])
            replayed = torch.from_numpy(row["routes"][:, slot]).long()
            assert torch.equal(index[start:start + n], replayed)
            gates = probs[start:start + n].gather(-1, replayed)
            torch.testing.assert_close(weights[start:start + n], gates / gates.sum(-1, keepdim=True))
            # A row's last token has no route (no engine forward read it): the router's own top-k.
            assert torch.equal(index[start + n].sort().values, probs[start + n].topk(2).indices.sort().values)
    assert replay.routed == sum(len(r["routes"]) for r in rows) and 0 < replay.flip_share <= 1
    logits.sum().backward()
    for layer in model.model.layers:
        assert layer.mlp.gate.weight.grad is not None and layer.mlp.gate.weight.grad.abs().sum() > 0


def test_routes_that_are_the_routers_own_change_nothing_and_count_no_flips():
    model = tiny_moe()
    rows = rows_with_routes([(4, 3)])
    batch = collate(rows, "cpu", {})
    plain = forward(model, batch)
    seen = record_blocks(model)
    forward(model, batch)
    own = np.stack([seen[("experts", layer)][0][:6].numpy() for layer in LAYOUT.layers], axis=1)
    rows[0]["routed_experts"] = LAYOUT.encode(own.astype(np.uint8))
    install_replay(model, LAYOUT)
    batch = collate(rows, "cpu", {})
    with replaying(LAYOUT, batch) as replay:
        replayed = forward(model, batch)
    torch.testing.assert_close(replayed, plain)
    assert replay.flip_share == 0.0


def test_measuring_only_leaves_the_routing_alone():
    model = tiny_moe()
    batch = collate(rows_with_routes([(4, 3)]), "cpu", {})
    plain = forward(model, batch)
    install_replay(model, LAYOUT)
    with replaying(LAYOUT, batch, apply=False) as replay:
        measured = forward(model, batch)
    torch.testing.assert_close(measured, plain)
    assert replay.flip_share > 0


def test_routes_of_the_wrong_length_are_refused():
    model = tiny_moe()
    install_replay(model, LAYOUT)
    rows = rows_with_routes([(4, 3)])
    rows[0]["response_ids"].append(5)
    rows[0]["loss_mask"].append(1)
    with pytest.raises(ValueError, match="routes for 6 tokens; its 8 tokens need 7"):
        with replaying(LAYOUT, collate(rows, "cpu", {})):
            pass


def test_the_layout_is_read_from_config_json_and_a_dense_model_is_refused(tmp_path):
    import json
    model = tiny_moe()
    model.config.mlp_only_layers = [0]
    model.config.save_pretrained(tmp_path / "moe")
    layout = route_layout(tmp_path / "moe")
    assert layout == RouteLayout(layers=(1,), top_k=2, num_experts=4) and layout.bytes_per_token == 2
    routes = np.array([[[3, 1]], [[0, 2]]], dtype=np.uint8)
    assert np.array_equal(layout.decode(layout.encode(routes)), routes)
    assert RouteLayout((0,), 8, 512).dtype == np.uint16
    (tmp_path / "dense").mkdir()
    (tmp_path / "dense" / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    with pytest.raises(RoutingError, match="llama.*not a mixture of experts"):
        route_layout(tmp_path / "dense")
    (tmp_path / "mixtral").mkdir()
    (tmp_path / "mixtral" / "config.json").write_text(json.dumps(
        {"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 2}))
    with pytest.raises(RoutingError, match="built for qwen3_moe, not 'mixtral'"):
        route_layout(tmp_path / "mixtral")


def test_routes_ride_a_checkpointed_buffer_and_a_shard_unchanged(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.controller.controller import in_trajectory_schema
    from pipeline.core.types import TRAJECTORY_SCHEMA
    rows = rows_with_routes([(3, 4), (5, 2)])
    table = pa.Table.from_pylist([dict(batch_id="b", target=0, version=0, prompt_id=f"p{i}", prompt_ids=r["prompt_ids"],
                                       response_ids=r["response_ids"], logprobs=[-1.0] * len(r["response_ids"]),
                                       reward=0.0, routed_experts=r["routed_experts"]) for i, r in enumerate(rows)],
                                 schema=TRAJECTORY_SCHEMA)
    pq.write_table(table, tmp_path / "buffer.parquet")  # as the controller checkpoints its buffer
    restored = in_trajectory_schema(pq.read_table(tmp_path / "buffer.parquet"))
    assert restored.column("routed_experts").to_pylist() == [r["routed_experts"] for r in rows]
    shard = trajectory_rows(restored.slice(1, 1))  # a data-parallel rank's rows
    assert np.array_equal(LAYOUT.decode(shard[0]["routed_experts"]), rows[1]["routes"])
