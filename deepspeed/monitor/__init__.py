"""`deepspeed.monitor`: training events written to TensorBoard, Weights & Biases, CSV files and Comet.

`MonitorMaster(config.monitor_config)` (monitor.py) holds the monitors the config switches on
and writes `(name, value, step)` events to each of them on global rank 0. The engine builds
one as `engine.monitor` and writes its own events through `engine_events.py`; a client adds
its own with `engine.monitor.write_events([...])`. The typed config is `config.py`; each
monitor is its own module, importing its package (tensorboard, wandb, comet_ml) only when
switched on. docs/config.md lists the keys.
"""
