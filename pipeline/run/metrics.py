"""Per-step metrics and samples from the step graph's tokens, the sinks they go to
(metrics.jsonl and samples.jsonl; TensorBoard and Weights & Biases when the
recipe asks) and the progress display of the training loop."""
from __future__ import annotations

import json
import os
import sys
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Any, TextIO

from pipeline.config import Config, ConfigError
from pipeline.core.samples import format_sample, unshard


def _clamp01(x: float) -> float:
    return min(1.0, max(0.0, x))


def _nodes(out: dict[str, object], prefix: str) -> list[Any]:
    """Outputs of the per-generator nodes `prefix[0]`, `prefix[1]`, ..."""
    return [v for k, v in out.items() if k.startswith(prefix + "[")]


def step_metrics(step: int, elapsed_s: float, out: dict[str, object]) -> dict[str, float]:
    """One flat record for a step from the graph's outputs (node name -> token).

    Works on any subset of nodes, so the prologue's outputs (no sample, no
    train) give a validation-only record. Training metrics keep their names;
    the derived timings and ratios below are added on top:

      wait_s          sample's wait for rollouts: generation the overlap did not hide
      train_s         the trainer's own training time (TrainOut metric time_s)
      refit_s         the slowest generator's refit (weight fetch, drain, weight load)
      validate_s      the slowest generator's validation
      trainer_idle    1 - train_s / step_time_s
      generator_idle  mean over generators of 1 - busy_s / step_time_s
      generated_tokens_per_s  response tokens trained on / step_time_s
    """
    record: dict[str, float] = {}
    # PPO: train_done joins the policy's and the critic's metrics (critic/... keys).
    train = out.get("train_done") or out.get("train")
    train_metrics = {k: float(v) for k, v in getattr(train, "metrics", ())}
    record.update(train_metrics)
    record["step"] = step
    record["step_time_s"] = float(elapsed_s)
    timed = elapsed_s > 0

    sample = out.get("sample")
    if sample is not None:
        record["wait_s"] = float(sample.wait_s)
        # After the trainer's: with dynamic sampling the reward metrics are of every rollout of the step.
        record.update((k, float(v)) for k, v in sample.metrics)
    if "time_s" in train_metrics:
        record["train_s"] = train_metrics["time_s"]
        if timed:
            record["trainer_idle"] = _clamp01(1.0 - train_metrics["time_s"] / elapsed_s)

    refits = _nodes(out, "refit")
    if refits:
        record["refit_s"] = max(float(r.refit_s) for r in refits)
    vals = _nodes(out, "validate")
    if vals:
        record["validate_s"] = max(float(v.validate_s) for v in vals)

    tickets = _nodes(out, "collect")
    if tickets and timed:
        record["generator_idle"] = sum(_clamp01(1.0 - t.busy_s / elapsed_s) for t in tickets) / len(tickets)
    if "response_tokens" in train_metrics and timed:
        # The model's tokens: an environment's observations are not generated.
        generated = train_metrics.get("model_tokens", train_metrics["response_tokens"])
        record["generated_tokens_per_s"] = generated / elapsed_s
    resume = out.get("resume")
    if resume is not None:
        record.update({k: float(v) for k, v in resume.val_scores})
    return record


def step_samples(out: dict[str, object]) -> list[dict]:
    """The samples the graph's tokens carry (metrics.samples): the step's batch's,
    then its validation's, set by set, each in its set's order."""
    batch = out.get("sample")
    shards = [v.samples for v in _nodes(out, "validate")]
    sets = dict.fromkeys(s.get("set", "") for shard in shards for s in shard)
    val = [s for name in sets for s in unshard([[s for s in shard if s.get("set", "") == name] for shard in shards])]
    return [*(batch.samples if batch is not None else ()), *val]


def _scalars(record: dict) -> dict[str, float]:
    """The numeric values of a record, without the step (it is the x-axis)."""
    return {k: float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class _TensorBoard:
    """Scalars through tensorboard's own event writer: the same writer
    torch's SummaryWriter wraps, without importing torch (2.6 s here) into a
    simulated run's driver."""

    def __init__(self, log_dir: Path, purge_step: int | None):
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.plugins.text.summary_v2 import text_pb
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
        self._event, self._summary, self._text_pb = Event, Summary, text_pb
        log_dir.mkdir(parents=True, exist_ok=True)
        self._writer = EventFileWriter(str(log_dir))
        if purge_step is not None:
            # A START session log at step T makes TensorBoard's reader drop every
            # earlier-written event at step >= T: the killed run's tail, which
            # this run writes again (what torch's purge_step does).
            self._writer.add_event(Event(step=purge_step, wall_time=time.time(),
                                         session_log=SessionLog(status=SessionLog.START)))

    def write(self, step: int, values: dict[str, float]) -> None:
        self._add(step, self._summary(value=[self._summary.Value(tag=k, simple_value=v) for k, v in values.items()]))

    def write_text(self, step: int, tag: str, markdown: str) -> None:
        self._add(step, self._text_pb(tag, markdown))

    def _add(self, step: int, summary) -> None:
        self._writer.add_event(self._event(step=step, wall_time=time.time(), summary=summary))
        # A killed driver loses at most the line being written, not two minutes of them.
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


WANDB_MISSING = ("metrics.wandb is true but the wandb package is not installed: "
                 "pip install wandb (or pip install -e '.[wandb]'), or set metrics.wandb=false")


class _WandB:
    ID_FILE = "wandb_run_id"

    def __init__(self, run_dir: Path, cfg: Config, start_step: int):
        try:
            import wandb
        except ImportError:
            raise ConfigError(WANDB_MISSING) from None
        # A resumed run (same run directory) continues the same W&B run.
        id_file = run_dir / self.ID_FILE
        run_id = id_file.read_text().strip() if start_step > 0 and id_file.is_file() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id + "\n")
        self.run = wandb.init(project=cfg.metrics.wandb_project, name=cfg.run.name, id=run_id,
                              resume="allow", dir=str(run_dir), config=cfg.to_dict())
        # Our step is the x-axis: W&B's own _step must rise monotonically, which
        # a validation record at step -1 or a resumed run re-logging steps is not.
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def write(self, step: int, values: dict[str, float]) -> None:
        self.run.log({"step": step, **values})

    def write_table(self, step: int, key: str, samples: list[dict]) -> None:
        """One row per completion, as TRL logs its completions."""
        import wandb
        rows = [[s["step"], s["kind"], s["prompt_id"], s["prompt"], c["text"], c["reward"],
                 ",".join(map(str, c["versions"])), s.get("age"), c["tokens"],
                 "\n".join(f"{t['role']}: {t['text']}" for t in c.get("turns", ()))]
                for s in samples for c in s["completions"]]
        self.run.log({"step": step, key: wandb.Table(columns=list(WANDB_SAMPLE_COLUMNS), data=rows)})

    def close(self) -> None:
        self.run.finish()


WANDB_SAMPLE_COLUMNS = ("step", "kind", "prompt_id", "prompt", "completion", "reward", "versions", "age", "tokens",
                        "turns")


class MetricSinks:
    """Every record goes to run_dir/metrics.jsonl, and to TensorBoard
    (run_dir/tensorboard) and W&B when cfg.metrics says so; the samples to
    read (metrics.samples) go to run_dir/samples.jsonl and the same two.

    start_step > 0 is a resumed run that re-runs steps start_step... of a
    killed one in the same run directory: the killed run's records of those
    steps are superseded, in the .jsonl files (rewritten without them) and in
    TensorBoard (purged on reading). W&B keeps what it was sent; its charts
    plot against `step`."""

    def __init__(self, run_dir: Path, cfg: Config, start_step: int = 0):
        run_dir = Path(run_dir)
        self.path = run_dir / "metrics.jsonl"
        self.samples_path = run_dir / "samples.jsonl"
        self._tb: _TensorBoard | None = None
        self._wandb: _WandB | None = None
        # W&B first: its missing-package error must come before any file is touched.
        if cfg.metrics.wandb:
            self._wandb = _WandB(run_dir, cfg, start_step)
        for path in (self.path, self.samples_path):
            _drop_records_from(path, start_step)
        self._jsonl: TextIO = open(self.path, "a")
        self._samples: TextIO | None = open(self.samples_path, "a") if cfg.metrics.samples else None
        if cfg.metrics.tensorboard:
            self._tb = _TensorBoard(run_dir / "tensorboard", start_step if start_step > 0 else None)

    def write(self, record: dict) -> None:
        if "step" not in record:
            raise ValueError(f"a metrics record needs a 'step': {sorted(record)}")
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        values = _scalars(record)
        if self._tb is not None:
            self._tb.write(int(record["step"]), values)
        if self._wandb is not None:
            self._wandb.write(int(record["step"]), values)

    def write_samples(self, samples: list[dict]) -> None:
        """One step's samples (pipeline/core/samples.py): a line each in samples.jsonl;
        in TensorBoard one text per kind (samples/train, samples/val), in W&B one table per kind."""
        if self._samples is None or not samples:
            return
        self._samples.write("".join(json.dumps(s) + "\n" for s in samples))
        self._samples.flush()
        for kind in dict.fromkeys(s["kind"] for s in samples):
            of_kind = [s for s in samples if s["kind"] == kind]
            step = int(of_kind[0]["step"])
            if self._tb is not None:
                # Indented four spaces: Markdown shows it as written, whatever the text holds.
                self._tb.write_text(step, f"samples/{kind}", "\n\n".join(
                    "    " + format_sample(s).replace("\n", "\n    ") for s in of_kind))
            if self._wandb is not None:
                self._wandb.write_table(step, f"samples/{kind}", of_kind)

    def close(self) -> None:
        self._jsonl.close()
        if self._samples is not None:
            self._samples.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None


def _drop_records_from(path: Path, start_step: int) -> None:
    """A resumed run (start_step > 0) drops the killed run's records of the steps it
    runs again; samples.jsonl too where this run writes none (metrics.samples 0)."""
    if start_step == 0 or not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", -1) < start_step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


def _fmt(metrics: dict, key: str, spec: str) -> str:
    value = metrics.get(key)
    return format(value, spec) if isinstance(value, (int, float)) else "-"


class Progress:
    """The training loop's display. On a terminal: a tqdm bar with reward and
    step time. Elsewhere (`ray job logs`, a pipe, a file): one plain line per
    step, since a bar's carriage returns make a log unreadable. Disabled: silent."""

    def __init__(self, total: int, start: int = 0, enabled: bool = True, stream: TextIO | None = None):
        self.total, self.enabled = total, enabled
        self.stream = stream if stream is not None else sys.stdout
        self._bar = None
        if enabled and self.stream.isatty():
            from tqdm import tqdm
            self._bar = tqdm(total=total, initial=start, file=self.stream, unit="step",
                             dynamic_ncols=True, desc="train")

    def update(self, metrics: dict) -> None:
        if not self.enabled:
            return
        # Each set's mean@n (validation.sets), or the implicit set's val_reward.
        val = "".join(f" {k}={v:.3f}" for k, v in metrics.items()
                      if k == "val_reward" or (k.startswith("val/") and k.count("/") == 2 and "/mean@" in k))
        step = metrics.get("step")
        if isinstance(step, int) and step < 0:  # validation of the initial weights: not a step
            line = f"before training:{val or ' (no validation)'}"
            if self._bar is not None:
                self._bar.write(line, file=self.stream)
            else:
                print(line, file=self.stream, flush=True)
            return
        if self._bar is not None:
            self._bar.set_postfix_str(f"reward={_fmt(metrics, 'reward_mean', '.3f')} "
                                      f"step_time={_fmt(metrics, 'step_time_s', '.2f')}s{val}", refresh=False)
            self._bar.update(1)
            return
        # Numbered from 0 as in metrics.jsonl, TensorBoard, the timeline and every message; the count beside it.
        shown = f"{step} ({step + 1} of {self.total} done)" if isinstance(step, int) else "?"
        print(f"step {shown} reward={_fmt(metrics, 'reward_mean', '.3f')} age={_fmt(metrics, 'age_mean', '.1f')} "
              f"loss={_fmt(metrics, 'loss', '.4f')} time={_fmt(metrics, 'step_time_s', '.2f')}s{val}",
              file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class RunTotals:
    """What summary.json says of the whole run's steps, in constant memory: a
    week-long run is 100k steps, and a list per step is a slope."""

    def __init__(self) -> None:
        self.head: list[float] = []
        self.tail: deque[float] = deque(maxlen=3)
        self.steps, self.time_s, self.tokens = 0, 0.0, 0.0

    def add(self, metrics: dict) -> None:
        if len(self.head) < 3:
            self.head.append(metrics["reward_mean"])
        self.tail.append(metrics["reward_mean"])
        self.steps += 1
        self.time_s += metrics["step_time_s"]
        self.tokens += metrics.get("response_tokens", 0.0)

    def summary(self) -> dict:
        return {
            "reward_start": sum(self.head) / len(self.head) if self.head else None,
            "reward_end": sum(self.tail) / len(self.tail) if self.tail else None,
            "step_time_mean_s": self.time_s / self.steps if self.steps else None,
            # Over the steps only: worker start-up (vLLM, DeepSpeed) is not generation.
            "generated_tokens_per_s": self.tokens / self.time_s if self.steps else None,
        }
