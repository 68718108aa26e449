"""A two-guess digit game for the tiny model (env.class
pipeline.envs.digit_game:DigitGuessEnv).

The secret is prompt.answer, a digit in a range of three shown by the prompt:

    prompt        "Guess my digit from 3 to 5.\\n"        (secret 5)
    model turn 1  "guess 4"             (then </s>)
    observation   "higher\\n"            ("lower\\n" / "correct\\n")
    model turn 2  "guess 5"             (then </s>)   -> reward 1.0, done

Rules:
- a turn must be exactly `guess D`, one digit (spaces allowed); anything
  else is malformed, gets "error: write 'guess D'\\n" and uses up the turn;
- a right guess ends the episode with reward 1.0, on the first guess or the
  second alike: no strategy can know the secret before the first feedback,
  so a bonus for guessing it at once would only add noise; the one optimal
  strategy is then "the middle, then the end the feedback names", which
  wins every episode (starting at an end wins 2/3);
- after max_turns guesses (default 2) the episode ends; reward 0 unless the
  last guess was right. Rewards come only on the last step.

Why this layout (tokens of the tiny BPE, pipeline/inputs/tiny.py): the range's
ends are " 3", " 5" in the prompt and the guess writes " 5" the same way, so
turn 2 is a copy of the end the feedback points at, and turn 1 is the one
digit between the two ends (a lookup): learnable by a 2-layer model, and
neither needs the secret, which only the env knows. Every turn is at most 6
tokens plus </s> (" 0" and " 7" are two tokens). Ranges start at 0..7, so
there are 8 prompts and 24 (range, secret) episodes, and training and
validation rows share them. A model shown every range learns the game in
90-150 supervised steps from the expert alone, which would leave RL nothing
to learn. So the warm-up (warmup_action) demonstrates the expert's first
guess and then a random digit of the range, whatever the feedback: RL has to
learn to read "higher" / "lower". Measured (300 steps, lr 2e-3, seed 0):
greedy validation 0.47, sampled 0.54 (98 % well formed); GRPO
(examples/tiny_game_grpo.yaml, lr 5e-4) raised the sampled reward to
0.75-0.81 and greedy validation to 0.75-0.84 in 60 steps (seeds 0-2).
"""
from __future__ import annotations

import argparse
import random
import re
from pathlib import Path

from pipeline.core.types import Prompt
from pipeline.core.jsonl import write_train_val

PROMPT = "Guess my digit from {low} to {high}.\n"
GUESS = "guess {digit}"
MALFORMED = "error: write 'guess D'\n"
WIDTH = 3

_PROMPT_RE = re.compile(r"from (\d) to (\d)\.")
_GUESS_RE = re.compile(r"\s*guess\s*(\d)\s*")


class DigitGuessEnv:
    """One game; see the module docstring for the rules."""

    # `python -m pipeline warmup`'s defaults for this env: every training prompt,
    # warmup_action's transcripts (measured in the module docstring).
    warmup_steps = 300
    warmup_prompts = None

    def __init__(self, max_turns: int = 2):
        if max_turns < 1:
            raise ValueError(f"DigitGuessEnv max_turns {max_turns}: at least one guess is needed")
        self.max_turns = max_turns
        self._prompt: Prompt | None = None

    def reset(self, prompt: Prompt) -> str:
        m = _PROMPT_RE.search(prompt.text)
        if m is None:
            raise ValueError(f"prompt {prompt.id!r}: no 'from L to H.' in {prompt.text!r}")
        self.low, self.high = int(m.group(1)), int(m.group(2))
        if not (prompt.answer.isdigit() and len(prompt.answer) == 1 and self.low <= int(prompt.answer) <= self.high):
            raise ValueError(f"prompt {prompt.id!r}: answer {prompt.answer!r} is not a digit "
                             f"from {self.low} to {self.high}")
        self.secret = int(prompt.answer)
        self._prompt = prompt
        self.turns = 0
        self.done = False
        # What the feedback so far allows: the expert's state, not the env's rules.
        self._lo, self._hi = self.low, self.high
        return prompt.text

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        if self._prompt is None or self.done:
            raise RuntimeError("DigitGuessEnv.step() before reset() or after the episode ended")
        self.turns += 1
        last = self.turns >= self.max_turns
        m = _GUESS_RE.fullmatch(action)
        if m is None:
            self.done = last
            return MALFORMED, 0.0, last, {"valid": False, "event": "malformed"}
        guess = int(m.group(1))
        if guess == self.secret:
            self.done = True
            return "correct\n", 1.0, True, {"valid": True, "event": "correct", "guess": guess}
        if guess < self.secret:
            self._lo = max(self._lo, guess + 1)
            observation = "higher\n"
        else:
            self._hi = min(self._hi, guess - 1)
            observation = "lower\n"
        self.done = last
        return observation, 0.0, last, {"valid": True, "event": observation.strip(), "guess": guess}

    def warmup_action(self, rng) -> str:
        """What the warm-up demonstrates: the expert's first guess (the middle),
        then a guess anywhere in the range, whatever the feedback said. The
        format is learned; reading the feedback is left to RL: 5/9 of the
        games win, all of them once the second guess follows it."""
        if self.turns == 0:
            return self.expert_action()
        return GUESS.format(digit=rng.randint(self.low, self.high))

    def expert_action(self) -> str:
        """Bisect what the feedback allows (never reading the secret): the
        middle of the range, then the one digit left on the named side."""
        return GUESS.format(digit=(self._lo + self._hi) // 2)


def game_rows(n: int, *, seed: int = 0, width: int = WIDTH) -> list[dict]:
    """`n` rows; the range's start is uniform over 0..10-width and the
    secret's position in it cycles, so each position is equally common."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        low = rng.randint(0, 10 - width)
        secret = low + (i % width)
        rows.append({"id": f"game-{seed}-{i}", "prompt": PROMPT.format(low=low, high=low + width - 1),
                     "answer": str(secret)})
    rng.shuffle(rows)
    return rows


def write_game_data(out_dir: str | Path, *, n_train: int = 256, n_val: int = 32) -> list[Path]:
    """data/game_train.jsonl (seed 0) and data/game_val.jsonl (seed 1)."""
    return write_train_val(out_dir, "game", game_rows, n_train=n_train, n_val=n_val)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m pipeline.envs.digit_game",
                                 description="(Re)write game_train.jsonl / game_val.jsonl.")
    ap.add_argument("out_dir", help="e.g. data")
    for written in write_game_data(ap.parse_args().out_dir):
        print(f"wrote {written}")
