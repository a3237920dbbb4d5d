"""The typed config of the monitors: `tensorboard`, `wandb`, `csv_monitor`, `comet`.

Each is a top-level block of the DeepSpeed JSON, with upstream's key names and defaults.
`monitor_config` is a block some clients write instead (LLaMA-Factory and CoLLiE:
``{"enabled": true, "tag": ..., "csv_monitor": {...}}``); the monitors inside it act as if
they were written at the top level. `resolve_monitor_config` merges the two places into the one
`DeepSpeedMonitorConfig` that `MonitorMaster` reads (`DeepSpeedConfig.monitor_config`).
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional

from pydantic import Field

from deepspeed.runtime.config_utils import DeepSpeedConfigModel, parse_section

MONITOR_KEYS = ("tensorboard", "wandb", "csv_monitor", "comet")


class TensorBoardConfig(DeepSpeedConfigModel):
    """`tensorboard`: scalars written with `torch.utils.tensorboard.SummaryWriter` (needs `tensorboard`)."""

    enabled: bool = False
    """Write the engine's events to TensorBoard event files on global rank 0."""

    output_path: str = ""
    """Folder under which the job's folder is made; "" means the current directory."""

    job_name: str = "DeepSpeedJobName"
    """The run's folder inside `output_path`: events go to `output_path/job_name/`."""


class WandbConfig(DeepSpeedConfigModel):
    """`wandb`: events logged to Weights & Biases with `wandb.log` (needs `wandb`)."""

    enabled: bool = False
    """Start a wandb run on global rank 0 and log the engine's events to it."""

    group: Optional[str] = None
    """`wandb.init(group=...)`: runs of one group are shown together."""

    team: Optional[str] = None
    """`wandb.init(entity=...)`: the team or user that owns the run; unset: wandb's default."""

    project: str = "deepspeed"
    """`wandb.init(project=...)`."""


class CSVConfig(DeepSpeedConfigModel):
    """`csv_monitor`: one CSV file per event name (no package needed)."""

    enabled: bool = False
    """Append the engine's events to CSV files on global rank 0."""

    output_path: str = ""
    """Folder under which the job's folder is made; "" means the current directory."""

    job_name: str = "DeepSpeedJobName"
    """The run's folder inside `output_path`: files go to `output_path/job_name/<event>.csv`."""


class CometConfig(DeepSpeedConfigModel):
    """`comet`: events logged to a Comet experiment (needs `comet_ml`). Unset keys fall back to
    Comet's own configuration (`.comet.config`, `COMET_*` environment variables)."""

    enabled: bool = False
    """Start a Comet experiment on global rank 0 and log the engine's events to it."""

    samples_log_interval: int = Field(100, ge=1)
    """Log an event name again only once this many samples passed since it was last logged."""

    project: Optional[str] = None
    """Comet project name."""

    workspace: Optional[str] = None
    """Comet workspace name."""

    api_key: Optional[str] = None
    """Comet API key."""

    experiment_name: Optional[str] = None
    """Name given to the experiment."""

    experiment_key: Optional[str] = None
    """Key of an existing experiment to continue (32 to 50 alphanumeric characters)."""

    online: Optional[bool] = None
    """False: keep the experiment locally (Comet's offline mode); unset: Comet's default (online)."""

    mode: Optional[str] = None
    """"get", "create" or "get_or_create" (Comet's default): how the experiment is started."""


class MonitorConfigBlock(DeepSpeedConfigModel):
    """`monitor_config`: monitors grouped in one block, as LLaMA-Factory and CoLLiE write them.

    Upstream DeepSpeed never reads this key; here each monitor inside acts as the top-level
    block of the same name would. Setting a monitor both here and at the top level with
    different values is an error naming both.
    """

    _no_effect: ClassVar[dict[str, str]] = {
        "enabled": "only the monitors inside the block switch anything on (each by its own enabled); "
        "the block's enabled is accepted as those clients write it and groups nothing else",
        "tag": "a label those clients write beside the monitors; the monitors' folders and runs are "
        "named by their own job_name, project and group",
    }

    enabled: bool = False
    """Accepted and ignored: each monitor inside is switched on by its own `enabled`."""

    tag: Optional[str] = None
    """Accepted and ignored (a client's label for the run)."""

    tensorboard: Optional[TensorBoardConfig] = None
    """As the top-level `tensorboard` block."""

    wandb: Optional[WandbConfig] = None
    """As the top-level `wandb` block."""

    csv_monitor: Optional[CSVConfig] = None
    """As the top-level `csv_monitor` block."""

    comet: Optional[CometConfig] = None
    """As the top-level `comet` block."""


class DeepSpeedMonitorConfig(DeepSpeedConfigModel):
    """Every monitor's settings, from the top level or `monitor_config` (upstream's class)."""

    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    """The TensorBoard monitor."""

    wandb: WandbConfig = Field(default_factory=WandbConfig)
    """The Weights & Biases monitor."""

    csv_monitor: CSVConfig = Field(default_factory=CSVConfig)
    """The CSV monitor."""

    comet: CometConfig = Field(default_factory=CometConfig)
    """The Comet monitor."""

    @property
    def enabled(self) -> bool:
        """Whether any monitor is switched on."""
        return any(getattr(self, key).enabled for key in MONITOR_KEYS)


def resolve_monitor_config(
    top_level: dict[str, Any], block: Optional[MonitorConfigBlock]
) -> DeepSpeedMonitorConfig:
    """One config from the top-level blocks (`{key: section or None}`) and `monitor_config`.

    A monitor given in only one place is taken from there; given in both with the same
    values, either; with different values, a ValueError names both keys.
    """
    chosen: dict[str, Any] = {}
    for key in MONITOR_KEYS:
        top = top_level.get(key)
        inner = getattr(block, key) if block is not None else None
        if top is not None and inner is not None and top != inner:
            raise ValueError(
                f"the monitor {key!r} is set twice with different values: {key}={top.model_dump()} at the "
                f"top level and monitor_config.{key}={inner.model_dump()}; keep one of the two blocks"
            )
        section = top if top is not None else inner
        if section is not None:
            chosen[key] = section
    return DeepSpeedMonitorConfig(**chosen)


def get_monitor_config(param_dict: dict) -> DeepSpeedMonitorConfig:
    """Upstream's helper: the monitors of a config dict (top-level blocks and `monitor_config`)."""
    sections = DeepSpeedMonitorConfig.model_fields
    top = {
        key: parse_section(sections[key].annotation, param_dict[key], key)
        for key in MONITOR_KEYS
        if param_dict.get(key) is not None
    }
    block = param_dict.get("monitor_config")
    parsed = parse_section(MonitorConfigBlock, block, "monitor_config") if block is not None else None
    return resolve_monitor_config(top, parsed)
