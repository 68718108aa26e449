"""Invariants 9 and 10: with a reward model, every batch trained was scored by
it after its rollout ended and before the buffer took it; with a distillation
teacher, every batch trained had the teacher's logprobs, put after its
rollout ended, before `sample` took it. Neither model's weights changed.

The evidence is each model's own events: `score_start` / `teach_start`
(after the batch's clock, which the delivery graph hands it) and
`score_end` / `teach_end` for each batch; the batch's clock goes on to the
controller's put, so a sample that took it, and the training after it, are
after that end. Each model's weights' digest is logged at load
(`worker_ready`) and at the run's end (`weights_checked`), for every
incarnation: all must be one. A batch restored from a checkpoint was scored
in the attempt before, whose log is archived.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Iterator

from pipeline.core.worker_names import REWARD_MODEL, TEACHER
from pipeline.tools.check_order import Violation, has_clock, of, t_
from pipeline.tools.check_chain import happened_before


@dataclass(frozen=True)
class Scorer:
    """A model of the delivery graph, as its events show it."""
    invariant: int
    start: str           # its event before the batch's work, and after it
    end: str
    worker: str          # the prefix of its incarnations' names
    who: str             # in messages
    did: str             # "scored by the reward model"
    before: str          # what the batch must have met it before: "its training started"


REWARD_MODEL_SCORES = Scorer(9, "score_start", "score_end", REWARD_MODEL, "the reward model",
                             "scored by the reward model", "its training started")
TEACHER_SCORES = Scorer(10, "teach_start", "teach_end", TEACHER, "the teacher",
                        "given the teacher's logprobs", "sample took it")


def _before(a: dict, b: dict) -> bool:
    if has_clock(a) and has_clock(b):
        return happened_before(a, b)
    return a["t"] < b["t"]  # a log from before vector clocks: one host's times


def batches_scored_before_training(events: list[dict], run_start: dict | None) -> Iterator[Violation]:
    if (run_start or {}).get("reward_model"):
        yield from _scored_in_time(events, REWARD_MODEL_SCORES, lambda ts: ts)


def batches_taught_before_sampling(events: list[dict], run_start: dict | None) -> Iterator[Violation]:
    """Against the step's `sample` node_end, which merged the clocks of the batches it took."""
    if not (run_start or {}).get("teacher"):
        return
    samples = {e.get("step"): e for e in of(events, "node_end") if e.get("node") == "sample"}
    yield from _scored_in_time(events, TEACHER_SCORES, lambda ts: samples.get(ts.get("step"), ts))


def _scored_in_time(events: list[dict], scorer: Scorer, deadline: Callable[[dict], dict]) -> Iterator[Violation]:
    """Every batch of each train_start met `scorer` after its rollout's end and before deadline(train_start)."""
    yield from _weights_never_changed(events, scorer)
    restored = {e.get("batch") for e in of(events, "restore")}
    ends: dict[str, list[dict]] = defaultdict(list)
    for e in of(events, "rollout_end"):
        if not e.get("failed") and not e.get("abandoned"):
            ends[e.get("batch")].append(e)
    starts: dict[tuple, list[dict]] = defaultdict(list)   # (worker, batch) -> its start events
    for e in of(events, scorer.start):
        starts[(e.get("worker"), e.get("batch"))].append(e)
    scored: dict[str, list[tuple[dict, dict]]] = defaultdict(list)  # batch -> (start, end)
    for end in of(events, scorer.end):
        begun = [s for s in starts[(end.get("worker"), end.get("batch"))] if _before(s, end)]
        if begun:
            scored[end.get("batch")].append((begun[-1], end))
    seen_steps = set()
    for ts in of(events, "train_start"):
        if ts.get("step") in seen_steps:   # the data-parallel ranks of one step share its batch
            continue
        seen_steps.add(ts.get("step"))
        by = deadline(ts)
        for batch in ts.get("batches") or []:
            if batch in restored:
                continue
            in_time = [(s, e) for s, e in scored[batch] if _before(e, by)]
            if not in_time:
                yield Violation(scorer.invariant, f"batch {batch} trained at step {ts.get('step')} ({t_(ts['t'])}) "
                                f"was not {scorer.did} before {scorer.before}", (by, *ends[batch]))
                continue
            if not any(_before(rollout, s) for s, _ in in_time for rollout in ends[batch]):
                s, e = in_time[0]
                yield Violation(scorer.invariant, f"batch {batch}: {scorer.who}'s work on {s.get('worker')} "
                                f"({t_(s['t'])}) is not after the rollout's end", (s, e, *ends[batch]))


def _weights_never_changed(events: list[dict], scorer: Scorer) -> Iterator[Violation]:
    mine = [e for e in events if str(e.get("worker", "")).startswith(scorer.worker)
            and e.get("ev") in ("worker_ready", "weights_checked")]
    seen: dict[str, dict] = {}
    for e in mine:
        for digest in {e.get("weights"), e.get("loaded")} - {None}:
            seen.setdefault(digest, e)
    if len(seen) > 1:
        yield Violation(scorer.invariant, f"{scorer.who}'s weights changed during the run: {len(seen)} digests ("
                        + ", ".join(f"{d} on {e.get('worker')} at {t_(e['t'])}" for d, e in seen.items()) + ")",
                        tuple(seen.values()))
