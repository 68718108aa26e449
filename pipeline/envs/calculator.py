"""A calculator tool task small enough for the tiny model (env.class
pipeline.envs.calculator:CalculatorEnv).

One episode, two model turns when played right:

    prompt        "What is 3+4? Use the calculator.\\n"
    model turn 1  "calc 3+4"            (then </s>)
    observation   "result 7\\n"
    model turn 2  "answer 7"            (then </s>)   -> reward 1.0, done

Rules:
- a turn must be exactly `calc A+B` (also `-` and `*`; spaces around the
  parts are allowed) or `answer N`; anything else is malformed and gets the
  observation "error: write 'calc A+B' or 'answer N'\\n" (reward 0, not done),
  so a sampled policy is told what went wrong instead of failing its sample;
- the tool computes whatever it is asked: a call that copied the wrong
  operands gets the wrong result, and the model answers wrongly;
- `answer N` ends the episode: reward 1.0 when N is prompt.answer, else 0.0;
- with require_tool (the default) an answer given before any call ends the
  episode with reward 0 whatever N is: the task is to use the tool, and the
  tiny model could otherwise only earn reward by guessing sums;
- the env ends the episode itself at its own max_turns (default 3: the two
  turns of a right episode plus one retry after a malformed turn), with
  reward 0 unless that last turn answered right. Rewards come only on the
  episode's last step, so the sum and the last of them are the same.

Why this layout (tokens of the tiny byte-level BPE, pipeline/inputs/tiny.py):
the prompt writes the sum as "37+45" after a space, the same tokens as the
call's (checked for every pair 0..99), and the observation's " 82" is the
answer's: both turns are copies (which a 2-layer model learns by attention)
plus a fixed word, never arithmetic. A call is at most 10 tokens plus </s>
and an answer 7 plus </s>, under generation.max_new_tokens 16 (numbers
split unevenly: " 12" is one token, " 17" two, " 7" two).

Why operands 0..99, not 0..9 or 0..9999: with 100 problems the training rows
cover them all, so a supervised warm-up reaches the format at once and the
reward measures the format, not how far copying generalises to unseen sums.

What RL learns here is to use the tool: the warm-up (warmup_action)
demonstrates the format on every training prompt, but half of its episodes
answer at once with a guess, which RL then unlearns (the warm-up's and the
recipes' curves: benchmarks/tool_seeds.py, docs/results.md). A warm-up that
imitates a perfect expert leaves only copying errors, which RL barely moves.
"""
from __future__ import annotations

import argparse
import random
import re
from pathlib import Path

from pipeline.core.types import Prompt
from pipeline.core.jsonl import write_train_val

PROMPT = "What is {a}+{b}? Use the calculator.\n"
CALL = "calc {a}+{b}"
RESULT = "result {value}\n"
ANSWER = "answer {value}"
MALFORMED = "error: write 'calc A+B' or 'answer N'\n"
MAX_OPERAND = 99

_PROMPT_RE = re.compile(r"What is (\d+)\+(\d+)\?")
# fullmatch, so a turn with trailing text (no </s> within the token limit) is malformed.
_CALL_RE = re.compile(r"\s*calc\s*(\d{1,6})\s*([-+*])\s*(\d{1,6})\s*")
_ANSWER_RE = re.compile(r"\s*answer\s*(-?\d{1,13})\s*")
_OPS = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y}


class CalculatorEnv:
    """One episode of the calculator task; see the module docstring for the rules."""

    # `python -m pipeline warmup`'s defaults for this env: every training prompt,
    # warmup_action's transcripts (the module docstring says why).
    warmup_steps = 800
    warmup_prompts = None

    def __init__(self, max_turns: int = 3, require_tool: bool = True):
        if max_turns < 2:
            raise ValueError(f"CalculatorEnv max_turns {max_turns}: a right episode needs 2 turns")
        self.max_turns = max_turns
        self.require_tool = require_tool
        self._prompt: Prompt | None = None

    def reset(self, prompt: Prompt) -> str:
        m = _PROMPT_RE.search(prompt.text)
        if m is None:
            raise ValueError(f"prompt {prompt.id!r}: no 'What is A+B?' in {prompt.text!r}")
        try:
            self.target = int(prompt.answer)
        except ValueError:
            raise ValueError(f"prompt {prompt.id!r}: answer {prompt.answer!r} is not an integer") from None
        self.a, self.b = int(m.group(1)), int(m.group(2))
        if self.a + self.b != self.target:
            raise ValueError(f"prompt {prompt.id!r}: answer {prompt.answer!r} is not {self.a}+{self.b}")
        self._prompt = prompt
        self.turns = 0
        self.calls = 0
        self.done = False
        return prompt.text

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        if self._prompt is None or self.done:
            raise RuntimeError("CalculatorEnv.step() before reset() or after the episode ended")
        self.turns += 1
        last = self.turns >= self.max_turns
        if (m := _ANSWER_RE.fullmatch(action)) is not None:
            self.done = True
            if self.require_tool and self.calls == 0:
                return "no calculator call\n", 0.0, True, {"valid": True, "event": "answer_without_call"}
            correct = int(m.group(1)) == self.target
            info = {"valid": True, "event": "answer", "correct": correct}
            return ("correct\n" if correct else "wrong\n"), float(correct), True, info
        if (m := _CALL_RE.fullmatch(action)) is not None:
            self.calls += 1
            value = _OPS[m.group(2)](int(m.group(1)), int(m.group(3)))
            self.done = last
            return RESULT.format(value=value), 0.0, last, {"valid": True, "event": "call", "value": value}
        self.done = last
        return MALFORMED, 0.0, last, {"valid": False, "event": "malformed"}

    def warmup_action(self, rng) -> str:
        """What the warm-up demonstrates: the expert's format, but half the
        episodes answer at once with a guess instead of calling the tool.
        Using the tool is then what RL has to learn (a guess is rewarded 0)."""
        if self.turns == 0 and self.calls == 0 and rng.random() < 0.5:
            return ANSWER.format(value=rng.randint(0, 2 * MAX_OPERAND))
        return self.expert_action()

    def expert_action(self) -> str:
        """Call first, then answer. The expert answers the true sum even after a
        wrong call (it knows the problem), so it earns 1.0 from any state with a
        call made and a turn left, or two turns left. It calls even without
        require_tool (unless one turn is left): it demonstrates the tool."""
        if self.calls == 0 and (self.require_tool or self.max_turns - self.turns >= 2):
            return CALL.format(a=self.a, b=self.b)
        return ANSWER.format(value=self.target)


def calculator_rows(n: int, *, seed: int = 0, max_operand: int = MAX_OPERAND) -> list[dict]:
    """`n` rows with operands drawn uniformly from 0..max_operand."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        rows.append({"id": f"tool-{seed}-{i}", "prompt": PROMPT.format(a=a, b=b), "answer": str(a + b)})
    return rows


def write_calculator_data(out_dir: str | Path, *, n_train: int = 256, n_val: int = 32) -> list[Path]:
    """data/tool_train.jsonl (seed 0) and data/tool_val.jsonl (seed 1)."""
    return write_train_val(out_dir, "tool", calculator_rows, n_train=n_train, n_val=n_val)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m pipeline.envs.calculator",
                                 description="(Re)write tool_train.jsonl / tool_val.jsonl.")
    ap.add_argument("out_dir", help="e.g. data")
    for written in write_calculator_data(ap.parse_args().out_dir):
        print(f"wrote {written}")
