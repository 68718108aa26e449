"""Non-finite values never reach the weights: a NaN or inf reward is a reward
failure, a NaN or inf loss or gradient skips the optimizer step (weights and
optimizer state bit-identical, every rank together), fault.max_nonfinite_steps
skips in a row stop the run, and non-finite weights are never saved.

The engines are the real DeepSpeed ones on a tiny random Llama (one process,
world size 1, as in tests/trainer/test_deepspeed_policy.py); the limit end to end is
tests/run/test_faults.py's (simulated workers, and the command line)."""
from __future__ import annotations

import json
import math
import re
import time

import pytest
import torch
from tests.support.training_helpers import (  # noqa: F401  (model_dir is a fixture)
    engine_config,
    make_table,
    model_dir,
    per_token,
)

from dags.tokens import Gate, Launch
from pipeline.generator.worker import GeneratorWorker
from pipeline.trainer.skipped_steps import NonfiniteStepsError, SkippedSteps, console_warnings
from pipeline.trainer import finite
from pipeline.trainer.deepspeed_critic import DeepSpeedCriticEngine
from pipeline.trainer.deepspeed_policy import DeepSpeedPolicyEngine
from pipeline.core.types import Completion, Prompt
from pipeline.envs.interface import check_step_result
from pipeline.rewards.scoring import score_sample
from pipeline.config import ConfigError, load_config
from pipeline.config.sections import ValSetConfig
from pipeline.evaluation.sets import EvalSet
from pipeline.core.events import EventLog

pytestmark = pytest.mark.real

torch.set_num_threads(1)
NAN, INF = float("nan"), float("inf")


# ------------------------------------------------------------------ rewards

class Loop:
    """The engine loop's validate call, answered at once (validate's only use of it)."""

    def __init__(self, completions):
        self.completions = completions

    def call(self, command, _arg, _deadline, _what):
        assert command == "validate"
        return self.completions


def scorer(tmp_path, rewards) -> GeneratorWorker:
    """A generator with only what scoring needs: a reward function returning `rewards` in turn."""
    g = GeneratorWorker(0)
    values = iter(rewards)
    g.reward_fn = lambda prompt, text: next(values)
    g.reward_model, g.scored_here = None, True   # no reward model: scored here
    g.cfg = load_config(None, [])
    g.log = EventLog(tmp_path, "gen0", time.time())
    return g


def completion(**kw) -> Completion:
    return Completion(prompt_ids=(1, 2), response_ids=(3, 4), logprobs=(-1.0, -1.0), text="11", **kw)


def events(tmp_path, name: str) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "events" / "gen0.jsonl").read_text().splitlines()
            if json.loads(line)["ev"] == name]


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_a_nonfinite_reward_is_a_reward_failure_named_by_its_value(tmp_path, bad):
    g = scorer(tmp_path, [1.0, bad, 0.0, 0.5])
    prompt = Prompt("p0", "repeat: 1 1")
    launch = Launch("t0.g0", 0, 0, (prompt,))
    table = g._table(launch, 0, [[completion() for _ in range(4)]])
    g.log.close()
    # Scored like a sample whose reward raised: its group's mean good reward, so its advantage is 0.
    assert table.column("reward").to_pylist() == [1.0, 0.5, 0.0, 0.5]
    assert all(math.isfinite(r) for rs in table.column("token_rewards").to_pylist() for r in rs)
    reason = f"prompt p0: reward function returned {bad}"
    assert table.column("reward_error").to_pylist() == ["", reason, "", ""]
    assert [e["reason"] for e in events(tmp_path, "reward_failed")] == [reason]


def test_validation_leaves_a_nonfinite_reward_out_of_its_sum(tmp_path):
    g = scorer(tmp_path, [1.0, NAN, INF, 0.25])
    g.val_sets = [EvalSet(ValSetConfig(name=""), tuple(Prompt(f"v{i}", "repeat: 1") for i in range(4)),
                          ((None,),) * 4, None)]
    g._loop, g.version = Loop([completion() for _ in range(4)]), 0
    out = g.validate(Gate(0, 0, ("",)))
    g.log.close()
    sums = dict(out.scores)
    assert (sums["\t\tmean@1"], sums["\t\tscored"], sums["\t\tfailed"]) == (1.25, 2.0, 2.0)


def test_an_environment_step_with_a_nonfinite_reward_fails_its_sample():
    for bad in (NAN, INF):
        with pytest.raises(ValueError, match=f"step\\(\\) returned reward {bad}; a reward must be finite"):
            check_step_result(("obs", bad, False, {}))
    # A sum of finite turn rewards that overflowed is refused too (the episode's reward).
    reward, error = score_sample(Prompt("p1", ""), completion(reward=INF, token_rewards=(1e308, 1e308)), None)
    assert (reward, error) == (0.0, "prompt p1: environment rewards sum to inf")


# ------------------------------------------------------------------ engines

def policy(model_dir, *overrides):
    return DeepSpeedPolicyEngine(engine_config(model_dir, "training.micro_batch_size=4", "training.lr=1e-3",
                                               *overrides))


def exact_weights(engine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.export_weights().items()}


def optimizer_state(engine) -> list[torch.Tensor]:
    """Everything the torch optimizer owns: its master weights and each one's moments and step."""
    inner = finite.torch_optimizer(engine.engine)
    out = []
    for group in inner.param_groups:
        for p in group["params"]:
            out.append(p.detach().clone())
            out += [v.detach().clone() if torch.is_tensor(v) else torch.tensor(v)
                    for _, v in sorted(inner.state.get(p, {}).items())]
    return out


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    changed = [k for k in a if not torch.equal(a[k], b[k])]
    assert not changed, f"changed: {changed[:5]}"


TABLE = make_table()
GOOD = per_token(TABLE, [0.5, -0.5] * 3)
NAN_ADVANTAGE = per_token(TABLE, [0.5, -0.5, NAN, -0.5, 0.5, -0.5])


@pytest.mark.parametrize("zero_stage,dtype", [(0, "fp32"), (1, "fp32"), (3, "fp32"), (0, "bf16"), (2, "bf16")])
def test_a_nan_advantage_leaves_weights_and_optimizer_bit_identical(model_dir, zero_stage, dtype):
    training = (f"training.zero_stage={zero_stage}", f"training.dtype={dtype}")
    skipping, clean = policy(model_dir, *training), policy(model_dir, *training)
    try:
        for e in (skipping, clean):
            assert e.train_step(TABLE, GOOD)["nonfinite_skipped"] == 0.0
        weights, state = exact_weights(skipping), optimizer_state(skipping)
        m = skipping.train_step(TABLE, NAN_ADVANTAGE)
        assert m["nonfinite_skipped"] == 1.0 and not math.isfinite(m["loss"]) and not math.isfinite(m["grad_norm"])
        assert skipping.steps == 1 and m["step"] == 1.0
        assert_same(exact_weights(skipping), weights)
        after = optimizer_state(skipping)
        assert len(after) == len(state) and all(torch.equal(x, y) for x, y in zip(after, state))
        # Nothing of the skipped step lingers (gradients, buffers): the next step is the clean engine's.
        assert skipping.train_step(TABLE, GOOD)["nonfinite_skipped"] == 0.0
        clean.train_step(TABLE, GOOD)
        assert skipping.steps == clean.steps == 2
        assert_same(exact_weights(skipping), exact_weights(clean))
    finally:
        skipping.close(), clean.close()


def test_a_nan_loss_with_finite_gradients_is_skipped_too(model_dir):
    e = policy(model_dir)
    loss = e._loss
    # A NaN added to the loss leaves every gradient finite: only the loss tells.
    e._loss = lambda batch, n: (lambda out: (out[0] + NAN, out[1]))(loss(batch, n))
    try:
        weights = exact_weights(e)
        m = e.train_step(TABLE, GOOD)
        assert m["nonfinite_skipped"] == 1.0 and math.isnan(m["loss"]) and math.isfinite(m["grad_norm"])
        assert e.steps == 0
        assert_same(exact_weights(e), weights)
    finally:
        e.close()


def test_lora_and_the_critic_skip_a_nonfinite_step(model_dir):
    lora = policy(model_dir, "training.lora.rank=8", "training.lr=1e-2")
    critic = DeepSpeedCriticEngine(engine_config(model_dir, "algorithm=ppo", "training.micro_batch_size=4",
                                                 "ppo.critic_lr=1e-2"))
    try:
        adapters = exact_weights(lora)
        m = lora.train_step(TABLE, NAN_ADVANTAGE)
        assert m["nonfinite_skipped"] == 1.0 and lora.steps == 0
        assert_same(exact_weights(lora), adapters)
        values = {k: v.clone() for k, v in critic.engine.module.state_dict().items()}
        nan_returns = per_token(TABLE, [1.0, NAN, 1.0, 1.0, 1.0, 1.0])
        m = critic.train_step(TABLE, nan_returns)
        assert m["nonfinite_skipped"] == 1.0 and math.isnan(m["value_loss"]) and critic.steps == 0
        assert_same({k: v.clone() for k, v in critic.engine.module.state_dict().items()}, values)
        assert critic.train_step(TABLE, per_token(TABLE, [1.0] * 6))["nonfinite_skipped"] == 0.0
        assert critic.steps == 1
    finally:
        lora.close(), critic.close()


# ------------------------------------------------------------------ the limit

class Log:
    def __init__(self):
        self.events = []

    def emit(self, ev, step=None, version=None, **extra):
        self.events.append({"ev": ev, "step": step, "version": version, **extra})


def test_skips_in_a_row_up_to_the_limit_stop_the_run_and_a_good_step_resets_the_count(capsys):
    log = Log()
    skipped = SkippedSteps(log, "policy", limit=3)
    nan_step = {"loss": NAN, "grad_norm": 0.5, "nonfinite_skipped": 1.0}
    for step, metrics in enumerate([nan_step, nan_step, {"loss": 0.1, "nonfinite_skipped": 0.0},
                                    nan_step, nan_step]):
        skipped.check(step, step, metrics)
    assert [(e["step"], e["in_a_row"], e["loss"], e["grad_norm"]) for e in log.events] == [
        (0, 1, "nan", 0.5), (1, 2, "nan", 0.5), (3, 1, "nan", 0.5), (4, 2, "nan", 0.5)]
    assert "step 4: the policy's loss nan: optimizer step skipped" in capsys.readouterr().err
    with pytest.raises(NonfiniteStepsError, match=r"the policy skipped 3 optimizer steps in a row .*"
                                                  r"\(step 5: gradient norm inf\), fault.max_nonfinite_steps is 3"):
        skipped.check(5, 5, {"loss": 0.2, "grad_norm": INF, "nonfinite_skipped": 1.0})


def test_the_console_names_the_skipped_update_and_its_values():
    lines = console_warnings(7, {"loss": NAN, "grad_norm": NAN, "nonfinite_skipped": 1.0,
                                 "critic/value_loss": 0.3, "critic/grad_norm": 1.0,
                                 "critic/nonfinite_skipped": 0.0}, 3)
    assert lines == ["dagrl: warning: step 7: the policy's loss nan and gradient norm nan: optimizer step "
                     "skipped, weights unchanged (fault.max_nonfinite_steps 3 in a row stop the run)"]
    assert console_warnings(7, {"loss": 0.1, "nonfinite_skipped": 0.0}, 3) == []


def test_max_nonfinite_steps_is_at_least_one():
    assert load_config(None, []).fault.max_nonfinite_steps == 3
    with pytest.raises(ConfigError, match="fault.max_nonfinite_steps"):
        load_config(None, ["fault.max_nonfinite_steps=0"])


# ------------------------------------------------------------------ saving

def test_nonfinite_weights_are_never_saved(model_dir, tmp_path):
    e = policy(model_dir)
    try:
        name, param = next((n, p) for n, p in e.engine.module.named_parameters() if n.endswith("q_proj.weight"))
        with torch.no_grad():
            param[0, 0] = NAN
        with pytest.raises(finite.NonfiniteWeightsError, match=rf"non-finite weights \(NaN or inf\) in {name}"):
            e.save(str(tmp_path / "policy"))
        with pytest.raises(finite.NonfiniteWeightsError, match="refusing to save the engine state"):
            e.save_state(str(tmp_path / "trainer_state"))
        assert not (tmp_path / "policy").exists() and not (tmp_path / "trainer_state").exists()
    finally:
        e.close()


# ------------------------------------------------------------------ end to end

def test_a_real_run_whose_every_reward_is_nan_stops_naming_max_reward_failures(tmp_path, tiny_model):
    """vLLM-CPU and DeepSpeed-CPU: the first batch's NaN rewards are reward failures, past
    fault.max_reward_failures (0), so the run stops non-zero before any NaN is trained on."""
    from tests.support._procs import run_driver
    log = tmp_path / "run.log"
    status = run_driver(["--config", "examples/tiny_grpo.yaml", f"model.path={tiny_model}",
                         f"run.output_dir={tmp_path}", "run.name=nan", "run.steps=3", "run.checkpoint_every=0",
                         "validation.period=0", "validation.at_end=false", "run.dag_mode=classic",
                         "data.reward=tests.support.nonfinite_reward:nan_reward", "metrics.progress=false",
                         "metrics.tensorboard=false"], log, timeout_s=400)
    out = log.read_text()
    assert status == 1, out[-3000:]
    # The run's first line: this machine's bf16 units (training.dtype auto would use them).
    from pipeline.core.precision import cpu_bf16_flags, describe_cpu
    assert out.splitlines()[0] == describe_cpu("fp32", cpu_bf16_flags()), out[:2000]
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert errors and re.search(r"failed on \d+ samples, more than fault.max_reward_failures \(0\); the last: "
                                r"prompt \S+: reward function returned nan", errors[-1]), out[-3000:]
    assert not (tmp_path / "nan" / "checkpoints").exists()
