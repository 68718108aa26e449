"""Reading a recipe: YAML and dotted overrides into a Config, every value
coerced and bounded, unknown keys refused (naming where a moved one went)."""
from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from pipeline.config.checks import check_cross_fields
from pipeline.config.sections import FIELD_NAMES, YAML_NAMES, Config, ConfigError


@dataclass(frozen=True)
class Removed:
    """A key of an earlier release that has no successor: why, and what to set instead."""
    instead: str


# Keys of earlier releases and where they went: a recipe that still uses one gets told.
MOVED: dict[str, str | Removed] = {
    "grpo.max_age": "schedule.max_age", "grpo.prompts_per_step": "schedule.prompts_per_step",
    "grpo.group_size": "schedule.group_size", "grpo.val_period": "validation.period",
    "grpo.val_at_start": "validation.at_start", "grpo.val_at_end": "validation.at_end",
    "grpo.clip_eps": "policy_loss.clip_eps", "grpo.kl_coef": "policy_loss.kl_coef",
    "grpo.is_clip": "policy_loss.is_clip", "reward.max_failures": "fault.max_reward_failures",
    "fault.deadline_s": "run.deadline_s", "ppo.critic_zero_stage": "training.zero_stage",
    # Three meanings of num_workers, each named for what it counts.
    "training.num_workers": "training.ranks", "ppo.critic_num_workers": "ppo.critic_ranks",
    "env.num_workers": "env.actors",
    # The simulator's fault switches: test-only, out of the user's sim section.
    "sim.fault": "inject.fault", "sim.fault_after": "inject.after", "sim.fault_worker": "inject.worker",
    "sim.fault_incarnations": "inject.incarnations",
    # The KL in the reward serves every critic-free algorithm, not REINFORCE++ alone.
    "reinforce_pp.kl_coef": "reward_kl.coef", "reinforce_pp.kl_estimator": "reward_kl.estimator",
    "reinforce_pp.kl_ctrl": "reward_kl.ctrl", "reinforce_pp.kl_target": "reward_kl.target",
    "reinforce_pp.kl_horizon": "reward_kl.horizon",
    "training.grad_accum": Removed(
        "a step already sums the gradients of all its micro-batches into one optimizer step; "
        "training.micro_batch_size or training.max_tokens_per_micro_batch set the micro-batches"),
}


def _misplaced(dotted: str, value: Any) -> str | None:
    """A top-level `reward:` that holds what data.reward takes (a spec, or a map
    of specs): data.reward dedented out of its section, not the old section."""
    specs = isinstance(value, str) or (isinstance(value, dict) and bool(value) and
                                       all(isinstance(s, str) and ":" in s for s in value.values()))
    if dotted == "reward" and specs:
        return "did you mean 'data.reward'? The reward function is a key of the data section"
    return None


def _moved(dotted: str) -> str | None:
    """Why an unknown key is unknown, if an earlier release had it."""
    if dotted in MOVED:
        new = MOVED[dotted]
        return f"{dotted!r} was removed: {new.instead}" if isinstance(new, Removed) else f"{dotted!r} is now {new!r}"
    inside = sorted(f"{old.split('.', 1)[1]} -> {new}" for old, new in MOVED.items()
                    if isinstance(new, str) and old.startswith(dotted + "."))
    if inside:
        return f"section {dotted!r} is gone; its keys moved: " + ", ".join(inside)
    return None


def _coerce(key: str, value: Any, typ: Any, meta: dict) -> Any:
    origin = typing.get_origin(typ)
    if origin is Literal:
        allowed = typing.get_args(typ)
        if value not in allowed:
            raise ConfigError(f"{key}: {value!r} is not allowed; choose one of {', '.join(map(repr, allowed))}")
        return value
    if typ is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
    elif typ is float:
        if isinstance(value, str):
            # YAML 1.1 reads "1e-4" (no dot) as a string.
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        value = float(value)
        # NaN passes every bound below (all comparisons are false), and an
        # infinite deadline or rate only fails later, inside a worker.
        if not math.isfinite(value):
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
    elif typ is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    elif typ == tuple[str, ...]:
        # An override gives "a,b"; a recipe a list.
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not items or not all(isinstance(v, str) and v.strip()
                                                                        for v in items):
            raise ConfigError(f"{key}: expected a non-empty list of names, got {value!r}")
        return tuple(v.strip() for v in items)
    elif typ == tuple[int, ...]:
        items = [v.strip() for v in value.split(",")] if isinstance(value, str) else value
        try:
            ints = tuple(int(v) for v in items if isinstance(v, (int, str)) and not isinstance(v, bool))
        except (TypeError, ValueError):
            ints = ()
        if not isinstance(items, (list, tuple)) or len(ints) != len(items) or any(v < 1 for v in ints):
            raise ConfigError(f"{key}: expected a list of positive integers, got {value!r}")
        return ints
    elif typ == str | dict:  # a reward spec, or a map of them by data_source (pipeline/rewards/specs.py)
        if isinstance(value, dict) and value and all(isinstance(k, str) and isinstance(v, str) and v.strip()
                                                     for k, v in value.items()):
            return dict(value)
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected module:function, or a mapping of data_source to module:function "
                              f"(with 'default' for the others), got {value!r}")
        return value
    elif typ is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{key}: expected a mapping of names to values, got {value!r}")
        return dict(value)
    bounds = [(meta.get("ge"), ">=", value < (meta.get("ge") or 0)),
              (meta.get("gt"), ">", value <= (meta.get("gt") or 0)),
              (meta.get("le"), "<=", value > (meta.get("le") or 0))]
    for bound, op, bad in bounds:
        if bound is not None and bad:
            raise ConfigError(f"{key}: {value!r} is out of range; it must be {op} {bound}")
    return value


def _build(cls: type, data: Any, prefix: str) -> Any:
    """The dataclass `cls` from a mapping. A ConfigError carries `.key`, the
    dotted key it is about, so load_config can blame an override or the file."""
    if not isinstance(data, dict):
        err = ConfigError(f"{prefix or 'config'}: expected a mapping of keys, got {data!r}")
        err.key = prefix
        raise err
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        key = FIELD_NAMES.get(key, key)
        try:
            if key not in fields:
                moved = _misplaced(dotted, value) or _moved(dotted)
                if moved is not None:
                    raise ConfigError(f"unknown key {dotted!r}: {moved}")
                close = difflib.get_close_matches(str(key), fields, n=1)
                hint = f"; did you mean {(f'{prefix}.' if prefix else '') + close[0]!r}?" if close else ""
                allowed = ", ".join(YAML_NAMES.get(f, f) for f in fields)
                raise ConfigError(f"unknown key {dotted!r}; allowed keys here: {allowed}{hint}")
            typ = hints[key]
            if dataclasses.is_dataclass(typ):
                kwargs[key] = _build(typ, value, dotted)
            elif _item_section(typ) is not None:
                kwargs[key] = _build_list(_item_section(typ), value, dotted)
            else:
                kwargs[key] = _coerce(dotted, value, typ, dict(fields[key].metadata))
        except ConfigError as err:
            if not hasattr(err, "key"):
                err.key = dotted
            raise
    return cls(**kwargs)


def _item_section(typ: Any) -> type | None:
    """The section a list key holds (validation.sets: ValSetConfig), or None."""
    args = typing.get_args(typ)
    if typing.get_origin(typ) is tuple and len(args) == 2 and args[1] is Ellipsis and dataclasses.is_dataclass(args[0]):
        return args[0]
    return None


def _build_list(cls: type, data: Any, prefix: str) -> tuple:
    """A list of `cls` sections; an item's errors name it as prefix[i]."""
    if not isinstance(data, list):
        err = ConfigError(f"{prefix}: expected a list of mappings, got {data!r}")
        err.key = prefix
        raise err
    return tuple(_build(cls, item, f"{prefix}[{i}]") for i, item in enumerate(data))


def _apply_override(tree: dict, override: str) -> None:
    if "=" not in override:
        raise ConfigError(f"override {override!r}: expected key=value, e.g. schedule.max_age=2")
    key, raw = override.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {key}: cannot parse value {raw!r}: {exc}") from None
    parts = key.split(".")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {key}: {part!r} is not a section")
    node[parts[-1]] = value


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """The recipe at `path` (None: defaults) with `overrides` applied. Every
    error is a ConfigError that starts with the file (and line, for YAML
    errors) or the override it comes from, and names the key."""
    tree: dict = {}
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} is not a file")
        try:
            text = p.read_bytes().decode("utf-8")
        except OSError as exc:
            raise ConfigError(f"config file {str(p)!r} cannot be read: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            line = p.read_bytes()[:exc.start].count(b"\n") + 1
            raise ConfigError(f"{p}: line {line}: not UTF-8 text") from None

        def at(mark) -> str:
            return f"line {mark.line + 1}, column {mark.column + 1}"

        def check_duplicates(node, prefix: str) -> None:
            # safe_load keeps the last of two equal keys: a second `schedule:` section
            # would silently replace the first one's settings.
            if isinstance(node, yaml.MappingNode):
                first: dict = {}
                for key_node, value_node in node.value:
                    key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
                    dotted = f"{prefix}.{key}" if prefix else str(key)
                    if key is not None and key != "<<":
                        if key in first:
                            raise ConfigError(f"{p}: {at(key_node.start_mark)}: duplicate key {dotted!r} "
                                              f"(first set at line {first[key]})")
                        first[key] = key_node.start_mark.line + 1
                    check_duplicates(value_node, dotted)
            elif isinstance(node, yaml.SequenceNode):
                for item in node.value:
                    check_duplicates(item, prefix)

        try:
            check_duplicates(yaml.compose(text, Loader=yaml.SafeLoader), "")
            loaded = yaml.safe_load(text)
        except yaml.MarkedYAMLError as exc:
            problem = exc.problem or "cannot parse"
            if exc.context:
                problem += f" ({exc.context}" + (f" at {at(exc.context_mark)})" if exc.context_mark else ")")
            where = f"{at(exc.problem_mark)}: " if exc.problem_mark else ""
            raise ConfigError(f"{p}: {where}not valid YAML: {problem}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"{p}: not valid YAML: {exc}") from None
        if loaded is None:
            raise ConfigError(f"config file {str(p)!r} is empty; a recipe sets at least one section")
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(p)!r}: the top level must be a mapping of sections, "
                              f"got a {type(loaded).__name__}")
        tree = loaded
    for override in overrides:
        _apply_override(tree, override)
    inferred = "backend" not in tree
    try:
        if inferred:
            tree["backend"] = _infer_backend(tree)
        return check_cross_fields(_build(Config, tree, ""), inferred)
    except ConfigError as exc:
        key = getattr(exc, "key", "") or ""

        def touches(override: str) -> bool:
            # An override sets this key, a key under it, or a section that holds it.
            k = override.split("=", 1)[0]
            return bool(key) and (k == key or k.startswith(key + ".") or key.startswith((k + ".", k + "[")))

        # The last override that touched the key decides its value, so blame it, not the file.
        culprit = next((o for o in reversed(overrides) if touches(o)), None)
        where = f"override {culprit!r}: " if culprit else (f"{path}: " if path is not None else "")
        raise ConfigError(f"{where}{exc}") from None


def _infer_backend(tree: dict) -> str:
    """A recipe without `backend`: real when it names a model, else sim. A sim
    run trains nothing, so a model's recipe must never fall to it by default."""
    model = tree.get("model")
    named = isinstance(model, dict) and bool(model.get("path"))
    simulated = next((section for section in ("sim", "inject") if section in tree), None)
    if named and simulated:
        err = ConfigError(f"backend: not set, but the recipe sets both model.path (a real run) and the {simulated} "
                          "section (simulated workers); set backend: real or backend: sim")
        err.key = "backend"
        raise err
    return "real" if named else "sim"
