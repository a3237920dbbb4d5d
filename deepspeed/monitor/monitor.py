"""`MonitorMaster`: the monitors the config switches on, written together (upstream's module).

An event is upstream's tuple `(name, value, step)`; see base.py. `Monitor` is importable from
here under upstream's path.
"""

from __future__ import annotations

from typing import Optional

from deepspeed.monitor.base import Monitor, checked_events, global_rank, require_package
from deepspeed.monitor.comet import CometMonitor, require_comet
from deepspeed.monitor.config import DeepSpeedMonitorConfig
from deepspeed.monitor.csv_monitor import CSVMonitor
from deepspeed.monitor.tensorboard import TensorBoardMonitor
from deepspeed.monitor.wandb import WandbMonitor

__all__ = ["Monitor", "MonitorMaster"]


class MonitorMaster(Monitor):
    """Every monitor the config switches on (`DeepSpeedConfig.monitor_config`), written together.

    `enabled` is the same on every rank: whether any monitor is on. The monitors themselves
    are built on global rank 0 only (a TensorBoard folder, the CSV folder, a wandb run, a
    Comet experiment); every rank checks first that their packages are installed, so a
    missing one raises everywhere rather than on rank 0 alone while the others wait.
    """

    tb_monitor: Optional[Monitor]
    wandb_monitor: Optional[Monitor]
    csv_monitor: Optional[Monitor]
    comet_monitor: Optional[Monitor]

    def __init__(self, monitor_config: Optional[DeepSpeedMonitorConfig] = None) -> None:
        monitor_config = monitor_config if monitor_config is not None else DeepSpeedMonitorConfig()
        super().__init__(monitor_config)
        self.enabled = monitor_config.enabled
        self.is_writer = self.enabled and global_rank() == 0  # this rank writes the events
        if monitor_config.tensorboard.enabled:
            require_package("tensorboard", "tensorboard", "tensorboard")
        if monitor_config.wandb.enabled:
            require_package("wandb", "wandb", "wandb")
        if monitor_config.comet.enabled:
            require_comet()
        self.tb_monitor = self.wandb_monitor = self.csv_monitor = self.comet_monitor = None
        if self.is_writer:
            self._build(monitor_config)

    def _build(self, config: DeepSpeedMonitorConfig) -> None:
        # Upstream's order: TensorBoard, wandb, CSV, Comet.
        if config.tensorboard.enabled:
            self.tb_monitor = TensorBoardMonitor(config.tensorboard)
        if config.wandb.enabled:
            self.wandb_monitor = WandbMonitor(config.wandb)
        if config.csv_monitor.enabled:
            self.csv_monitor = CSVMonitor(config.csv_monitor)
        if config.comet.enabled:
            self.comet_monitor = CometMonitor(config.comet)

    def monitors(self) -> list:
        """The monitors built on this rank (none off rank 0)."""
        built = (self.tb_monitor, self.wandb_monitor, self.csv_monitor, self.comet_monitor)
        return [monitor for monitor in built if monitor is not None]

    def write_events(self, event_list: list) -> None:
        """Write `[(name, value, step), ...]` to every enabled monitor; nothing off global rank 0."""
        if not self.is_writer:
            return
        events = checked_events(event_list)
        for monitor in self.monitors():
            monitor.write_events(events)

    def close(self) -> None:
        """Flush and close every monitor (the wandb run is finished, the Comet experiment ended)."""
        for monitor in self.monitors():
            monitor.close()
