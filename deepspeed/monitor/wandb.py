"""The Weights & Biases monitor: a wandb run on global rank 0, one `wandb.log` per event.

`wandb.init(project=project, group=group, entity=team)` starts the run when the monitor is
built; each event is logged as `wandb.log({name: value}, step=step)`. wandb's own settings
apply (`WANDB_MODE=offline`, `WANDB_DIR`, `WANDB_API_KEY`, ...). wandb keeps a run's steps
increasing: an event whose step is below the run's current step is dropped by wandb, with
its warning.
"""

from __future__ import annotations

from typing import Any, Optional

from deepspeed.monitor.base import Monitor, require_package
from deepspeed.monitor.config import WandbConfig


class WandbMonitor(Monitor):
    """Built on global rank 0 by `MonitorMaster` when `wandb.enabled` is true."""

    def __init__(self, wandb_config: WandbConfig) -> None:
        super().__init__(wandb_config)
        require_package("wandb", "wandb", "wandb")
        import wandb

        self.enabled = wandb_config.enabled
        self.group = wandb_config.group
        self.team = wandb_config.team
        self.project = wandb_config.project
        self.run: Any = None
        if self.enabled:
            self.run = wandb.init(project=self.project, group=self.group, entity=self.team)

    def log(self, data: dict, step: Optional[int] = None, commit: Optional[bool] = None) -> None:
        """`wandb.log` on the run (upstream's method)."""
        if self.enabled and self.run is not None:
            self.run.log(data, step=step, commit=commit)

    def write_events(self, event_list: list) -> None:
        for name, value, step in event_list:
            self.log({name: value}, step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
