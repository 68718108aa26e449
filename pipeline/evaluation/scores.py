"""A validation's numbers: each prompt's contributions to its set's sums, and
the metrics those sums give once every generator's share is added up.

Sums, not means, travel from the generators (ValOut.scores): each holds a
shard of every set, and a sum adds up the same whichever shard a prompt was
in, so the in-run eval and `python -m pipeline eval` (one engine, the whole
set) report the same numbers. A sum's key is "set<TAB>data_source<TAB>metric";
data_source "" is the whole set.

Per prompt: mean@n is the mean reward of its samples whose reward did not
fail (a prompt with none left is out of mean@n's average, as it is out of
val_reward's); pass@k and maj@k count a failed sample as incorrect.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from pipeline.config.sections import ValSetConfig
from pipeline.evaluation.estimators import extract_answer, majority_at_k, pass_at_k

SEP = "\t"


def prompt_sums(spec: ValSetConfig, data_source: str, rewards: Sequence[float], failed: Sequence[bool],
                texts: Sequence[str]) -> dict[str, float]:
    """One prompt's n samples scored: what it adds to its set's sums, for the
    whole set and (named sets only) for its data_source."""
    good = [r for r, bad in zip(rewards, failed) if not bad]
    metrics = {"prompts": 1.0, "failed": float(sum(failed)), "scored": float(bool(good)),
               f"mean@{spec.n}": sum(good) / len(good) if good else 0.0}
    correct = [not bad and r >= spec.correct_at for r, bad in zip(rewards, failed)]
    answers = [None if bad else extract_answer(t, spec.vote_on) for t, bad in zip(texts, failed)] \
        if spec.vote_on else []
    for k in spec.k:
        metrics[f"pass@{k}"] = pass_at_k(len(rewards), sum(correct), k)
        if spec.vote_on:
            metrics[f"maj@{k}"] = majority_at_k(answers, correct, k)
    sources = [""] + ([data_source] if data_source and spec.name else [])
    return {SEP.join((spec.name, source, m)): v for source in sources for m, v in metrics.items()}


def add_sums(parts: Iterable[Mapping[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for part in parts:
        for key, value in part.items():
            total[key] = total.get(key, 0.0) + value
    return total


def val_metrics(sums: Mapping[str, float]) -> dict[str, float]:
    """The metrics of a validation's sums: `val/<set>/mean@n`, `pass@k`, `maj@k`,
    `count` (prompts) and `failed` (samples whose reward failed), and the same
    under `val/<set>/<data_source>/`; the implicit set (data.val, no
    validation.sets) as val_reward and val_count."""
    groups: dict[tuple[str, str], dict[str, float]] = {}
    for key, value in sums.items():
        name, source, metric = key.split(SEP)
        groups.setdefault((name, source), {})[metric] = value
    out: dict[str, float] = {}
    for (name, source), m in groups.items():
        scored = max(m["scored"], 1.0)
        if not name:
            mean = next(v for metric, v in m.items() if metric.startswith("mean@"))
            out |= {"val_reward": mean / scored, "val_count": m["scored"]}
            continue
        prefix = "/".join(["val", name, *([source] if source else [])]) + "/"
        for metric, value in m.items():
            if metric.startswith("mean@"):
                out[prefix + metric] = value / scored
            elif metric.startswith(("pass@", "maj@")):
                out[prefix + metric] = value / m["prompts"]
        out |= {prefix + "count": m["prompts"], prefix + "failed": m["failed"]}
    return out
