"""The gradients of a leaf module are reduced as one unit, zero-filled, in parameter order.

[Note: a leaf's gradients are one unit]
A leaf module (a mixture-of-experts block, see utils/z3_leaf_module.py) runs only the
children its router picks, so in one step rank 0 may produce gradients for experts 1 and 3
and rank 1 for experts 2 and 3. Reducing each gradient as autograd produces it would put
different tensors into each rank's buckets: a mismatched collective, or one expert's
gradient summed with another's. So the gradients of a leaf's trainable parameters wait in
`param.grad` until the leaf's backward is over, and are then reduced together, in parameter
order, with a zero gradient for each parameter this rank did not use: every rank issues the
same reductions. The leaf's backward is over at stage 3 when the coordinator says so (the
backward of its last forward use in the pass has finished, `leaf_backward_done`), so only
one leaf's full gradients wait at a time; otherwise at the end of backward (`flush`): at
stage 2, and for a leaf whose inputs needed no gradient. Stages 0-1 reduce every gradient
at the boundary in parameter order anyway; there the leaves' parameters are zero-filled
(`fill`). The same holds whatever the stage, so a leaf-marked MoE trains at stages 1-3.

A zero gradient must not train a parameter that no rank used: plain PyTorch leaves it
without a gradient, and its optimizer skips it (no momentum step, no weight decay). So each
rank records which of these parameters got a real gradient since the last step; the step's
norm all-reduce carries those flags (`presence`), and a parameter no rank used has its
master's gradient dropped before the optimizer steps (optimizer.py, `_global_norm_of_scaled_grads`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from deepspeed.utils.z3_leaf_module import z3_leaf_module


class _Unit:
    __slots__ = ("module", "states", "reduced")

    def __init__(self, module: nn.Module, states: list) -> None:
        self.module = module
        self.states = states  # trainable states of the leaf's subtree, in parameter order
        self.reduced = False  # in the current backward


def _outer_leaves(root: nn.Module) -> list:
    """Leaf modules of `root` not inside another leaf, in `modules()` order."""
    found, stack = [], [root]
    while stack:
        module = stack.pop()
        if z3_leaf_module(module):
            found.append(module)
            continue
        stack.extend(reversed(list(module.children())))
    return found


class LeafGradients:
    """The engine's leaf units (see the note); `state_of(param)` gives a parameter's shard
    state and `trained(state)` whether the optimizer holds a master for it."""

    def __init__(self, module: nn.Module, state_of: Callable, trained: Callable) -> None:
        self.module = module
        self.state_of = state_of
        self.trained = trained
        self.units: list = []
        self._unit_of: dict = {}  # id(param) -> its unit
        self._by_module: dict = {}  # id(leaf module) -> its unit
        self.ids: list = []  # ds_ids of every unit's states, in order: the same list on every rank
        self.present: set = set()  # ds_ids that got a real gradient on this rank since the last step

    def refresh(self) -> None:
        """Re-read the leaves (a backward starts): leaves marked since the last one count."""
        self.units, self._unit_of, self._by_module, ids = [], {}, {}, []
        seen: set = set()
        for leaf in _outer_leaves(self.module):
            states = []
            for param in leaf.parameters():
                state = self.state_of(param) if param.requires_grad else None
                if state is None or not self.trained(state) or state.ds_id in seen:
                    continue
                seen.add(state.ds_id)
                states.append(state)
            if states:
                unit = _Unit(leaf, states)
                self.units.append(unit)
                self._by_module[id(leaf)] = unit
                for state in states:
                    self._unit_of[id(state.param)] = unit
                ids.extend(state.ds_id for state in states)
        self.ids = ids

    def waits(self, param: nn.Parameter) -> bool:
        """Whether `param`'s gradient waits for its unit (stages 2-3, inside a backward)."""
        unit = self._unit_of.get(id(param))
        return unit is not None and not unit.reduced

    def leaf_backward_done(self, module: nn.Module, reducer: Any) -> None:
        unit = self._by_module.get(id(module))
        if unit is not None and not unit.reduced:
            self._reduce(unit, reducer)

    def flush(self, reducer: Any) -> None:
        """The end of a backward: reduce the units whose backward end was not seen, and reset."""
        for unit in self.units:
            if not unit.reduced:
                self._reduce(unit, reducer)
            unit.reduced = False

    def _reduce(self, unit: _Unit, reducer: Any) -> None:
        unit.reduced = True
        for state in unit.states:
            grad, state.param.grad = state.param.grad, None
            reducer.add(state, self._real_or_zero(state, grad))

    def fill(self, state: Any, grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Stages 0-1 at the boundary: `grad`, or a zero gradient for a unit's parameter without one."""
        if id(state.param) not in self._unit_of:
            return grad
        return self._real_or_zero(state, grad)

    def _real_or_zero(self, state: Any, grad: Optional[torch.Tensor]) -> torch.Tensor:
        if grad is not None:
            self.present.add(state.ds_id)
            return grad
        return torch.zeros(state.shape, dtype=state.param.dtype, device=state.param.device)

    def presence(self) -> list:
        """1.0 for each unit parameter (in `ids` order) that got a real gradient here, else 0.0."""
        return [1.0 if ds_id in self.present else 0.0 for ds_id in self.ids]

    def unused(self, totals: list) -> list:
        """ds_ids whose presence, summed over ranks, is zero: no rank used them."""
        return [ds_id for ds_id, total in zip(self.ids, totals) if total == 0.0]
