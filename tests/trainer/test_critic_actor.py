"""The PPO critic actor's nodes, critic_values, advantages and critic_train,
on the simulated and the DeepSpeed critic, and its state round trip.
"""
from __future__ import annotations

import time

import pytest
import torch
from tests.support.training_helpers import make_table, model_dir  # noqa: F401  (model_dir is a fixture)

pytestmark = pytest.mark.real

torch.set_num_threads(1)


@pytest.mark.parametrize("backend", ["sim", "real"])
def test_critic_worker_nodes(tmp_path, ray_session, model_dir, backend):
    from dags.tokens import Advantages, Batch, CriticOut, Stored, Values
    from pipeline.trainer.critic_worker import CriticWorker
    from pipeline.core.node import NodeError
    from pipeline.config import load_config
    ray = ray_session
    cfg = load_config(None, [f"backend={backend}", "algorithm=ppo", f"model.path={model_dir}",
                             "data.train=x", "data.reward=x", "sim.train_s=0", "ppo.gamma=1.0",
                             "ppo.lam=1.0", "ppo.whiten_advantages=false"])
    table = make_table()
    w = CriticWorker()
    w.begin_run(cfg, str(tmp_path / "run"), time.time())
    values = w.critic_values(Batch(3, ("b0",), (2,), Stored(ray.put(table))))
    assert isinstance(values, Values) and values.step == 3 and values.rank == 0
    adv = w.advantages(values)
    assert isinstance(adv, Advantages) and adv.step == 3
    got = adv.table_ref.fetch(60)
    # values start at 0 for both engines, so A = R = the row's reward on every token
    lengths = [len(r) for r in table.column("response_ids").to_pylist()]
    rewards = table.column("reward").to_pylist()
    assert got.column("advantages").to_pylist() == [[r] * n for r, n in zip(rewards, lengths)]
    out = w.critic_train(adv)
    metrics = dict(out.metrics)
    assert isinstance(out, CriticOut) and out.step == 3
    assert {"value_loss", "explained_var", "returns_mean", "values_mean"} <= metrics.keys()
    # value loss at V = 0: 0.5 * mean(R^2) over tokens; R in {0, 1} -> 0.5 * share of reward-1 tokens
    ones = sum(n for r, n in zip(rewards, lengths) if r == 1.0)
    assert metrics["value_loss"] == pytest.approx(0.5 * ones / sum(lengths), abs=1e-6)
    with pytest.raises(NodeError, match="critic_train of step 3 without its critic_values"):
        w.critic_train(adv)
    w.save_state(str(tmp_path / "state"))
    v = CriticWorker()
    v.begin_run(cfg, str(tmp_path / "run2"), time.time(), restore_dir=str(tmp_path / "state"))
    assert v.engine.values(table) == w.engine.values(table) != [[0.0] * n for n in lengths]
    w.log.close(), v.log.close()
