"""The teacher's actor: it puts the teacher's logprob of every response token
(and with distill.loss topk_kl its top-k there) into each finished rollout batch, between the generator (or the reward model)
and the buffer (the delivery graph, dags/step_graph.py), with a transformers
forward (pipeline/distill/forward.py) or, on backend sim, a simulated teacher.

Everything is set up in __init__, so that Ray's own restart (max_restarts:
fault.max_restarts) rebuilds it whole: a teach call that a dead process left
unfinished runs again on the new one (max_task_retries), and the handles the
generators hold stay valid. Each incarnation logs as a worker of its own
(teacher, teacher_r1, ...), so its clock lane starts fresh.

It logs `teach_start` after the batch's clock and `teach_end` before the
batch goes on to the buffer; its weights' digest at load (`worker_ready`) and
at the run's end (`weights_checked`) let the checker prove they never changed
(invariant 10, DESIGN.md).
"""
from __future__ import annotations

import dataclasses
import math

import pyarrow as pa
import ray

from dags.tokens import Clock, Rollout
from pipeline.config import Config
from pipeline.core.events import EventLog
from pipeline.core.node import Actor, one_thread, scorer_actor, whereabouts
from pipeline.core.precision import device_dtype
from pipeline.core.worker_names import TEACHER, logged_incarnations, teacher_name


def teacher_forward(cfg: Config, incarnation: int):
    """The teacher the recipe names: (prompt ids, response ids) of each row -> TeacherScores
    (its response tokens' logprobs; with distill.loss topk_kl, its top-k at each of them)."""
    d = cfg.distill
    topk = d.topk if d.loss == "topk_kl" else 0
    if cfg.backend == "sim":
        from pipeline.sim.engines import SimTeacher
        return SimTeacher(cfg.sim, inject=cfg.inject, faulty=incarnation < cfg.inject.incarnations, topk=topk)
    from pipeline.distill.forward import TeacherForward
    return TeacherForward(d.teacher, batch_size=d.batch_size, dtype=device_dtype(d.dtype, "distill.dtype"),
                          temperature=cfg.generation.temperature, topk=topk)


def with_teacher_scores(table: pa.Table, scores) -> pa.Table:
    """`table` with its teacher columns set from TeacherScores, refused unless each
    row has a finite logprob (and, with top-k, k finite ones) for each of its response tokens."""
    lengths = [len(r) for r in table.column("response_ids").to_pylist()]
    for i, (row, n) in enumerate(zip(scores.logprobs, lengths, strict=True)):
        if len(row) != n or not all(math.isfinite(x) for x in row):
            raise ValueError(f"row {i}: the teacher gave {len(row)} logprobs (finite: "
                             f"{sum(map(math.isfinite, row))}) for {n} response tokens")
    columns = {"teacher_logprobs": scores.logprobs}
    if scores.topk_ids is not None:
        for i, (ids, lps, n) in enumerate(zip(scores.topk_ids, scores.topk_logprobs, lengths, strict=True)):
            shapes = {(len(a), len(b)) for a, b in zip(ids, lps)}
            finite = all(math.isfinite(x) for t in lps for x in t)
            if len(ids) != n or len(lps) != n or len(shapes) > 1 or any(a != b for a, b in shapes) or not finite:
                raise ValueError(f"row {i}: the teacher's top-k has {len(ids)} id and {len(lps)} logprob lists "
                                 f"(sizes {sorted(shapes)}, all finite: {finite}) for {n} response tokens")
        columns.update(teacher_topk_ids=scores.topk_ids, teacher_topk_logprobs=scores.topk_logprobs)
    for name, values in columns.items():
        column = table.schema.get_field_index(name)
        table = table.set_column(column, table.schema.field(column), pa.array(values, table.schema.field(column).type))
    return table


class TeacherWorker(Actor):
    def __init__(self, cfg: Config, run_dir: str, t0: float):
        super().__init__()
        one_thread()
        # A restart is a new process with the same arguments: the logs so far count the incarnations.
        incarnation = logged_incarnations(run_dir, TEACHER)
        self.log = EventLog(run_dir, teacher_name(incarnation), t0)
        self.log.emit("worker_start", **whereabouts(), incarnation=incarnation)
        self.teacher = teacher_forward(cfg, incarnation)
        self.digest = self.teacher.digest()
        self.log.emit("worker_ready", teacher=cfg.distill.teacher, weights=self.digest)

    def ready(self) -> Clock:
        return self.log.now()

    @ray.method(concurrency_group="teach")
    def teach(self, rollout: Rollout) -> Rollout:
        """The batch with the teacher's logprobs; the token carries this worker's clock."""
        self.log.merge(rollout.clock)
        self.log.emit("teach_start", step=rollout.step, version=rollout.version, batch=rollout.batch_id)
        table = rollout.table
        scores = self.teacher.score(table.column("prompt_ids").to_pylist(), table.column("response_ids").to_pylist())
        taught = with_teacher_scores(table, scores)
        self.log.emit("teach_end", step=rollout.step, version=rollout.version, batch=rollout.batch_id)
        return dataclasses.replace(rollout, table=taught, clock=self.log.now())

    @ray.method(concurrency_group="teach")
    def finish(self, after: Clock = ()) -> Clock:
        """At the run's end, after its last batch: the weights' digest again, for the checker."""
        self.log.merge(after)
        self.log.emit("weights_checked", weights=self.teacher.digest(), loaded=self.digest)
        return self.log.now()

    def close(self) -> None:
        self.teacher.close()
        self.log.close()


def start_teacher(cfg: Config, run_dir: str, t0: float, options: dict):
    """The run's teacher actor, restarted by Ray up to fault.max_restarts times."""
    return scorer_actor(TeacherWorker, "teach", cfg.fault.max_restarts, options, cfg, run_dir, t0)
