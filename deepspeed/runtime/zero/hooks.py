"""Stage-3 module hooks: gather each submodule's parameters around its forward and backward.

[Note: the engine is one more holder]
The hooks use the same refcounted `gather.fetch_states` / `release_states` as
GatheredParameters, so a live `GatheredParameters` over a parameter and the engine's hold
for the submodule running with it compose: whoever releases last frees the tensor.

[Note: how backward finds its parameters]
Forward frees a submodule's parameters as soon as it returns, but autograd needs them again
for the submodule's backward. An identity autograd function, `_BackwardCallback`, brackets
that backward: wrapped around the submodule's outputs, its backward (run when the gradients
of those outputs are ready, i.e. just before the submodule's own backward) gathers the
parameters; wrapped around the submodule's inputs, its backward (run once the gradients of
those inputs are computed, i.e. after the submodule's backward) releases them. A submodule whose inputs need no gradient (the first embedding)
never reaches the second function: `finish_backward()` releases what is left.

[Note: prefetch from a recorded trace]
The first forward/backward records the order in which submodules fetch. Later passes use
it: when submodule i fetches, the next submodules' parameters are gathered asynchronously,
up to `prefetch_bucket_size` elements ahead and `max_live_parameters` in flight or held by
the prefetcher; and when a submodule releases parameters that the trace fetches again
within `max_reuse_distance` elements (its own backward, a reused layer), the prefetcher
keeps them gathered instead. The prefetcher is a holder like any other; its holds move to the
submodule when that submodule fetches, and anything left is released at the end of each
pass, so a pass that strays from the trace costs only wasted prefetches, never a wrong value.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from deepspeed.runtime.zero import gather
from deepspeed.runtime.zero.param_state import ACCESS_HOOK, is_zero_param
from deepspeed.runtime.zero.partition_parameters import external_parameters, register_external_parameter


def _module_states(module: nn.Module) -> list:
    own = [p for p in module._parameters.values() if p is not None and is_zero_param(p)]
    return gather.zero_states(own + external_parameters(module))


def _grad_tensors(value: Any, found: list) -> None:
    """Collect, in a fixed order, the tensors that require grad inside `value`."""
    if isinstance(value, torch.Tensor):
        if value.requires_grad:
            found.append(value)
    elif isinstance(value, (tuple, list)):
        for v in value:
            _grad_tensors(v, found)
    elif isinstance(value, dict):
        for v in value.values():
            _grad_tensors(v, found)


def _replace_tensors(value: Any, replacements: list) -> Any:
    """Rebuild `value` with `_grad_tensors`' tensors replaced, in the same order."""
    if isinstance(value, torch.Tensor):
        return replacements.pop(0) if value.requires_grad else value
    if isinstance(value, tuple):
        items = [_replace_tensors(v, replacements) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list):
        return [_replace_tensors(v, replacements) for v in value]
    if isinstance(value, dict):
        for key in list(value.keys()):  # in place: keeps dict subclasses (HF ModelOutput) intact
            value[key] = _replace_tensors(value[key], replacements)
        return value
    return value


def _on_backward(value: Any, callback) -> Any:
    """Route every grad-requiring tensor in `value` through one `_BackwardCallback` (see the note)."""
    tensors: list = []
    _grad_tensors(value, tensors)
    if not tensors:
        return value
    outputs = _BackwardCallback.apply(callback, *tensors)
    outputs = list(outputs) if isinstance(outputs, tuple) else [outputs]
    return _replace_tensors(value, outputs)


class _BackwardCallback(torch.autograd.Function):
    """Identity in forward; in backward, calls `callback()` once the tensors' gradients are ready."""

    @staticmethod
    def forward(ctx, callback, *tensors):
        ctx.callback = callback
        ctx.set_materialize_grads(False)
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)


class _Prefetcher:
    """Holds parameters gathered ahead of use, following the recorded fetch trace."""

    def __init__(self, bucket_elems: int, max_live_elems: int, max_reuse_elems: int = 0) -> None:
        self.bucket_elems = bucket_elems
        self.max_live_elems = max_live_elems
        self.max_reuse_elems = max_reuse_elems
        self.trace: list = []  # per fetch, in order: the list of states fetched
        self.elems_before: list = []  # elements fetched before each trace entry (cumulative)
        self.uses: dict = {}  # ds_id -> trace positions that fetch it, ascending
        self.recording = True
        self.position = 0
        self.held: dict = {}  # ds_id -> state the prefetcher holds
        self.held_elems = 0
        self.prefetched = 0  # parameters gathered ahead of use, for tests and benchmarks

    def record_or_advance(self, states: list) -> None:
        if self.recording:
            self.trace.append(states)
            return
        ids = [s.ds_id for s in states]
        # Resync on the next trace entry that matches; a strayed pass just prefetches nothing.
        for offset in range(self.position, len(self.trace)):
            if [s.ds_id for s in self.trace[offset]] == ids:
                self.position = offset + 1
                return

    def finish_recording(self) -> None:
        self.recording = False
        total = 0
        for index, entry in enumerate(self.trace):
            self.elems_before.append(total)
            total += sum(s.numel for s in entry)
            for s in entry:
                self.uses.setdefault(s.ds_id, []).append(index)

    def keep_for_reuse(self, states: list) -> list:
        """Take holds on those of `states` fetched again within `max_reuse_elems`; return the rest.

        A submodule releasing parameters that the trace says are needed again soon (its own
        backward, a reused layer) keeps them gathered instead of re-gathering them.
        """
        if self.recording or self.max_reuse_elems <= 0:
            return states
        here = self.elems_before[self.position] if self.position < len(self.trace) else None
        free = []
        for s in states:
            later = next((i for i in self.uses.get(s.ds_id, ()) if i >= self.position), None)
            fits = self.held_elems + s.numel <= self.max_live_elems and s.ds_id not in self.held
            if (
                here is None
                or later is None
                or not fits
                or self.elems_before[later] - here > self.max_reuse_elems
            ):
                free.append(s)
                continue
            s.hold()  # already gathered: holding it is all it takes to keep it
            self.held[s.ds_id] = s
            self.held_elems += s.numel
        return free

    def hand_over(self, states: list) -> None:
        """The submodule now holds these: drop the prefetcher's holds on them."""
        mine = [s for s in states if s.ds_id in self.held]
        for s in mine:
            del self.held[s.ds_id]
            self.held_elems -= s.numel
        if mine:
            gather.release_states(mine)

    def prefetch_next(self) -> None:
        if self.recording or self.bucket_elems <= 0:
            return
        wanted, budget = [], self.bucket_elems
        for entry in self.trace[self.position :]:
            for s in entry:
                if s.ds_id in self.held or s.persist or s.numel > budget:
                    continue
                if self.held_elems + s.numel > self.max_live_elems:
                    break
                wanted.append(s)
                budget -= s.numel
                self.held[s.ds_id] = s
                self.held_elems += s.numel
            if budget <= 0:
                break
        if wanted:
            gather.fetch_states(gather.zero_states(s.param for s in wanted), async_op=True)
            self.prefetched += len(wanted)

    def end_pass(self) -> None:
        if self.held:
            gather.release_states(list(self.held.values()))
        self.held.clear()
        self.held_elems = 0
        self.position = 0


class ParameterCoordinator:
    """Installs the stage-3 hooks on every submodule of `module` and tracks the holds they take."""

    def __init__(
        self,
        module: nn.Module,
        prefetch_bucket_size: int,
        max_live_parameters: int,
        max_reuse_distance: int = 0,
    ) -> None:
        self.module = module
        self.prefetcher = _Prefetcher(
            int(prefetch_bucket_size), int(max_live_parameters), int(max_reuse_distance)
        )
        self.backward_holds: dict = {}  # id(module) -> [(module, states)] held for its backward
        self.forward_stack: list = []  # submodules whose forward is running, innermost last
        self.stray_holds: list = []  # states gathered on access with no submodule running
        self._handles: list = []
        for sub in module.modules():
            self._handles.append(sub.register_forward_pre_hook(self._pre_forward, with_kwargs=True))
            self._handles.append(sub.register_forward_hook(self._post_forward, with_kwargs=True))

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # ------------------------------------------------------------------ fetch / release

    def _fetch(self, module: nn.Module) -> list:
        states = _module_states(module)
        if not states:
            return states
        gather.fetch_states(states)  # takes this submodule's hold
        self.prefetcher.hand_over(states)
        self.prefetcher.record_or_advance(states)
        self.prefetcher.prefetch_next()
        for s in states:
            s.active_sub_modules.add(id(module))
        return states

    def _release(self, module: nn.Module, states: list) -> None:
        for s in states:
            s.active_sub_modules.discard(id(module))
        self.prefetcher.keep_for_reuse(states)  # holds what is needed again soon
        gather.release_states(states)

    # ------------------------------------------------------------------ forward

    # ------------------------------------------------------------------ use outside the owner

    def activate(self) -> None:
        """Route uses of not-gathered parameters to `_on_access` (see param_state's note)."""
        ACCESS_HOOK.hook = self._on_access

    def deactivate(self) -> None:
        ACCESS_HOOK.hook = None
        self.forward_stack.clear()
        if self.stray_holds:
            gather.release_states(self.stray_holds)
            self.stray_holds = []

    def _on_access(self, param: nn.Parameter) -> None:
        state = param._zero_state
        if not self.forward_stack:
            self.stray_holds.append(state)  # used by code outside any submodule: held for the pass
            gather.fetch_states([state])
            return
        module = self.forward_stack[-1]
        register_external_parameter(module, param)  # from now on fetched with `module`
        gather.fetch_states([state])  # released by `module`'s post-forward, with its own
        state.active_sub_modules.add(id(module))

    # ------------------------------------------------------------------ forward

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict):
        self.forward_stack.append(module)
        states = self._fetch(module)
        if not states or not torch.is_grad_enabled():
            return None
        # Runs once the gradients of the inputs exist, i.e. after the submodule's backward.
        args, kwargs = _on_backward((args, kwargs), lambda: self.exit_backward(module))
        return args, kwargs

    def _post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any):
        if self.forward_stack and self.forward_stack[-1] is module:
            self.forward_stack.pop()
        states = _module_states(module)
        if not states:
            return None
        self._release(module, states)
        if not torch.is_grad_enabled():
            return None
        # Runs when the gradients of the outputs are ready, i.e. before the submodule's backward.
        return _on_backward(output, lambda: self.enter_backward(module))

    # ------------------------------------------------------------------ backward

    def enter_backward(self, module: nn.Module) -> None:
        states = self._fetch(module)
        self.backward_holds.setdefault(id(module), []).append((module, states))

    def exit_backward(self, module: nn.Module) -> None:
        held = self.backward_holds.get(id(module))
        if not held:
            return  # its backward entry never ran (no output needed a gradient)
        _, states = held.pop()
        if not held:
            del self.backward_holds[id(module)]
        self._release(module, states)

    def finish_backward(self) -> None:
        """Release the holds of submodules whose inputs needed no gradient (see the note)."""
        for entries in self.backward_holds.values():
            for module, states in entries:
                self._release(module, states)
        self.backward_holds.clear()
        self.end_pass()

    def end_pass(self) -> None:
        if self.prefetcher.recording and self.prefetcher.trace:
            self.prefetcher.finish_recording()
        self.prefetcher.end_pass()


def persistent_states(module: nn.Module, threshold: int) -> list:
    """Parameters small enough to stay gathered (`stage3_param_persistence_threshold`)."""
    return [p._zero_state for p in module.parameters() if is_zero_param(p) and p.ds_numel < threshold]


def mark_persistent(states: list) -> None:
    """Gather once and keep: the prefetcher's hold would otherwise come and go every pass."""
    for s in states:
        s.persist = True
    gather.fetch_states(states)
    gather.release_states(states)  # the gather's own hold; persistence keeps the tensor
