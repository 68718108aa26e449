"""Per-step orchestration cost of the step graph, and the CPU it burns.

Three ways to run the same step on the same actors:

  compiled  the step graph as a Ray Compiled Graph   (GraphRunner "compiled")
  classic   the step graph with the classic DAG API  (GraphRunner "classic")
  hand      a hand-written driver loop of ray.get(actor.method.remote(...)) in
            the graph's order, waiting between dependent calls (NeMo-RL / verl style)

Measurements, all on one pool of actors (controller, trainer, generators):

  calib  one no-op actor round trip, ray.get(a.ping.remote()): this machine's unit cost
  stub   every node returns its token at once: pure dispatch cost of a step
  zero   the sim workers with every latency 0: dispatch plus the workers' host
         bookkeeping (event log, Arrow tables, object store, rollout thread)
  sleep  sim workers sleeping G, T, R (a GPU worker as the host sees it): all CPU
         the process tree uses is orchestration or bookkeeping
  busy   the same workers burning G, T, R seconds of thread CPU time:
         overhead CPU = process-tree CPU - the CPU the workers logged burning
  idle   (stub part) process-tree CPU with the graph alive but not executing:
         compiled graphs spin on their channels

See benchmarks/README.md for the method and the results.

    .venv/bin/python -m benchmarks.overhead            # full: about 4 minutes
    .venv/bin/python -m benchmarks.overhead --quick    # CI smoke run: under a minute
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import ray

from benchmarks.harness import CpuWindow, machine_info, print_table, print_targets, sample_load, shutdown_ray
from benchmarks.harness import start_ray, stats, write_result
from benchmarks.overhead_actors import DEADLINE_S, actors, configure, start_pool
from dags.step_graph import Workers, build_prologue_graph, build_step_graph
from dags.tokens import StepPlan

MODES = ("compiled", "classic", "hand")


# --- the hand-written driver loop -------------------------------------------------------------

def hand_step(w: Workers, plan: StepPlan, timeout: float = DEADLINE_S) -> dict:
    """One step as plain actor calls, in the order dags/step_graph.py states, waiting
    on each result before the calls that depend on it (NeMo-RL / verl style)."""
    batch = ray.get(w.controller.sample.remote(plan), timeout=timeout)
    train = ray.get(w.trainers[0].train.remote(batch), timeout=timeout)
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
    """Runs steps in one mode. A compiled graph lives from here to close() only:
    its actor loops spin even between executions and would load the other modes."""

    def __init__(self, workers: Workers, mode: str, run_dir: Path):
        from pipeline.run.runner import GraphRunner
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


# --- measurements -----------------------------------------------------------------------------

def measure_calib(w: Workers, calls: int, idle_s: float) -> dict:
    """A no-op actor round trip, and the CPU the cluster burns with nothing to do
    (raylet, gcs_server, agents, idle workers): Ray's background rate."""
    for _ in range(10):
        ray.get(w.controller.ping.remote())
    with CpuWindow() as win:
        for i in range(calls):
            ray.get(w.controller.ping.remote(i))
    with CpuWindow() as idle:
        time.sleep(idle_s)
    return {"call_ms": win.wall / calls * 1e3, "cpu_ms_per_call": win.cpu / calls * 1e3,
            "ray_idle_cores": idle.cpu / idle.wall}


def measure_stub(w: Workers, mode: str, steps: int, warm: int, idle_s: float, tmp: Path) -> dict:
    configure(w, stub=True)
    stepper = Stepper(w, mode, tmp)
    try:
        for i in range(warm):  # the first execution also starts a compiled graph's loops
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
    return {"step_ms": stats(times)["median"] * 1e3, "mean_step_ms": win.wall / steps * 1e3,
            "cpu_ms_per_step": win.cpu / steps * 1e3, "cores_while_stepping": win.cpu / win.wall,
            "idle_cores": idle.cpu / idle.wall, "processes_exited_in_window": win.exited + idle.exited}


def measure_sim(w: Workers, mode: str, lat: dict, steps: int, warm: int, max_age: int,
                busy: bool, tmp: Path, name: str) -> dict:
    """One run of `steps` steps. The CPU window covers steps warm..steps-1: compiling a
    graph and starting its loops are set-up, not per-step cost. The workers' compute
    in the window is the CPU their CpuBurn logged inside it (pro rata at the edges)."""
    from pipeline.config import load_config
    from pipeline.core.events import EventLog, merge_events
    from pipeline.run.runner import GraphRunner
    from pipeline.tools.check import check_events
    from pipeline.core.events import load_events
    cfg = load_config(None, [f"sim.generate_s={lat['G']}", f"sim.train_s={lat['T']}",
                             f"sim.refit_s={lat['R']}", "sim.validate_s=0", "sim.jitter=0",
                             f"schedule.max_age={max_age}", "validation.period=0", f"run.steps={steps}",
                             f"generation.num_generators={len(w.generators)}",
                             f"run.output_dir={tmp}", f"run.name={name}"])
    run_dir = tmp / name
    run_dir.mkdir(parents=True)
    t0 = time.time()
    log = EventLog(run_dir, "driver", t0)
    log.emit("run_start", max_age=max_age, steps=steps, start_step=0, dag_mode=mode, refit_mode="drain")
    configure(w, busy=busy)
    ray.get([w.controller.begin_run.remote(cfg, str(run_dir), t0), w.trainers[0].begin_run.remote(cfg, str(run_dir), t0),
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
    calls = [c for log_ in ray.get([a.burn_log.remote() for a in actors(w)], timeout=DEADLINE_S) for c in log_]
    burned = sum(cpu * _overlap(a, b, win.wall_start, win.wall_end) for a, b, cpu in calls)
    log.emit("run_end", error=None)
    log.close()
    merge_events(run_dir)
    # The event log proves each mode ran the same, correct step (DESIGN.md invariants 1-5).
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
            "cores_while_stepping": win.cpu / win.wall, "wall_ms_per_step": win.wall / n * 1e3,
            "processes_exited_in_window": win.exited}


def _overlap(a: float, b: float, start: float, end: float) -> float:
    """The share of [a, b] inside [start, end]: a burn that straddles an edge of the
    window (the rollout launched by the last warm-up step) counts pro rata."""
    if b <= a:
        return 1.0 if start <= a <= end else 0.0
    return max(0.0, min(b, end) - max(a, start)) / (b - a)


def rotate(seq, k):
    k %= len(seq)
    return list(seq[k:]) + list(seq[:k])


def auto_mode_here(num_generators: int, cpus: float) -> str:
    from pipeline.config import load_config
    from pipeline.run.driver import resolve_dag_mode
    return resolve_dag_mode(load_config(None, [f"generation.num_generators={num_generators}"]), cpus)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="CI smoke size: seconds, not a measurement")
    ap.add_argument("--repeats", type=int, help="repeats of every block (full 3, quick 1)")
    ap.add_argument("--generators", type=int, default=2)
    ap.add_argument("--stub-steps", type=int, help="timed steps per stub block (full 300, quick 20)")
    ap.add_argument("--zero-steps", type=int, help="steps per zero-latency run (full 40, quick 6)")
    ap.add_argument("--work-steps", type=int, help="steps per sleeping / busy run (full 12, quick 5)")
    ap.add_argument("--work", type=float, help="G = T for the sleeping and busy runs, s (full 0.2, quick 0.02); R = G/10")
    ap.add_argument("--parts", default="calib,stub,zero,sleep,busy", help="which measurements, comma-separated")
    ap.add_argument("--out", type=Path, help="directory for overhead.json (default benchmarks/results)")
    args = ap.parse_args(argv)
    q = args.quick
    repeats = args.repeats or (1 if q else 3)
    stub_steps = args.stub_steps or (20 if q else 300)
    zero_steps = args.zero_steps or (6 if q else 40)
    work_steps = args.work_steps or (5 if q else 12)
    work = args.work or (0.02 if q else 0.2)
    parts = [p for p in args.parts.split(",") if p]
    max_age, warm = 1, 2
    lat_work = {"G": work, "T": work, "R": work / 10}
    lat_zero = {"G": 0.0, "T": 0.0, "R": 0.0}
    idle_s = 0.3 if q else 2.0
    calib_calls = 50 if q else 500
    logical_cpus = 8

    info = machine_info()
    params = {"quick": q, "repeats": repeats, "generators": args.generators, "graph_actors": 2 + args.generators,
              "modes": list(MODES), "parts": parts, "calib_calls": calib_calls, "stub_steps": stub_steps,
              "stub_warmup_steps": 5, "zero_steps": zero_steps, "work_steps": work_steps,
              "work_latencies_s": lat_work, "max_age": max_age, "warmup_steps": warm,
              "steady_steps_skipped_last": max_age, "idle_window_s": idle_s, "ray_logical_cpus": logical_cpus}
    raw: dict = {p: {m: [] for m in MODES} for p in parts if p != "calib"}
    calib: list[dict] = []
    t_start = time.time()
    tmp = Path(tempfile.mkdtemp(prefix="dagrl_overhead_"))
    start_ray(logical_cpus)
    pool = None
    try:
        pool = start_pool(args.generators)
        ray.get([a.ping.remote() for a in actors(pool)], timeout=120)
        for rep in range(repeats):
            if "calib" in parts:
                calib.append(measure_calib(pool, calib_calls, idle_s))
                print(f"  calib rep={rep}: actor round trip {calib[-1]['call_ms']:.2f} ms, "
                      f"{calib[-1]['cpu_ms_per_call']:.2f} ms CPU; Ray idle "
                      f"{calib[-1]['ray_idle_cores']:.3f} cores", flush=True)
            if "stub" in parts:
                for mode in rotate(MODES, rep):
                    sample_load(info)
                    t_block = time.time()
                    r = measure_stub(pool, mode, stub_steps, 5, idle_s, tmp)
                    raw["stub"][mode].append(r)
                    print(f"  stub  {mode:8s} rep={rep}: {r['step_ms']:7.2f} ms/step, "
                          f"{r['cpu_ms_per_step']:7.2f} ms CPU/step, idle {r['idle_cores']:.2f} cores "
                          f"[{time.time() - t_block:.1f} s]", flush=True)
        for part, lat, steps, busy in (("zero", lat_zero, zero_steps, False), ("sleep", lat_work, work_steps, False),
                                       ("busy", lat_work, work_steps, True)):
            if part not in parts:
                continue
            for rep in range(repeats):
                for mode in rotate(MODES, rep):
                    sample_load(info)
                    t_block = time.time()
                    r = measure_sim(pool, mode, lat, steps, warm, max_age, busy, tmp, f"{part}_{mode}_{rep}")
                    raw[part][mode].append(r)
                    print(f"  {part:5s} {mode:8s} rep={rep}: {r['step_ms']:7.2f} ms/step, "
                          f"{r['cpu_ms_per_step']:7.2f} ms CPU/step, overhead "
                          f"{r['overhead_cpu_ms_per_step']:7.2f} ms CPU/step "
                          f"({r['overhead_cpu_fraction'] * 100:.1f} %) [{time.time() - t_block:.1f} s]", flush=True)
        cluster_cpus = ray.cluster_resources().get("CPU", 0)
    finally:
        if pool is not None:
            for a in actors(pool):
                ray.kill(a)
        shutdown_ray()
        shutil.rmtree(tmp, ignore_errors=True)

    # Split the overhead: Ray's background (its idle rate, measured in the same repeat,
    # times the window's wall time) and the rest, the orchestration of the steps.
    for part in ("zero", "sleep", "busy"):
        for mode in MODES:
            for i, r in enumerate(raw.get(part, {}).get(mode, [])):
                bg = calib[i]["ray_idle_cores"] * r["wall_ms_per_step"] if calib else 0.0
                r["background_cpu_ms_per_step"] = bg
                r["orchestration_cpu_ms_per_step"] = r["overhead_cpu_ms_per_step"] - bg
                r["orchestration_cpu_fraction"] = r["orchestration_cpu_ms_per_step"] / r["cpu_ms_per_step"]
    figures: dict = {}
    if calib:
        figures["calib"] = {k: stats([c[k] for c in calib]) for k in calib[0]}
    for part in raw:
        figures[part] = {}
        for mode in MODES:
            figures[part][mode] = {k: stats([r[k] for r in raw[part][mode]]) for k in raw[part][mode][0]}
        # Ratios within one repeat: each repeat ran the three modes back to back.
        for mode in ("compiled", "classic"):
            figures[part][f"{mode}_over_hand"] = stats(
                [a["step_ms"] / b["step_ms"] for a, b in zip(raw[part][mode], raw[part]["hand"])])
    auto = {"rule": "compiled iff cluster CPUs >= 2 * (graph actors + 1) (pipeline/run/driver.py resolve_dag_mode)",
            "ray_logical_cpus": cluster_cpus, "physical_cores": info["cpu_physical"],
            "auto_with_these_logical_cpus": auto_mode_here(args.generators, cluster_cpus),
            "auto_with_physical_cores": auto_mode_here(args.generators, info["cpu_physical"] or 1),
            "auto_by_generators_with_these_logical_cpus": {
                n: auto_mode_here(n, cluster_cpus) for n in (1, 2, 3, 4)}}
    result = {"benchmark": "overhead", "machine": info, "params": params, "figures": figures, "auto": auto,
              "targets": targets(figures, auto["auto_with_these_logical_cpus"]),
              "wall_s": round(time.time() - t_start, 1)}
    report(result)
    path = write_result("overhead", result, args.out)
    print(f"\nwrote {path} (load average {result['machine']['loadavg_start']} -> "
          f"{result['machine']['loadavg_end']}, during {result['machine'].get('loadavg_1min_during')})")
    return result


def _med(figures, part, mode, key):
    return figures[part][mode][key]["median"]


def targets(figures: dict, auto_mode: str) -> list[dict]:
    out = []
    for part in ("stub", "zero"):
        if part in figures:
            ms = _med(figures, part, "compiled", "step_ms")
            ratio = figures[part]["compiled_over_hand"]["median"]
            out.append({"target": f"compiled <= 1 ms per step ({part})", "value": ms, "met": ms <= 1.0})
            out.append({"target": f"compiled <= 0.5 x hand-written loop ({part})", "value": ratio,
                        "met": ratio <= 0.5})
    if "busy" in figures:
        for mode in MODES:
            label = ", auto's pick here" if mode == auto_mode else ""
            frac = _med(figures, "busy", mode, "orchestration_cpu_fraction")
            out.append({"target": f"orchestration <= 5 % of step CPU, busy workers ({mode}{label})",
                        "value": frac, "met": frac <= 0.05})
            frac = _med(figures, "busy", mode, "overhead_cpu_fraction")
            out.append({"target": f"orchestration + Ray background <= 5 % of step CPU, busy workers ({mode}{label})",
                        "value": frac, "met": frac <= 0.05})
    return out


def report(result: dict) -> None:
    f = result["figures"]
    if "calib" in f:
        print(f"\ncalibration: one no-op actor round trip {f['calib']['call_ms']['median']:.2f} ms wall, "
              f"{f['calib']['cpu_ms_per_call']['median']:.2f} ms CPU (all processes); Ray idle "
              f"{f['calib']['ray_idle_cores']['median']:.3f} cores")
    rows = []
    for part in f:
        if part == "calib":
            continue
        for mode in MODES:
            m = f[part][mode]
            row = [part, mode, m["step_ms"]["median"], f"{m['step_ms']['min']:.1f}-{m['step_ms']['max']:.1f}",
                   f[part][f"{mode}_over_hand"]["median"] if mode != "hand" else 1.0,
                   m["cpu_ms_per_step"]["median"], m["cores_while_stepping"]["median"]]
            if "overhead_cpu_ms_per_step" in m:
                row += [m["worker_cpu_ms_per_step"]["median"], m["background_cpu_ms_per_step"]["median"],
                        m["orchestration_cpu_ms_per_step"]["median"],
                        f"{m['orchestration_cpu_fraction']['median'] * 100:.1f} %"]
            else:
                row += ["", "", "", ""]
            row += [m["idle_cores"]["median"]] if "idle_cores" in m else [""]
            rows.append(row)
    print_table(["part", "mode", "step ms", "range", "x hand", "CPU ms/step", "cores", "worker CPU ms",
                 "Ray bg CPU ms", "orch CPU ms", "orch share", "idle cores"], rows,
                title=f"overhead: {result['params']['generators']} generators, median of "
                      f"{result['params']['repeats']} repeats")
    print(f"auto here: {result['auto']}")
    print_targets(result["targets"])


if __name__ == "__main__":
    main()
