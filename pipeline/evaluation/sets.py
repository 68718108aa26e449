"""Validation sets as a generator (or `python -m pipeline eval`) decodes them:
which are due after a step, their prompts, each sample's seed, and their scores.

Without validation.sets the run has one implicit set, named "": data.val,
greedy, one sample, reported as val_reward (pipeline/evaluation/scores.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from pipeline.config import Config
from pipeline.config.sections import ValSetConfig
from pipeline.core.types import Completion, Prompt, sample_seeds
from pipeline.evaluation.scores import add_sums, prompt_sums

IMPLICIT = ValSetConfig(name="")


def set_specs(cfg: Config) -> tuple[ValSetConfig, ...]:
    return cfg.validation.sets or (IMPLICIT,)


def due_after(step: int, cfg: Config) -> tuple[str, ...]:
    """The sets validated after `step` (NeMo-RL's meaning: when (step + 1) % period
    == 0; a set's period defaults to validation.period), and all of them after
    the last step with validation.at_end."""
    v = cfg.validation
    last = v.at_end and step == cfg.run.steps - 1
    return tuple(s.name for s in set_specs(cfg) if last or ((s.period or v.period) > 0
                                                              and (step + 1) % (s.period or v.period) == 0))


def due_at_start(cfg: Config, start_step: int) -> tuple[str, ...]:
    """validation.at_start: every set, on the initial weights (not on a resume)."""
    return tuple(s.name for s in set_specs(cfg)) if cfg.validation.at_start and start_step == 0 else ()


def set_prompts(cfg: Config, spec: ValSetConfig) -> list[Prompt]:
    """The set's prompts in file order (over-long ones handled as data.filter_overlong says)."""
    if cfg.backend == "sim":
        from pipeline.sim.engines import sim_prompts
        return sim_prompts(cfg.sim.num_val_prompts, spec.name or "val")
    path = spec.data if spec.name else cfg.data.val
    if not path:
        return []
    from pipeline.inputs.datasets import run_prompts
    return list(run_prompts(cfg, spec.name or "val", path).prompts)


def set_seeds(run_seed: int, spec: ValSetConfig, prompts: list[Prompt]) -> list[list[int | None]]:
    """Each prompt's n sampler seeds, from the run seed, the set and the prompt's
    place in the whole set (the same every step, whichever generator decodes it); None: greedy."""
    if spec.temperature == 0:
        return [[None] * spec.n for _ in prompts]
    return sample_seeds(run_seed, f"val/{spec.name}", prompts, spec.n)


@dataclass(frozen=True)
class EvalSet:
    """One set's share that a generator decodes: its prompts, each with its n seeds."""
    spec: ValSetConfig
    prompts: tuple[Prompt, ...]
    seeds: tuple[tuple[int | None, ...], ...]
    reward_fn: Callable | None   # the set's own reward (or validation.reward); None: the training reward

    def requests(self) -> list[tuple[Prompt, int | None, float]]:
        """(prompt, seed, temperature) per sample, prompt by prompt."""
        return [(p, seed, self.spec.temperature) for p, seeds in zip(self.prompts, self.seeds) for seed in seeds]

    def sums(self, completions: list[Completion], scored: list[tuple[float, str]]) -> dict[str, float]:
        """The set's sums (scores.py) from its samples' completions and (reward, error), in requests' order."""
        n = self.spec.n
        return add_sums(prompt_sums(self.spec, p.data_source, [r for r, _ in scored[i * n:(i + 1) * n]],
                                    [bool(e) for _, e in scored[i * n:(i + 1) * n]],
                                    [c.text for c in completions[i * n:(i + 1) * n]])
                        for i, p in enumerate(self.prompts))


def load_sets(cfg: Config, shard: int = 0, shards: int = 1) -> list[EvalSet]:
    """Every set's share prompts[shard::shards], seeded as in the whole set."""
    from pipeline.rewards.specs import load_reward
    out = []
    for spec in set_specs(cfg):
        prompts = set_prompts(cfg, spec)
        seeds = set_seeds(cfg.run.seed, spec, prompts)
        reward = spec.reward or cfg.validation.reward
        out.append(EvalSet(spec, tuple(prompts[shard::shards]), tuple(map(tuple, seeds[shard::shards])),
                           load_reward(reward) if reward else None))
    return out
