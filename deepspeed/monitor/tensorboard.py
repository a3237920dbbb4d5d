"""The TensorBoard monitor: scalars in event files under `output_path/job_name/`.

Written with `torch.utils.tensorboard.SummaryWriter` (which needs the `tensorboard`
package), one `add_scalar(name, value, step)` per event, flushed after every batch of
events so the files can be read (by TensorBoard, or `EventAccumulator`) while training runs.
"""

from __future__ import annotations

import os
from typing import Any

from deepspeed.monitor.base import Monitor, require_package
from deepspeed.monitor.config import TensorBoardConfig


class TensorBoardMonitor(Monitor):
    """Built on global rank 0 by `MonitorMaster` when `tensorboard.enabled` is true."""

    def __init__(self, tensorboard_config: TensorBoardConfig) -> None:
        super().__init__(tensorboard_config)
        require_package("tensorboard", "tensorboard", "tensorboard")
        self.enabled = tensorboard_config.enabled
        self.output_path = tensorboard_config.output_path
        self.job_name = tensorboard_config.job_name
        self.log_dir = os.path.join(self.output_path, self.job_name)
        self.summary_writer: Any = None
        if self.enabled:
            self.get_summary_writer()

    def get_summary_writer(self) -> Any:
        """The `SummaryWriter` of `output_path/job_name` (made, with the folder, on first use)."""
        if self.summary_writer is None:
            from torch.utils.tensorboard import SummaryWriter

            os.makedirs(self.log_dir, exist_ok=True)
            self.summary_writer = SummaryWriter(log_dir=self.log_dir)
        return self.summary_writer

    def write_events(self, event_list: list, flush: bool = True) -> None:
        if not self.enabled:
            return
        writer = self.get_summary_writer()
        for name, value, step in event_list:
            writer.add_scalar(name, value, step)
        if flush:
            writer.flush()

    def flush(self) -> None:
        if self.summary_writer is not None:
            self.summary_writer.flush()

    def close(self) -> None:
        if self.summary_writer is not None:
            self.summary_writer.close()
            self.summary_writer = None
