"""Engine checkpoint methods (save/load, 16-bit export), mixed into `DeepSpeedEngine`."""


class CheckpointMixin:
    """Checkpoint methods of `DeepSpeedEngine`; they use only the engine's public state."""
