"""The generation engine a generator runs, simulated or vLLM, and what it
scores and validates with. Called inside the actor, so that vLLM is imported
only in the processes that run it."""
from __future__ import annotations

from typing import Callable

from pipeline.core.memory import frozen_imports
from pipeline.core.precision import device_dtype
from pipeline.core.types import GenerationEngine, Prompt
from pipeline.config import Config
from pipeline.core.spans import span


VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def generation_engine(cfg: Config, index: int, incarnation: int = 0) -> GenerationEngine:
    # Only the sim's latency jitter draws from this seed: every rollout sample is
    # seeded from its batch (pipeline.core.types.sample_seeds), so a restarted or
    # resumed generator replays exactly what its predecessor would have drawn.
    seed = cfg.run.seed * 1000 + index + 100 * incarnation
    if cfg.backend == "sim":
        from pipeline.sim.engines import SimGenerationEngine
        faulty = index == cfg.inject.worker and incarnation < cfg.inject.incarnations
        return SimGenerationEngine(cfg.sim, seed=seed, max_new_tokens=cfg.generation.max_new_tokens,
                                   inject=cfg.inject, faulty=faulty)
    adapter = None
    if cfg.training.lora.rank:
        from pipeline.weights.lora import adapter_config
        adapter = adapter_config(cfg.training.lora, cfg.model.path)
    return vllm_engine(cfg, seed, adapter)


def vllm_engine(cfg: Config, seed: int, adapter: dict | None) -> GenerationEngine:
    """cfg.model.path on vLLM as generation says, serving a LoRA adapter of
    `adapter`'s config (pipeline/weights/lora.py adapter_config) when given."""
    with span("import vllm"), frozen_imports():
        from pipeline.generator.vllm_engine import VllmGenerationEngine
    g = cfg.generation
    # One collect starts at most max_age + 1 batches: size the KV cache for all their samples at once
    # (inflight refits: one batch more, the one a refit finds still decoding).
    prompts = -(-cfg.schedule.prompts_per_step // g.num_generators)
    batches = cfg.schedule.max_age + 1 + (g.refit_mode == "inflight")
    requests = prompts * cfg.schedule.group_size * batches
    with span("vllm.start"):
        # T > 1: vLLM's TP workers go into this generator's bundles (pipeline/run/placement.py, vllm_llm_kwargs below).
        return VllmGenerationEngine(cfg.model.path, seed=seed, max_new_tokens=g.max_new_tokens,
                                    dtype=VLLM_DTYPES[device_dtype(g.dtype, "generation.dtype")],
                                    temperature=g.temperature, top_p=g.top_p, kv_cache_seqs=max(requests, 32),
                                    inflight_kv=g.inflight_kv, adapter_config=adapter,
                                    routing_replay=cfg.training.routing_replay, **vllm_llm_kwargs(cfg))


def vllm_llm_kwargs(cfg: Config) -> dict:
    """vllm.LLM's arguments for the generator's tensor parallelism (none with T = 1)."""
    tp = cfg.generation.tensor_parallel_size
    return {"tensor_parallel_size": tp, "distributed_executor_backend": "ray"} if tp > 1 else {}


def reward_function(cfg: Config) -> Callable[[Prompt, str], float] | None:
    """data.reward's function (on backend sim, the simulator's); None where an
    environment scores its samples, or a reward model scores them alone."""
    if cfg.env.class_:
        return None
    if cfg.backend == "sim":
        from pipeline.sim.engines import faulty_sim_reward, sim_reward
        return faulty_sim_reward(cfg.inject) if cfg.inject.fault == "reward_raise" else sim_reward
    from pipeline.rewards.specs import load_reward
    return load_reward(cfg.data.reward) if cfg.data.reward else None

