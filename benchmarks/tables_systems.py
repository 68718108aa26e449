"""docs/results.md's tables of the systems benchmarks: overlap, refits, trainer, batching, faults."""
from __future__ import annotations

import statistics

from benchmarks.markdown import md, rng, g3, machine, targets


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
    kinds = sorted({f"{x['fault']} ({x['phase']})" if x["phase"] != "-" else x["fault"] for x in r["runs"]})
    head = (f"{p['schedules']} schedules of {p['steps']} steps per seed, seeds "
            f"{', '.join(str(seed) for seed in p['seeds'])}; faults by phase: {', '.join(kinds)}. {machine(r)}\n\n"
            f"A schedule took {min(walls):.0f}-{max(walls):.0f} s (median {statistics.median(walls):.0f} s), "
            f"{sum(walls):.0f} s in all.\n\n")
    rows = [[k.replace("_", " "), v] for k, v in t.items()]
    return head + md(["", "count"], rows, text_cols=1) + "\n\nTargets:\n\n" + targets(r["targets"])



def agents(r: dict) -> str:
    f = r["figures"]
    through = md(["model", "repeat", "env tokens/s", "gateway tokens/s", "gateway / env", "context tokens (env, gateway)"],
                 [[t["model"], i, f"{x['env']['tokens_per_s']:.0f}", f"{x['gateway']['tokens_per_s']:.0f}",
                   f"{x['ratio']:.2f}", f"{x['env']['context_tokens']}, {x['gateway']['context_tokens']}"]
                  for t in f["throughput"] for i, x in enumerate(t["repeats"])])
    overhead = md(["sessions at once", "requests", "p50 ms", "p99 ms"],
                  [[o["sessions"], o["requests"], f"{o['p50_ms']:.2f}", f"{o['p99_ms']:.2f}"] for o in f["overhead"]],
                  text_cols=1)
    sessions = md(["sessions", "errors", "wall s", "requests/s"],
                  [[c["sessions"], c["errors"], f"{c['wall_s']:.2f}", f"{c['requests_per_s']:.0f}"]
                   for c in f["concurrency"]], text_cols=1)
    learning = "" if not isinstance(f["learning"], list) else (
        "\n\n`examples/tiny_agent_grpo.yaml`, per seed: greedy validation after the warm-up -> at the end, "
        "training reward of the first -> last 10 steps:\n\n"
        + md(["seed", "validation", "reward", "reward failures"],
             [[x["seed"], f"{x['val_start']:.3g} -> {x['val_end']:.3g}",
               f"{x['reward_first10']:.2f} -> {x['reward_last10']:.2f}", x["env_failures"]] for x in f["learning"]],
             text_cols=1))
    return (f"{machine(r)}\n\nThe calculator task, generated tokens/s of 4 batches x 16 prompts x 4 samples, the "
            "in-process environment against an agent through the gateway on one engine, both decoding the same "
            "tokens (the environment writes the chat template's markup):\n\n" + through
            + "\n\nPer-request overhead (simulated engine, one token per request, the client's wall time):\n\n"
            + overhead + "\n\nConcurrent sessions on one generator (simulated engine, two requests each):\n\n"
            + sessions + learning + "\n\nTargets:\n\n" + targets(r["targets"]))


def routing_replay(r: dict) -> str:
    p = r["params"]
    rows = [[a["model"], a["mode"].replace("_", " "), a["max_age"], f"{a['routing_differs']:.3f}",
             f"{a['own_routing_differs']:.3f}", f"{g3(a['logprob_gap_mean'])}", f"{g3(a['other_logprob_gap_mean'])}",
             f"{g3(a['logprob_gap_max'])}"] for a in r["arms"]]
    paired = [[a["model"], a["max_age"], *(f"{a['paired_s'][k]:.3g}" for k in
                                            ("train_replayed", "train_plain", "generate_recorded", "generate_unrecorded"))]
              for a in r["arms"] if "paired_s" in a]
    head = (f"{p['model']}, weights drawn at std {', '.join(str(s) for s in p['init_std'].values())}; {p['steps']} GRPO "
            f"steps an arm, {p['prompts_per_step']} prompts x {p['group_size']}, lr {p['lr']}; "
            f"{p['route_bytes_per_token']} route bytes a token. {machine(r)}\n\n")
    return (head + md(["model", "arm", "max_age", "routing differs", "own routers differ", "logprob gap",
                       "scored the other way", "gap max"], rows, text_cols=2)
            + "\n\nPaired seconds (one process, alternating):\n\n"
            + md(["model", "max_age", "update, routes", "update, none", "batch, recorded", "batch, not"], paired,
                 text_cols=1))
