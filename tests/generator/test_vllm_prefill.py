"""Prefills larger than one engine step's token budget, with every request
seeded as dagrl seeds them: on CPU they must not be prefilled in chunks
(vLLM rewinds a chunked request's generator, which a CPU generator refuses)."""
from __future__ import annotations

import pytest

from pipeline.core.types import Prompt

pytestmark = pytest.mark.real


def test_many_long_seeded_prompts_at_once_decode(tiny_model):
    from pipeline.generator.vllm_engine import VllmGenerationEngine
    engine = VllmGenerationEngine(tiny_model, seed=0, max_new_tokens=4, temperature=1.0, kv_cache_seqs=64)
    try:
        # 64 x 200 tokens: three times the 4096 tokens an engine step schedules on CPU.
        for i in range(64):
            ids = tuple([1] + [5 + (i + j) % 300 for j in range(199)])
            engine.add(f"r{i}", Prompt(f"p{i}", "", token_ids=ids), seed=1000 + i)
        done = []
        while engine.busy():
            done += engine.step()
        assert sorted(key for key, _ in done) == sorted(f"r{i}" for i in range(64))
    finally:
        engine.close()
