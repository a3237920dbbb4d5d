"""The Comet monitor: a Comet experiment on global rank 0 (needs `comet_ml` 3.41 or later).

The experiment is started with `comet_ml.start(api_key, project, workspace, experiment_key,
mode, online)` and named `experiment_name`; each event is logged as a metric at its step, an
event name again only once `samples_log_interval` samples passed since it was last logged.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from deepspeed.monitor.base import Monitor
from deepspeed.monitor.config import CometConfig

_PIP = 'pip install "comet_ml>=3.41.0"'


def require_comet() -> None:
    """Raise an ImportError naming `comet_ml` and the pip command unless a recent one is installed."""
    if importlib.util.find_spec("comet_ml") is None:
        raise ImportError(
            "the \"comet\" monitor is enabled but the package 'comet_ml' is not installed: "
            f'{_PIP} (or set "comet": {{"enabled": false}})'
        )
    import comet_ml

    if not hasattr(comet_ml, "start"):
        raise ImportError(
            f'the "comet" monitor needs comet_ml 3.41.0 or later (comet_ml.start), found '
            f"{getattr(comet_ml, '__version__', 'an older one')}: {_PIP}"
        )


class CometMonitor(Monitor):
    """Built on global rank 0 by `MonitorMaster` when `comet.enabled` is true."""

    def __init__(self, comet_config: CometConfig) -> None:
        super().__init__(comet_config)
        require_comet()
        import comet_ml

        self.enabled = comet_config.enabled
        self.samples_log_interval = comet_config.samples_log_interval
        self._last_logged: dict = {}  # event name -> the step it was last logged at
        self.experiment: Any = None
        if self.enabled:
            self.experiment = comet_ml.start(
                api_key=comet_config.api_key,
                project=comet_config.project,
                workspace=comet_config.workspace,
                experiment_key=comet_config.experiment_key,
                mode=comet_config.mode,
                online=comet_config.online,
            )
            if comet_config.experiment_name is not None:
                self.experiment.set_name(comet_config.experiment_name)

    def _due(self, name: str, step: int) -> bool:
        last = self._last_logged.get(name)
        if last is not None and step - last < self.samples_log_interval:
            return False
        self._last_logged[name] = step
        return True

    def write_events(self, event_list: list) -> None:
        if self.experiment is None:
            return
        for name, value, step in event_list:
            if self._due(name, step):
                self.experiment.log_metric(name, value, step=step)

    def close(self) -> None:
        if self.experiment is not None:
            self.experiment.end()
            self.experiment = None
