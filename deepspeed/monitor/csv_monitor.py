"""The CSV monitor: one file per event name under `output_path/job_name/`, as upstream lays it out.

The file of "Train/Samples/train_loss" is `Train_Samples_train_loss.csv` ("/" and spaces
become "_"); its first row is `step,<the name's last "/" part>` ("step,train_loss"), then
one `step,value` row per event. Rows are appended, so a resumed run continues its files;
the header is written when a file is new or empty (upstream writes it again each time a
process first writes a file, so a resumed run's file holds it twice).
"""

from __future__ import annotations

import csv
import os

from deepspeed.monitor.base import Monitor
from deepspeed.monitor.config import CSVConfig


def csv_file_name(event_name: str) -> str:
    """The file name upstream gives an event's CSV file."""
    return event_name.replace("/", "_").replace(" ", "_") + ".csv"


class CSVMonitor(Monitor):
    """Built on global rank 0 by `MonitorMaster` when `csv_monitor.enabled` is true."""

    def __init__(self, csv_config: CSVConfig) -> None:
        super().__init__(csv_config)
        self.enabled = csv_config.enabled
        self.output_path = csv_config.output_path
        self.job_name = csv_config.job_name
        self.log_dir = os.path.join(self.output_path, self.job_name)
        if self.enabled:
            os.makedirs(self.log_dir, exist_ok=True)

    def write_events(self, event_list: list) -> None:
        if not self.enabled:
            return
        for name, value, step in event_list:
            path = os.path.join(self.log_dir, csv_file_name(name))
            new = not os.path.exists(path) or os.path.getsize(path) == 0
            with open(path, "a", newline="") as handle:
                writer = csv.writer(handle)
                if new:
                    writer.writerow(["step", name.split("/")[-1]])
                writer.writerow([step, value])


csvMonitor = CSVMonitor  # upstream's class name
