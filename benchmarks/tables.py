"""Markdown tables of the results files, for README.md and benchmarks/README.md.

    .venv/bin/python benchmarks/tables.py [results dir]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks.harness import RESULTS


def md(headers: list[str], rows: list[list], text_cols: int = 2) -> str:
    align = ["---" if i < text_cols else "---:" for i in range(len(headers))]
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join(align) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def rng(s: dict, scale: float = 1.0, fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(s['min'] * scale)}–{fmt.format(s['max'] * scale)}"


def machine(r: dict) -> str:
    m = r["machine"]
    during = m.get("loadavg_1min_during")
    load = f"load average (1 min) {m['loadavg_start'][0]} at start, {m['loadavg_end'][0]} at end"
    if during:
        load += f", median {during['median']:.2f} / max {during['max']:.2f} during"
    return (f"{m['cpu_physical']} cores, {m['memory_gib']} GiB, Ray {m['ray']}, Python {m['python']}; {load}; "
            f"commit {m['git_commit'][:8]}{' (dirty)' if m['git_dirty'] else ''}; {r['wall_s']:.0f} s")


def overlap(r: dict) -> str:
    p = r["params"]
    rows = []
    for f in r["figures"]:
        rows.append([f["mode"], f["G_over_T"], f"{f['G_s'] * 1e3:.0f}/{f['T_s'] * 1e3:.0f}", f["max_age"],
                     f"{f['ideal_step_s'] * 1e3:.0f}", f"{f['step_s']['median'] * 1e3:.0f}",
                     rng(f["step_s"], 1e3, "{:.0f}"), f"{f['overhead_ms']['median']:.0f}",
                     f"{f['efficiency']['median']:.2f}", f"{f['speedup_over_sync']['median']:.2f}",
                     rng(f["speedup_over_sync"]), f"{f['ideal_speedup']:.2f}"])
    head = (f"{p['generators']} generators, R = {p['refit_s'] * 1e3:.0f} ms, {p['repeats']} repeats, "
            f"{p['steps_per_run'] - p['steps_skipped_first'] - p['steps_skipped_last']} steady steps per run "
            f"(median per run, then median and range over repeats). {machine(r)}\n\n")
    table = md(["mode", "G/T", "G/T ms", "max_age", "ideal ms", "step ms", "range", "overhead ms",
                "efficiency", "speedup", "speedup range", "ideal speedup"], rows)
    t = md(["mode", "max_age", "efficiency (≥ 0.95)", "speedup (≥ target)", "target", "overhead ms/step",
            "ideal step for eff. 0.95"],
           [[x["mode"], x["max_age"], f"{x['efficiency']:.3f} {'met' if x['efficiency_met'] else 'missed'}",
             f"{x['speedup']:.2f} {'met' if x['speedup_met'] else 'missed'}", f"{x['speedup_target']:.2f}",
             f"{x['overhead_ms_per_step']:.0f}", f"{x['ideal_step_s_for_efficiency_0.95']:.2f} s"]
            for x in r["targets"]])
    return head + table + "\n\nTargets at G = T:\n\n" + t


def overhead(r: dict) -> str:
    f, p = r["figures"], r["params"]
    out = [f"{p['generators']} generators ({p['graph_actors']} graph actors), {p['repeats']} repeats. {machine(r)}\n"]
    if "calib" in f:
        c = f["calib"]
        out.append(f"Calibration: one no-op actor round trip `ray.get(a.ping.remote())` "
                   f"{c['call_ms']['median']:.2f} ms wall ({rng(c['call_ms'])}), "
                   f"{c['cpu_ms_per_call']['median']:.2f} ms CPU over all processes; an idle cluster burns "
                   f"{c['ray_idle_cores']['median']:.3f} cores.\n")
    rows = []
    for part in ("stub", "zero", "sleep", "busy"):
        if part not in f:
            continue
        for mode in ("compiled", "classic", "hand"):
            m = f[part][mode]
            ratio = f[part][f"{mode}_over_hand"] if mode != "hand" else None
            row = [part, mode, f"{m['step_ms']['median']:.1f}", rng(m["step_ms"], 1, "{:.1f}"),
                   f"{ratio['median']:.2f} ({rng(ratio)})" if ratio else "1",
                   f"{m['cpu_ms_per_step']['median']:.0f}", f"{m['cores_while_stepping']['median']:.2f}"]
            if "orchestration_cpu_ms_per_step" in m:
                row += [f"{m['worker_cpu_ms_per_step']['median']:.0f}", f"{m['background_cpu_ms_per_step']['median']:.0f}",
                        f"{m['orchestration_cpu_ms_per_step']['median']:.0f}",
                        f"{m['orchestration_cpu_fraction']['median'] * 100:.0f} %", ""]
            else:
                row += ["", "", "", "", f"{m['idle_cores']['median']:.2f}"]
            rows.append(row)
    out.append(md(["part", "mode", "step ms", "range", "× hand (range)", "CPU ms/step", "cores used",
                   "worker CPU ms", "Ray background ms", "orchestration CPU ms", "orch. share", "idle cores"], rows))
    out.append("\nTargets:\n")
    out.append(md(["target", "value", ""], [[t["target"], f"{t['value']:.3f}", "met" if t["met"] else "missed"]
                                          for t in r["targets"]], text_cols=1))
    return "\n".join(out)


def seeds(r: dict) -> str:
    """One row per recipe and mode: what every seed reached (benchmarks/seeds.py)."""
    p, summary = r["params"], r["summary"]
    rows = []
    for key, s in summary.items():
        if not isinstance(s, dict):
            continue
        algorithm, mode = key.split("_")
        ratio = summary.get(f"{algorithm}_async_over_sync_steps") if mode == "async" else None
        rows.append([algorithm.upper(), mode, f"{s['seeds_val_ge_0.9']} / {len(s['seeds'])}",
                     ", ".join(f"{v:.2f}" for v in s["final_val"]),
                     ", ".join("never" if v is None else str(v) for v in s["steps_to_0.7"]),
                     s["median_steps_to_0.7"], "" if ratio is None else f"{ratio:.2f}"])
    trl = r["trl_reference"]
    rows.append(["GRPO (TRL GRPOTrainer)", "sync", f"{len(trl['seeds'])} / {len(trl['seeds'])}",
                 ", ".join(f"{v:.2f}" for v in trl["final_val"]),
                 f"{trl['steps_to_0.7']['min']}-{trl['steps_to_0.7']['max']}", "", ""])
    head = (f"seeds {p['seeds']}, {p['steps']} steps, validation every {p['val_period']} steps; "
            f"{machine(r)}")
    return head + "\n\n" + md(["algorithm", "mode", f"final val >= {p['val_bar']}", "final val per seed",
                                f"steps to {p['reward_bar']} (per seed)", "median", "async / sync"],
                               rows)


def main() -> None:
    d = Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS
    for name, fn in (("seeds", seeds), ("overlap", overlap), ("overlap_scale1", overlap), ("overhead", overhead),
                     ("overhead_1gen", overhead)):
        path = d / f"{name}.json"
        if path.is_file():
            print(f"\n### {name}\n")
            print(fn(json.loads(path.read_text())))


if __name__ == "__main__":
    main()
