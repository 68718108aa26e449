"""The reward model's actor: it scores each finished rollout batch between
the generator and the buffer (the delivery graph, dags/step_graph.py), with a
sequence classifier, an LLM judge (pipeline/reward_model/classifier.py,
judge.py) or, on backend sim, a simulated one.

Everything is set up in __init__, so that Ray's own restart (max_restarts:
fault.max_restarts) rebuilds it whole: a score call that a dead process left
unfinished runs again on the new one (max_task_retries), and the handles the
generators hold stay valid. Each incarnation logs as a worker of its own
(reward_model, reward_model_r1, ...), so its clock lane starts fresh.

It logs `score_start` after the rollout's clock and `score_end` with the
batch's final flat groups; its weights' digest at load (`worker_ready`) and at
the run's end (`weights_checked`) let the checker prove they never changed
(invariant 9, DESIGN.md).
"""
from __future__ import annotations

import dataclasses

import ray

from dags.tokens import Clock, Rollout
from pipeline.algos.groups import flat_group_indices
from pipeline.config import Config
from pipeline.core.events import EventLog
from pipeline.core.node import Actor, one_thread, scorer_actor, whereabouts
from pipeline.core.precision import device_dtype
from pipeline.core.worker_names import REWARD_MODEL, logged_incarnations, reward_model_name
from pipeline.rewards.mix import apply_scores
from pipeline.reward_model.common import row_prompts

def reward_scorer(cfg: Config, incarnation: int):
    """The scorer the recipe names: (prompts, completion texts) -> [(score, why it failed or "")]."""
    rm = cfg.reward_model
    if cfg.backend == "sim":
        from pipeline.sim.engines import SimRewardModel
        return SimRewardModel(cfg.sim, seed=cfg.run.seed * 1000 + 999, inject=cfg.inject,
                              faulty=incarnation < cfg.inject.incarnations)
    dtype = device_dtype(rm.dtype, "reward_model.dtype")
    if rm.kind == "classifier":
        from pipeline.reward_model.classifier import ClassifierScorer
        return ClassifierScorer(rm.path, batch_size=rm.batch_size, dtype=dtype)
    from pipeline.reward_model.judge import JudgeScorer
    return JudgeScorer(rm.path, template=rm.template, score_pattern=rm.score_pattern, output_regex=rm.output_regex,
                       max_new_tokens=rm.max_new_tokens, batch_size=rm.batch_size, dtype=dtype)


class RewardModelWorker(Actor):
    def __init__(self, cfg: Config, run_dir: str, t0: float):
        super().__init__()
        one_thread()
        self.cfg = cfg
        # A restart is a new process with the same arguments: the logs so far count the incarnations.
        incarnation = logged_incarnations(run_dir, REWARD_MODEL)
        self.log = EventLog(run_dir, reward_model_name(incarnation), t0)
        self.log.emit("worker_start", **whereabouts(), incarnation=incarnation)
        self.scorer = reward_scorer(cfg, incarnation)
        self.digest = self.scorer.digest()
        self.log.emit("worker_ready", kind=cfg.reward_model.kind, weights=self.digest)

    def ready(self) -> Clock:
        return self.log.now()

    @ray.method(concurrency_group="score")
    def score(self, rollout: Rollout) -> Rollout:
        """The batch with its rewards as the run trains on them; the token carries this worker's clock."""
        self.log.merge(rollout.clock)
        self.log.emit("score_start", step=rollout.step, version=rollout.version, batch=rollout.batch_id)
        table, group = rollout.table, self.cfg.schedule.group_size
        prompts = row_prompts(rollout.prompts, table.num_rows)
        scores = self.scorer.score(prompts, table.column("text").to_pylist())
        scored = apply_scores(table, scores, self.cfg.reward_model.weight, group, self.log.worker)
        for reason in scored.failures:
            self.log.emit("reward_failed", step=rollout.step, version=rollout.version, batch=rollout.batch_id,
                          reason=reason)
        rewards = scored.table.column("reward").to_pylist()
        self.log.emit("score_end", step=rollout.step, version=rollout.version, batch=rollout.batch_id,
                      flat_groups=flat_group_indices(rewards, group))
        return dataclasses.replace(rollout, table=scored.table, clock=self.log.now())

    @ray.method(concurrency_group="score")
    def score_texts(self, prompts: list, completions: list[str]) -> list[tuple[float, str]]:
        """A validation's completions, scored as the training batches are (the validate node waits for it)."""
        return self.scorer.score(prompts, completions)

    @ray.method(concurrency_group="score")
    def finish(self, after: Clock = ()) -> Clock:
        """At the run's end, after its last batch: the weights' digest again, for the checker."""
        self.log.merge(after)
        self.log.emit("weights_checked", weights=self.scorer.digest(), loaded=self.digest)
        return self.log.now()

    def close(self) -> None:
        self.scorer.close()
        self.log.close()


def start_reward_model(cfg: Config, run_dir: str, t0: float, options: dict):
    """The run's reward model actor, restarted by Ray up to fault.max_restarts times."""
    return scorer_actor(RewardModelWorker, "score", cfg.fault.max_restarts, options, cfg, run_dir, t0)
