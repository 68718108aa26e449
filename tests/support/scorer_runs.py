"""The sim runs that the reward model's and the teacher's tests share: two
generators, jittered timings, validation every third step, and check-events
clean on what they logged."""
from __future__ import annotations

from pipeline.core.events import load_events
from pipeline.run.driver import train
from pipeline.tools.check import check_events
from tests.run.test_faults import sim_config


def checked_scorer_run(tmp_path, name: str, steps: int, **overrides):
    """(summary, events) of a sim run with `overrides`; fails on any check-events violation."""
    cfg = sim_config(tmp_path, name, run__steps=steps, generation__num_generators=2, validation__period=3,
                     sim__generate_s=0.02, sim__train_s=0.01, sim__jitter=0.5, **overrides)
    summary = train(cfg, quiet=True)
    events = load_events(tmp_path / name)
    violations = check_events(events)
    assert violations == [], "\n".join(v.message for v in violations)
    return summary, events
