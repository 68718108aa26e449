"""Hand-written event logs for tests/tools/test_check.py, with the vector clocks a
real run gives its events (pipeline/core/events.py): `run_log` says what each event
waited for, and leaves one such wait out on request, as the mutations of
tests/support/mutations.py do in real runs."""
from __future__ import annotations


def stamp(lanes: dict, lane: str, after=()) -> dict:
    """The clock of the next event on `lane`, after the events `after`."""
    vc = dict(lanes.get(lane, {}))
    for e in after:
        for k, n in e["vc"].items():
            vc[k] = max(vc.get(k, 0), n)
    vc[lane] = vc.get(lane, 0) + 1
    lanes[lane] = vc
    return dict(vc)


def add(events: list[dict], t: float, kind: str, worker: str, lane: str | None = None, after=(),
        step=None, version=None, **extra) -> dict:
    """Insert an event at time t, its clock after its lane's last event and `after`."""
    lane = lane or worker
    last = [e for e in events if e.get("lane") == lane]
    lanes = {lane: last[-1]["vc"]} if last else {}
    e = {"t": t, "ev": kind, "step": step, "version": version, "worker": worker, **extra,
         "lane": lane, "vc": stamp(lanes, lane, after)}
    events.insert(next((i for i, x in enumerate(events) if x["t"] > t), len(events)), e)
    return e


def run_log(steps=4, max_age=1, generators=("gen0", "gen1"), validate=(1,), start_step=0,
            groups=1, finished=True, drain=True, resume_waits_for_validation=True, refit_waits_for_train=True,
            agents=False):
    """Events of a valid drain-mode run, in time order, one time unit apart.

    Batch "b<target>.<i>" goes to generators[(target + i) % n]. Its rollout
    starts right after its launch; it ends before the training step that needs
    it, and at the latest before its generator's next refit (drain). Each
    event's clock is after what the real one waits for: a node's tokens, the
    rollouts a refit drains, the batches sample takes; each step is after all
    of the step before (the driver's plan). The last three arguments leave one
    of those waits out, as the mutations of tests/support/mutations.py do.
    With `agents`, each batch and each validation is one agent sample of one
    request, logged on its generator's rollouts lane as the sessions log it
    (pipeline/agents/sessions.py): a batch's just before its rollout_end, a
    validation's between its start and end in time, unordered with them by
    the clocks, as in a real run.
    """
    t = 0.0
    lanes: dict[str, dict] = {}

    def ev(kind, worker, step=None, version=None, lane=None, after=(), **extra):
        nonlocal t
        t += 1.0
        lane = lane or worker
        return {"t": t, "ev": kind, "step": step, "version": version, "worker": worker, **extra,
                "lane": lane, "vc": stamp(lanes, lane, after)}

    n = len(generators)
    launched = {}      # batch id -> (target, version, worker)
    in_flight = []     # batch ids whose rollout started and has not ended
    ends = {}          # batch id -> its rollout_end
    seen = []          # what the driver has seen: the next step's plan is after it

    def launch(target, version, after):
        for i in range(groups):
            batch, worker = f"b{target}.{i}", generators[(target + i) % n]
            launched[batch] = (target, version, worker)
            in_flight.append(batch)
            la = ev("launch", worker, version=version, lane=f"{worker}/collect", after=after,
                    batch=batch, target=target)
            rs = ev("rollout_start", worker, version=version, lane=f"{worker}/rollouts", after=[la],
                    batch=batch, target=target)
            seen.extend([la, rs])
            yield la
            yield rs

    def agent_sample(worker, batch, step, version):
        fields = dict(lane=f"{worker}/rollouts", batch=batch, sample=f"{batch}/0")
        yield ev("agent_start", worker, step, version, **fields)
        yield ev("agent_request_start", worker, step, version, request=1, segment=1, context=8, rendered=8,
                 loaded=version, **fields)
        yield ev("agent_request_end", worker, step, version, request=1, tokens=4, token_versions=[[version, 4]],
                 finish="stop", **fields)
        yield ev("agent_end", worker, step, version, requests=1, segments=1, reward=None, info=None, **fields)

    def finish(batches):
        for batch in batches:
            target, version, worker = launched[batch]
            in_flight.remove(batch)
            if agents:
                yield from agent_sample(worker, batch, target, version)
            ends[batch] = ev("rollout_end", worker, version=version, lane=f"{worker}/rollouts",
                             batch=batch, target=target)
            yield ends[batch]

    start = ev("run_start", "driver", max_age=max_age, steps=steps, start_step=start_step)
    seen.append(start)
    yield start
    for target in range(start_step, min(start_step + max_age + 1, steps)):
        yield from launch(target, start_step, [start])
    for s in range(start_step, steps):
        mine = [b for b in launched if launched[b][0] == s]
        plan, seen[:] = list(seen), []
        yield ev("node_start", "controller", step=s, lane="controller/sample", after=plan, node="sample")
        yield from finish([b for b in mine if b in in_flight])
        sampled = ev("node_end", "controller", step=s, lane="controller/sample", after=[ends[b] for b in mine],
                     node="sample")
        yield sampled
        yield ev("train_start", "trainer", step=s, version=s, after=[sampled], batches=mine,
                 batch_versions=[launched[b][1] for b in mine])
        yield from finish(list(in_flight))   # drain: overlaps training, ends before refit
        trained = ev("train_end", "trainer", step=s, version=s + 1)
        yield trained
        refitted = []
        for g in generators:
            drained = [e for b, e in ends.items() if launched[b][2] == g] if drain else []
            yield ev("refit_start", g, step=s, version=s, lane=f"{g}/refit",
                     after=[trained] * refit_waits_for_train + drained + plan)
            refitted.append(ev("refit_end", g, step=s, version=s + 1, lane=f"{g}/refit"))
            yield refitted[-1]
        resumed = list(refitted)
        if s in validate:
            g = generators[0]
            yield ev("validation_start", g, step=s, version=s + 1, lane=f"{g}/validate", after=[refitted[0]])
            if agents:
                yield from agent_sample(g, "val", None, s + 1)
            val_end = ev("validation_end", g, step=s, version=s + 1, lane=f"{g}/validate")
            yield val_end
            resumed += [val_end] * resume_waits_for_validation
        seen.extend([sampled, trained, *refitted, *resumed])
        if s + 1 + max_age < steps:
            yield from launch(s + 1 + max_age, s + 1, resumed)
    if finished:
        yield ev("run_end", "driver", after=seen)


def log(**kw) -> list[dict]:
    return list(run_log(**kw))


def without_clocks(events: list[dict]) -> list[dict]:
    """The log as it was before vector clocks: the checker falls back to wall-clock times."""
    return [{k: v for k, v in e.items() if k not in ("vc", "lane")} for e in events]


def find(events, kind, **match) -> dict:
    hits = [e for e in events if e["ev"] == kind and all(e.get(k) == v for k, v in match.items())]
    assert len(hits) == 1, (kind, match, hits)
    return hits[0]
