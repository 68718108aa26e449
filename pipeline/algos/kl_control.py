"""The coefficient of the KL in the reward: fixed, or adaptive (Ziegler et al.
2019, "Fine-tuning language models from human preferences"; verl's
core_algos.AdaptiveKLController). Pure Python: the trainer actor keeps one and
writes its state beside the engine's, so a resumed run goes on with the same
coefficient."""
from __future__ import annotations

import json
from pathlib import Path

STATE_FILE = "kl_ctrl.json"


class KLController:
    """`value` is the coefficient the next batch's rewards use. Adaptive
    (target > 0): after each batch of n samples whose KL was `kl`,
        value *= 1 + clip(kl / target - 1, -0.2, 0.2) x n / horizon
    Fixed (target 0): value never changes."""

    def __init__(self, coef: float, target: float = 0.0, horizon: float = 10000.0):
        self.value, self.target, self.horizon = coef, target, horizon

    def update(self, kl: float, n_samples: int) -> None:
        if self.target <= 0:
            return
        error = min(max(kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_samples / self.horizon

    def save(self, directory: str | Path) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / STATE_FILE).write_text(json.dumps({"value": self.value}))

    def restore(self, directory: str | Path) -> None:
        """The value save() wrote in `directory`; a checkpoint without one (written
        before the reward had a KL) keeps the configured start."""
        path = Path(directory) / STATE_FILE
        if path.is_file():
            self.value = float(json.loads(path.read_text())["value"])
