"""Recipes and overrides: every bad value is an error that names its key."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import ConfigError, load_config
from pipeline.tools.config_table import reference_table

pytestmark = pytest.mark.unit


def test_recipe_and_overrides(tmp_path):
    cfg = load_config("examples/sim_grpo.yaml", ["schedule.max_age=2", "run.name=x", "training.lr=1e-4",
                                                "sim.jitter=0.5", "validation.at_end=false"])
    assert cfg.schedule.max_age == 2 and cfg.run.name == "x" and cfg.training.lr == 1e-4
    assert cfg.sim.jitter == 0.5 and cfg.validation.at_end is False
    assert cfg.validation.period == 5  # from the recipe


@pytest.mark.parametrize("override,needle", [
    ("schedule.max_ag=2", "unknown key 'schedule.max_ag'; allowed keys here: max_age"),
    ("schedule.max_ag=2", "did you mean 'schedule.max_age'?"),
    ("grpo.max_age=2", "unknown key 'grpo': section 'grpo' is gone; its keys moved: "),
    ("grpo.val_period=2", "val_period -> validation.period"),
    ("reward.max_failures=2", "max_failures -> fault.max_reward_failures"),
    ("fault.deadline_s=2", "unknown key 'fault.deadline_s': 'fault.deadline_s' is now 'run.deadline_s'"),
    ("training.num_workers=2", "unknown key 'training.num_workers': 'training.num_workers' is now "
                               "'training.ranks'"),
    ("ppo.critic_num_workers=2", "'ppo.critic_num_workers' is now 'ppo.critic_ranks'"),
    ("env.num_workers=2", "'env.num_workers' is now 'env.actors'"),
    ("sim.fault=train_exit", "unknown key 'sim.fault': 'sim.fault' is now 'inject.fault'"),
    ("sim.fault_after=2", "'sim.fault_after' is now 'inject.after'"),
    ("sim.fault_worker=1", "'sim.fault_worker' is now 'inject.worker'"),
    ("sim.fault_incarnations=2", "'sim.fault_incarnations' is now 'inject.incarnations'"),
    ("inject.fault=oom", "inject.fault: 'oom' is not allowed; choose one of '', 'train_raise'"),
    ("generation.refit_mode=fast", "generation.refit_mode: 'fast' is not allowed; choose one of 'drain', "
                                   "'inflight'"),
    ("generation.inflight_kv=drop", "generation.inflight_kv: 'drop' is not allowed"),
    ("schedule.max_age=-1", "schedule.max_age: -1 is out of range; it must be >= 0"),
    ("schedule.max_age=two", "schedule.max_age: expected an integer, got 'two'"),
    ("schedule.max_age=1.5", "schedule.max_age: expected an integer"),
    ("run.dag_mode=fast", "run.dag_mode: 'fast' is not allowed; choose one of 'auto', 'compiled', 'classic'"),
    ("backend=gpu", "backend: 'gpu' is not allowed"),
    ("validation.at_start=maybe", "validation.at_start: expected true or false"),
    ("generation.top_p=0", "generation.top_p: 0.0 is out of range; it must be > 0"),
    ("training.zero_stage=4", "training.zero_stage: 4 is out of range; it must be <= 3"),
    ("training.dtype=fp16", "training.dtype: 'fp16' is not allowed; choose one of 'fp32', 'bf16', 'auto'"),
    ("schedule.group_size=0", "schedule.group_size: 0 is out of range; it must be >= 1"),
    ("nosection.x=1", "unknown key 'nosection'"),
    ("schedule=3", "schedule: expected a mapping"),
    ("schedule.max_age", "expected key=value"),
    ("run.name=a/b", "run.name: 'a/b' must be a non-empty name"),
    ("run.name=..", "run.name: '..' must be a non-empty name"),
    ("run.name=' '", "run.name: ' ' must be a non-empty name"),
    ("training.lr=.inf", "training.lr: expected a finite number, got inf"),
    ("run.deadline_s=.nan", "run.deadline_s: expected a finite number, got nan"),
    ("algorithm=gae", "algorithm: 'gae' is not allowed; choose one of 'grpo', 'dr_grpo', 'rloo', 'reinforce_pp', "
                      "'ppo'"),
    ("policy_loss.dual_clip=0.5", "policy_loss.dual_clip: 0.5 must be > 1"),
    ("policy_loss.mode=ppo2", "policy_loss.mode: 'ppo2' is not allowed; choose one of 'clip', 'gspo', 'cispo'"),
    ("policy_loss.is_mode=drop", "policy_loss.is_mode: 'drop' is not allowed"),
    ("policy_loss.aggregation=seq-mean", "policy_loss.aggregation: 'seq-mean' is not allowed"),
    ("training.lr_schedule=step", "training.lr_schedule: 'step' is not allowed"),
])
def test_bad_override_names_the_key(override, needle):
    with pytest.raises(ConfigError) as err:
        load_config("examples/sim_grpo.yaml", [override])
    assert needle in str(err.value)
    if "=" in override:  # the override is blamed, not the recipe it changes
        assert str(err.value).startswith(f"override {override!r}: ")


@pytest.mark.parametrize("overrides,needle", [
    (["algorithm=rloo", "schedule.group_size=1"], "schedule.group_size: 1 gives every sample a zero advantage "
                                                  "(rloo compares the samples of one prompt)"),
    (["policy_loss.mode=cispo", "policy_loss.dual_clip=3"], "policy_loss.dual_clip: cispo clips the IS weight"),
    (["training.mini_batches=3", "training.ranks=3"], "training.mini_batches: 3 mini-batches of whole prompt "
                                                      "groups for 3 rank(s) need schedule.prompts_per_step >= 9"),
    (["algorithm=ppo", "overlong.buffer=4"], "overlong.buffer: shapes the outcome rewards of the critic-free"),
    (["overlong.buffer=16"], "overlong.buffer: 16 must be below generation.max_new_tokens (16)"),
    (["algorithm=ppo", "dynamic_sampling.max_rounds=2"], "dynamic_sampling.max_rounds: leaves out groups whose"),
    (["algorithm=ppo", "reward_kl.coef=0.01"], "reward_kl.coef: puts the KL in the rewards of the critic-free algorithms"),
    (["reward_kl.coef=0.01", "backend=sim"], "reward_kl.coef: needs the initial"),
    (["training.lr_schedule=cosine", "training.lr_warmup_steps=10", "run.steps=10"],
     "training.lr_warmup_steps: 10 leaves no step of the cosine schedule in a run of 10"),
])
def test_rules_between_the_algorithm_keys(overrides, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        load_config("examples/sim_grpo.yaml", overrides)


def test_reinforce_pp_needs_no_groups():
    assert load_config("examples/sim_grpo.yaml", ["algorithm=reinforce_pp", "schedule.group_size=1"]).train_graph \
        == "critic_free"


def test_the_override_that_set_a_key_is_blamed(tmp_path):
    # The last override to touch a key (itself or its whole section) decided its value.
    with pytest.raises(ConfigError, match=r"^override 'schedule=\{max_age: -1\}': schedule.max_age: -1 is out"):
        load_config("examples/sim_grpo.yaml", ["schedule.group_size=2", "schedule={max_age: -1}"])
    with pytest.raises(ConfigError, match=r"^override 'schedule.max_age=-2': schedule.max_age: -2 is out"):
        load_config("examples/sim_grpo.yaml", ["schedule={max_age: -1}", "schedule.max_age=-2"])
    with pytest.raises(ConfigError, match=r"^override 'data.val=': data.val: not set"):
        load_config("examples/tiny_grpo.yaml", ["data.val="])
    # A bad key the file sets is the file's, even when overrides change its neighbours.
    recipe = tmp_path / "r.yaml"
    recipe.write_text("schedule:\n  max_age: -1\n")
    with pytest.raises(ConfigError, match=rf"^{recipe}: schedule.max_age: -1 is out of range"):
        load_config(recipe, ["schedule.group_size=2"])


def test_bad_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("schedule: [unclosed\n")
    with pytest.raises(ConfigError, match=r"bad.yaml.*not valid YAML"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(listy)


def test_real_backend_requires_model_data_and_validation_data():
    with pytest.raises(ConfigError, match="model.path: not set; it is required when backend is 'real'"):
        load_config(None, ["backend=real"])
    with pytest.raises(ConfigError, match="data.val: not set, but validation is scheduled"):
        load_config("examples/tiny_grpo.yaml", ["data.val="])
    assert load_config("examples/tiny_grpo.yaml", ["data.val=", "validation.period=0", "validation.at_end=false"])


def test_cli_exits_nonzero_with_the_key_and_writes_no_run(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pipeline", "train", "--config", "examples/sim_grpo.yaml",
                           "schedule.max_age=-2", f"run.output_dir={tmp_path}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "schedule.max_age: -2 is out of range" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_recipe_from_before_the_split_is_told_where_its_keys_went(tmp_path):
    recipe = tmp_path / "old.yaml"
    recipe.write_text("grpo:\n  max_age: 1\n  clip_eps: 0.2\n")
    with pytest.raises(ConfigError) as err:
        load_config(recipe)
    assert str(err.value).startswith(f"{recipe}: unknown key 'grpo': section 'grpo' is gone; its keys moved: ")
    assert "max_age -> schedule.max_age" in str(err.value) and "clip_eps -> policy_loss.clip_eps" in str(err.value)


def test_a_removed_key_says_what_to_set_instead(tmp_path):
    recipe = tmp_path / "old.yaml"
    recipe.write_text("training:\n  micro_batch_size: 4\n  grad_accum: 4\n")
    with pytest.raises(ConfigError) as err:
        load_config(recipe)
    assert str(err.value).startswith(f"{recipe}: unknown key 'training.grad_accum': 'training.grad_accum' was "
                                     "removed: a step already sums the gradients of all its micro-batches")
    assert "training.micro_batch_size or training.max_tokens_per_micro_batch" in str(err.value)


def test_the_configuration_page_lists_every_key_as_the_config_defines_it():
    page = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    start, end = "<!-- config-table: start -->\n", "<!-- config-table: end -->"
    assert start in page and end in page
    copy = page[page.index(start) + len(start):page.index(end)]
    assert copy == reference_table(), \
        "docs/configuration.md's config table is stale: paste `python -m pipeline config-table` between its markers"
    listed = {line.split("`")[1] for line in copy.splitlines()[2:]}
    assert "schedule.max_age" in listed and "policy_loss.clip_eps" in listed and len(listed) == copy.count("\n") - 2



def test_fault_injection_is_a_section_of_its_own_for_the_simulated_workers_only(tmp_path):
    cfg = load_config("examples/sim_grpo.yaml", ["inject.fault=generate_exit", "inject.after=3", "inject.worker=1"])
    assert (cfg.inject.fault, cfg.inject.after, cfg.inject.worker, cfg.inject.incarnations) == ("generate_exit", 3,
                                                                                               1, 1)
    assert load_config(None).inject == type(cfg.inject)()  # off by default
    with pytest.raises(ConfigError, match=r"^override 'inject.worker=1': inject.worker: fault injection drives the "
                                          r"simulated workers .*; it needs backend 'sim'$"):
        load_config("examples/tiny_grpo.yaml", ["inject.worker=1"])
    # A model and fault injection, no backend: neither guess is safe, as with a sim section.
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  path: /models/m\ninject:\n  fault: train_exit\n")
    with pytest.raises(ConfigError, match=r"backend: not set, but the recipe sets both model.path \(a real run\) "
                                          r"and the inject section"):
        load_config(recipe)
    # Test-only switches: the README's table of a user's keys leaves them out.
    assert "`inject." not in reference_table() and "fault_after" not in reference_table()

# -- backend: inferred when the recipe does not set it -------------------------

REAL_KEYS = {"model": {"path": "/models/m"}, "data": {"train": "/data/t.jsonl", "reward": "m:f"}}


def _recipe(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("tree,overrides,backend", [
    (REAL_KEYS, [], "real"),                                    # names a model: a real run, never the simulator
    ({"run": {"steps": 3}}, [], "sim"),                         # no model: nothing to train but the simulation
    ({"run": {"steps": 3}, "sim": {"jitter": 0.1}}, [], "sim"),
    ({**REAL_KEYS, "backend": "sim"}, [], "sim"),               # an explicit backend always wins ...
    ({**REAL_KEYS, "backend": "real"}, ["backend=sim"], "sim"),  # ... from the recipe or the command line
    (REAL_KEYS, ["backend=sim"], "sim"),
    ({"run": {"steps": 3}}, ["model.path=/m", "data.train=/t.jsonl", "data.reward=m:f"], "real"),
    (REAL_KEYS, ["model.path="], "sim"),                        # the override that empties model.path decides
])
def test_backend_is_real_when_the_recipe_names_a_model_unless_it_says_otherwise(tmp_path, tree, overrides,
                                                                                   backend):
    import yaml
    cfg = load_config(_recipe(tmp_path, yaml.safe_dump(tree)), overrides)
    assert cfg.backend == backend
    # The run directory's config.yaml carries the resolved backend, so a resume reads the same one back.
    again = _recipe(tmp_path, yaml.safe_dump(cfg.to_dict()))
    assert load_config(again).backend == backend and "backend" in cfg.to_dict()


def test_an_unset_backend_that_cannot_be_told_is_an_error(tmp_path):
    # model.path says real, a sim section says simulated: neither guess is safe.
    recipe = _recipe(tmp_path, "model:\n  path: /models/m\nsim:\n  jitter: 0.1\n")
    with pytest.raises(ConfigError, match=rf"^{recipe}: backend: not set, but the recipe sets both model.path "
                                          r"\(a real run\) and the sim section"):
        load_config(recipe)
    assert load_config(recipe, ["backend=sim"]).backend == "sim"
    # Inferred real, the missing key's message says where 'real' came from.
    with pytest.raises(ConfigError, match=r"data.train: not set; it is required when backend is 'real' "
                                          r"\(backend is not set: model.path makes it real"):
        load_config(_recipe(tmp_path, "model:\n  path: /models/m\n"))


@pytest.mark.sim
def test_a_simulated_run_says_so_first_and_in_its_summary(tmp_path):
    """sim_grpo.yaml without its `backend:` line: inferred sim (no model), and
    the run's first console line and summary.json say that nothing was trained."""
    import json

    from tests.support._procs import run_driver
    text = Path("examples/sim_grpo.yaml").read_text()
    assert "\nbackend: sim\n" in text
    recipe = _recipe(tmp_path, text.replace("\nbackend: sim\n", "\n"))
    log = tmp_path / "out.log"
    status = run_driver(["--config", str(recipe), "run.steps=2", f"run.output_dir={tmp_path / 'runs'}",
                         "run.name=sim", "metrics.progress=false", "metrics.tensorboard=false"], log, timeout_s=300)
    out = log.read_text()
    assert status == 0, out[-3000:]
    assert out.splitlines()[0] == "dagrl: simulated workers (backend: sim): no model is trained", out[:2000]
    assert out.count("no model is trained") == 1
    summary = json.loads((tmp_path / "runs" / "sim" / "summary.json").read_text())
    assert summary["simulated"] is True and summary["backend"] == "sim" and summary["steps"] == 2
    assert "filtered_overlong" not in summary  # the simulator's prompts are no dataset


@pytest.mark.parametrize("recipe", sorted(str(p) for p in Path("examples").glob("*.yaml")))
def test_every_example_recipe_loads(recipe):
    cfg = load_config(recipe)
    assert cfg.run.name  # each recipe names its run directory
