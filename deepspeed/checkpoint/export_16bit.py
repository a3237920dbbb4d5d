"""The whole model in its training dtype, as one `torch.save`d state dict (`save_16bit_model`)."""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Optional

from deepspeed.checkpoint import rank_phases
from deepspeed.checkpoint.atomic_write import atomic_torch_save
from deepspeed.checkpoint.interface import CheckpointEngine
from deepspeed.runtime.zero.partition_parameters import GatheredParameters
from deepspeed.utils.logging import log_dist


def consolidated_16bit_state_dict(
    engine: CheckpointEngine, exclude_frozen_parameters: bool
) -> Optional[dict]:
    """The module's full state dict in the model dtype on rank 0 (None on other ranks).

    Every rank must call it. Parameters are gathered one module at a time, so no more than
    one module's parameters are whole at once; tied parameters share one tensor, and
    persistent buffers are included, in `module.state_dict()` order.
    """
    rank0 = engine.checkpoint_rank_and_world()[0] == 0 and engine.checkpoint_writes_files()
    out: Optional[OrderedDict] = OrderedDict() if rank0 else None
    seen: dict = {}  # id(param) -> the key it was stored under
    for prefix, module in engine.checkpoint_module().named_modules(remove_duplicate=False):
        key = (prefix + ".") if prefix else ""
        own = [
            (key + n, p)
            for n, p in module._parameters.items()
            if p is not None and (p.requires_grad or not exclude_frozen_parameters)
        ]
        fresh = [p for _, p in own if id(p) not in seen]
        gathered = GatheredParameters(fresh).start()
        try:
            for full_name, p in own:
                if id(p) in seen:
                    value = out[seen[id(p)]] if rank0 else None
                else:
                    seen[id(p)] = full_name
                    value = p.data.detach().to("cpu", copy=True) if rank0 else None
                if rank0:
                    out[full_name] = value
        finally:
            gathered.stop()
        if rank0:
            for n, buf in module._buffers.items():
                if buf is not None and n not in module._non_persistent_buffers_set:
                    out[key + n] = buf.detach().to("cpu", copy=True)
    return out


def save_16bit_model(
    engine: CheckpointEngine, save_dir: str, save_filename: str, exclude_frozen_parameters: bool
) -> bool:
    """`engine.save_16bit_model` (see its docstring): False, writing nothing, where the engine
    does not save 16-bit weights."""
    path = os.path.join(save_dir, save_filename)
    if not engine.saves_16bit_weights():
        log_dist(
            f"Did not save the model {path} because `stage3_gather_16bit_weights_on_model_save` is False",
            ranks=[0],
        )
        return False
    state_dict = consolidated_16bit_state_dict(engine, exclude_frozen_parameters)

    def write() -> None:
        if state_dict is not None:
            os.makedirs(save_dir, exist_ok=True)
            atomic_torch_save(state_dict, path)

    rank_phases.on_all_ranks("save_16bit_model", write)
    return True
