"""vLLM's per-refit INFO lines stay out of a run's logs, its warnings and
errors do not, and vLLM's own logging setup, run again by each engine's
start, does not undo that (pipeline/core/vllm_env.py). Here on a logger tree
of the test's own, shaped as vLLM configures its own; the refit test in
tests/generator/test_vllm_generator.py watches a real engine's refit."""
from __future__ import annotations

import logging
import logging.config

import pytest

from pipeline.core import vllm_env

pytestmark = pytest.mark.unit

ROOT = "dagrl_test_vllm"  # stands for "vllm"
PER_REFIT = f"{ROOT}.v1.core.block_pool"


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.seen: list[tuple[str, str]] = []

    def emit(self, record):
        self.seen.append((record.levelname, record.getMessage()))


def configure_like_vllm() -> Records:
    """What vLLM's _configure_vllm_root_logger does at import and at each engine's start."""
    logging.config.dictConfig({"version": 1, "disable_existing_loggers": False,
                               "handlers": {"h": {"class": "logging.NullHandler"}},
                               "loggers": {ROOT: {"handlers": ["h"], "level": "INFO", "propagate": False}}})
    records = Records()
    logging.getLogger(ROOT).addHandler(records)
    return records


@pytest.fixture
def loggers(monkeypatch):
    monkeypatch.setattr(vllm_env, "PER_REFIT_LOGGERS", (PER_REFIT,))
    yield
    for name in (ROOT, PER_REFIT):
        logger = logging.getLogger(name)
        logger.handlers, logger.filters = [], []


def log_a_refit() -> None:
    logger = logging.getLogger(PER_REFIT)
    logger.info("Successfully reset prefix cache")
    logger.warning("Failed to reset prefix cache because some blocks (3) are not freed yet")
    logger.error("an error")


def test_a_refits_info_line_is_dropped_and_its_warnings_and_errors_kept(loggers):
    records = configure_like_vllm()
    vllm_env.quiet_per_refit_logs()
    vllm_env.quiet_per_refit_logs()  # once per engine: one filter
    log_a_refit()
    assert records.seen == [("WARNING", "Failed to reset prefix cache because some blocks (3) are not freed yet"),
                            ("ERROR", "an error")]
    assert len(logging.getLogger(PER_REFIT).filters) == 1


def test_vllms_logging_setup_run_again_keeps_the_info_line_out(loggers):
    configure_like_vllm()
    vllm_env.quiet_per_refit_logs()
    records = configure_like_vllm()  # an engine's start: dictConfig resets the child loggers' levels
    log_a_refit()
    assert [level for level, _ in records.seen] == ["WARNING", "ERROR"]
