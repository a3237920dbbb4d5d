"""The `comms_logger` config section (upstream's path and names), read by `deepspeed.comm.configure`."""

from __future__ import annotations

from typing import Any, Optional

from deepspeed.runtime.config_utils import DeepSpeedConfigModel, parse_section

COMMS_LOGGER = "comms_logger"


class CommsLoggerConfig(DeepSpeedConfigModel):
    """`comms_logger`: time and record the collectives of `deepspeed.comm`
    ([Note: the communication logger] in deepspeed/utils/comms_logging.py)."""

    enabled: bool = False
    """Time and record collectives; off, each collective pays one attribute check."""

    verbose: bool = False
    """Log one line per recorded collective as it completes (rank 0)."""

    prof_all: bool = True
    """Record every collective; false: only those whose log name is in `prof_ops` (or called with prof=True)."""

    prof_ops: list[str] = []
    """Log names to record while `prof_all` is false (a collective's log name is its own name unless
    the call passes `log_name=`), e.g. ["all_gather_into_tensor", "reduce_scatter_tensor"]."""

    debug: bool = False
    """Add the calling function to each record's name: "all_reduce | [Caller Func: step]"."""


class DeepSpeedCommsConfig:
    """Upstream's `DeepSpeedConfig.comms_config`: whether the config has a `comms_logger` block,
    and the block."""

    def __init__(self, present: bool, section: CommsLoggerConfig) -> None:
        self.comms_logger_enabled = present  # upstream's name for "the config has the block"
        self.comms_logger = section

    def __repr__(self) -> str:
        return f"DeepSpeedCommsConfig(comms_logger_enabled={self.comms_logger_enabled}, comms_logger={self.comms_logger!r})"


def comms_logger_section(config: Any) -> Optional[CommsLoggerConfig]:
    """The `comms_logger` section of `config` (a `DeepSpeedConfig`, or a config dict); None when it has none."""
    comms = getattr(config, "comms_config", None)
    if isinstance(comms, DeepSpeedCommsConfig):
        return comms.comms_logger if comms.comms_logger_enabled else None
    if not isinstance(config, dict):
        raise TypeError(
            f"deepspeed.comm.configure: deepspeed_config is a {type(config).__name__}; pass a DeepSpeedConfig "
            "(an engine's config) or a config dict"
        )
    if config.get(COMMS_LOGGER) is None:
        return None
    return parse_section(CommsLoggerConfig, config[COMMS_LOGGER], prefix=COMMS_LOGGER)
