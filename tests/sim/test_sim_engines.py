"""The simulated training and critic engines (pipeline/sim/engines.py): their
state round trip, and the alignment checks the real engines make too.
"""
from __future__ import annotations

import pytest
from tests.support.training_helpers import make_table, per_token

from pipeline.algos.ppo import compute_advantages
from pipeline.sim.engines import SimCriticEngine, SimTrainingEngine

pytestmark = pytest.mark.unit


def test_sim_engines_save_and_load_state(tmp_path):
    from pipeline.config import SimConfig
    cfg = SimConfig(train_s=0.0)
    table = make_table()
    t = SimTrainingEngine(cfg, seed=0)
    t.train_step(table, per_token(table, [1.0] * 6))
    t.save_state(str(tmp_path / "t"))
    u = SimTrainingEngine(cfg, seed=0)
    u.load_state(str(tmp_path / "t"))
    assert u.export_weights() == t.export_weights() == {"sim_updates": 1}
    with pytest.raises(ValueError, match="advantages"):
        t.train_step(table, per_token(table, [1.0] * 6).slice(0, 5))

    c = SimCriticEngine(cfg, seed=0)
    targets, _ = compute_advantages(table, c.values(table), gamma=1.0, lam=1.0, whiten_advantages=True)
    c.train_step(table, targets)
    assert c.values(table)[0][0] > 0  # moved towards the mean return
    c.save_state(str(tmp_path / "c"))
    d = SimCriticEngine(cfg, seed=0)
    d.load_state(str(tmp_path / "c"))
    assert d.values(table) == c.values(table) and d.updates == c.updates == 1
    assert d.train_step(table, targets) == c.train_step(table, targets)
