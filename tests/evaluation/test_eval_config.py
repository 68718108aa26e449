"""validation.sets in a recipe: what loads, and each mistake an error naming the set and the key."""
from __future__ import annotations

import pytest

from pipeline.config import ConfigError, load_config
from pipeline.evaluation.sets import due_after, due_at_start

pytestmark = pytest.mark.unit

TWO_SETS = ("validation.sets=[{name: greedy}, {name: sampled, n: 4, temperature: 1.0, k: [1, 2, 4], period: 3}]")


def test_sets_load_and_round_trip(tmp_path):
    cfg = load_config(None, [TWO_SETS, "validation.period=2"])
    greedy, sampled = cfg.validation.sets
    assert (greedy.n, greedy.temperature, greedy.k) == (1, 0.0, ())
    assert (sampled.n, sampled.temperature, sampled.k, sampled.period) == (4, 1.0, (1, 2, 4), 3)
    import yaml
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    assert load_config(path) == cfg


def test_each_set_has_its_period():
    cfg = load_config(None, [TWO_SETS, "validation.period=2", "run.steps=7", "validation.at_end=true",
                             "validation.at_start=true"])
    assert [due_after(s, cfg) for s in range(7)] == [
        (), ("greedy",), ("sampled",), ("greedy",), (), ("greedy", "sampled"), ("greedy", "sampled")]
    assert due_at_start(cfg, 0) == ("greedy", "sampled") and due_at_start(cfg, 3) == ()
    # No sets: the implicit one (""), on validation.period.
    assert due_after(1, load_config(None, ["validation.period=2"])) == ("",)


@pytest.mark.parametrize("sets,needle", [
    ("[{name: 'a/b'}]", "validation.sets[0].name: 'a/b' must be a non-empty name"),
    ("[{n: 2}]", "validation.sets[0].name: '' must be a non-empty name"),
    ("[{name: a}, {name: a}]", "validation.sets[a].name: 'a' names two sets"),
    ("[{name: a, n: 2, temperature: 1, k: [1, 4]}]", "validation.sets[a].k: 4 is more than the set's n (2)"),
    ("[{name: a, n: 2}]", "validation.sets[a].n: 2 greedy samples (temperature 0)"),
    ("[{name: a, n: 2, temperature: 1, vote_on: boxed}]", "validation.sets[a].vote_on: 'boxed' is set, but k is empty"),
    ("[{name: a, vote_on: words}]", "validation.sets[0].vote_on: 'words' is not allowed"),
    ("[{name: a, k: [0]}]", "validation.sets[0].k: expected a list of positive integers"),
    ("[{name: a, temp: 1}]", "unknown key 'validation.sets[0].temp'"),
    ("{name: a}", "validation.sets: expected a list of mappings"),
    ("[{name: a, reward: 'm:f'}]", "validation.sets[a].reward: scores single-turn validations on the real stack"),
])
def test_bad_sets_name_the_set_and_key(sets, needle):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"validation.sets={sets}"])
    assert needle in str(err.value)
    assert str(err.value).startswith("override ") and "validation.sets=" in str(err.value).split(":")[0]


def test_real_sets_need_their_data(tmp_path):
    with pytest.raises(ConfigError, match=r"validation.sets\[gsm\].data: not set"):
        load_config(None, ["model.path=m", "data.train=t.jsonl", "data.reward=a:b", "validation.sets=[{name: gsm}]"])


def _real(tmp_path, sets: str):
    return load_config(None, ["model.path=m", "data.train=t.jsonl", "data.reward=pipeline.rewards.rules:tiny_reward",
                              f"validation.sets={sets}"])


def test_missing_set_file_names_the_set_and_key(tmp_path):
    from pipeline.inputs.datasets import DataError
    from pipeline.inputs.preflight import check_val_sets
    cfg = _real(tmp_path, f"[{{name: gsm, data: '{tmp_path}/missing.jsonl'}}]")
    with pytest.raises(DataError, match=r"^validation.sets\[gsm\].data: .*missing.jsonl"):
        check_val_sets(cfg)


def test_unknown_set_reward_names_the_set_and_key(tmp_path):
    from pipeline.inputs.preflight import check_val_sets
    from pipeline.rewards.specs import RewardError
    data = tmp_path / "v.jsonl"
    data.write_text('{"prompt": "a", "answer": "a"}\n')
    check_val_sets(_real(tmp_path, f"[{{name: v, data: '{data}'}}]"))  # data.reward scores it
    cfg = _real(tmp_path, f"[{{name: v, data: '{data}', reward: 'pipeline.rewards.rules:no_such'}}]")
    with pytest.raises(RewardError, match=r"^validation.sets\[v\].reward: .*no_such"):
        check_val_sets(cfg)


def test_a_samples_seed_is_the_same_whichever_generator_decodes_it():
    from pipeline.evaluation.sets import load_sets
    cfg = load_config(None, [TWO_SETS, "sim.num_val_prompts=5", "run.seed=7"])

    def seeds(shards: int) -> dict:
        return {(s.spec.name, p.id): seeds for shard in range(shards) for s in load_sets(cfg, shard, shards)
                for p, seeds in zip(s.prompts, s.seeds)}
    whole = seeds(1)
    assert seeds(2) == seeds(3) == whole and len(whole) == 10
    assert all(seed == (None,) for (name, _), seed in whole.items() if name == "greedy")
    sampled = [seed for (name, _), seed in whole.items() if name == "sampled"]
    assert all(len(set(s)) == 4 for s in sampled) and len({x for s in sampled for x in s}) == 20
    # Another run seed draws other samples.
    other = load_sets(load_config(None, [TWO_SETS, "sim.num_val_prompts=5", "run.seed=8"]))[1].seeds
    assert not set(other[0]) & set(sampled[0])
