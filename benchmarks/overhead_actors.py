"""The actors benchmarks.overhead measures: the sim workers, switchable to
stub nodes (every node returns its token at once) or to engines that burn CPU
instead of sleeping."""
from __future__ import annotations

import sys
import time

import ray
import ray.cloudpickle

from dags.step_graph import Workers
from dags.tokens import Batch, Gate, Refitted, Resume, Ticket, TrainOut, ValOut
from pipeline.controller.controller import Controller
from pipeline.generator.worker import GeneratorWorker
from pipeline.core.node import rank_actor
from pipeline.trainer.worker import TrainerWorker

# Ray's worker processes cannot import this module by name: ship its classes by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

DEADLINE_S = 60.0


class CpuBurn:
    """Stands in for sim's sleeping latency: spends the seconds as this thread's
    CPU time, and logs each spend as (wall start, wall end, CPU seconds)."""

    def __init__(self):
        self.calls: list[tuple[float, float, float]] = []

    def spend(self, seconds: float) -> None:
        w0, t0 = time.time(), time.thread_time()
        end = t0 + seconds
        while time.thread_time() < end:
            sum(range(200))
        self.calls.append((w0, time.time(), time.thread_time() - t0))


class _Switchable:
    """configure(stub=True): every node returns its token at once, nothing else runs.
    configure(busy=True) before begin_run: the engine burns CPU instead of sleeping.
    Otherwise the worker is the plain sim worker of pipeline/generator/ or pipeline/trainer/."""
    stub = False
    busy = False

    def configure(self, stub: bool = False, busy: bool = False) -> None:
        self.stub, self.busy = stub, busy

    def ping(self, x=None):
        return x

    def _maybe_burn(self) -> None:
        if self.busy:
            self.engine.latency = CpuBurn()

    def burn_log(self) -> list:
        engine = getattr(self, "engine", None)
        return list(getattr(getattr(engine, "latency", None), "calls", []))


class BenchController(_Switchable, Controller):
    def sample(self, plan):
        return Batch(plan.step, (), ()) if self.stub else super().sample(plan)

    def validation_gate(self, plan, train=None):
        if self.stub:
            return Gate(plan.step, train.version if train is not None else 0, plan.validate)
        return super().validation_gate(plan, train)

    def resume(self, *vals):
        return Resume(vals[0].step, vals[0].version) if self.stub else super().resume(*vals)


class BenchTrainer(_Switchable, TrainerWorker):
    def begin_run(self, *args, **kwargs):
        super().begin_run(*args, **kwargs)
        self._maybe_burn()

    def train(self, batch, advantages=None):
        return TrainOut(batch.step, batch.step + 1) if self.stub else super().train(batch, advantages)


class BenchGenerator(_Switchable, GeneratorWorker):
    def begin_run(self, *args, **kwargs):
        super().begin_run(*args, **kwargs)
        self._maybe_burn()

    def refit(self, train, gate):
        return Refitted("stub", gate.step, train.version, gate.validate) if self.stub else super().refit(train, gate)

    def validate(self, ready):
        return ValOut("stub", ready.step, ready.version, False) if self.stub else super().validate(ready)

    def collect(self, resume):
        return Ticket("stub", resume.step, resume.version) if self.stub else super().collect(resume)


def start_pool(num_generators: int) -> Workers:
    """pipeline.run.driver.start_workers, with the same actor options, on the switchable workers."""
    return Workers(ray.remote(BenchController).options(num_cpus=0.5, max_concurrency=8).remote(),
                   (rank_actor(BenchTrainer, num_cpus=0.5).remote(),),
                   tuple(ray.remote(BenchGenerator).options(num_cpus=0.5, max_concurrency=4).remote(i)
                         for i in range(num_generators)))


def actors(w: Workers) -> list:
    return [w.controller, *w.trainers, *w.generators]


def configure(w: Workers, **flags) -> None:
    ray.get([a.configure.remote(**flags) for a in actors(w)], timeout=DEADLINE_S)
