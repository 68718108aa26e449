"""Optimizer steps an engine skipped for a non-finite loss or gradient norm
(pipeline/trainer/finite.py), counted in a row by the trainer and critic actors.

A skipped step leaves the weights as they were, so a run goes on past one; but
a run whose every step is skipped trains nothing while it looks alive, so
fault.max_nonfinite_steps in a row stop it with an error.
"""
from __future__ import annotations

import math
import sys


class NonfiniteStepsError(RuntimeError):
    """fault.max_nonfinite_steps optimizer steps in a row were skipped; the message says why."""


def _json(x: float):
    # The event log is JSON, which has no NaN or inf: those go in as their names.
    return x if math.isfinite(x) else str(x)


def what_was_nonfinite(loss: float, grad_norm: float) -> str:
    bad = [f"{name} {value}" for name, value in (("loss", loss), ("gradient norm", grad_norm))
           if not math.isfinite(value)]
    return " and ".join(bad) or "a gradient on another rank"


class SkippedSteps:
    """One actor's count of skipped steps in a row. `who`: its name in messages
    (the policy, the critic); `loss_key`: its engine's loss metric."""

    def __init__(self, log, who: str, limit: int, loss_key: str = "loss"):
        self.log, self.who, self.limit, self.loss_key = log, who, limit, loss_key
        self.in_a_row = 0

    def check(self, step: int, version: int | None, metrics: dict[str, float]) -> None:
        """After an update: log a skipped one (event nonfinite_skip, a warning on
        stderr) and raise NonfiniteStepsError at the limit; a step taken resets the count."""
        if not metrics.get("nonfinite_skipped"):
            self.in_a_row = 0
            return
        self.in_a_row += 1
        loss, grad_norm = metrics.get(self.loss_key, math.nan), metrics.get("grad_norm", math.nan)
        what = what_was_nonfinite(loss, grad_norm)
        self.log.emit("nonfinite_skip", step=step, version=version, who=self.who, loss=_json(loss),
                      grad_norm=_json(grad_norm), in_a_row=self.in_a_row, limit=self.limit)
        print(f"dagrl: warning: step {step}: the {self.who}'s {what}: optimizer step skipped, weights "
              f"unchanged ({self.in_a_row} in a row of fault.max_nonfinite_steps {self.limit})",
              file=sys.stderr, flush=True)
        if self.in_a_row >= self.limit:
            raise NonfiniteStepsError(
                f"the {self.who} skipped {self.in_a_row} optimizer steps in a row for a non-finite loss or "
                f"gradient norm (step {step}: {what}), fault.max_nonfinite_steps is {self.limit}: nothing is "
                "being trained. Look for NaN or inf in the rewards, advantages or inputs of these steps, or "
                "lower the learning rate; --resume picks the last complete checkpoint")


def console_warnings(step: int, metrics: dict[str, float], limit: int) -> list[str]:
    """The driver's lines for a step's skipped updates (the policy's; PPO's critic/ metrics too)."""
    lines = []
    for who, prefix, loss_key in (("policy", "", "loss"), ("critic", "critic/", "value_loss")):
        if metrics.get(prefix + "nonfinite_skipped"):
            what = what_was_nonfinite(metrics.get(prefix + loss_key, math.nan),
                                      metrics.get(prefix + "grad_norm", math.nan))
            lines.append(f"dagrl: warning: step {step}: the {who}'s {what}: optimizer step skipped, weights "
                         f"unchanged (fault.max_nonfinite_steps {limit} in a row stop the run)")
    return lines
