"""docs/configuration.md's table of every key, read off the dataclasses in
pipeline/config/ so that the documentation cannot drift from the loader
(tests/config/test_config.py compares the page's copy with it). The test-only
`inject` section (fault injection for the recovery tests) is left out."""
from __future__ import annotations

import dataclasses
import typing
from typing import Literal

from pipeline.config import YAML_NAMES, Config


def reference_table() -> str:
    """Every key as a Markdown table row (README "Configuration"), read off the
    dataclasses above, so the documentation cannot drift from the loader."""
    rows = ["| key | default | allowed | meaning |", "|---|---|---|---|"]

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            typ, dotted = hints[f.name], prefix + YAML_NAMES.get(f.name, f.name)
            if f.metadata.get("test_only"):
                continue
            if dataclasses.is_dataclass(typ):
                walk(typ, dotted + ".")
                continue
            item = typing.get_args(typ)[0] if typing.get_origin(typ) is tuple else None
            if dataclasses.is_dataclass(item):
                rows.append(f"| `{dotted}` | `[]` | list of sets | {f.metadata['help']} |")
                walk(item, dotted + "[].")
                continue
            meta = f.metadata
            if typing.get_origin(typ) is Literal:
                allowed = " / ".join(repr(a) for a in typing.get_args(typ))
            elif typ == tuple[str, ...]:
                allowed = "list of names"
            elif typ == tuple[int, ...]:
                allowed = "list of int >= 1"
            elif typ == str | dict:
                allowed = "str or mapping"
            else:
                bounds = [f"{op} {meta[k]:g}" for k, op in (("ge", ">="), ("gt", ">"), ("le", "<="))
                          if meta.get(k) is not None]
                allowed = f"{typ.__name__} " + ", ".join(bounds) if bounds else typ.__name__
            value = f.default_factory() if f.default is dataclasses.MISSING else f.default
            default = "true" if value is True else "false" if value is False else repr(value)
            if isinstance(value, tuple):
                default = "[" + ", ".join(map(str, value)) + "]"
            if meta.get("shown"):
                default = meta["shown"]
            rows.append(f"| `{dotted}` | `{default}` | {allowed.strip()} | {meta['help']} |")
    walk(Config, "")
    return "\n".join(rows) + "\n"
