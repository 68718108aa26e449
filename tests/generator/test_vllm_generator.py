"""The vLLM generation engine against transformers on the same weights (real
vLLM in-process, no Ray), and the tiny model builder it runs on.

TOL: on CPU in fp32, vLLM's sampled-token logprobs and transformers' log-softmax
of the same tokens differed by at most 9.5e-7 (prefix-cache hits and refits
included); a weight change of 0.02 * N(0, 1) moved them by 0.6-0.97. 1e-5 sits
ten times above the noise and far below a real change.
"""
from __future__ import annotations

import contextlib
import json
import logging
import shutil
import time

import pytest
import torch

from benchmarks.harness import greedy_all, sample_all
from pipeline.core.types import Prompt, sample_seeds
from pipeline.inputs.models import ModelError, check_model_dir
from pipeline.inputs.tiny import build_tiny_model, model_digest, tiny_prompt

pytestmark = pytest.mark.real

torch.set_num_threads(1)

TOL = 1e-5
# >= 64 tokens, so two full 32-token KV blocks of the prompt are cached and reused.
LONG_PROMPT = Prompt("long", "How many apples are left? repeat: " + " ".join(["0"] * 40), "0")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0)


@pytest.fixture(scope="module")
def engine(model_dir):
    from pipeline.generator.vllm_engine import VllmGenerationEngine
    t0 = time.perf_counter()
    # Stats on, so the test can see prefix-cache hits.
    eng = VllmGenerationEngine(model_dir, seed=0, max_new_tokens=16, temperature=1.0, top_p=1.0,
                               max_model_len=256, disable_log_stats=False)
    print(f"\nvLLM engine start: {time.perf_counter() - t0:.1f}s")
    try:
        yield eng
    finally:
        eng.close()


def hf_model(model_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_logprobs(model, prompt_ids, response_ids, temperature: float = 1.0) -> list[float]:
    ids = torch.tensor([list(prompt_ids) + list(response_ids)])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float() / temperature, dim=-1)
    start = len(prompt_ids) - 1
    return [logp[start + i, tok].item() for i, tok in enumerate(response_ids)]


def prompt_logprobs(engine, prompt_ids, response_ids) -> list[float]:
    """Logprobs of `response_ids` following `prompt_ids` under the engine's
    current weights (teacher forcing), one per response token."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    # Eager, as the engine samples on CPU: compiling vLLM's logprob helper takes 45 s on 2 cores.
    with torch.compiler.set_stance("force_eager"):
        out = engine.llm.generate([TokensPrompt(prompt_token_ids=[*prompt_ids, *response_ids])], params,
                                  use_tqdm=False)[0]
    scored = out.prompt_logprobs[len(prompt_ids):]
    return [float(entry[tok].logprob) for entry, tok in zip(scored, response_ids)]


def max_gap(model, groups, temperature: float = 1.0) -> float:
    return max(abs(a - b) for group in groups for c in group
               for a, b in zip(c.logprobs, hf_logprobs(model, c.prompt_ids, c.response_ids, temperature)))


_draws = iter(range(10**9))


def draw(engine, prompts, n):
    """n samples per prompt, seeded as a fresh batch of a run would be."""
    return sample_all(engine, prompts, sample_seeds(0, f"test{next(_draws)}", prompts, n))


def prefix_cache_hits(engine) -> int:
    return next(int(m.value) for m in engine.llm.get_metrics() if m.name == "vllm:prefix_cache_hits")


# -- the tiny model ----------------------------------------------------------

def test_tiny_model_is_deterministic_and_loads_in_transformers(tmp_path, model_dir):
    from transformers import AutoTokenizer
    again = build_tiny_model(tmp_path / "again", seed=0)
    other = build_tiny_model(tmp_path / "other", seed=1)
    assert model_digest(again) == model_digest(model_dir)
    assert model_digest(other) != model_digest(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = hf_model(model_dir)
    # vLLM and reload_weights need the unpadded vocabulary: exactly the tokenizer's.
    assert len(tok) == model.config.vocab_size
    ids = tok(tiny_prompt("0")).input_ids
    assert ids[0] == tok.bos_token_id and tok.decode(ids, skip_special_tokens=True) == tiny_prompt("0")
    assert tok.eos_token_id is not None and tok.pad_token_id is not None
    assert check_model_dir(model_dir) == model_dir


# -- generation ----------------------------------------------------------------

def test_generate_returns_n_completions_with_logprobs(engine):
    prompts = [Prompt("a", tiny_prompt("0"), "0"), Prompt("b", tiny_prompt("1"), "1")]
    groups = draw(engine, prompts, 3)
    assert [len(g) for g in groups] == [3, 3]
    for prompt, group in zip(prompts, groups):
        for c in group:
            assert c.prompt_ids == tuple(engine.encode(prompt.text))
            assert 1 <= len(c.response_ids) <= 16 and len(c.logprobs) == len(c.response_ids)
            assert all(lp <= 0.0 for lp in c.logprobs)
            # Cut at the limit exactly when the response did not end on its end-of-text token.
            eos = engine.tokenizer.eos_token_id
            assert c.truncated == (len(c.response_ids) == 16 and c.response_ids[-1] != eos)
    greedy = greedy_all(engine, prompts)
    assert len(greedy) == 2 and greedy_all(engine, prompts[:1])[0] == greedy[0]
    assert sample_all(engine, [], []) == [] and greedy_all(engine, []) == []


def test_completion_text_is_what_vllms_detokenizer_gives(engine):
    """Rollouts skip vLLM's per-step detokenizer and decode each completion once;
    the reward must see the same text vLLM would have produced, including on an
    untrained model's stray bytes (a trailing partial UTF-8 sequence is held back)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    prompts = [Prompt(f"p{i}", text) for i, text in enumerate(
        [tiny_prompt("0"), tiny_prompt("1"), "hello world", "a"])]
    seeds = list(range(120))
    params = [SamplingParams(max_tokens=16, temperature=1.0, seed=s) for s in seeds]
    inputs = [TokensPrompt(prompt_token_ids=engine.encode(prompts[s % 4].text)) for s in seeds]
    reference = engine.llm.generate(inputs, params, use_tqdm=False)
    assert sum(o.outputs[0].text != engine.tokenizer.decode(o.outputs[0].token_ids) for o in reference) > 0
    assert [engine.decode(o.outputs[0].token_ids) for o in reference] == [o.outputs[0].text for o in reference]
    ours = sample_all(engine, prompts, [seeds[i::4] for i in range(4)])
    assert [c.text for group in ours for c in group] == [
        reference[s].outputs[0].text for i in range(4) for s in seeds[i::4]]


def test_a_group_encodes_its_prompt_once(engine, monkeypatch):
    """The loop adds a prompt's samples one after another: the tokenizer runs once a
    group (a tenth of a tiny rollout batch's CPU went to re-encoding), and every
    sample still carries the prompt's ids."""
    encoded = []
    encode = engine.encode
    monkeypatch.setattr(engine, "encode", lambda text: encoded.append(text) or encode(text))
    prompts = [Prompt("a", tiny_prompt("0"), "0"), Prompt("b", tiny_prompt("1"), "1"),
               Prompt("c", tiny_prompt("0"), "0")]
    groups = sample_all(engine, prompts, [[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    assert encoded == [p.text for p in prompts]
    assert [{c.prompt_ids for c in g} for g in groups] == [{tuple(encode(p.text))} for p in prompts]


def test_identical_prompts_in_one_call_draw_independent_samples(engine):
    """The sampler's streams come from (run seed, batch, prompt, sample): eight
    copies of one prompt in one call, 4 samples each, give 32 different
    completions (with one seed per call, vLLM gave identical groups)."""
    prompt = Prompt("same", tiny_prompt("0"), "0")
    groups = draw(engine, [prompt] * 8, 4)
    responses = [c.response_ids for g in groups for c in g]
    assert len(set(responses)) == len(responses) == 32


def test_a_batch_draws_the_same_samples_whatever_call_it_lands_in(engine):
    """Reproducibility: a batch's samples depend on its seeds only, not on
    which other requests share the engine call, their order, or earlier calls."""
    prompts = [Prompt(f"p{i}", tiny_prompt(str(i % 2)), str(i % 2)) for i in range(4)]
    seeds = sample_seeds(7, "t3.g0", prompts, 4)
    alone = sample_all(engine, prompts, seeds)
    others = [Prompt("o", tiny_prompt("1"), "1")] * 3
    mixed = sample_all(engine, [*others, *prompts[::-1]], [*sample_seeds(7, "t4.g0", others, 4), *seeds[::-1]])
    assert mixed[3:] == alone[::-1]
    assert sample_all(engine, prompts, seeds) == alone


def test_sample_seeds_never_repeat_across_batches_prompts_and_samples():
    prompts = [Prompt(f"p{i}", "x") for i in range(8)] + [Prompt("p0", "x")]  # a prompt twice in a batch
    seeds = [s for run in (0, 1) for batch in ("t0.g0", "t0.g1", "t1.g0")
             for group in sample_seeds(run, batch, prompts, 4) for s in group]
    assert len(set(seeds)) == len(seeds) == 2 * 3 * 9 * 4
    # vLLM draws sample i of a request from seed + i: no seed may sit next to another.
    ordered = sorted(seeds)
    assert min(b - a for a, b in zip(ordered, ordered[1:])) > 1000
    assert all(0 <= s < 2**63 for s in seeds)
    assert sample_seeds(0, "t0.g0", prompts, 4) == sample_seeds(0, "t0.g0", prompts, 4)


def test_logprobs_match_transformers_through_the_prefix_cache(engine, model_dir):
    model = hf_model(model_dir)
    assert len(engine.encode(LONG_PROMPT.text)) >= 64
    first = draw(engine, [LONG_PROMPT], 2)
    hits = prefix_cache_hits(engine)
    second = draw(engine, [LONG_PROMPT], 2)
    assert prefix_cache_hits(engine) >= hits + 64, "the second call should reuse the cached prompt blocks"
    assert max_gap(model, first) < TOL
    assert max_gap(model, second) < TOL
    c = second[0][0]
    scored = prompt_logprobs(engine, c.prompt_ids, c.response_ids)
    assert max(abs(a - b) for a, b in zip(scored, c.logprobs)) < TOL


def test_a_chat_prompt_reaches_vllm_as_the_templates_ids(engine, model_dir, tmp_path):
    """A chat-format row, rendered once by the model's template (data.* with
    messages), is sent to vLLM as those ids, not re-encoded from its text; the
    logprobs vLLM reports for them are transformers' on the same ids."""
    from transformers import AutoTokenizer

    from pipeline.inputs.datasets import ChatTemplate, load_prompts
    from pipeline.inputs.tiny import TINY_CHAT_TEMPLATE
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    rows = tmp_path / "chat.jsonl"
    rows.write_text('{"prompt": [{"role": "user", "content": "repeat: 7"}], "answer": "7"}\n')
    prompt = load_prompts(rows, chat=ChatTemplate(tokenizer, system_prompt="Answer with digits."))[0]
    assert prompt.text.startswith("<s><|system|>\nAnswer with digits.</s>\n<|user|>\nrepeat: 7</s>")
    assert prompt.token_ids[0] == tokenizer.bos_token_id and prompt.token_ids.count(tokenizer.bos_token_id) == 1
    out = draw(engine, [prompt], 2)
    assert all(c.prompt_ids == prompt.token_ids for c in out[0])
    assert max_gap(hf_model(model_dir), out) < TOL


def test_logprobs_are_of_the_tempered_distribution(engine, model_dir):
    """The trainer divides its logits by the sampling temperature; the
    engine's logprobs must be of that same distribution."""
    model = hf_model(model_dir)
    engine.temperature = 0.7
    try:
        groups = draw(engine, [LONG_PROMPT], 2)
    finally:
        engine.temperature = 1.0
    assert max_gap(model, groups, temperature=0.7) < TOL
    assert max_gap(model, groups, temperature=1.0) > 100 * TOL


@contextlib.contextmanager
def vllm_log_records():
    """Every record that reaches vLLM's own log handler (its loggers do not propagate to the root)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    logging.getLogger("vllm").addHandler(handler)
    try:
        yield records
    finally:
        logging.getLogger("vllm").removeHandler(handler)


def test_refit_loads_new_weights_and_drops_the_prefix_cache(engine, model_dir):
    model = hf_model(model_dir)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    draw(engine, [LONG_PROMPT], 2)  # the prompt is now cached under the old weights
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
    try:
        assert max_gap(model, draw(engine, [LONG_PROMPT], 2)) > 100 * TOL, "stale weights must show"
        t0 = time.perf_counter()
        with vllm_log_records() as records:
            engine.load_weights(model.state_dict())
        print(f"\nload_weights: {1e3 * (time.perf_counter() - t0):.1f} ms")
        # A line per refit is a line per generator per step in a job's log (pipeline/core/vllm_env.py).
        assert [r.getMessage() for r in records if r.levelno < logging.WARNING] == []
        after = draw(engine, [LONG_PROMPT], 2)
        assert max_gap(model, after) < TOL
        c = after[0][0]
        assert max(abs(a - b) for a, b in zip(prompt_logprobs(engine, c.prompt_ids, c.response_ids),
                                               hf_logprobs(model, c.prompt_ids, c.response_ids))) < TOL
    finally:
        engine.load_weights(original)  # later tests see the built model again
    assert max_gap(hf_model(model_dir), draw(engine, [LONG_PROMPT], 1)) < TOL


def refit_mid_generation(engine, new_weights, steps_before: int, kv: str):
    """Two samples of LONG_PROMPT, with `new_weights` loaded as version 1 after
    `steps_before` engine steps, as the engine loop installs an inflight refit:
    load between two steps, then label. Completions of the samples."""
    prompts = [LONG_PROMPT]
    seeds = sample_seeds(0, f"test{next(_draws)}", prompts, 2)[0]
    engine.inflight_kv = kv
    engine.set_version(0)
    done = {}
    try:
        for j, seed in enumerate(seeds):
            engine.add(f"mid/{j}", LONG_PROMPT, seed)
        for _ in range(steps_before):
            done.update(engine.step())
        assert engine.busy() and engine.progress() == {"mid/0": steps_before, "mid/1": steps_before}
        engine.load_weights(new_weights)
        engine.set_version(1)
        while engine.busy():
            done.update(engine.step())
    finally:
        engine.abort_all()
        engine.inflight_kv = "recompute"
    return [done[f"mid/{j}"] for j in range(len(seeds))]


def gaps_by_version(models, completions) -> dict[int, float]:
    """Per version: the largest gap between a token's engine logprob and its
    version's transformers model scoring the whole sequence."""
    gaps: dict[int, float] = {}
    for c in completions:
        ref = {v: hf_logprobs(m, c.prompt_ids, c.response_ids) for v, m in models.items()}
        for i, (lp, v) in enumerate(zip(c.logprobs, c.versions)):
            gaps[v] = max(gaps.get(v, 0.0), abs(lp - ref[v][i]))
    return gaps


@pytest.mark.parametrize("kv", ["recompute", "keep"])
def test_a_refit_mid_generation_gives_each_token_its_versions_logprob(engine, model_dir, kv):
    """refit_mode inflight on the real engine: the samples carry tokens of two
    versions. With inflight_kv recompute each token's logprob is its version's
    model's; with keep, the tokens after the load attend to keys and values of
    the old weights, and the gap to the new model shows."""
    old, new = hf_model(model_dir), hf_model(model_dir)
    original = {k: v.clone() for k, v in old.state_dict().items()}
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for p in new.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
    # min_tokens would change the sampled distribution; the tiny model runs to 16 tokens here.
    try:
        completions = refit_mid_generation(engine, new.state_dict(), steps_before=6, kv=kv)
    finally:
        engine.load_weights(original)
        engine.set_version(0)
    assert all(c.versions == (0,) * 6 + (1,) * (len(c.versions) - 6) for c in completions), \
        [c.versions for c in completions]
    assert all(len(c.versions) > 6 for c in completions)
    gaps = gaps_by_version({0: old, 1: new}, completions)
    print(f"\ninflight_kv {kv}: largest logprob gap, version 0 tokens {gaps[0]:.2e}, version 1 tokens {gaps[1]:.2e}")
    assert gaps[0] < TOL
    if kv == "recompute":
        assert gaps[1] < TOL
    else:
        assert gaps[1] > 10 * TOL  # the mix keep buys: 0.46 measured


def test_reload_without_cache_reset_serves_stale_prompt_blocks(engine, model_dir):
    """Why load_weights resets the prefix cache: vLLM's reload_weights alone
    leaves KV blocks of the old weights in the cache, and hits on them skew
    the logprobs of the new ones."""
    model = hf_model(model_dir)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    draw(engine, [LONG_PROMPT], 1)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    try:
        engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(model.state_dict().items())})
        assert max_gap(model, draw(engine, [LONG_PROMPT], 1)) > 100 * TOL
    finally:
        engine.load_weights(original)


def test_load_weights_rejects_a_padded_vocabulary(engine, model_dir):
    sd = hf_model(model_dir).state_dict()
    padded = torch.zeros(sd["lm_head.weight"].shape[0] + 64, sd["lm_head.weight"].shape[1])
    with pytest.raises(ModelError, match=r"lm_head\.weight has \d+ rows .* vocab_size is") as err:
        engine.load_weights({**sd, "lm_head.weight": padded})
    assert str(model_dir) in str(err.value)


# -- bad model directories: errors name the path, before vLLM starts -----------

def test_preflight_counts_a_prompt_and_the_context_as_the_engine_has_them(engine, model_dir):
    """data.filter_overlong's counts (pipeline/inputs/datasets.py, with transformers'
    tokenizer as load_tokenizer loads it, before any engine starts) are the ids
    this engine sends to vLLM, and its context the max_model_len vLLM enforces."""
    from pipeline.inputs.datasets import GSM8K_TEMPLATE, prompt_lengths
    from pipeline.inputs.models import context_length, load_tokenizer
    texts = [tiny_prompt("0"), LONG_PROMPT.text, GSM8K_TEMPLATE.format(question="What is 2 + 2?"),
             " a leading space", "\u00fcn\u00efcode \u2713", "<s> looks special"]
    prompts = [Prompt(f"p{i}", t) for i, t in enumerate(texts)]
    sent = [len(engine.encode(t)) for t in texts]
    assert prompt_lengths(prompts, load_tokenizer(model_dir)) == sent
    assert prompt_lengths(prompts, engine.tokenizer) == sent
    assert context_length(model_dir, 256) == engine.llm.llm_engine.model_config.max_model_len == 256


def test_bad_model_directories_are_named(tmp_path, model_dir):
    from pipeline.generator.vllm_engine import VllmGenerationEngine
    missing = tmp_path / "nope"
    with pytest.raises(ModelError, match="does not exist") as err:
        VllmGenerationEngine(missing)
    assert str(missing) in str(err.value)

    no_config = tmp_path / "no_config"
    shutil.copytree(model_dir, no_config)
    (no_config / "config.json").unlink()
    with pytest.raises(ModelError, match="has no config.json") as err:
        VllmGenerationEngine(no_config)
    assert str(no_config) in str(err.value)

    no_tok = tmp_path / "no_tokenizer"
    shutil.copytree(model_dir, no_tok)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (no_tok / name).unlink()
    with pytest.raises(ModelError, match="has no tokenizer files") as err:
        VllmGenerationEngine(no_tok)
    assert str(no_tok) in str(err.value)

    small = tmp_path / "small_vocab"
    shutil.copytree(model_dir, small)
    config = json.loads((small / "config.json").read_text())
    config["vocab_size"] = 300
    (small / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match=r"the tokenizer has \d+ tokens but the model's vocab_size is 300") as err:
        VllmGenerationEngine(small)
    assert str(small) in str(err.value)


class EchoTool:
    """Answers every turn with a fixed observation; three turns. `jitter_s`: a
    random wait before each answer (unseeded: each run interleaves differently)."""

    def __init__(self, jitter_s: float = 0.0):
        self.jitter_s = jitter_s

    def reset(self, prompt):
        return prompt.text

    def step(self, action):
        import random
        time.sleep(random.random() * self.jitter_s)  # a tool's latency, varied on purpose: it orders nothing
        self.turn = getattr(self, "turn", 0) + 1
        return " tool says 7 ->", float(self.turn), self.turn == 3, {}


def roll_episodes(engine, tmp_path, *overrides):
    import threading

    from dags.tokens import Launch
    from pipeline.generator.engine_loop import EngineLoop
    from pipeline.config import load_config
    from pipeline.core.events import EventLog
    cfg = load_config(None, ["env.class=tests.generator.test_vllm_generator:EchoTool", "env.max_turns=3", *overrides])
    out, finished = {}, threading.Event()
    loop = EngineLoop(engine, EventLog(tmp_path, "gen0", time.time()),
                      lambda batch, completions, spans: (out.update(c=completions), finished.set()),
                      lambda batch, reason: (out.update(failed=reason), finished.set()), 0, 2, cfg.env)
    try:
        prompts = (Prompt("a", tiny_prompt("0"), "0"), Prompt("b", tiny_prompt("1"), "1"),
                   Prompt("c", tiny_prompt("1") + " 1", "1"))
        loop.call("submit", (0, [(Launch("mt", 0, 0, prompts), [11, 12, 13, 14, 15, 16])]), 60, "submit")
        assert finished.wait(120) and "failed" not in out, out.get("failed")
    finally:
        loop.stop(30)
    return out["c"]


def test_multiturn_samples_do_not_depend_on_the_tools_timing(engine, tmp_path):
    """Turns join the engine's batches whenever their tool answers: the samples
    must be the same however that falls (each turn has its own seed). The
    logprobs may differ in their last bits: which requests share a step
    changes vLLM-CPU's rounding (seen once in a full suite run)."""
    runs = [roll_episodes(engine, tmp_path / str(i), "env.args={jitter_s: 0.05}") for i in range(2)]
    assert [c.response_ids for c in runs[0]] == [c.response_ids for c in runs[1]]
    gap = max(abs(a - b) for x, y in zip(*runs) for a, b in zip(x.logprobs, y.logprobs))
    assert gap < TOL, gap


def test_multiturn_samples_carry_the_exact_context_each_turn_saw(engine, model_dir, tmp_path):
    """Through the engine loop: every model token's logprob is the model's given
    the prompt, the earlier turns and the observations as the sample holds them
    (so the trainer scores what the engine sampled), observation tokens are the
    tokenizer's without a BOS, masked, with logprob 0."""
    completions = roll_episodes(engine, tmp_path)
    observation = engine.encode_continuation(" tool says 7 ->")
    assert observation and observation[0] != engine.tokenizer.bos_token_id
    model = hf_model(model_dir)
    for c in completions:
        assert c.turns == 3 and c.reward == 6.0 and c.token_rewards[-1] == 3.0 and not c.error
        assert c.loss_mask.count(0) == 2 * len(observation)
        expected = hf_logprobs(model, c.prompt_ids, c.response_ids)
        for lp, want, trained in zip(c.logprobs, expected, c.loss_mask):
            assert (abs(lp - want) < TOL) if trained else lp == 0.0


BF16_ENGINE = """
import math, sys
from benchmarks.harness import sample_all
from pipeline.core.types import Prompt, sample_seeds
from pipeline.generator.vllm_engine import VllmGenerationEngine
from pipeline.inputs.tiny import tiny_prompt
engine = VllmGenerationEngine(sys.argv[1], seed=0, max_new_tokens=8, dtype="bfloat16", kv_cache_seqs=32)
prompts = [Prompt("p0", tiny_prompt("1"))]
out = sample_all(engine, prompts, sample_seeds(0, "bf16", prompts, 2))
assert all(len(c.logprobs) == len(c.response_ids) > 0 and all(map(math.isfinite, c.logprobs))
           for group in out for c in group), out
engine.close()
print("bf16 ok")
"""


def _has_bf16() -> bool:
    from pipeline.core.precision import cpu_bf16_flags
    return torch.cuda.is_available() or bool(cpu_bf16_flags())


@pytest.mark.skipif(not _has_bf16(), reason="this CPU has no bf16 units (amx_bf16, avx512_bf16): "
                                            "vLLM-CPU's bf16 path needs them")
def test_vllm_generates_in_bf16_where_the_cpu_has_the_units(model_dir, tmp_path):
    """generation.dtype bf16: vLLM-CPU's bf16 attention uses AMX tiles without asking
    Linux for them, and died of SIGILL (exit 132) on its first decode until the
    engine requests them (precision.request_amx). In its own process: a second
    engine beside the module's would share vLLM's process-wide state."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", BF16_ENGINE, str(model_dir)], capture_output=True, text=True,
                          timeout=300, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0 and "bf16 ok" in proc.stdout, (proc.returncode, proc.stderr[-3000:])
