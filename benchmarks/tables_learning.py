"""docs/results.md's tables of the learning benchmarks: seeds, the multi-turn recipes, TRL, long runs."""
from __future__ import annotations

from benchmarks.markdown import md, machine, targets


def seeds(r: dict) -> str:
    """One row per recipe and mode: what every seed reached (benchmarks/seeds.py)."""
    p, summary = r["params"], r["summary"]
    rows = []
    for key, s in summary.items():
        if not isinstance(s, dict):
            continue
        algorithm, mode = key.rsplit("_", 1)
        ratio = summary.get(f"{algorithm}_async_over_sync_steps") if mode == "async" else None
        rows.append([algorithm.upper().replace("_LORA", ", LoRA"), mode, f"{s['seeds_val_ge_0.9']} / {len(s['seeds'])}",
                     ", ".join(f"{v:.2f}" for v in s["final_val"]),
                     ", ".join("never" if v is None else str(v) for v in s["steps_to_0.7"]),
                     s["median_steps_to_0.7"], "" if ratio is None else f"{ratio:.2f}"])
    if "grpo" in p["algorithms"]:  # the reference was measured on the full fine-tune's settings
        trl = r["trl_reference"]
        rows.append(["GRPO (TRL GRPOTrainer)", "sync", f"{len(trl['seeds'])} / {len(trl['seeds'])}",
                     ", ".join(f"{v:.2f}" for v in trl["final_val"]),
                     f"{trl['steps_to_0.7']['min']}-{trl['steps_to_0.7']['max']}", "", ""])
    head = (f"seeds {p['seeds']}, {p['steps']} steps, validation every {p['val_period']} steps; "
            + (f"every run with `{' '.join(p['overrides'])}`; " if p.get("overrides") else "") + machine(r))
    commits = {(run["git_commit"][:8], run["git_dirty"]) for run in r["runs"] if "git_commit" in run}
    if len(commits) > 1:  # merged from several invocations (seeds.py --merge)
        head += "; runs taken at commits " + ", ".join(c + (" (dirty)" if d else "") for c, d in sorted(commits))
    table = md(["algorithm", "mode", f"final val >= {p['val_bar']}", "final val per seed",
                f"steps to {p['reward_bar']} (per seed)", "median", "async / sync"], rows)
    marks = [k for k in range(0, p["steps"], 10)] + [p["steps"] - 1]
    curves = [[run["algorithm"].upper().replace("_LORA", ", LoRA"), run["mode"],
               "/".join(f"{run['rewards'][k]:.2f}" for k in marks)]
              for run in r["runs"] if run["seed"] == p["seeds"][0]]
    curve = md(["algorithm", "mode", f"training reward at steps {'/'.join(map(str, marks))}"], curves)
    return (head + "\n\n" + table + f"\n\nSeed {p['seeds'][0]}'s curves (training reward, the step's mean):\n\n"
            + curve)


def tool_seeds(r: dict) -> str:
    p = r["params"]
    rows = []
    for recipe in p["recipes"]:
        runs = [x for x in r["runs"] if x["recipe"] == recipe]
        rows.append([f"`{recipe}`"] + [f"{x['val_start']:.3g} -> {x['val_end']:.3g}, "
                                       f"{x['reward_first10']:.2f} -> {x['reward_last10']:.2f}" for x in runs]
                    + [str(sum(x["env_failures"] for x in runs))])
    head = (f"seeds {p['seeds']}, {p['steps']} steps, validation every {p['val_period']} steps; {machine(r)}\n\n"
            "Per seed: greedy validation after the warm-up -> at the end, training reward of the first -> "
            "last 10 steps.\n\n")
    return (head + md(["recipe"] + [f"seed {s}" for s in p["seeds"]] + ["environment failures"], rows, text_cols=1 + len(p["seeds"]))
            + "\n\nTargets:\n\n" + targets(r["targets"]))


def vs_trl(r: dict) -> str:
    p, f = r["params"], r["figures"]
    names = (("dagrl_async", "dagrl async (`max_age 1`)"), ("dagrl_sync", "dagrl sync (`max_age 0`)"),
             ("trl", "TRL GRPOTrainer"))
    rows = []
    for key, name in names:
        runs, fig = r["runs"][key], f[key]
        cells = [name]
        for field, fmt in (("startup_s", "{:.1f}"), ("step_time_s", "{:.3f}"), ("steps_to_threshold", "{:.0f}"),
                           ("time_to_threshold_s", "{:.2f}")):
            values = [x[field] for x in runs]
            cells.append(f"{fmt.format(fig[field])} ({fmt.format(min(values))}-{fmt.format(max(values))})")
        rows.append(cells)
    ratios = [[name, *(f"{f[key][k]:.2f}" for k in ("step_time_s", "time_to_threshold_s", "startup_s"))]
              for key, name in (("dagrl_async_over_trl", "async / TRL"), ("dagrl_sync_over_trl", "sync / TRL"))]
    versions = ", ".join(f"{k} {v}" for k, v in p["trl_versions"].items())
    head = (f"{p['recipe']}, seeds {p['seeds']}, {p['steps']} steps, threshold {p['threshold']} "
            f"(mean of {p['window']} steps); TRL side: {versions}. {machine(r)}\n\n"
            "Medians over seeds (range).\n\n")
    return (head + md(["", "start-up, s", "step, s", f"steps to {p['threshold']}", f"time to {p['threshold']}, s"],
                      rows, text_cols=1)
            + "\n\nMedians of the per-seed ratios:\n\n"
            + md(["", "step time", f"time to {p['threshold']}", "start-up"], ratios, text_cols=1)
            + "\n\nTargets:\n\n" + targets(f["targets"]))


def vs_trl_scale(r: dict) -> str:
    p = r["params"]
    ranks2 = all("async_2ranks" in c for c in r["cases"])

    def two(c: dict) -> list:
        if not ranks2:
            return []
        a2 = c["async_2ranks"]
        return [f"{a2['step_time_s']:.3g}", f"{c['async_2ranks_over_trl']:.2f}", f"{a2['efficiency']:.2f}"]
    rows = [[c["size"], c["dtype"], f"{c['trl']['step_time_s']:.3g}", f"{c['async']['step_time_s']:.3g}",
             f"{c['sync']['step_time_s']:.3g}", f"{c['async_over_trl']:.2f}", f"{c['sync_over_trl']:.2f}",
             f"{c['trl']['tokens_per_s']:.0f}", f"{c['async']['tokens_per_s']:.0f}", f"{c['sync']['tokens_per_s']:.0f}",
             f"{c['async']['train_s']:.3g}", f"{c['async']['generation_s']:.3g}", f"{c['async']['efficiency']:.2f}",
             *two(c)] for c in r["cases"]]
    steps = (", ".join(f"{size} {n}" for size, n in p["steps"].items()) if isinstance(p["steps"], dict)
             else p["steps"])
    head = (f"TRL GRPOTrainer against dagrl async and sync, {p['prompts']} prompts x {p['group_size']} samples, "
            f"{p['max_new_tokens']}-token completions, {steps} steps each (median of steps 1..), one torch "
            f"thread a process; the CPU's bf16 units: {', '.join(p['cpu_bf16']) or 'none'}. {machine(r)}\n\n")
    return (head + md(["model", "dtype", "TRL step (s)", "async (s)", "sync (s)", "async / TRL", "sync / TRL",
                       "TRL tok/s", "async tok/s", "sync tok/s", "async train (s)", "async generation (s)",
                       "async efficiency", *(["async 2 ranks (s)", "async 2 ranks / TRL", "async 2 ranks efficiency"]
                                             if ranks2 else [])], rows) + "\n\nTargets:\n\n" + targets(r["targets"]))


def long_run(r: dict) -> str:
    rows = []
    for name, c in r["cases"].items():
        key = next(k for k in ("held_slope_kb_per_step", "low_slope_kb_per_step", "slope_kb_per_step")
                   if f"max_{k}" in c)
        slopes = ", ".join(f"{role} {v[key]:.1f}" for role, v in
                           sorted(c["roles"].items(), key=lambda kv: -kv[1][key]))
        copies = f" = {c['store_peak_mb'] / c['weight_copy_mb']:.3f} copies" if c["weight_copy_mb"] else ""
        bound = f" (bound {c['store_bound_mb']:.2f} MB)" if c["store_bound_mb"] else ""
        commit = c.get("git_commit", r["machine"]["git_commit"])[:7]
        rows.append([name, commit, slopes, f"{c['store_peak_mb']:.2f} MB{copies}{bound}",
                     ", ".join(k for k, v in c["targets_met"].items() if not v) or "none",
                     c["steps"], f"{c['store_spilled_mb']:.0f}",
                     f"{c['last_over_first']:.2f}" + (f" (p {c['rising_p']:.2f})" if "rising_p" in c else ""),
                     f"{c['own_last_over_first']:.2f} (p {c['own_rising_p']:.2f})"
                     if c.get("own_last_over_first") is not None else "not probed",
                     c["violations"]])
    m = r["model"]
    head = (f"Model `{m['path']}` (`build-tiny {' '.join(m['build'])}`); RSS slopes fitted after the first "
            f"{r['warmup_share'] * 100:.0f} % of steps: for a role with a heap cap, through its RSS right after "
            f"each trim, for the others through each eighth's lowest RSS (`held_slope`; a case read before it "
            f"existed shows `low_slope`); p: how often the tenths' median step times, shuffled, rise as steadily "
            f"as they did (a slowdown: p < 0.05, or the last tenth above the first by more than the first nine "
            f"tenths' range); at one machine "
            f"speed: each tenth scaled by the benchmark's probe of the machine beside the run, which the "
            f"target reads where a run has it. {machine(r)}\n\n")
    return head + md(["case", "commit", "RSS slope per role (KB/step)", "store peak", "targets missed", "steps",
                      "spilled MB", "last / first 10 % step time", "the same at one machine speed", "violations"],
                     rows, text_cols=5)



def distill(r: dict) -> str:
    """Per seed: the distilled student and GRPO from the same fresh model, against the teacher (benchmarks/distill.py)."""
    p, t = r["params"], r["teacher"]
    by = {(x["kind"], x["seed"]): x for x in r["runs"]}

    def steps(x: dict) -> str:
        return " / ".join("never" if x[k] is None else str(x[k]) for k in ("reached", "held"))
    rows = [[s, steps(by["distill", s]), steps(by["grpo", s]), f"{by['distill', s]['val_end']:.2f}",
             f"{by['grpo', s]['val_end']:.2f}", f"{by['distill', s]['kl_start']:.3f} -> {by['distill', s]['kl_end']:.3f}"]
            for s in p["seeds"]]
    loss = ", ".join(f"{k} {v}" for k, v in r.get("distill", {}).items())
    head = (f"distillation {loss or 'as examples/tiny_distill.yaml'}; "
            f"seeds {p['seeds']}, {p['steps']} steps, greedy validation every {p['val_period']} steps; the teacher "
            f"(`make models/tiny_teacher/config.json`, {t['steps']} warm-up steps, built in {t['build_s']} s): greedy "
            f"validation {t['val_greedy_after']['reward']:.3f}, sampled {t['val_sampled_after']['reward']:.3f}, the "
            f"fresh student's {t['val_greedy_before']['reward']:.3f}; the bar (within 10 %) {r['bar']:.3f}. "
            f"{machine(r)}\n\n"
            "Steps trained until the greedy validation first reaches the bar / from when it stays there to the end:\n\n")
    marks = sorted({0, *range(10, p["steps"], 10), p["steps"]})
    curves = [[kind, s, " / ".join(f"{v:.2f}" for step, v in by[kind, s]["val"] if step + 1 in marks)]
              for s in p["seeds"] for kind in ("distill", "grpo")]
    m = r["medians"]
    rows.append(["median"] + [" / ".join("never" if m[k][w] is None else f"{m[k][w]:g}" for w in ("reached", "held"))
                              for k in ("distill", "grpo")] + ["", "", ""])
    return (head + md(["seed", "distill", "GRPO", "distill val end", "GRPO val end", "distill/kl first -> last"],
                      rows, text_cols=1)
            + f"\n\nGreedy validation after {' / '.join(map(str, marks))} steps:\n\n"
            + md(["run", "seed", "validation"], curves, text_cols=3)
            + "\n\nTargets:\n\n" + targets(r["targets"]))


def vlm(r: dict) -> str:
    """Per seed and mode: the tiny VLM's greedy validation along the run (benchmarks/vlm.py)."""
    p = r["params"]
    head = (f"seeds {p['seeds']}, {p['steps']} steps, async (max_age 1) and sync (max_age 0), greedy validation at "
            f"the start and every {p['val_period']} steps; chance (one digit for every picture) {r['chance']}. "
            f"{machine(r)}\n\n")
    rows = [[x["mode"], x["seed"], " / ".join(f"{v:.2f}" for _, v in x["val"]), f"{x['val_end']:.2f}",
             len(x["violations"]), x["wall_s"]] for x in r["runs"]]
    steps = " / ".join(str(step + 1) for step, _ in r["runs"][0]["val"])
    return (head + md(["mode", "seed", f"greedy validation after {steps} steps", "end", "violations", "wall s"],
                      rows, text_cols=3)
            + "\n\nTargets:\n\n" + targets(r["targets"]))
