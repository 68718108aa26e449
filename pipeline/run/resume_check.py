"""What a resume may change, in one place, and the config a resume starts from.

A resume continues its checkpoint's run exactly, so each key of its config is one of:

    SAFE_TO_CHANGE     how long, how fast, where and how watched the run is: free to change
    CHECKPOINT_SHAPE   what shapes the checkpoint's parts: never (the resume could not load them)
    every other key    what the run trains on or with: refused unless --allow-change names it

The data files count by content too: each attempt digests data.train,
data.val and each validation set's data when it starts and every checkpoint it
writes records them (meta.json "inputs"), so a file edited in place since the
run read it is a change of its key (a set's file: of validation.sets, named
validation.sets[<name>].data).
"""
from __future__ import annotations

import dataclasses
import difflib
import hashlib
from pathlib import Path
from typing import Any

from pipeline.config import MOVED, YAML_NAMES, Config, ConfigError, load_config

# Prefixes: a section name covers its every key.
SAFE_TO_CHANGE = frozenset({
    "run.name", "run.output_dir",  # the run directory is --resume's argument
    "run.steps", "run.deadline_s", "run.startup_deadline_s", "run.dag_mode", "run.ray_address", "run.num_cpus",
    "run.checkpoint_every", "run.stop_grace_s",
    "validation.period", "validation.at_start", "validation.at_end",
    "generation.sync_bucket_mb",
    "env.actors", "env.worker_cpus", "env.threads", "env.step_timeout_s",
    "agent.threads", "agent.timeout_s", "agent.actors", "agent.worker_cpus",
    "sim.generate_s", "sim.train_s", "sim.refit_s", "sim.validate_s", "sim.score_s", "sim.jitter",
    "fault", "resources", "metrics", "inject",
})

# The launch schedule and the buffer, the data-parallel shards, and the trainer
# state (a LoRA checkpoint holds the adapter alone).
CHECKPOINT_SHAPE = frozenset({
    "algorithm", "backend", "schedule.max_age", "schedule.prompts_per_step", "schedule.group_size",
    "generation.num_generators", "training.ranks", "ppo.critic_ranks",
    "training.lora.rank", "training.lora.target_modules",
})

DATA_FILES = ("data.train", "data.val")

HOW_TO_RESUME = "docs/checkpoints-and-faults.md#resume"


class ResumeError(ValueError):
    """A resume refused: each change named with its old and new value."""


@dataclasses.dataclass(frozen=True)
class Change:
    """A key whose value differs from the run's; `content`: a data file edited in place."""
    key: str
    was: Any
    now: Any
    content: bool = False

    @property
    def allow_key(self) -> str:
        """The key --allow-change names to let it through: a set's file is one of validation.sets."""
        return self.key.split("[", 1)[0]

    def __str__(self) -> str:
        if self.content:
            return f"{self.key}: its file changed since the run read it (sha256 {self.was[:12]} in the run, " \
                   f"{self.now[:12] if self.now else 'no such file'} now)"
        return f"{self.key} was {self.was!r} in the run, the config says {self.now!r}"

    def record(self) -> dict:
        """For the event log and summary.json."""
        return {"key": self.key, "was": self.was, "now": self.now, "content": self.content}


def config_keys() -> list[str]:
    """Every dotted key of a recipe (env.args, a mapping, is one key)."""
    def walk(obj, prefix: str) -> list[str]:
        out = []
        for f in dataclasses.fields(obj):
            value, dotted = getattr(obj, f.name), prefix + YAML_NAMES.get(f.name, f.name)
            out += walk(value, dotted + ".") if dataclasses.is_dataclass(value) else [dotted]
        return out
    return walk(Config(), "")


def is_safe(key: str, cfg: Config) -> bool:
    if key == "run.steps" and cfg.training.lr_schedule != "constant":
        return False  # linear and cosine reach 0 at run.steps: another length changes every later step's rate
    return any(key == p or key.startswith(p + ".") for p in SAFE_TO_CHANGE)


def allowed_keys(names: list[str]) -> frozenset[str]:
    """--allow-change's keys (each argument a comma-separated list), every one a key a resume may be let change."""
    keys = config_keys()
    allowed = [k.strip() for arg in names for k in arg.split(",") if k.strip()]
    for key in allowed:
        if key not in keys:
            close = difflib.get_close_matches(key, keys, n=1)
            raise ConfigError(f"--allow-change: unknown key {key!r}" + (f"; did you mean {close[0]!r}?" if close else ""))
        if key in CHECKPOINT_SHAPE:
            raise ConfigError(f"--allow-change: {key} shapes the checkpoint, so no resume can change it; "
                              "start a new run")
    return frozenset(allowed)


def data_digests(cfg: Config) -> dict[str, dict]:
    """data.train, data.val and each validation set's data as they are now:
    {key: {"path", "sha256"}}, a set's key validation.sets[<name>].data. A
    missing file is left out: the preflight names it, not this."""
    out = {}
    paths = [(key, _get(cfg.to_dict(), key)) for key in DATA_FILES]
    paths += [(_set_key(s.name), s.data) for s in cfg.validation.sets]
    for key, path in paths:
        if path and Path(path).is_file():
            out[key] = {"path": path, "sha256": _sha256(Path(path))}
    return out


def _set_key(name: str) -> str:
    return f"validation.sets[{name}].data"


def _input_path(tree: dict, key: str):
    """The file a data_digests key names in a config tree (None: no such set now)."""
    for spec in (tree.get("validation") or {}).get("sets") or ():
        if _set_key(spec["name"]) == key:
            return spec["data"]
    return _get(tree, key)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def changes(saved: dict, saved_inputs: dict | None, cfg: Config, inputs: dict) -> list[Change]:
    """What `cfg` and the data files `inputs` (data_digests) change in the run that
    wrote a checkpoint (its meta.json's config and inputs), safe keys left out. A
    checkpoint without inputs (written before they were recorded) is compared by path."""
    now, defaults = cfg.to_dict(), Config().to_dict()
    found = []
    for key in config_keys():
        was, becomes = _saved_value(saved, defaults, key), _get(now, key)
        if was != becomes and not is_safe(key, cfg):
            found.append(Change(key, was, becomes))
    for key, then in sorted((saved_inputs or {}).items()):
        if _input_path(now, key) != then["path"]:
            continue  # listed above, by path
        digest = inputs.get(key, {}).get("sha256")
        if digest != then["sha256"]:
            found.append(Change(key, then["sha256"], digest, content=True))
    return found


def check(ckpt: Path, found: list[Change], allow: frozenset[str]) -> list[Change]:
    """The changes `allow` lets through; a ResumeError naming every other one."""
    refused = [c for c in found if c.allow_key not in allow or c.key in CHECKPOINT_SHAPE]
    if not refused:
        return found
    lines = [f"  {c}" + (" (it shapes the checkpoint: no resume can change it)" if c.key in CHECKPOINT_SHAPE else "")
             for c in refused]
    allowable = sorted({c.allow_key for c in refused if c.key not in CHECKPOINT_SHAPE})
    undo = []
    if any(not c.content for c in refused):
        undo.append(f"leave the changed keys out (--resume {ckpt.parent.parent} alone continues with the run's "
                    "own config)")
    if any(c.content for c in refused):
        undo.append("put back the data the run read")
    how = " and ".join(undo)
    if allowable:
        how += f", or let {'it' if len(allowable) == 1 else 'them'} change with --allow-change {','.join(allowable)}"
    raise ResumeError(f"cannot resume {ckpt}: the config or data change what the run trained on or with:\n"
                      + "\n".join(lines) + f"\n{how} ({HOW_TO_RESUME})")


def run_config(run_dir: str | Path, overrides: list[str]) -> Config:
    """The config a run ran with (its config.yaml) with `overrides` on top: what
    `--resume runs/X` without --config continues with."""
    path = Path(run_dir) / "config.yaml"
    if not path.parent.is_dir():
        raise ResumeError(f"--resume {run_dir}: no such run directory")
    if not path.is_file():
        raise ResumeError(f"--resume {run_dir}: it has no config.yaml; name the run's recipe with --config")
    # A fault injected into an earlier attempt is that attempt's, not the run's: "inject={}" resets the section.
    return load_config(path, ["inject={}", *overrides])


def _saved_value(saved: dict, defaults: dict, key: str):
    """A key as the checkpoint holds it: under an earlier name (config.MOVED), or
    its default if it is newer than the checkpoint."""
    value = _get(saved, key)
    for old in (old for old, new in MOVED.items() if new == key):
        value = _get(saved, old) if value is None else value
    return _get(defaults, key) if value is None else value


def _get(tree: dict, dotted: str):
    for part in dotted.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree
