"""A tiny reward model for the tiny task, built and fitted offline: the tiny
model's body with a one-label score head (pipeline/inputs/tiny.py,
classifier=True), regressed onto tiny_reward on made-up completions, so that
examples/tiny_reward_model.yaml learns from a learned reward, as a run with a
real reward model would.

The completions mix what a policy emits on the way: random tokens of the
vocabulary (a random policy), and runs of either character, the asked one or
the other, with spaces and strays at every share (a learning one, and one
that ignores the prompt). The fit is portable_fit's, so the saved weights
are the same bytes on every x86 CPU. Measured here (2 cores, seed 0): 400
steps of 64, the whole build about 80 s of CPU time, then on 256 held-out
completions a squared error of 0.0048 against a reward variance of 0.096
(correlation 0.978); 16 copies of the asked character score 0.92-1.01, of
the other one 0.00-0.03.
"""
from __future__ import annotations

import random
from pathlib import Path

from pipeline.core.types import Prompt
from pipeline.inputs.portable_fit import portable_fit
from pipeline.rewards.rules import tiny_reward
from pipeline.inputs.tiny import TINY_ALPHABET, build_tiny_model, tiny_prompt

STRAYS = (" ", ":", "a")


def made_up_sample(rng: random.Random, tokenizer) -> tuple[str, float]:
    """(the classifier's input text, tiny_reward of its completion) for one made-up completion."""
    target = rng.choice(TINY_ALPHABET)
    if rng.random() < 0.3:
        ids = [rng.randrange(len(tokenizer.all_special_ids), len(tokenizer)) for _ in range(rng.randint(1, 16))]
        completion = tokenizer.decode(ids, skip_special_tokens=True)
    else:
        # Runs of the target and, as often, of the other character: a classifier that never saw
        # "1111" under "repeat: 0 ..." scored it high, and the policy learned to ignore the prompt.
        main = target if rng.random() < 0.5 else rng.choice([c for c in TINY_ALPHABET if c != target])
        share = rng.random()
        choices = [*TINY_ALPHABET, *STRAYS]
        completion = "".join(main if rng.random() < share else rng.choice(choices)
                             for _ in range(rng.randint(1, 24)))
    prompt = tiny_prompt(target)
    return prompt + completion, tiny_reward(Prompt("made-up", prompt, target), completion)


def build_tiny_reward_model(out_dir: str | Path, *, seed: int = 0, steps: int = 400, batch: int = 64,
                            lr: float = 3e-3) -> dict:
    """Build the classifier in `out_dir`, fit it (portable_fit: the same bytes on
    every x86 CPU), save it; returns its held-out fit."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    out = build_tiny_model(out_dir, seed=seed, classifier=True)
    tokenizer = AutoTokenizer.from_pretrained(out)
    rng = random.Random(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_pretrained(out)

        def scored(rows: list[tuple[str, float]]) -> tuple[torch.Tensor, torch.Tensor]:
            enc = tokenizer([text for text, _ in rows], padding=True, return_tensors="pt")
            predicted = model(**enc).logits[:, 0]
            return predicted, torch.tensor([r for _, r in rows], dtype=predicted.dtype)

        held_out = [made_up_sample(rng, tokenizer) for _ in range(256)]
        with portable_fit(model, lambda params: torch.optim.AdamW(params, lr=lr)) as optimizer:
            model.train()
            for _ in range(steps):
                predicted, target = scored([made_up_sample(rng, tokenizer) for _ in range(batch)])
                loss = ((predicted - target) ** 2).mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        model.eval()
        with torch.no_grad():
            predicted, target = scored(held_out)
    model.save_pretrained(out)
    return {"held_out_mse": float(((predicted - target) ** 2).mean()), "reward_var": float(target.var()),
            "correlation": float(torch.corrcoef(torch.stack([predicted, target]))[0, 1])}
