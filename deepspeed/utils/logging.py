"""The package logger (`deepspeed.utils.logger`) and rank-aware logging helpers."""

import logging
import os
import sys
import types

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
    logger to its own process log level) or a config's `log_level` may have changed it."""
    logger.setLevel(os.environ.get(LOG_LEVEL_ENV, "WARNING").upper())
    for handler in logger.handlers:  # set_log_level_from_string (a config's log_level) sets these too
        handler.setLevel(logging.NOTSET)


process_state.register("deepspeed.utils.logging.logger (its level)", logger, _reset_level)


LOG_LEVELS = types.MappingProxyType(
    {
        "debug": logging.DEBUG,
        "info": logging.INFO,
        "warning": logging.WARNING,
        "error": logging.ERROR,
        "critical": logging.CRITICAL,
    }
)


def get_log_level_from_string(log_level_str: str) -> int:
    """The `logging` level named by `log_level_str` ("debug" ... "critical", any case)."""
    level = LOG_LEVELS.get(str(log_level_str).lower())
    if level is None:
        raise ValueError(f"log level {log_level_str!r} is not one of {sorted(LOG_LEVELS)}")
    return level


def set_log_level_from_string(log_level_str: str, custom_logger: logging.Logger = None) -> None:
    """Set `custom_logger` (default: the package logger) and its handlers to the named level;
    the config's `log_level` does this at initialize."""
    target = logger if custom_logger is None else custom_logger
    level = get_log_level_from_string(log_level_str)
    target.setLevel(level)
    for handler in target.handlers:
        handler.setLevel(level)


def should_log_le(max_log_level_str: str) -> bool:
    """Whether the package logger's level is at or below the named one (what it would show)."""
    return logger.getEffectiveLevel() <= get_log_level_from_string(max_log_level_str)


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
