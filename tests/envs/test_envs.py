"""The multi-turn environments and the supervised warm-up (no Ray, no vLLM)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.core.types import Prompt
from pipeline.envs.calculator import MALFORMED, CalculatorEnv, calculator_rows, write_calculator_data
from pipeline.envs.digit_game import DigitGuessEnv, game_rows, write_game_data
from pipeline.envs.interface import load_env_class
from pipeline.inputs.datasets import load_prompts

pytestmark = pytest.mark.unit

DATA = Path(__file__).resolve().parents[2] / "data"
CALC = "pipeline.envs.calculator:CalculatorEnv"
GAME = "pipeline.envs.digit_game:DigitGuessEnv"


def calc(a: int, b: int, **kwargs) -> CalculatorEnv:
    env = CalculatorEnv(**kwargs)
    env.reset(Prompt("p", f"What is {a}+{b}? Use the calculator.\n", str(a + b)))
    return env


def game(low: int, secret: int, **kwargs) -> DigitGuessEnv:
    env = DigitGuessEnv(**kwargs)
    env.reset(Prompt("g", f"Guess my digit from {low} to {low + 2}.\n", str(secret)))
    return env


def play_expert(env) -> tuple[float, int]:
    reward, turns, done = 0.0, 0, False
    while not done:
        _, r, done, _ = env.step(env.expert_action())
        reward, turns = reward + r, turns + 1
    return reward, turns


# -- calculator rules --------------------------------------------------------

def test_calculator_right_episode():
    env = CalculatorEnv()
    prompt = Prompt("p", "What is 37+45? Use the calculator.\n", "82")
    assert env.reset(prompt) == prompt.text
    assert env.step("calc 37+45") == ("result 82\n", 0.0, False, {"valid": True, "event": "call", "value": 82})
    obs, reward, done, info = env.step("answer 82")
    assert (reward, done, info["correct"]) == (1.0, True, True)
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("answer 82")


@pytest.mark.parametrize("turns, reward", [
    (["calc 37+45", "answer 81"], 0.0),             # misread result
    (["calc 37+46", "answer 83"], 0.0),             # miscopied operand: the tool obeys
    (["  calc 37 + 45 ", " answer 82 "], 1.0),      # spaces are allowed
    (["oops", "calc 37+45", "answer 82"], 1.0),     # one retry after a malformed turn
    (["answer 82"], 0.0),                           # no tool call: no pay
])
def test_calculator_rewards(turns, reward):
    env = calc(37, 45)
    for i, action in enumerate(turns):
        _, r, done, _ = env.step(action)
        assert done == (i == len(turns) - 1)
    assert r == reward


@pytest.mark.parametrize("action", ["calc 3+4 x", "answer 7 please", "calc(3+4)", "", "calc 3/4", "7"])
def test_calculator_malformed_turn_is_told_not_raised(action):
    env = calc(3, 4)
    assert env.step(action) == (MALFORMED, 0.0, False, {"valid": False, "event": "malformed"})


def test_calculator_ends_at_its_max_turns_and_computes_other_ops():
    env = calc(3, 4, max_turns=3)
    assert env.step("calc 9*9")[0] == "result 81\n"
    assert env.step("calc 3-5")[0] == "result -2\n"
    assert env.step("calc 3+4") == ("result 7\n", 0.0, True, {"valid": True, "event": "call", "value": 7})


def test_calculator_without_require_tool_pays_a_direct_answer():
    env = calc(3, 4, require_tool=False)
    assert env.step("answer 7")[1:3] == (1.0, True)


def test_calculator_bad_prompt_names_it():
    with pytest.raises(ValueError, match="prompt 'x'"):
        CalculatorEnv().reset(Prompt("x", "hello", "1"))
    with pytest.raises(ValueError, match="answer 'seven'"):
        CalculatorEnv().reset(Prompt("x", "What is 3+4?", "seven"))
    with pytest.raises(ValueError, match="answer '8' is not 3\\+4"):
        CalculatorEnv().reset(Prompt("x", "What is 3+4?", "8"))


# -- digit game rules --------------------------------------------------------

@pytest.mark.parametrize("turns, observations, reward", [
    (["guess 5"], ["correct\n"], 1.0),
    (["guess 4", "guess 5"], ["higher\n", "correct\n"], 1.0),    # the second guess pays the same
    (["guess 4", "guess 3"], ["higher\n", "higher\n"], 0.0),
    (["guess 9", "guess 3"], ["lower\n", "higher\n"], 0.0),      # out of range is a valid guess
    (["4", "guess 5"], ["error: write 'guess D'\n", "correct\n"], 1.0),  # a malformed turn uses a guess
    (["guess 44", "guess five"], ["error: write 'guess D'\n"] * 2, 0.0),
])
def test_game_rules(turns, observations, reward):
    env = game(3, 5)
    total = 0.0
    for i, (action, expected) in enumerate(zip(turns, observations)):
        obs, r, done, info = env.step(action)
        assert obs == expected and done == (i == len(turns) - 1)
        assert info["valid"] == (expected != "error: write 'guess D'\n")
        total += r
    assert total == reward


def test_game_bad_prompts_are_named():
    with pytest.raises(ValueError, match="prompt 'g'"):
        DigitGuessEnv().reset(Prompt("g", "guess", "1"))
    with pytest.raises(ValueError, match="answer '7' is not a digit from 3 to 5"):
        DigitGuessEnv().reset(Prompt("g", "Guess my digit from 3 to 5.\n", "7"))


# -- experts and data --------------------------------------------------------

def test_experts_win_every_shipped_episode_in_two_turns():
    for name, cls in (("tool", CalculatorEnv), ("game", DigitGuessEnv)):
        for split in ("train", "val"):
            for prompt in load_prompts(DATA / f"{name}_{split}.jsonl"):
                env = cls()
                env.reset(prompt)
                reward, turns = play_expert(env)
                assert reward == 1.0 and turns <= 2, prompt


def test_game_expert_never_reads_the_secret():
    """The optimal strategy, from the feedback alone: middle, then the named end."""
    for low in range(8):
        for secret in range(low, low + 3):
            env = game(low, secret)
            assert env.expert_action() == f"guess {low + 1}"
            if env.step(env.expert_action())[0] != "correct\n":
                assert env.expert_action() == f"guess {secret}"


def test_calculator_expert_recovers_from_a_wrong_call():
    env = calc(37, 45)
    env.step("calc 1+1")
    assert env.expert_action() == "answer 82"


def test_shipped_data_is_what_the_writers_write(tmp_path):
    written = write_calculator_data(tmp_path) + write_game_data(tmp_path)
    for path in written:
        assert path.read_text() == (DATA / path.name).read_text(), path.name
    assert [len(load_prompts(p)) for p in written] == [256, 32, 256, 32]
    assert calculator_rows(3, seed=5) == calculator_rows(3, seed=5)
    secrets = [int(r["answer"]) - int(r["prompt"].split("from ")[1][0]) for r in game_rows(30)]
    assert sorted(secrets) == [0] * 10 + [1] * 10 + [2] * 10


@pytest.mark.parametrize("spec, args", [(CALC, {}), (CALC, {"max_turns": 2, "require_tool": False}),
                                        (GAME, {"max_turns": 3})])
def test_env_specs_load(spec, args):
    cls = load_env_class(spec, args)
    assert cls(**args).max_turns == args.get("max_turns", cls().max_turns)


# -- token layout --------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(tiny_model))


def test_every_expert_turn_fits_in_12_tokens(tokenizer):
    texts = [f"calc {a}+{b}" for a in range(100) for b in range(100)]
    texts += [f"answer {v}" for v in range(199)] + [f"guess {d}" for d in range(10)]
    lengths = [len(ids) + 1 for ids in tokenizer(texts, add_special_tokens=False).input_ids]  # + </s>
    assert max(lengths) <= 12


def test_expert_transcript_layout(tokenizer):
    from pipeline.trainer.warmup import expert_episode
    eos = tokenizer.eos_token_id
    prompt = Prompt("p", "What is 17+7? Use the calculator.\n", "24")
    ep = expert_episode(CalculatorEnv, {}, prompt, tokenizer)

    def enc(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False).input_ids
    context = tokenizer(prompt.text).input_ids
    assert context[0] == tokenizer.bos_token_id
    call, obs, answer = enc("calc 17+7") + [eos], enc("result 24\n"), enc("answer 24") + [eos]
    assert ep.ids == context + call + obs + answer  # no final observation ("correct\n")
    assert ep.mask == [0] * len(context) + [1] * len(call) + [0] * len(obs) + [1] * len(answer)
    assert (ep.reward, ep.turns, ep.done, ep.ended_by_env) == (1.0, 2, True, True)
    # Every model turn ends with </s>, and </s> appears nowhere else.
    ends = [i for i, m in enumerate(ep.mask) if m and (i + 1 == len(ep.mask) or not ep.mask[i + 1])]
    assert [i for i, t in enumerate(ep.ids) if t == eos] == ends


def test_rollout_max_turns_cuts_the_episode_without_its_last_observation(tokenizer):
    from pipeline.trainer.warmup import Episode
    ep = Episode.start(CalculatorEnv(max_turns=3), Prompt("p", "What is 1+2?", "3"), tokenizer, max_turns=2)
    bad = tokenizer("oops", add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    ep.play(bad)
    n = len(ep.ids)
    ep.play(bad)
    assert ep.done and not ep.ended_by_env and not ep.all_valid
    assert ep.ids[n:] == bad and ep.mask[n:] == [1] * len(bad)  # the 2nd error message is not appended
    with pytest.raises(RuntimeError):
        ep.play(bad)


def test_expert_turn_over_the_token_limit_is_refused(tokenizer):
    from pipeline.trainer.warmup import expert_episode
    with pytest.raises(ValueError, match="over max_new_tokens 4"):
        expert_episode(CalculatorEnv, {}, Prompt("p", "What is 1+2?", "3"), tokenizer, max_new_tokens=4)


# -- the warm-up ---------------------------------------------------------------

def _small_val(tmp_path: Path) -> Path:
    path = tmp_path / "val.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in calculator_rows(4, seed=9)))
    return path


def test_warmup_cli_lowers_the_loss_and_writes_a_loadable_dir(tiny_model, tmp_path, capsys):
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from pipeline.__main__ import main
    from pipeline.trainer.warmup import _decode_turns
    from pipeline.inputs.models import check_model_dir
    from pipeline.inputs.tiny import model_digest
    out = tmp_path / "warm"
    code = main(["warmup", "--model", str(tiny_model), "--env", CALC, "--data", str(DATA / "tool_train.jsonl"),
                 "--val", str(_small_val(tmp_path)), "--out", str(out), "--steps", "25", "--prompts", "32"])
    printed = capsys.readouterr().out
    assert code == 0
    assert "val reward before: greedy 0.000" in printed and "val reward after : greedy" in printed
    meta = json.loads((out / "warmup.json").read_text())
    assert (meta["steps"], meta["prompts"], meta["env"]) == (25, 32, CALC)
    assert meta["loss_last"] < 0.6 * meta["loss_first"]
    check_model_dir(out)
    assert (out / "tokenizer.json").read_bytes() == (tiny_model / "tokenizer.json").read_bytes()
    model = LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    # Batched greedy turns are each context's own: right padding does not leak.
    tok = AutoTokenizer.from_pretrained(str(out))
    contexts = [tok(f"What is {a}+{b}? Use the calculator.\n").input_ids for a, b in ((1, 2), (37, 45), (5, 60))]
    kw = dict(eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, max_new_tokens=8)
    assert _decode_turns(model, contexts, **kw) == [_decode_turns(model, [c], **kw)[0] for c in contexts]

    # Deterministic: the same inputs give the same weights.
    from pipeline.trainer.warmup import warmup
    again = tmp_path / "again"
    warmup(tiny_model, CALC, DATA / "tool_train.jsonl", again, steps=25, prompts=32)
    assert model_digest(again) == model_digest(out)


def test_sampled_play_is_seeded(tiny_model):
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from pipeline.trainer.warmup import play
    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    model = LlamaForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    prompts = load_prompts(DATA / "game_val.jsonl")[:2]
    runs = [play(model, tok, DigitGuessEnv, {}, prompts, temperature=1.0, samples=2, seed=s, max_new_tokens=4)
            for s in (0, 0, 1)]
    ids = [[ep.ids for ep in r.episodes] for r in runs]
    assert ids[0] == ids[1] != ids[2]


@pytest.mark.parametrize("case, args, needle", [
    ("missing model", ["--model", "{tmp}/nope"], "model directory '{tmp}/nope' does not exist"),
    ("bad env spec", ["--env", "pipeline.envs.calculator:Nope"], "has no attribute 'Nope'"),
    ("env not a module:Class", ["--env", "calculator"], "env.class 'calculator': expected 'module:Class'"),
    ("bad env args", ["--env-args", '{"colour": 1}'], "cannot be built with env.args"),
    ("env args not JSON", ["--env-args", "{max_turns: 2}"], "--env-args '{max_turns: 2}' is not JSON"),
    ("missing data", ["--data", "{tmp}/none.jsonl"], "{tmp}/none.jsonl: data file does not exist"),
    ("missing val", ["--val", "{tmp}/none.jsonl"], "{tmp}/none.jsonl: data file does not exist"),
    ("out is the model", ["--out", "{model}"], "is the input model directory"),
    ("zero steps", ["--steps", "0"], "warm-up steps must be at least 1, got 0"),
])
def test_warmup_cli_errors_name_the_bad_input(tiny_model, tmp_path, capsys, case, args, needle):
    from pipeline.__main__ import main
    given = {"--model": str(tiny_model), "--env": CALC, "--data": str(DATA / "tool_train.jsonl"),
             "--out": str(tmp_path / "out")}
    given.update(dict(zip(args[::2], args[1::2])))

    def fill(text: str) -> str:
        return text.replace("{tmp}", str(tmp_path)).replace("{model}", str(tiny_model))
    assert main(["warmup"] + [fill(x) for kv in given.items() for x in kv]) == 1
    assert fill(needle) in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
