"""A tiny Llama model and the tiny "repeat" task, built offline.

There is no model hub at run time, so tests and smoke runs build a randomly
initialised Llama plus a byte-level BPE tokenizer trained here, and save both
with `save_pretrained` so transformers and vLLM load the directory like any
checkpoint.

The tiny task ("repeat"): the prompt shows one character eight times,
"repeat: 0 0 0 0 0 0 0 0", and the reward is the fraction of response
characters equal to it (pipeline.rewards.rules.tiny_reward). Measured with a plain
GRPO loop (8 prompts x 4 samples x 16 tokens, Adam lr 1e-2, 4 seeds): the mean
reward rises from about 0.01 to 0.44-0.96 by step 20 and to 0.99 by step 30 in
3 seeds of 4 (lr 3e-3 is about twice as slow). What made it learnable:
- two target characters: with 10, the policy collapses onto one digit for
  every prompt (rewarded whatever the prompt) and stays there for 100 steps;
- the character repeated as separate tokens, so (near-uniform) attention
  carries it into every response position: "repeat:0" alone collapsed too;
- an exact-match reward with no partial credit: credit for "any digit" is an
  unconditional direction that the policy learns first and gets stuck in.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parents[2] / "data"
TINY_ALPHABET = "01"
TINY_REPEATS = 8
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2

# The tokenizer's training texts, frozen in a file: English and arithmetic (so
# GSM8K-style prompts encode sensibly), runs of every digit (so merges like "00"
# and "0000" exist and a random policy hits the target more often), and the
# GSM8K sample as it was when the task was measured. Frozen because any edit
# changes the merges, hence the model, hence the learning curves measured on it.
TOKENIZER_CORPUS = DATA_DIR / "tokenizer_corpus.jsonl"


def tiny_task_rows(n: int, *, seed: int = 0, alphabet: str = TINY_ALPHABET) -> list[dict]:
    """`n` rows of the repeat task; every character appears equally often."""
    rng = random.Random(seed)
    chars = [alphabet[i % len(alphabet)] for i in range(n)]
    rng.shuffle(chars)
    return [{"id": f"repeat-{seed}-{i}", "prompt": tiny_prompt(c), "answer": c}
            for i, c in enumerate(chars)]


def tiny_prompt(c: str) -> str:
    return "repeat: " + " ".join([c] * TINY_REPEATS)


def write_tiny_data(out_dir: str | Path, *, n_train: int = 512, n_val: int = 64) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, n, seed in (("tiny_train.jsonl", n_train, 0), ("tiny_val.jsonl", n_val, 1)):
        path = out / name
        with path.open("w") as f:
            for row in tiny_task_rows(n, seed=seed):
                f.write(json.dumps(row) + "\n")
        paths.append(path)
    return paths


def tokenizer_corpus(path: str | Path = TOKENIZER_CORPUS) -> list[str]:
    """The training texts of the tokenizer, in file order (BPE breaks ties by
    order, so the order is part of determinism)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"tokenizer corpus {str(p)!r} does not exist (it ships in data/)")
    return [json.loads(line)["text"] for line in p.read_text().splitlines() if line.strip()]


def build_tokenizer(vocab_size: int = 384, *, corpus: str | Path = TOKENIZER_CORPUS):
    """A byte-level BPE tokenizer (every string encodes; no unknown token)
    that prepends <s> like Llama's does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    n_min = 256 + len(SPECIAL_TOKENS)
    if vocab_size < n_min:
        raise ValueError(f"vocab_size {vocab_size} is too small: a byte-level BPE needs at least {n_min}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=1)
    tok.train_from_iterator(tokenizer_corpus(corpus), trainer=trainer)
    bos_id = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        padding_side="left", model_max_length=1 << 16, add_bos_token=True)


# A chat template in the plain shape of the real ones (role markers, the generation
# prompt, the EOS after each turn), in the tiny tokenizer's own words.
TINY_CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}"
                      "\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")

# TINY_CHAT_TEMPLATE with tools: the same text for plain messages, the tools as a turn of
# their own before them (so every render of a longer conversation extends a shorter one's),
# and an assistant's calls in the `pythonic` tool parser's format, the shortest a byte-level
# vocabulary can write without special tokens: [calculator(expression="37+45")].
# A call's arguments are a dict, as in HF templates (vLLM parses OpenAI's JSON strings before
# rendering; pipeline.agents.tool_calls.template_messages does the same); a string is refused
# rather than rendered into text no parser reads back. Content beside calls is refused too:
# pythonic output is a call list or text, never both.
TINY_TOOL_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|tools|>\n{% for t in tools %}{% set f = t['function'] if t['function'] is defined else t %}"
    "{{ f['name'] }}({{ ((f['parameters'] | default({}))['properties'] | default({})) | list | join(', ') }})"
    "{% if f['description'] %}: {{ f['description'] }}{% endif %}\n{% endfor %}{{ eos_token }}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m['tool_calls'] %}"
    "{% if m['content'] %}{{ raise_exception('an assistant message with tool_calls must have no content') }}{% endif %}"
    "[{% for c in m['tool_calls'] %}{% set f = c['function'] %}"
    "{% if f['arguments'] is not mapping %}{{ raise_exception('tool call arguments must be a dict: parse the JSON "
    "string first (pipeline.agents.tool_calls.template_messages)') }}{% endif %}"
    "{{ f['name'] }}({% for k, v in f['arguments'] | items %}{{ k }}={{ v | tojson }}{{ ', ' if not loop.last }}"
    "{% endfor %}){{ ', ' if not loop.last }}{% endfor %}]"
    "{% elif m['content'] is string %}{{ m['content'] }}"
    "{% elif m['content'] %}{% for part in m['content'] %}{{ part['text'] }}{% endfor %}{% endif %}"
    "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
CHAT_TEMPLATES = {"plain": TINY_CHAT_TEMPLATE, "tools": TINY_TOOL_CHAT_TEMPLATE}


# architecture -> (transformers config class, model class)
ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}


def build_tiny_model(out_dir: str | Path, *, seed: int = 0, hidden: int = 64, layers: int = 2,
                     heads: int = 4, head_dim: int = 32, intermediate: int = 128,
                     vocab_size: int = 384, max_positions: int = 512,
                     tie_embeddings: bool = False, init_std: float = 0.02,
                     corpus: str | Path = TOKENIZER_CORPUS, chat_template: str | None = None,
                     architecture: str = "llama", kv_heads: int | None = None,
                     experts: int = 4, experts_per_token: int = 2, classifier: bool = False) -> Path:
    """Build and save a random tiny Llama and its tokenizer into `out_dir`.

    head_dim defaults to 32 rather than hidden // heads (16) because vLLM's CPU
    attention only supports head sizes 32, 64, 80, ...; Llama allows
    heads * head_dim != hidden. Weights are fp32 so vLLM (dtype float32) and
    transformers compute the same logprobs. `chat_template`: a name in
    CHAT_TEMPLATES, the tokenizer's chat template: "plain" for chat-format
    datasets, "tools" for agents that call tools. `architecture`: one of
    ARCHITECTURES, the families users train (Qwen2: q/k/v biases; Qwen3: q/k
    norms; Qwen3-MoE: Qwen3 with `experts` MLPs of `intermediate` width in
    every layer, `experts_per_token` of them routed to each token);
    `kv_heads` < heads: grouped-query attention. `classifier`: the same body
    with a one-label score head (AutoModelForSequenceClassification), the
    layout of a reward model (reward_model.kind classifier).
    """
    import torch
    import transformers

    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture {architecture!r}: one of {', '.join(ARCHITECTURES)}")
    if chat_template is not None and chat_template not in CHAT_TEMPLATES:
        raise ValueError(f"chat template {chat_template!r}: one of {', '.join(CHAT_TEMPLATES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size, corpus=corpus)
    if chat_template is not None:
        tokenizer.chat_template = CHAT_TEMPLATES[chat_template]
    # The HF vocab must be the tokenizer's real length: vLLM pads internally
    # and reload_weights expects the unpadded [len(tokenizer), hidden] shapes.
    config_class, model_class = ARCHITECTURES[architecture]
    if classifier:
        model_class = model_class.replace("ForCausalLM", "ForSequenceClassification")
    if architecture != "llama":
        # As AutoTokenizer loads it beside this model type: transformers picks the family's
        # tokenizer class (Qwen2's adds <|endoftext|>), and vLLM and the trainer load that one.
        tokenizer.save_pretrained(out)
        getattr(transformers, config_class)().save_pretrained(out)
        tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    n_vocab = len(tokenizer)
    config = getattr(transformers, config_class)(
        vocab_size=n_vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads or heads,
        head_dim=head_dim, max_position_embeddings=max_positions, rms_norm_eps=1e-6,
        initializer_range=init_std,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=tie_embeddings,
        dtype="float32", architectures=[model_class], **({"num_labels": 1} if classifier else {}),
        **(dict(num_experts=experts, num_experts_per_tok=experts_per_token, moe_intermediate_size=intermediate)
           if architecture == "qwen3_moe" else {}))
    # Seed a private generator state, not the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, model_class)(config).to(torch.float32)
    if not classifier:  # a causal LM generates
        model.generation_config.bos_token_id = tokenizer.bos_token_id
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def model_digest(path: str | Path) -> str:
    """sha256 over the saved weights and tokenizer, for determinism checks."""
    h = hashlib.sha256()
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        f = Path(path) / name
        if f.is_file():
            h.update(name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline.inputs.tiny",
                                 description="Build a tiny random Llama + tokenizer (offline).")
    ap.add_argument("--out", help="directory to save the model and tokenizer into")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--intermediate", type=int, default=128)
    ap.add_argument("--vocab-size", type=int, default=384)
    ap.add_argument("--chat-template", nargs="?", const="plain", choices=sorted(CHAT_TEMPLATES),
                    help="give the tokenizer a chat template: plain (the default) or tools")
    ap.add_argument("--architecture", default="llama", choices=sorted(ARCHITECTURES),
                    help="the model family (qwen3_moe: a mixture of experts, for docs/moe.md)")
    ap.add_argument("--write-data", metavar="DIR",
                    help="also (re)write tiny_train.jsonl / tiny_val.jsonl into DIR")
    args = ap.parse_args(argv)
    if not args.out and not args.write_data:
        ap.error("give --out DIR and/or --write-data DIR")
    if args.write_data:
        for path in write_tiny_data(args.write_data):
            print(f"wrote {path}")
    if args.out:
        import torch
        torch.set_num_threads(1)
        out = build_tiny_model(args.out, seed=args.seed, hidden=args.hidden, layers=args.layers,
                               heads=args.heads, head_dim=args.head_dim, intermediate=args.intermediate,
                               vocab_size=args.vocab_size, chat_template=args.chat_template,
                               architecture=args.architecture)
        print(f"built tiny model in {out} (sha256 {model_digest(out)[:12]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
