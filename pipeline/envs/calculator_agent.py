"""The calculator task (pipeline/envs/calculator.py) as an agent on the
OpenAI chat API plays it: one function tool, `calculator`, offered with
every request; the model's calls are run by run_calculator() and sent back
as `tool` messages. solve() is that agent (agent.function of
examples/tiny_agent_grpo.yaml); the transcripts below teach the tiny model
its format before RL (`make models/tiny_agent/config.json`).

A transcript, rendered by the tiny model's tool template (pipeline/inputs/tiny.py):

    user       What is 37+45? Use the calculator.\\n  (the data row's prompt)
    assistant  [calculator(expression="37+45")]     (tool_calls; pythonic)
    tool       82                                    (run_calculator's result)
    assistant  82                                    (the answer: the number alone)

Seven in ten of the written transcripts (`guesses`) answer at once with a
guess instead, as CalculatorEnv.warmup_action does with half, so that using
the tool is left for RL to learn: the warmed-up model's greedy first turn
guesses, while its sampled turns sometimes call the tool. Token counts in the tiny vocabulary, </s> included:
a call is 29 to 31 tokens (operands 0..99), an answer 2 to 4, the first
request (tools, prompt, assistant header) 103 to 106, a whole transcript
at most 168 of the model's 512 positions. A call is over the run's default
generation.max_new_tokens (16): the agent asks for MAX_TOKENS with each
request.

    python -m pipeline.envs.calculator_agent data/tool_train.jsonl OUT.jsonl [--guesses 0.7]
"""
from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

from pipeline.core.jsonl import JsonLineError, json_lines
from pipeline.core.types import Prompt
from pipeline.envs.calculator import _OPS, MAX_OPERAND

CALCULATOR_TOOL = {"type": "function", "function": {
    "name": "calculator", "description": "Computes A+B, A-B or A*B.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}
TOOL_PARSER = "pythonic"  # the format the tiny model's tool template writes calls in
MAX_TOKENS = 32           # max_tokens of each request: the longest call with </s>, and a spare one
GUESSES = 0.7
MAX_REQUESTS = 3          # a call and an answer, and one retry (CalculatorEnv's max_turns)

_EXPRESSION_RE = re.compile(r"\s*(\d{1,6})\s*([-+*])\s*(\d{1,6})\s*")


def run_calculator(arguments: dict) -> str:
    """The tool: the value of arguments["expression"] ("A+B", "A-B" or "A*B",
    whole numbers), or an error the model reads, never an exception."""
    expression = arguments.get("expression") if isinstance(arguments, dict) else None
    m = _EXPRESSION_RE.fullmatch(expression) if isinstance(expression, str) else None
    if m is None:
        return "error: expression must be A+B, A-B or A*B"
    return str(_OPS[m.group(2)](int(m.group(1)), int(m.group(3))))


async def solve(client, prompt: Prompt) -> float:
    """The example agent (examples/tiny_agent_grpo.yaml): offers the calculator,
    runs the calls the model makes and sends back their results; 1.0 when the
    model's answer is prompt.answer after at least one call (as CalculatorEnv
    with require_tool rewards), else 0.0."""
    messages: list[dict] = [{"role": "user", "content": prompt.text}]
    called = False
    for _ in range(MAX_REQUESTS):
        answer = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR_TOOL],
                                                      max_tokens=MAX_TOKENS)
        message = answer.choices[0].message
        if not message.tool_calls:
            return float(called and (message.content or "").strip() == prompt.answer)
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": _run_call(call.function)})
        called = True
    return 0.0


def _run_call(function) -> str:
    if function.name != "calculator":
        return f"error: no tool named {function.name!r}"
    try:
        arguments = json.loads(function.arguments)
    except ValueError:
        return "error: the arguments are not JSON"
    return run_calculator(arguments)


def calculator_transcript(prompt: Prompt, *, guesses: float = GUESSES) -> dict:
    """{"messages": [...], "tools": [CALCULATOR_TOOL]} for one prompt: the
    tool called and its result answered, or (with probability `guesses`,
    drawn from the prompt's id) a guess from 0..198 answered at once."""
    rng = random.Random(f"warmup|{prompt.id}")
    messages: list[dict] = [{"role": "user", "content": prompt.text}]
    if rng.random() < guesses:
        messages.append({"role": "assistant", "content": str(rng.randint(0, 2 * MAX_OPERAND))})
        return {"messages": messages, "tools": [CALCULATOR_TOOL]}
    m = re.search(r"What is (\d+\+\d+)\?", prompt.text)
    if m is None:
        raise ValueError(f"prompt {prompt.id!r}: no 'What is A+B?' in {prompt.text!r}")
    arguments = {"expression": m.group(1)}
    call = {"id": "call_0", "type": "function",
            "function": {"name": "calculator", "arguments": json.dumps(arguments)}}
    result = run_calculator(arguments)
    messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": "call_0", "content": result},
                 {"role": "assistant", "content": result}]
    return {"messages": messages, "tools": [CALCULATOR_TOOL]}


def write_calculator_transcripts(prompts_path: str | Path, out: str | Path, *, guesses: float = GUESSES) -> int:
    """One transcript per row ({"id", "prompt", "answer"}) of the JSONL file
    `prompts_path`, as JSON lines into `out`; how many."""
    if not 0 <= guesses <= 1:
        raise ValueError(f"guesses {guesses}: a share from 0 to 1")
    try:
        prompts = [Prompt(row["id"], row["prompt"], row["answer"])
                   for _, row in json_lines(Path(prompts_path).read_text().splitlines())]
    except (KeyError, TypeError, JsonLineError) as exc:
        raise ValueError(f"{prompts_path}: not the calculator's rows ({{\"id\", \"prompt\", \"answer\"}}): "
                         f"{type(exc).__name__}: {exc}") from None
    rows = [calculator_transcript(p, guesses=guesses) for p in prompts]
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text("".join(json.dumps(row) + "\n" for row in rows))
    return len(rows)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m pipeline.envs.calculator_agent",
                                 description="Write calculator agent transcripts for `pipeline warmup --transcripts`.")
    ap.add_argument("prompts", help="the task's rows, e.g. data/tool_train.jsonl")
    ap.add_argument("out", help="JSONL file to write")
    ap.add_argument("--guesses", type=float, default=GUESSES,
                    help=f"share of transcripts that guess instead of calling the tool (default {GUESSES})")
    args = ap.parse_args()
    try:
        n = write_calculator_transcripts(args.prompts, args.out, guesses=args.guesses)
    except (OSError, ValueError) as exc:
        sys.exit(f"error: {exc}")
    print(f"wrote {n} transcripts to {args.out}")
