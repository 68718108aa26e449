"""docs/results.md: every results file's figures as Markdown tables.

    .venv/bin/python -m benchmarks.tables            # print the page
    .venv/bin/python -m benchmarks.tables --write    # write it to docs/results.md
    .venv/bin/python -m benchmarks.tables --results DIR --write PATH

The page is generated, never edited by hand: tests/docs/test_docs.py fails when
docs/results.md differs from what this prints for benchmarks/results/*.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmarks.harness import RESULTS

PAGE = Path(__file__).resolve().parents[1] / "docs" / "results.md"


def md(headers: list[str], rows: list[list], text_cols: int = 2) -> str:
    align = ["---" if i < text_cols else "---:" for i in range(len(headers))]
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join(align) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def rng(s: dict, scale: float = 1.0, fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(s['min'] * scale)}–{fmt.format(s['max'] * scale)}"


def g3(x: float) -> str:
    """Three significant digits, no exponent for the sizes on this page."""
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"


def machine(r: dict) -> str:
    m = r["machine"]
    during = m.get("loadavg_1min_during")
    load = f"load average (1 min) {m['loadavg_start'][0]} at start, {m['loadavg_end'][0]} at end"
    if during:
        load += f", median {during['median']:.2f} / max {during['max']:.2f} during"
    wall = f"; {r['wall_s']:.0f} s" if "wall_s" in r else ""
    return (f"{m['cpu_physical']} cores, {m['memory_gib']} GiB, Ray {m['ray']}, Python {m['python']}; {load}; "
            f"commit {m['git_commit'][:8]}{' (dirty)' if m['git_dirty'] else ''}{wall}")


def targets(r: list[dict]) -> str:
    def value(v):
        if isinstance(v, float):
            return f"{v:.3f}"
        if isinstance(v, list):
            return ", ".join(f"{x:.3g}" if isinstance(x, float) else str(x) for x in v)
        return str(v)
    return md(["target", "value", ""], [[t["target"], value(t["value"]), "met" if t["met"] else "missed"]
                                       for t in r], text_cols=1)


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


def step_profile(r: dict) -> str:
    p, runs = r["params"], r["runs"]
    modes = list(runs)
    ms = lambda x: f"{x * 1e3:.1f}"  # noqa: E731
    chain = [[k] + [ms(runs[m]["chain_s"][k]) for m in modes] for k in runs[modes[0]]["chain_s"]]
    spans = [[node, span] + [ms(runs[m]["spans_s"][node][span]) for m in modes]
             for node, parts in runs[modes[0]]["spans_s"].items() for span in parts]
    startup = [[k] + [f"{runs[m]['startup_s'][k]:.2f}" for m in modes] for k in runs[modes[0]]["startup_s"]]
    lv = r["leaves"]
    shares = ", ".join(f"{k} {v * 100:.0f} %" for k, v in lv["vllm_share_of_call"].items())
    head = (f"{p['recipe']}, {p['steps']} steps per mode, seed {p['seed']}, medians over steps "
            f"{p['warmup_steps_left_out']}..; validation {p['validation']}, checkpoints {p['checkpoints']}. "
            f"{machine(r)}\n\n"
            + ", ".join(f"{m}: step {runs[m]['step_time_s'] * 1e3:.0f} ms, {runs[m]['events_per_step']:.0f} "
                        f"events per step" for m in modes) + ".\n\n")
    leaves = (f"vLLM alone: one call of {lv['requests_per_call']} requests x {lv['max_new_tokens']} tokens "
              f"{lv['vllm_sample_call_s'] * 1e3:.1f} ms; its shares (cProfile): {shares}. One event-log write "
              f"{lv['event_log_write_s'] * 1e6:.1f} us.")
    return (head + "The step as a chain of nodes and the dispatch gaps before them, ms:\n\n"
            + md(["node"] + modes, chain, text_cols=1)
            + "\n\nSpans inside the nodes, ms:\n\n" + md(["node", "span"] + modes, spans)
            + "\n\nStart-up, s:\n\n" + md(["phase"] + modes, startup, text_cols=1) + "\n\n" + leaves)


def inflight(r: dict) -> str:
    p = r["params"]
    rows = [[f"{x['tail_ratio']:g}", x["max_age"], f"{x['drain_tokens_per_s']['median']:.0f}",
             f"{x['inflight_tokens_per_s']['median']:.0f}",
             f"{x['tokens_per_s_ratio']['median']:.2f} ({rng(x['tokens_per_s_ratio']).replace('–', '-')})",
             f"{x['drain_step_s']['median'] * 1e3:.0f} -> {x['inflight_step_s']['median'] * 1e3:.0f} ms",
             f"{x['drain_busy']['median']:.2f}", f"{x['inflight_busy']['median']:.2f}"] for x in r["throughput"]]
    learn = []
    for age in p["learn_ages"]:
        for mode in ("drain", "inflight"):
            runs = [x for x in r["learning"] if x["max_age"] == age and x["refit_mode"] == mode]
            to_val = [x["steps_to_val_0.9"] for x in runs]
            learn.append([age, mode, ", ".join(str(v) for v in to_val),
                          statistics.median([v for v in to_val if v is not None]) if any(v is not None for v in to_val) else "never",
                          ", ".join(str(x["steps_to_0.7"]) for x in runs),
                          ", ".join(f"{x['final_val']:.2f}" for x in runs)])
    head = (f"Simulated workers: {p['prompts']} prompts per step on {p['generators']} generators, lognormal lengths "
            f"capped at {p['max_new_tokens']} tokens, {p['generate_s']} s to decode them, {p['train_s']} s training, "
            f"{p['refit_s']} s refits; {p['repeats']} repeats of {p['steps']} steady steps, medians (range). "
            f"{machine(r)}\n\n")
    seeds_ = ", ".join(map(str, p["seeds"]))
    return (head + md(["tail p99/p50", "max_age", "drain tokens/s", "inflight tokens/s", "inflight / drain",
                       "step, drain -> inflight", "drain busy", "inflight busy"], rows, text_cols=0)
            + f"\n\nLearning on the real tiny recipe (GRPO, {p['learn_steps']} steps, validation every "
              f"{p['val_period']}, seeds {seeds_}):\n\n"
            + md(["max_age", "mode", f"steps to val 0.9 (seeds {seeds_})", "median", "steps to reward 0.7",
                  "final val"], learn)
            + "\n\nTargets:\n\n" + targets(r["targets"]))


def multiturn(r: dict) -> str:
    p = r["params"]
    rows = [[x["latency"], f"{x['turns']}" if x["turns"] != "random" else "1-4", x["env"],
             f"{x['sync_step_s']['median'] * 1e3:.0f}",
             f"{x['async_step_s']['median'] * 1e3:.0f} / {x['async_step_mean_s']['median'] * 1e3:.0f}",
             f"{x['sync_tokens_per_s']['median']:.0f}", f"{x['async_tokens_per_s']['median']:.0f}",
             f"{x['tokens_per_s_ratio']['median']:.2f} ({rng(x['tokens_per_s_ratio']).replace('–', '-')})",
             f"{x['sync_busy']['median']:.2f}", f"{x['async_busy']['median']:.2f}",
             f"{x['async_observation_share']['median'] * 100:.0f} %", x["env_failures"], len(x["violations"])]
            for x in r["figures"]]
    head = (f"Simulated workers and tool: {p['generators']} generators, {p['prompts']} prompts x {p['group']} samples "
            f"per step, up to {p['max_new_tokens']} tokens per turn, tool call {p['latency_s']} s (lognormal: p99/p50 "
            f"{p['tool_tail']:g}), {p['train_s']} s training; sync `max_age 0` with draining refits, async "
            f"`max_age {p['async_max_age']}` with inflight refits; {p['repeats']} repeats of {p['steps']} steady "
            f"steps, medians (range). {machine(r)}\n\n")
    return (head + md(["tool latency", "turns", "environments", "sync step ms", "async step ms (median / mean)",
                       "sync tokens/s", "async tokens/s", "async / sync", "sync busy", "async busy",
                       "observation tokens", "env failures", "violations"], rows, text_cols=3)
            + "\n\nTargets:\n\n" + targets(r["targets"]))


def refit(r: dict) -> str:
    p = r["params"]
    memcpy = r["memcpy"]["median"]
    fig = {(x["size"], x["generators"], x["path"]): x for x in r["figures"]}
    paths = [x for x in p["paths"] if not x.startswith("lora_")]
    rows = []
    for size in p["sizes"]:
        for gens in p["generators"]:
            base = fig[(size, gens, paths[0])]
            row = [size, f"{base['sync_bytes'] / 2 ** 20:.1f}", gens]
            for path in paths:
                x = fig[(size, gens, path)]
                row.append(f"{g3(x['wall_s']['median'] * 1e3)} ({x['fraction_of_memcpy']:.3f})")
            rows.append(row)
    parts = []
    for size in p["sizes"]:
        for gens in p["generators"]:
            cells = [size, gens]
            for path in ("object_store", "collective", "collective_socket"):
                x = fig[(size, gens, path)]["parts_s"]
                keys = [k for k in x if k != "repack_s"]
                cells.append(", ".join(g3(x[k] * 1e3) for k in keys) + f" ({g3(x.get('repack_s', 0) * 1e3)})")
            parts.append(cells)
    part_names = {path: ", ".join(k[:-2].replace("_", " + ") for k in fig[(next(iter(p['sizes'])), 1, path)]
                                  ["parts_s"] if k != "repack_s") for path in ("object_store", "collective",
                                                                               "collective_socket")}
    lora = [[x["size"], x["generators"], x["path"].removeprefix("lora_"), f"{x['full_bytes'] / 2 ** 20:.2f}",
             f"{x['lora_bytes'] / 2 ** 20:.2f}", f"{g3(x['full_wall_s'] * 1e3)} -> {g3(x['lora_wall_s'] * 1e3)}",
             f"{x['speedup']:.2f}"] for x in r["lora_vs_full"]]
    head = (f"Model sizes {', '.join(p['sizes'])} ({p['dtype']}), 1 and 2 generators, buckets of "
            f"{p['bucket_bytes'] // 2 ** 20} MiB, LoRA rank {p['lora_rank']}; medians over repeats. Memory-copy "
            f"bandwidth in the same run: {memcpy / 1e9:.2f} GB/s median. {machine(r)}\n\n"
            "Refit wall time, ms (its fraction of the memory-copy bandwidth):\n\n")
    return (head + md(["model", "MiB", "gens"] + [f"`{x}`" for x in paths], rows, text_cols=1)
            + "\n\nWhere it goes, ms (repack inside the load); object store: " + part_names["object_store"]
            + "; collective: " + part_names["collective"] + ":\n\n"
            + md(["model", "gens", "object store", "collective (/dev/shm)", "collective (sockets)"], parts, text_cols=5)
            + "\n\nA rank-" + str(p["lora_rank"]) + " adapter against the full weights:\n\n"
            + md(["model", "gens", "path", "full MiB", "adapter MiB", "full -> LoRA, ms", "speed-up"], lora, text_cols=3))


def lora_trainer(r: dict) -> str:
    p = r["params"]
    mib = 2 ** 20
    rows = [[x["size"], x["mode"], f"{x['params'] / 1e6:.3g}", f"{x['trainable_params'] / 1e6:.3g}",
             f"{g3(x['optimizer_bytes'] / mib)}", f"{g3(x['export_bytes'] / mib)}", f"{x['peak_rss_bytes'] / mib:.0f}",
             f"{x['step_s']:.3g}"] for x in r["figures"]]
    ratios = [[x["size"], f"{x['optimizer_ratio']:.3f}", f"{x['export_ratio']:.3f}", f"{x['peak_rss_ratio']:.2f}",
               f"{x['step_time_ratio']:.2f}"] for x in r["lora_vs_full"]]
    head = (f"DeepSpeed policy engine, CPU, {p['dtype']}, ZeRO {p['zero_stage']}, one rank; {p['steps']} GRPO updates "
            f"on {p['rows']} rows of {p['prompt_tokens']} prompt + {p['response_tokens']} response tokens; LoRA rank "
            f"{p['rank']}. {machine(r)}\n\n")
    return (head + md(["model", "mode", "params (M)", "trainable (M)", "AdamW state (MiB)", "refit moves (MiB)",
                       "peak RSS (MiB)", "step (s)"], rows)
            + "\n\nLoRA / full:\n\n" + md(["model", "AdamW state", "refit bytes", "peak RSS", "step time"], ratios,
                                          text_cols=1))


def batching(r: dict) -> str:
    p, lengths = r["params"], r["params"]["lengths"]
    rows = [[c["micro_batch_size"], c["max_tokens"] or "off", "on" if c.get("packing") else "off", c["micro_batches"],
             f"{c['pad_token_share']:.3f}", f"{c['step_s']:.3g}", f"{c['step_over_rows']:.2f}", f"{c['loss_diff']:.2g}"]
            for c in r["cases"]]
    head = (f"DeepSpeed policy engine, CPU, fp32, ZeRO 0, one rank, the {p['size']} model; {p['steps']} GRPO updates "
            f"on {p['rows']} rows of {lengths['min']}-{lengths['max']} tokens (median {lengths['median']:.0f}). "
            f"{machine(r)}\n\n")
    return (head + md(["micro_batch_size", "max_tokens_per_micro_batch", "packing", "micro-batches",
                       "pad_token_share", "step (s)", "step / rows' step", "loss diff"], rows, text_cols=0)
            + f"\n\nTarget: pad_token_share <= {r['targets']['pad_token_share_max']} under a budget: "
            + ("met" if r["targets_met"]["pad_token_share"] else "missed") + ".")


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


def trainer_efficiency(r: dict) -> str:
    p = r["params"]
    rows = [[c["size"], c["dtype"], c["ranks"], f"{c['worker_step_s']:.3g}", f"{c['bare_step_s']:.3g}",
             f"{c['worker_over_bare']:.3f}", f"{min(c['ratios']):.3f}-{max(c['ratios']):.3f}",
             f"{c['worker_tokens_per_s']:.0f}"] for c in r["cases"]]
    head = (f"CPU, one thread per rank; {p['prompts']} prompts x {p['group_size']} samples, {p['prompt_len']}-token "
            f"prompts, responses up to {p['response_len']} tokens, micro-batches of {p['micro_batch_size']}; "
            f"median of {p['repeats']} timings of {p['steps']} steps per side. {machine(r)}\n\n")
    return (head + md(["model", "dtype", "ranks", "worker step (s)", "bare loop step (s)", "worker / bare",
                       "range", "worker tokens/s"], rows, text_cols=2) + "\n\nTargets:\n\n" + targets(r["targets"]))


def soak(r: dict) -> str:
    p, t = r["params"], r["totals"]
    walls = [x["wall_s"] for x in r["runs"]]
    head = (f"{p['schedules']} schedules of {p['steps']} steps, seed {p['seed']}, fault kinds "
            f"{', '.join(sorted({x['fault'] for x in r['runs']}))}. {machine(r)}\n\n"
            f"A schedule took {min(walls):.0f}-{max(walls):.0f} s (median {statistics.median(walls):.0f} s), "
            f"{sum(walls):.0f} s in all.\n\n")
    rows = [[k.replace("_", " "), v] for k, v in t.items()]
    return head + md(["", "count"], rows, text_cols=1) + "\n\nTargets:\n\n" + targets(r["targets"])


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


SECTIONS = (
    ("seeds", seeds, "learning on every seed, full fine-tunes (`seeds.py`)"),
    ("seeds_lora", seeds, "learning on every seed, LoRA (`seeds.py --algorithms grpo_lora ppo_lora`)"),
    ("seeds_bf16", seeds, "learning on every seed, full fine-tunes trained in bf16 (`seeds.py --set training.dtype=bf16`)"),
    ("seeds_algos", seeds, "learning on every seed, the algorithm presets (`seeds.py --algorithms dr_grpo rloo ...`)"),
    ("seeds_reward_model", seeds, "learning on every seed from a reward model's score "
                                  "(`seeds.py --algorithms reward_model`)"),
    ("tool_seeds", tool_seeds, "the multi-turn recipes across seeds (`tool_seeds.py`)"),
    ("vs_trl", vs_trl, "against TRL's GRPOTrainer (`vs_trl.py`)"),
    ("step_profile", step_profile, "where a step and the start-up go (`step_profile.py`)"),
    ("overlap", overlap, "does async overlap generation with training? (`overlap.py`)"),
    ("overlap_scale1", overlap, "the same at G = T = 1 s (`overlap.py --ratios 1 --scale 1.0 --steps 4 --repeats 2`)"),
    ("inflight", inflight, "in-flight refits against draining (`inflight.py`)"),
    ("multiturn", multiturn, "multi-turn rollouts with a tool, async against sync (`multiturn.py`)"),
    ("refit", refit, "a refit, object store against collective, full against LoRA (`refit.py`)"),
    ("lora_trainer", lora_trainer, "trainer memory and step time, full against LoRA (`lora_trainer.py`)"),
    ("batching", batching, "padding and train-step time: rows, a token budget, packing (`batching.py`)"),
    ("vs_trl_scale", vs_trl_scale, "dagrl against TRL's GRPOTrainer at 4M and 33M parameters (`vs_trl_scale.py`)"),
    ("vs_trl_scale_33m", vs_trl_scale, "the same at 33M again, on a quiet machine (`vs_trl_scale.py --sizes 33M`)"),
    ("trainer_efficiency", trainer_efficiency, "the DeepSpeed train step against a bare torch loop (`trainer_efficiency.py`)"),
    ("soak", soak, "faults under randomized schedules (`soak.py`)"),
    ("long_run", long_run, "memory, object store and step time over thousands of steps (`long_run.py`)"),
)


def page(results: Path = RESULTS) -> str:
    """The whole of docs/results.md for the results files in `results`."""
    out = ["# Results", "",
           "<!-- Generated by `.venv/bin/python -m benchmarks.tables --write` from benchmarks/results/*.json; "
           "do not edit by hand. -->", "",
           "Every table below is generated from a results file in `benchmarks/results/` by "
           "`.venv/bin/python -m benchmarks.tables --write`; a test fails when this page and the files disagree. "
           "Each section's first line gives the machine, its load while the benchmark ran and the commit, as the "
           "file records them. How each benchmark runs, what its figures mean and how to read them: "
           "[benchmarks.md](benchmarks.md).", ""]
    present = [(name, fn, title) for name, fn, title in SECTIONS if (results / f"{name}.json").is_file()]
    out += [f"- [`{name}`](#{name}): {title}" for name, _, title in present]
    for name, fn, title in present:
        r = json.loads((results / f"{name}.json").read_text())
        out += ["", f"## {name}", "", f"`benchmarks/results/{name}.json`: {title}.", "", fn(r)]
    other = sorted(p.stem for p in results.glob("*.json") if p.stem not in {n for n, _, _ in SECTIONS})
    if other:
        out += ["", "## Not tabulated", "", "Results files this page has no table for yet: "
                + ", ".join(f"`{n}.json`" for n in other) + "."]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=RESULTS, help="results directory (default benchmarks/results)")
    ap.add_argument("--write", nargs="?", type=Path, const=PAGE, default=None, metavar="PATH",
                    help=f"write the page (default {PAGE.relative_to(PAGE.parents[1])}) instead of printing it")
    args = ap.parse_args(argv)
    text = page(args.results)
    if args.write is None:
        print(text, end="")
    else:
        args.write.parent.mkdir(parents=True, exist_ok=True)
        args.write.write_text(text)
        print(f"wrote {args.write}")


if __name__ == "__main__":
    main()
