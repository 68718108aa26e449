"""An LLM judge as the reward model: a causal LM on a vLLM engine of its own
answers `reward_model.template` (greedy), and the score is parsed from its
answer by `reward_model.score_pattern`. `reward_model.output_regex`
constrains the answer with vLLM's structured outputs, so a small judge
always answers in a form that parses. An answer without a score is that
sample's reward failure, counted under fault.max_reward_failures.

The engine is never refit: nothing in the run sends it weights.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from pipeline.core.types import Prompt
from pipeline.core.weights_digest import state_digest
from pipeline.reward_model.common import question


def parse_score(answer: str, pattern: re.Pattern) -> float | None:
    """The first match of `pattern` in the answer (its first group, if it has one) as a number, or None."""
    match = pattern.search(answer)
    if match is None:
        return None
    try:
        return float(match.group(1) if pattern.groups else match.group(0))
    except (TypeError, ValueError):
        return None


class JudgeScorer:
    MAX_MODEL_LEN = 4096

    def __init__(self, path: str, *, template: str, score_pattern: str, output_regex: str = "",
                 max_new_tokens: int = 8, batch_size: int = 16, dtype: str = "fp32"):
        import torch

        from pipeline.core.vllm_env import kv_cache_bytes, set_vllm_environment
        from pipeline.inputs.models import ModelError, check_model_dir, check_reward_model
        set_vllm_environment()  # before vLLM's import below, which reads it once
        from vllm import LLM, SamplingParams
        from vllm.sampling_params import StructuredOutputsParams
        check_model_dir(path)
        check_reward_model(path, "judge")
        config = json.loads((Path(path) / "config.json").read_text())
        self.context = min(self.MAX_MODEL_LEN, int(config.get("max_position_embeddings") or self.MAX_MODEL_LEN))
        vllm_dtype = "bfloat16" if dtype == "bf16" else "float32"
        on_cpu = not torch.cuda.is_available()
        memory = ({"kv_cache_memory_bytes": kv_cache_bytes(config, self.context, batch_size, vllm_dtype)}
                  if on_cpu else {"gpu_memory_utilization": 0.2})
        try:
            self.llm = LLM(model=path, tokenizer=path, dtype=vllm_dtype, max_model_len=self.context,
                           enforce_eager=on_cpu, **memory)
        except Exception as exc:
            raise ModelError(f"model directory {path!r}: vLLM could not load it as a judge: "
                             f"{type(exc).__name__}: {exc}") from exc
        self.tokenizer = self.llm.get_tokenizer()
        self.chat = bool(getattr(self.tokenizer, "chat_template", None))
        self.template, self.pattern = template, re.compile(score_pattern)
        self.max_new_tokens, self.batch_size = max_new_tokens, batch_size
        self.params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, structured_outputs=(
            StructuredOutputsParams(regex=output_regex) if output_regex else None))

    def render(self, prompt: Prompt, completion: str) -> list[int]:
        """The judge's prompt as token ids: the template filled in, in the judge's chat template if it has one."""
        text = self.template.format(prompt=question(prompt), completion=completion, answer=prompt.answer)
        if self.chat:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                      add_generation_prompt=True, tokenize=False)
            return self.tokenizer(text, add_special_tokens=False).input_ids
        return self.tokenizer(text).input_ids

    def score(self, prompts: list[Prompt], completions: list[str]) -> list[tuple[float, str]]:
        from vllm.inputs import TokensPrompt
        ids = [self.render(p, c) for p, c in zip(prompts, completions, strict=True)]
        out: list[tuple[float, str]] = [(0.0, "")] * len(ids)
        fits = []
        for i, row in enumerate(ids):
            if len(row) + self.max_new_tokens > self.context:
                out[i] = (0.0, f"prompt {prompts[i].id}: the judge's prompt of {len(row)} tokens and "
                               f"{self.max_new_tokens} to answer exceed its context of {self.context}")
            else:
                fits.append(i)
        for start in range(0, len(fits), self.batch_size):
            rows = fits[start:start + self.batch_size]
            answers = self.llm.generate([TokensPrompt(prompt_token_ids=ids[i]) for i in rows], self.params,
                                        use_tqdm=False)
            for i, answer in zip(rows, answers):
                text = answer.outputs[0].text
                value = parse_score(text, self.pattern)
                out[i] = (value, "") if value is not None else (
                    0.0, f"prompt {prompts[i].id}: the judge's answer {text[:80]!r} has no score "
                         f"(reward_model.score_pattern {self.pattern.pattern!r})")
        return out

    def digest(self) -> str:
        """A hash of the engine's weights, as its process holds them (the in-process engine)."""
        return state_digest(self.llm.llm_engine.model_executor.driver_worker.model_runner.model.state_dict())

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()
