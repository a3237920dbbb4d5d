"""The package logger (`deepspeed.utils.logger`) and rank-aware logging helpers."""

import logging
import os
import sys

from deepspeed import process_state

LOG_LEVEL_ENV = "DEEPSPEED_LOG_LEVEL"


def _create_logger(name: str = "DeepSpeed") -> logging.Logger:
    log = logging.getLogger(name)
    if not log.handlers:  # idempotent when the module is re-imported in tests
        handler = logging.StreamHandler(stream=sys.stdout)
        handler.setFormatter(
            logging.Formatter("[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d] %(message)s")
        )
        log.addHandler(handler)
    log.setLevel(os.environ.get(LOG_LEVEL_ENV, "WARNING").upper())
    log.propagate = False
    return log


logger = _create_logger()


def _reset_level() -> None:
    """The level the environment asks for: a client library (transformers sets the deepspeed
    logger to its own process log level) may have changed it, hiding warnings."""
    logger.setLevel(os.environ.get(LOG_LEVEL_ENV, "WARNING").upper())


process_state.register("deepspeed.utils.logging.logger (its level)", logger, _reset_level)


def _rank() -> int:
    # Read from the environment so that logging never imports the comm layer.
    return int(os.environ.get("RANK", "0"))


def log_dist(message: str, ranks=None, level: int = logging.INFO) -> None:
    """Log `message` on the given ranks only (default rank 0; `[-1]` means every rank)."""
    ranks = [0] if ranks is None else list(ranks)
    rank = _rank()
    if -1 in ranks or rank in ranks:
        logger.log(level, f"[Rank {rank}] {message}")


def print_dist(message: str, ranks=None) -> None:
    ranks = [0] if ranks is None else list(ranks)
    if -1 in ranks or _rank() in ranks:
        print(message, flush=True)
