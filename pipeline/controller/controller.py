"""The controller actor: rollout queue, prompt stream and launch schedule.

Its graph nodes are sample, validation_gate, resume and train_done; the
generators' engine loops call `put` and `rollout_failed`; the driver calls
`relaunch`, `interrupt` and `save_state` between graph executions.

Vector clocks (pipeline/core/events.py): a rollout's clock comes with its `put` and
is kept with the batch, so `sample`, which waits for the batches it takes,
logs after their rollout_ends and hands that on in its Batch.
"""
from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dags.tokens import (
    Batch,
    Clock,
    CriticOut,
    Gate,
    Launch,
    Relaunch,
    RelaunchPlan,
    Resume,
    Rollout,
    StepPlan,
    Ticket,
    TopUp,
    TrainOut,
    ValOut,
    WeightsSent,
)
from pipeline.evaluation.scores import add_sums, val_metrics
from pipeline.algos.groups import choose_groups, flat_group_indices
from pipeline.core.events import EventLog
from pipeline.core.node import Actor, node, whereabouts
from pipeline.controller.rollout_queue import RolloutQueue
from pipeline.core.samples import train_samples
from pipeline.core.types import TRAJECTORY_SCHEMA, Prompt
from pipeline.config import Config
from pipeline.core import spans
from pipeline.core.worker_names import CONTROLLER


class Controller(Actor):
    def begin_run(self, cfg: Config, run_dir: str, t0: float, start_step: int = 0,
                  restore_dir: str | None = None, prompts: list[Prompt] | None = None) -> Clock:
        """`prompts`: the training prompts as the driver's preflight fitted them
        (data.filter_overlong), so that this process need not import a tokenizer
        to count them again; None: read and fit data.train here."""
        self.cfg = cfg
        self.log = EventLog(run_dir, CONTROLLER, t0)
        self.log.emit("worker_start", **whereabouts())
        self.queue = RolloutQueue(cfg.schedule.max_age, self.log)
        self.prompts = list(prompts) if prompts is not None else train_prompts(cfg)
        # metrics.samples: the prompt of each group shown (top-ups and restored batches draw from these too).
        self._prompt_texts = {p.id: p.text for p in self.prompts} if cfg.metrics.samples else {}
        self.rng = random.Random(cfg.run.seed)
        self.order: list[int] = []
        self.cursor = 0
        self.start_step = start_step
        self.reward_failures = 0
        self._relaunch_at_start: list[str] = []
        self._top_ups: dict[int, int] = {}   # step -> prompts its top-up rounds launched
        # The last target launched: a restored run launches none up to it again.
        self._launched_through = start_step - 1
        if restore_dir is not None:
            self._restore(Path(restore_dir))
        return self.log.now()

    def _next_prompts(self, count: int) -> list[Prompt]:
        out = []
        for _ in range(count):
            if self.cursor >= len(self.order):
                self.order = list(range(len(self.prompts)))
                self.rng.shuffle(self.order)
                self.cursor = 0
            out.append(self.prompts[self.order[self.cursor]])
            self.cursor += 1
        return out

    @node("sample")
    def sample(self, plan: StepPlan, *extra_started: Ticket) -> Batch:
        """`extra_started`: the last top-up round's extra_collect tickets (dynamic sampling)."""
        started = time.perf_counter()
        with spans.span("buffer.take"):
            ids, versions, table = self.queue.take(plan.step, self.cfg.run.deadline_s)
        metrics = ()
        if self.cfg.dynamic_sampling.max_rounds:
            table, metrics = self._informative_groups(plan.step, table)
        with spans.span("batch.put"):
            stored = self.put_for_step("batch", table)
        samples = train_samples(plan.step, table, self._prompt_texts, dict(zip(ids, versions)),
                                self.cfg.metrics.samples, self.cfg.schedule.group_size)
        return Batch(plan.step, tuple(ids), tuple(versions), stored,
                     wait_s=time.perf_counter() - started, metrics=metrics, samples=samples)

    @node("top_up")
    def top_up(self, plan: StepPlan, round_: int, *started: Ticket) -> TopUp:
        """Dynamic sampling's round `round_`: once every rollout of the step is in,
        launch more prompts if they hold fewer informative groups than the step
        needs: as many as the share of informative groups so far says will fill
        the gap, at most dynamic_sampling.max_prompts. The generators hold the
        step's version (the last refit's), so these rollouts are of age 0."""
        g, ds = self.cfg.schedule.group_size, self.cfg.dynamic_sampling
        arrived = self.queue.arrived(plan.step, self.cfg.run.deadline_s)
        seen = sum(t.num_rows // g for _, t in arrived)
        informative = seen - sum(len(flat_group_indices(t.column("reward").to_pylist(), g)) for _, t in arrived)
        missing = self.cfg.schedule.prompts_per_step - informative
        count = 0
        if missing > 0:
            cap = ds.max_prompts or self.cfg.schedule.prompts_per_step
            count = min(cap, math.ceil(missing * seen / max(informative, 1)))
        launches = self._launch(plan.step, plan.step, self._next_prompts(count), round_) if count else []
        self.log.emit("top_up", step=plan.step, version=plan.step, round=round_, informative=informative,
                      groups=seen, prompts=count)
        self._top_ups[plan.step] = self._top_ups.get(plan.step, 0) + count
        return TopUp(plan.step, plan.step, tuple(launches))

    def _informative_groups(self, step: int, table: pa.Table) -> tuple[pa.Table, tuple]:
        """The first prompts_per_step informative groups of the step's batches, in
        launch order (pipeline/algos/groups.py); every group left out is logged
        with its reason. Fewer than training.ranks x training.mini_batches cannot
        be split: then none is trained, and the trainer skips the update."""
        g, t = self.cfg.schedule.group_size, self.cfg.training
        ids = table.column("batch_id").to_pylist()
        rewards = table.column("reward").to_pylist()
        batches, starts = [], {}
        for i, batch_id in enumerate(ids):
            if batch_id not in starts:
                starts[batch_id] = i
                batches.append((batch_id, []))
            batches[-1][1].append(rewards[i])
        choice = choose_groups(batches, g, self.cfg.schedule.prompts_per_step)
        n = max(len(rewards), 1)
        mean = sum(rewards) / n
        keep, too_few = choice.keep, choice.informative < t.ranks * t.mini_batches
        for batch_id, _ in batches:
            for reason, groups in (("flat", choice.flat[batch_id]), ("surplus", choice.surplus[batch_id]),
                                   ("too_few", keep[batch_id] if too_few else ())):
                if groups:
                    self.log.emit("group_drop", step=step, batch=batch_id, groups=list(groups), reason=reason)
        rows = [] if too_few else [starts[b] + k * g + j for b, groups in keep.items() for k in groups
                                   for j in range(g)]
        metrics = (("flat_groups_dropped", float(sum(map(len, choice.flat.values())))),
                   ("surplus_groups_dropped", float(sum(map(len, choice.surplus.values())))),
                   ("informative_groups", float(0 if too_few else choice.informative)),
                   ("extra_prompts", float(self._top_ups.pop(step, 0))),
                   # Of every rollout of the step, the left-out groups among them (the trained rows'
                   # would be biased by the filter): these replace the trainer's in the step's record.
                   ("reward_mean", mean), ("reward_std", (sum((r - mean) ** 2 for r in rewards) / n) ** 0.5))
        return table.take(pa.array(rows, type=pa.int64())), metrics

    @node("validation_gate")
    def validation_gate(self, plan: StepPlan, train: TrainOut | None = None) -> Gate:
        return Gate(plan.step, train.version if train is not None else self.start_step, plan.validate)

    @node("train_done")
    def train_done(self, *outs: TrainOut | CriticOut) -> TrainOut:
        """Joins the train sub-graph: the policy ranks' TrainOuts (rank 0's first:
        its weights and its metrics, which are the batch's on every rank) and
        PPO's CriticOut, whose metrics it adds under critic/."""
        policy = [o for o in outs if isinstance(o, TrainOut)]
        made = {(o.step, o.version) for o in policy}
        if len(made) != 1:
            raise RuntimeError(f"the policy ranks disagree on (step, version): {sorted(made)}")
        head = policy[0]
        if head.weights_ref is None and self.cfg.generation.weight_sync == "object_store":
            raise RuntimeError(f"step {head.step}: the first policy rank sent no weights")
        metrics = dict(head.metrics) | {f"critic/{k}": v for o in outs if isinstance(o, CriticOut)
                                        for k, v in o.metrics}
        return TrainOut(head.step, head.version, head.weights_ref, tuple(sorted(metrics.items())))

    @node("resume")
    def resume(self, *done: ValOut | WeightsSent) -> Resume:
        """After every generator's validation (and, with a collective weight sync,
        the trainer's send): launch the next batches."""
        vals = [v for v in done if isinstance(v, ValOut)]
        versions = {v.version for v in done}
        if len(versions) != 1:
            raise RuntimeError(f"generators disagree on the weight version: {sorted(versions)}")
        version, step = versions.pop(), vals[0].step
        launches = []
        if step == self.start_step - 1 and self._relaunch_at_start:
            launches = [self._relaunch(batch_id, version, "resumed from a checkpoint", None)
                        for batch_id in self._relaunch_at_start]
            self._relaunch_at_start = []
        # After a resume the prologue launches only the targets its checkpoint did not hold.
        launches += self._new_launches(step, version)
        val = val_metrics(add_sums(dict(v.scores) for v in vals if v.validated))
        return Resume(step, version, tuple(launches), tuple(val.items()))

    def _new_launches(self, step: int, version: int) -> list[Launch]:
        max_age = self.cfg.schedule.max_age
        # The prologue (the step before the first) fills the pipeline; each step then tops it up.
        first = self.start_step
        targets = range(first, first + max_age + 1) if step == first - 1 else [step + 1 + max_age]
        launches = []
        for target in (t for t in targets if self._launched_through < t < self.cfg.run.steps):
            launches += self._launch(target, version, self._next_prompts(self.cfg.schedule.prompts_per_step))
            self._launched_through = target
        return launches

    def _launch(self, target: int, version: int, prompts: list[Prompt], round_: int = 0) -> list[Launch]:
        """The prompts dealt out to the generators, one batch each, expected in the rollout queue."""
        n, launches = self.cfg.generation.num_generators, []
        for index in range(n):
            shard = tuple(prompts[index::n])
            if shard:
                batch_id = f"t{target}.r{round_}.g{index}" if round_ else f"t{target}.g{index}"
                launch = Launch(batch_id, target, index, shard, round_)
                self.queue.expect(launch.batch_id, target, version, launch)
                launches.append(launch)
        return launches

    def _relaunch(self, batch_id: str, version: int, reason: str, dead: str | None) -> Launch:
        launch = self.queue.relaunch(batch_id, version)
        self.log.emit("relaunch", step=launch.target, version=version, batch=batch_id,
                      target=launch.target, of=dead, reason=reason)
        return launch

    @node("relaunch")
    def relaunch(self, plan: RelaunchPlan) -> Relaunch:
        """The dead generator's unfinished batches, for its replacement: same ids, same prompts."""
        launches = [self._relaunch(e.batch_id, plan.version, f"{plan.dead_worker} died", plan.dead_worker)
                    for e in self.queue.in_flight(plan.generator)]
        return Relaunch(self.start_step - 1, plan.version, tuple(launches))

    def interrupt(self, reason: str) -> None:
        self.queue.interrupt(reason)

    def clear_interrupt(self) -> None:
        self.queue.clear_interrupt()

    def put(self, rollout: Rollout) -> None:
        """A finished rollout batch, scored (the delivery graph's last node); its
        clock, its generator's or its reward model's, is kept with it for `sample`."""
        table = rollout.table
        failed = [e for e in table.column("reward_error").to_pylist() if e]
        if failed:
            self.reward_failures += len(failed)
            limit = self.cfg.fault.max_reward_failures
            if self.reward_failures > limit:
                self.queue.fatal(f"the reward failed on {self.reward_failures} samples, more than "
                                  f"fault.max_reward_failures ({limit}); the last: {failed[-1]}")
        self.queue.put(rollout.batch_id, rollout.version, table, rollout.clock)

    def rollout_failed(self, batch_id: str, reason: str, clock: Clock = ()) -> None:
        self.queue.fail(batch_id, reason, clock)

    def finish(self, after: Clock = ()) -> dict:
        """`after`: the driver's clock; the drops at the end are after the whole run."""
        self.log.merge(after)
        self.queue.drop_all("unused_at_end")
        return {**self.queue.accounting(), "reward_failures": self.reward_failures}

    # ------------------------------------------------------------ checkpoints

    def save_state(self, path: str) -> None:
        """Data position, RNG, counters and every buffered or in-flight batch."""
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        entries, counters = self.queue.snapshot()
        arrived = [e.table for e in entries if e.table is not None]
        if arrived:
            pq.write_table(pa.concat_tables(arrived), out / "buffer.parquet")
        state = {
            "order": self.order, "cursor": self.cursor, "rng": _jsonable(self.rng.getstate()),
            "counters": counters, "reward_failures": self.reward_failures,
            # Saved, not inferred from the entries: a target whose batches all failed left none.
            "launched_through": self._launched_through,
            "entries": [{"batch_id": e.batch_id, "target": e.target, "version": e.version,
                         "arrived": e.table is not None, "generator": e.launch.generator,
                         "prompts": [p.state() for p in e.launch.prompts]} for e in entries],
        }
        (out / "controller.json").write_text(json.dumps(state))

    def _restore(self, path: Path) -> None:
        state = json.loads((path / "controller.json").read_text())
        self.order, self.cursor = state["order"], state["cursor"]
        self.rng.setstate(_tupled(state["rng"]))
        self.reward_failures = state["reward_failures"]
        self.queue.restore_counters(state["counters"])
        self._launched_through = state["launched_through"]
        tables = {}
        if (path / "buffer.parquet").is_file():
            table = in_trajectory_schema(pq.read_table(path / "buffer.parquet"))
            for batch_id in set(table.column("batch_id").to_pylist()):
                tables[batch_id] = table.filter(pc.equal(table.column("batch_id"), batch_id))
        for e in state["entries"]:
            launch = Launch(e["batch_id"], e["target"], e["generator"], tuple(Prompt.from_state(p) for p in e["prompts"]))
            table = tables.get(e["batch_id"]) if e["arrived"] else None
            self.queue.restore(e["batch_id"], e["target"], e["version"], table, launch)
            if table is not None:
                self.log.emit("restore", step=e["target"], version=e["version"], batch=e["batch_id"],
                              target=e["target"])
            else:
                self._relaunch_at_start.append(e["batch_id"])


def in_trajectory_schema(table: pa.Table) -> pa.Table:
    """A buffer an earlier release checkpointed lacks the columns added since
    (transcript): null there, as a single-turn row's is."""
    for field in TRAJECTORY_SCHEMA:
        if field.name not in table.column_names:
            table = table.append_column(field, pa.nulls(table.num_rows, field.type))
    return table.select(TRAJECTORY_SCHEMA.names).cast(TRAJECTORY_SCHEMA)


def _jsonable(state):
    return [_jsonable(x) for x in state] if isinstance(state, tuple) else state


def _tupled(state):
    return tuple(_tupled(x) for x in state) if isinstance(state, list) else state


def train_prompts(cfg: Config) -> list[Prompt]:
    if cfg.backend == "sim":
        from pipeline.sim.engines import sim_prompts
        return sim_prompts(max(64, cfg.schedule.prompts_per_step), "train")
    from pipeline.inputs.datasets import run_prompts
    return list(run_prompts(cfg, "train").prompts)  # what the driver's preflight kept (data.filter_overlong)
