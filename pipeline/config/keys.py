"""How a section declares a key (sections.py, distill_section.py)."""
from __future__ import annotations

from dataclasses import field
from typing import Any


def _key(default: Any, help: str, *, ge: float | None = None, gt: float | None = None,
         le: float | None = None, shown: str | None = None) -> Any:
    """A config key: its default, bounds and the one line the README's table shows
    (`shown`: the table's default, for a key whose recipe default load_config infers)."""
    return field(default=default, metadata={"ge": ge, "gt": gt, "le": le, "help": help, "shown": shown})
