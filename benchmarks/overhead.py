"""Per-step orchestration cost of the step graph, and the CPU it burns.

Three ways to run the same step on the same actors:

  compiled  the step graph as a Ray Compiled Graph   (GraphRunner "compiled")
  classic   the step graph with the classic DAG API  (GraphRunner "classic")
  hand      a hand-written driver loop of ray.get(actor.method.remote(...)),
            the style of NeMo-RL / verl drivers: the graph's order, a ray.get
            between dependent calls

Four measurements (see benchmarks/README.md for the method):

  A. stub     actors whose methods return a token at once: pure dispatch cost
  B. zero     the real sim workers with every latency 0: dispatch plus the
              workers' host bookkeeping (event log, Arrow tables, object store)
  C. sleep    sim workers that sleep G, T, R (a GPU worker seen from the host):
              all CPU the process tree uses is orchestration and bookkeeping
  D. busy     the same workers burning G, T, R seconds of thread CPU time:
              orchestration CPU = process-tree CPU - the workers' own burn
  idle        CPU of the process tree with a graph alive but not executing
              (compiled graphs spin on their channels)

    .venv/bin/python benchmarks/overhead.py            # full: about 4 minutes
    .venv/bin/python benchmarks/overhead.py --quick    # CI smoke run: seconds
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import CpuWindow, machine_info, print_table, start_ray, stats, write_result  # noqa: E402

import ray  # noqa: E402

from dags.step_graph import Workers, build_prologue_graph, build_step_graph  # noqa: E402
from dags.tokens import Batch, Gate, Refitted, Resume, StepPlan, Ticket, TrainOut, ValOut  # noqa: E402
from pipeline.workers import GeneratorWorker, TrainerWorker  # noqa: E402

MODES = ("compiled", "classic", "hand")
DEADLINE_S = 60.0


# --- the hand-written driver loop -------------------------------------------------------------

def hand_step(w: Workers, plan: StepPlan, timeout: float = DEADLINE_S) -> dict:
    """One step as plain actor calls, in the order dags/step_graph.py states, waiting
    on each result before the calls that depend on it (NeMo-RL / verl style)."""
    batch = ray.get(w.controller.sample.remote(plan), timeout=timeout)
    train = ray.get(w.trainer.train.remote(batch), timeout=timeout)
    gate = ray.get(w.controller.validation_gate.remote(plan, train), timeout=timeout)
    refits = ray.get([g.refit.remote(train, gate) for g in w.generators], timeout=timeout)
    vals = ray.get([g.validate.remote(r) for g, r in zip(w.generators, refits)], timeout=timeout)
    resume = ray.get(w.controller.resume.remote(*vals), timeout=timeout)
    tickets = ray.get([g.collect.remote(resume) for g in w.generators], timeout=timeout)
    return {"train": train, "resume": resume, "collect": tickets}


def hand_prologue(w: Workers, plan: StepPlan, timeout: float = DEADLINE_S) -> None:
    gate = ray.get(w.controller.validation_gate.remote(plan), timeout=timeout)
    vals = ray.get([g.validate.remote(gate) for g in w.generators], timeout=timeout)
    resume = ray.get(w.controller.resume.remote(*vals), timeout=timeout)
    ray.get([g.collect.remote(resume) for g in w.generators], timeout=timeout)


class Stepper:
    """Runs steps in one mode; a compiled graph lives from open to close only,
    because its actor loops spin even between executions."""

    def __init__(self, workers: Workers, mode: str, run_dir: Path):
        from pipeline.driver import GraphRunner
        self.workers, self.mode, self.run_dir = workers, mode, run_dir
        self.runner = None if mode == "hand" else GraphRunner(build_step_graph(workers), mode,
                                                             first_deadline_s=120)

    def step(self, plan: StepPlan) -> None:
        if self.runner is None:
            hand_step(self.workers, plan)
        else:
            self.runner.run(plan, DEADLINE_S, self.run_dir)

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()


# --- A. stub actors: the graph's shape, no work ----------------------------------------------

class Stub:
    """Every node of the step graph, returning its token at once."""

    def sample(self, plan):
        return Batch(plan.step, (), ())

    def train(self, batch):
        return TrainOut(batch.step, batch.step + 1)

    def validation_gate(self, plan, train=None):
        return Gate(plan.step, train.version if train is not None else 0, plan.validate)

    def refit(self, train, gate):
        return Refitted("stub", gate.step, train.version, gate.validate)

    def validate(self, ready):
        return ValOut("stub", ready.step, ready.version, False)

    def resume(self, *vals):
        return Resume(vals[0].step, vals[0].version)

    def collect(self, resume):
        return Ticket("stub", resume.step, resume.version)


def start_stubs(num_generators: int) -> Workers:
    # The same actor options as pipeline.driver.start_workers.
    cls = ray.remote(Stub)
    return Workers(cls.options(num_cpus=0.5, max_concurrency=8).remote(),
                   cls.options(num_cpus=0.5, max_concurrency=2).remote(),
                   tuple(cls.options(num_cpus=0.5, max_concurrency=4).remote() for _ in range(num_generators)))


def stop(workers: Workers) -> None:
    for actor in (workers.controller, workers.trainer, *workers.generators):
        ray.kill(actor)


def measure_stub(workers: Workers, mode: str, steps: int, warm: int, idle_s: float, tmp: Path) -> dict:
    stepper = Stepper(workers, mode, tmp)
    try:
        for i in range(warm):
            stepper.step(StepPlan(i, False))
        times = []
        with CpuWindow() as win:
            for i in range(steps):
                t0 = time.perf_counter()
                stepper.step(StepPlan(warm + i, False))
                times.append(time.perf_counter() - t0)
        with CpuWindow() as idle:
            time.sleep(idle_s)
    finally:
        stepper.close()
    return {"step_ms": stats(times)["median"] * 1e3, "cpu_ms_per_step": win.cpu / steps * 1e3,
            "cores_while_stepping": win.cpu / win.wall, "idle_cores": idle.cpu / idle.wall,
            "processes_exited_in_window": win.exited}


# --- B-D. sim workers --------------------------------------------------------------------------

class CpuBurn:
    """Stands in for sim's sleeping latency: spends the seconds as this thread's
    CPU time, and logs each spend (wall start, wall end, CPU seconds)."""

    def __init__(self):
        self.calls: list[tuple[float, float, float]] = []

    def spend(self, seconds: float) -> None:
        w0, t0 = time.time(), time.thread_time()
        end = t0 + seconds
        while time.thread_time() < end:
            sum(range(200))
        self.calls.append((w0, time.time(), time.thread_time() - t0))


class _Switchable:
    """Mixed into the sim workers: `set_busy(True)` before `begin_run` swaps the
    engine's sleep for CpuBurn; with busy False the worker is the plain sim worker."""
    busy = False

    def set_busy(self, busy: bool) -> None:
        self.busy = busy

    def _maybe_burn(self) -> None:
        if self.busy:
            self.engine.latency = CpuBurn()

    def burn_log(self) -> list:
        return list(getattr(self.engine.latency, "calls", []))


class BenchTrainer(_Switchable, TrainerWorker):
    def begin_run(self, cfg, run_dir, t0, start_version=0):
        super().begin_run(cfg, run_dir, t0, start_version)
        self._maybe_burn()


class BenchGenerator(_Switchable, GeneratorWorker):
    def begin_run(self, cfg, run_dir, t0, controller, start_version=0):
        super().begin_run(cfg, run_dir, t0, controller, start_version)
        self._maybe_burn()


def start_sim(num_generators: int) -> Workers:
    """pipeline.driver.start_workers with the same options, on the switchable workers."""
    from pipeline.workers import Controller
    return Workers(ray.remote(Controller).options(num_cpus=0.5, max_concurrency=8).remote(),
                   ray.remote(BenchTrainer).options(num_cpus=0.5, max_concurrency=2).remote(),
                   tuple(ray.remote(BenchGenerator).options(num_cpus=0.5, max_concurrency=4).remote(i)
                         for i in range(num_generators)))


def measure_sim(workers: Workers, mode: str, lat: dict, steps: int, warm: int, max_age: int,
                busy: bool, tmp: Path, name: str) -> dict:
    """One run of `steps` steps; the CPU window covers steps warm..steps-1 (compiling and
    starting a compiled graph's loops are set-up, not per-step cost). Worker compute in
    the window is the CPU the workers' CpuBurn logged with its midpoint inside it."""
    from pipeline.check import check_events, load_events
    from pipeline.config import load_config
    from pipeline.driver import GraphRunner
    from pipeline.events import EventLog, merge_events
    cfg = load_config(None, [f"sim.generate_s={lat['G']}", f"sim.train_s={lat['T']}",
                             f"sim.refit_s={lat['R']}", "sim.validate_s=0", "sim.jitter=0",
                             f"grpo.max_age={max_age}", "grpo.val_period=0", f"run.steps={steps}",
                             f"generation.num_generators={len(workers.generators)}",
                             f"run.output_dir={tmp}", f"run.name={name}"])
    run_dir = tmp / name
    run_dir.mkdir(parents=True)
    t0 = time.time()
    log = EventLog(run_dir, "driver", t0)
    log.emit("run_start", max_age=max_age, steps=steps, start_step=0, dag_mode=mode, refit_mode="drain")
    w = workers
    actors = [w.trainer, *w.generators]
    ray.get([a.set_busy.remote(busy) for a in actors], timeout=DEADLINE_S)
    ray.get([w.controller.begin_run.remote(cfg, str(run_dir), t0), w.trainer.begin_run.remote(cfg, str(run_dir), t0),
             *[g.begin_run.remote(cfg, str(run_dir), t0, w.controller) for g in w.generators]], timeout=DEADLINE_S)
    stepper = Stepper(w, mode, run_dir)
    times = []
    try:
        if mode == "hand":
            hand_prologue(w, StepPlan(-1, False))
        else:
            GraphRunner(build_prologue_graph(w), "classic", DEADLINE_S).run(StepPlan(-1, False), DEADLINE_S, run_dir)
        for step in range(warm):
            stepper.step(StepPlan(step, False))
        with CpuWindow() as win:
            for step in range(warm, steps):
                t_step = time.perf_counter()
                stepper.step(StepPlan(step, False))
                times.append(time.perf_counter() - t_step)
    finally:
        stepper.close()
    acct = ray.get(w.controller.finish.remote(), timeout=DEADLINE_S)
    calls = [c for log_ in ray.get([a.burn_log.remote() for a in actors], timeout=DEADLINE_S) for c in log_]
    burned = sum(cpu for a, b, cpu in calls if win.wall_start <= (a + b) / 2 <= win.wall_end)
    log.emit("run_end", error=None)
    log.close()
    merge_events(run_dir)
    violations = check_events(load_events(run_dir))
    shutil.rmtree(run_dir, ignore_errors=True)
    if not acct["balanced"] or violations:
        raise RuntimeError(f"{name}: accounting {acct}, violations {[v.message for v in violations][:3]}")
    n = steps - warm
    steady = times[:len(times) - max_age]  # the last max_age steps have no rollout to wait for
    overhead_cpu = win.cpu - burned
    return {"step_ms": stats(steady)["median"] * 1e3, "cpu_ms_per_step": win.cpu / n * 1e3,
            "worker_cpu_ms_per_step": burned / n * 1e3, "overhead_cpu_ms_per_step": overhead_cpu / n * 1e3,
            "overhead_cpu_fraction": overhead_cpu / win.cpu if win.cpu > 0 else 0.0,
            "cores_while_stepping": win.cpu / win.wall, "processes_exited_in_window": win.exited}


def rotate(seq, k):
    k %= len(seq)
    return list(seq[k:]) + list(seq[:k])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="CI smoke size: seconds, not a measurement")
    ap.add_argument("--repeats", type=int, help="repeats of every block (full 3, quick 1)")
    ap.add_argument("--generators", type=int, default=2)
    ap.add_argument("--stub-steps", type=int, help="timed steps per stub block (full 300, quick 30)")
    ap.add_argument("--zero-steps", type=int, help="steps per zero-latency run (full 40, quick 8)")
    ap.add_argument("--work-steps", type=int, help="steps per sleeping / busy run (full 12, quick 5)")
    ap.add_argument("--work", type=float, help="G = T for the sleeping and busy runs, seconds (full 0.1, quick 0.02)")
    ap.add_argument("--parts", default="stub,zero,sleep,busy", help="which measurements, comma-separated")
    ap.add_argument("--out", type=Path, help="directory for overhead.json (default benchmarks/results)")
    args = ap.parse_args(argv)
    q = args.quick
    repeats = args.repeats or (1 if q else 3)
    stub_steps = args.stub_steps or (30 if q else 300)
    zero_steps = args.zero_steps or (8 if q else 40)
    work_steps = args.work_steps or (5 if q else 12)
    work = args.work or (0.02 if q else 0.1)
    parts = [p for p in args.parts.split(",") if p]
    max_age, warm = 1, 2
    lat_work = {"G": work, "T": work, "R": work / 10}
    lat_zero = {"G": 0.0, "T": 0.0, "R": 0.0}
    idle_s = 0.3 if q else 2.0

    info = machine_info()
    params = {"quick": q, "repeats": repeats, "generators": args.generators, "graph_actors": 2 + args.generators,
              "modes": list(MODES), "parts": parts, "stub_steps": stub_steps, "stub_warmup_steps": 5,
              "zero_steps": zero_steps, "work_steps": work_steps, "work_latencies_s": lat_work, "max_age": max_age,
              "warmup_steps": warm, "steady_steps_skipped_last": max_age, "idle_window_s": idle_s,
              "ray_logical_cpus": 8}
    raw: dict = {p: {m: [] for m in MODES} for p in parts}
    t_start = time.time()
    tmp = Path(tempfile.mkdtemp(prefix="dagrl_overhead_"))
    start_ray()
    pools: list[Workers] = []
    try:
        if "stub" in parts:
            stubs = start_stubs(args.generators)
            pools.append(stubs)
            for rep in range(repeats):
                for mode in rotate(MODES, rep):
                    t_block = time.time()
                    r = measure_stub(stubs, mode, stub_steps, 5, idle_s, tmp)
                    raw["stub"][mode].append(r)
                    print(f"  stub  {mode:8s} rep={rep}: {r['step_ms']:7.2f} ms/step, "
                          f"{r['cpu_ms_per_step']:7.2f} ms CPU/step, idle {r['idle_cores']:.2f} cores "
                          f"[{time.time() - t_block:.1f} s]", flush=True)
            stop(stubs)
            pools.remove(stubs)
        sim_parts = [(part, lat, steps, part == "busy") for part, lat, steps in
                     (("zero", lat_zero, zero_steps), ("sleep", lat_work, work_steps), ("busy", lat_work, work_steps))
                     if part in parts]
        if sim_parts:
            pool = start_sim(args.generators)
            pools.append(pool)
            for part, lat, steps, busy in sim_parts:
                for rep in range(repeats):
                    for mode in rotate(MODES, rep):
                        t_block = time.time()
                        r = measure_sim(pool, mode, lat, steps, warm, max_age, busy, tmp, f"{part}_{mode}_{rep}")
                        raw[part][mode].append(r)
                        print(f"  {part:5s} {mode:8s} rep={rep}: {r['step_ms']:7.2f} ms/step, "
                              f"{r['cpu_ms_per_step']:7.2f} ms CPU/step, overhead "
                              f"{r['overhead_cpu_ms_per_step']:7.2f} ms CPU/step "
                              f"({r['overhead_cpu_fraction'] * 100:.1f} %) [{time.time() - t_block:.1f} s]", flush=True)
    finally:
        for pool in pools:
            stop(pool)
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)

    figures: dict = {}
    for part in parts:
        figures[part] = {}
        for mode in MODES:
            keys = raw[part][mode][0].keys() if raw[part][mode] else []
            figures[part][mode] = {k: stats([r[k] for r in raw[part][mode]]) for k in keys}
        # Ratios within one repeat: each repeat ran the three modes back to back.
        for mode in ("compiled", "classic"):
            figures[part][f"{mode}_over_hand"] = stats(
                [a["step_ms"] / b["step_ms"] for a, b in zip(raw[part][mode], raw[part]["hand"])])
    result = {"benchmark": "overhead", "machine": info, "params": params, "figures": figures,
              "targets": targets(figures), "wall_s": round(time.time() - t_start, 1)}
    report(result)
    path = write_result("overhead", result, args.out)
    print(f"\nwrote {path} (load average {result['machine']['loadavg_start']} -> "
          f"{result['machine']['loadavg_end']})")
    return result


def _med(figures, part, mode, key):
    try:
        return figures[part][mode][key]["median"]
    except KeyError:
        return None


def targets(figures: dict) -> list[dict]:
    out = []
    for part in ("stub", "zero"):
        if part not in figures:
            continue
        ms = _med(figures, part, "compiled", "step_ms")
        ratio = figures[part]["compiled_over_hand"]["median"]
        out.append({"target": f"compiled <= 1 ms per step ({part})", "value": ms, "met": ms <= 1.0})
        out.append({"target": f"compiled <= 0.5 x hand-written loop ({part})", "value": ratio, "met": ratio <= 0.5})
    if "busy" in figures:
        # auto resolves to classic on this machine (see README): its busy-worker share is the one that counts.
        for mode in MODES:
            frac = _med(figures, "busy", mode, "overhead_cpu_fraction")
            out.append({"target": f"orchestration <= 5 % of step CPU, busy workers ({mode}"
                                  f"{', what auto picks here' if mode == 'classic' else ''})",
                        "value": frac, "met": frac <= 0.05})
    return out


def report(result: dict) -> None:
    f = result["figures"]
    rows = []
    for part in f:
        for mode in MODES:
            m = f[part][mode]
            if not m:
                continue
            row = [part, mode, m["step_ms"]["median"], f"{m['step_ms']['min']:.2f}-{m['step_ms']['max']:.2f}",
                   f[part][f"{mode}_over_hand"]["median"] if mode != "hand" else 1.0,
                   m["cpu_ms_per_step"]["median"], m["cores_while_stepping"]["median"]]
            row += [m["overhead_cpu_ms_per_step"]["median"], f"{m['overhead_cpu_fraction']['median'] * 100:.1f} %"] \
                if "overhead_cpu_ms_per_step" in m else ["", ""]
            row += [m["idle_cores"]["median"]] if "idle_cores" in m else [""]
            rows.append(row)
    print_table(["part", "mode", "step ms", "range", "x hand", "CPU ms/step", "cores busy", "overhead CPU ms",
                 "overhead share", "idle cores"], rows,
                title=f"overhead: {result['params']['generators']} generators, median of "
                      f"{result['params']['repeats']} repeats")
    print_table(["target", "value", "met"], [[t["target"], t["value"], t["met"]] for t in result["targets"]],
                title="targets")


if __name__ == "__main__":
    main()
