"""The estimators a validation set reports per prompt (docs/evaluation.md):
pass@k by the unbiased estimator of Chen et al. 2021, maj@k by a vote over
the answers extracted from the first k samples."""
from __future__ import annotations

import math
import re
from collections.abc import Hashable, Sequence

from pipeline.rewards.rules import extract_last_number


def pass_at_k(n: int, c: int, k: int) -> float:
    """The chance that at least one of k samples drawn without replacement from
    n, of which c are correct, is correct: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_correct(answers: Sequence[Hashable | None], correct: Sequence[bool], k: int) -> bool:
    """maj@k of one prompt: the answer most of its first k samples give wins
    (a tie goes to the answer given first), and counts as correct when the
    first sample that gave it is. Samples with no answer (None) do not vote;
    none voting is incorrect."""
    counts: dict[Hashable, int] = {}
    first: dict[Hashable, int] = {}
    for i, answer in enumerate(answers[:k]):
        if answer is not None:
            counts[answer] = counts.get(answer, 0) + 1
            first.setdefault(answer, i)
    if not counts:
        return False
    winner = max(counts, key=lambda a: (counts[a], -first[a]))
    return bool(correct[first[winner]])


_BOXED = re.compile(r"\\boxed\s*\{")


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (braces balanced), spaces removed; None without one."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return re.sub(r"\s+", "", text[start:i])
    return None


def extract_answer(text: str, vote_on: str) -> Hashable | None:
    """The answer maj@k compares (validation.sets[].vote_on); None: the sample has none."""
    if vote_on == "last_number":
        return extract_last_number(text)
    if vote_on == "boxed":
        return last_boxed(text)
    if vote_on == "text":
        return text.strip() or None
    raise ValueError(f"vote_on: unknown answer extraction {vote_on!r}")
