"""Stage-3 module hooks: gather each submodule's parameters around its forward and backward.

[Note: the engine is one more holder]
The hooks use the same refcounted `gather.fetch_states` / `release_states` as
GatheredParameters, so a live `GatheredParameters` over a parameter and the engine's hold
for the submodule running with it compose: whoever releases last frees the tensor.

[Note: how backward finds its parameters]
Forward frees a submodule's parameters as soon as it returns, but autograd needs them again
for the submodule's backward. Two gradient hooks bracket that backward, and neither changes
a tensor the model sees (a custom autograd function in between would return views, which
in-place ops such as `nn.ReLU(inplace=True)` or a residual `out += identity` then refuse):
- on the submodule's outputs, a hook that fires when the first of their gradients is ready,
  i.e. just before the submodule's own backward, gathers the parameters (`enter_backward`);
- on its inputs, a hook that fires once all of their gradients are computed, i.e. after the
  submodule's backward, releases them (`exit_backward`).
Tensor hooks registered before an in-place op still fire, with the gradient of the value
before the op, which is what both brackets need. A submodule whose inputs need no gradient
(the first embedding) never reaches its second hook: `finish_backward()` releases what is
left when the backward pass ends.

[Note: holds that cannot leak]
Each submodule's forward and backward is one owner of its holds (a `_Hold`, see gather.py).
The post-forward hook is registered with `always_call=True`, so it runs, and releases, even
when the forward raises: an exception in the model, or non-reentrant activation
checkpointing, whose recomputation stops inside a forward once it has what backward needs.
The outermost forward of each pass also marks where a pass starts: a pass that ran with
grad enabled and was never followed by a backward (an eval loop, `generate` called on the
module directly) is closed there, so the prefetch trace and holds stay bounded.

[Note: frozen parameters saved by a recomputation]
Non-reentrant activation checkpointing recomputes a region's forward inside backward and keeps
what autograd saves there: a tensor that requires grad as a detached alias (its own shape and
storage, so freeing the parameter afterwards changes nothing it sees), any other tensor as
itself. A frozen parameter is such a tensor: released after the recomputed forward, it would
be empty by the time checkpoint compares it with what the first forward saved (a
`CheckpointError` on shape [0]) or the submodule's backward reads it. So when a forward ends
inside backward, its frozen parameters stay held by a `recompute` hold until that submodule's
backward is over (`exit_backward`), or the pass ends.

[Note: prefetch from a recorded trace]
The first forward/backward records the order in which submodules fetch. Later passes use
it: when submodule i fetches, the next submodules' parameters are gathered asynchronously,
up to `prefetch_bucket_size` elements ahead and `max_live_parameters` in flight or held by
the prefetcher; and when a submodule releases parameters that the trace fetches again
within `max_reuse_distance` elements (its own backward, a reused layer), the prefetcher
keeps them gathered instead. The prefetcher is a holder like any other; its holds move to the
submodule when that submodule fetches, and anything left is released at the end of each
pass, so a pass that strays from the trace costs only wasted prefetches, never a wrong value.

[Note: leaf modules are one unit]
A module marked as a ZeRO-3 leaf (`deepspeed.utils.set_z3_leaf_modules`, see
utils/z3_leaf_module.py) is fetched as a whole: its forward and backward hold every
parameter of its subtree (and the external parameters registered with any module in it),
and its descendants hold nothing of their own, so which children run (a router picking
experts) never changes which collectives a rank issues. The set of descendants is re-read at
the start of each outer forward, so a leaf marked after the engine was built counts from the
next pass. A parameter used outside its module inside a leaf is registered with the leaf.
The coordinator also counts each leaf's forward uses in a pass and tells the engine when the
backward of the last one is over (`on_leaf_backward_done`), when the leaf's gradients are
reduced as one unit (leaf_grads.py).

[Note: one engine hooks a module]
A module can be handed to `deepspeed.initialize` twice while the first engine lives: TRL's
DPO with `precompute_ref_log_probs` wraps the policy in an inference engine to score the data,
then the Trainer wraps the same model in the training engine. Two sets of hooks on one module
would each take holds and push access hooks, and unwind out of order. So the newest engine's
coordinator takes the hooks over: it removes those of any coordinator whose module lies
inside its own, and the older engine keeps working through them (its forward calls the same
module, whose hooks now belong to the new coordinator).

[Note: a gradient needs its parameter whole]
Autograd accumulates a leaf's gradient into `param.grad` shaped like the parameter: while the
parameter is partitioned (`param.data` of shape [0]) that copy fails ("The size of tensor a
(0) must match the size of tensor b ..."). The bracket above keeps a submodule's parameters
gathered through its own backward, but a gradient can also reach a parameter that no
submodule holds: a custom autograd function that gathered the weight itself in forward and
in its backward (TRL's fused LM head reads `lm_head.weight` and never calls `lm_head`), or a
parameter used outside any hooked module. So a gradient hook on every partitioned parameter
gathers one that is not available when its gradient arrives (`gather_for_gradient`), and the
engine's post-accumulate hook releases it once the gradient is taken (`release_after_gradient`).
Every rank runs the same graph, so every rank issues these gathers in the same order. For a
function handed the weight while it is partitioned (TRL's distillation loss), autograd would
refuse the full gradient before that hook runs; the engine keeps each parameter's gradient
accumulator made with the full shape (stage.py's `_FullShapeAccumulator`).

[Note: the pass phases]
The coordinator's `phase` says where it stands in a pass, and moves only in
`_begin_outer_forward`, `_end_outer_forward` and `end_pass`:
- IDLE -> FORWARD when an outer forward starts (the access hook is pushed for its length);
- FORWARD -> AWAITING_BACKWARD when it returns with grad enabled; without grad (eval,
  `no_grad` generation) the pass is closed there, back to IDLE;
- AWAITING_BACKWARD -> RECOMPUTE when an outer forward starts inside backward (activation
  checkpointing recomputing a region), and back to AWAITING_BACKWARD when it returns;
- AWAITING_BACKWARD -> FORWARD when an outer forward starts outside backward: the last pass
  had no backward of this engine, so it is closed first (see `end_pass`);
- a FORWARD that started inside a backward (another model's) returns to IDLE;
- `end_pass` (the engine's `finish_backward`, or the cases above) -> IDLE from any phase.
Each `_Hold` names the part of the pass it belongs to with a `HoldKind`.
"""

from __future__ import annotations

import bisect
import enum
import types
from typing import Any, Optional

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook

from deepspeed.runtime.zero import gather, param_swap
from deepspeed.runtime.zero.external_params import (
    external_parameters,
    named_external_parameters,
    register_external_parameter,
    unregister_external_parameter,
)
from deepspeed.runtime.zero.lifecycle import ZeroParamStatus
from deepspeed.runtime.zero.parameter import ACCESS_HOOK, is_zero_param, zero_params_in
from deepspeed.utils.z3_leaf_module import z3_leaf_module


def _ds_id(state: Any) -> int:
    return state.ds_id


def _module_states(module: nn.Module) -> list:
    own = [p for p in module._parameters.values() if p is not None and is_zero_param(p)]
    return gather.zero_states(own + external_parameters(module))


def _leaf_states(leaf: nn.Module) -> list:
    """Every ZeRO parameter of `leaf`'s subtree, and those registered as external with it."""
    params = [p for p in leaf.parameters() if is_zero_param(p)]
    for sub in leaf.modules():
        params.extend(external_parameters(sub))
    return gather.zero_states(params)


def _under_leaves(root: nn.Module) -> set:
    """ids of the modules strictly inside a leaf module's subtree (see the leaf note)."""
    inside: set = set()
    stack = [root]
    while stack:
        module = stack.pop()
        if z3_leaf_module(module):
            inside.update(id(m) for m in module.modules() if m is not module)
            continue
        stack.extend(module.children())
    return inside


def _grad_tensors(value: Any, found: list) -> list:
    """The non-leaf tensors that require grad inside `value` (tuples, lists, dict values)."""
    if isinstance(value, torch.Tensor):
        if value.requires_grad and value.grad_fn is not None:
            found.append(value)
    elif isinstance(value, (tuple, list)):
        for v in value:
            _grad_tensors(v, found)
    elif isinstance(value, dict):
        for v in value.values():
            _grad_tensors(v, found)
    return found


def _on_gradients(tensors: list, fn: Any, mode: str) -> None:
    """`register_multi_grad_hook(tensors, fn, mode=mode)`; one tensor's plain hook when there is one.

    For a single tensor "all" and "any" both mean "when its gradient is computed", which is
    what a tensor hook does, at a third of the multi-hook's cost; most submodules take and
    return one tensor, and this runs twice per submodule per pass.
    """
    if len(tensors) == 1:

        def hook(grad: torch.Tensor) -> None:  # returns None: the gradient passes unchanged
            fn([grad] if mode == "all" else grad)

        tensors[0].register_hook(hook)
    else:
        register_multi_grad_hook(tensors, fn, mode=mode)


class HoldKind(str, enum.Enum):
    """The part of a pass a `_Hold` belongs to. A `str`, so a kind reads, prints and compares
    as its value (`hold.phase == "forward"`), as the plain strings it replaced did."""

    FORWARD = "forward"  # a submodule's forward
    BACKWARD = "backward"  # a submodule's backward
    RECOMPUTE = "recompute"  # frozen parameters a forward recomputed inside backward saved
    GRADIENT = "gradient"  # a parameter a gradient reached while nothing held it

    def __str__(self) -> str:
        return self.value


class PassPhase(enum.Enum):
    """Where a `ParameterCoordinator` stands in a pass ([Note: the pass phases])."""

    IDLE = "idle"  # between passes: no forward runs and no backward is awaited
    FORWARD = "forward"  # an outer forward runs; no backward is awaited
    AWAITING_BACKWARD = "awaiting backward"  # a grad-enabled forward returned; no backward closed the pass
    RECOMPUTE = "recompute"  # a forward runs inside the awaited backward (activation checkpointing)


_FORWARD_RUNNING = (PassPhase.FORWARD, PassPhase.RECOMPUTE)


class TracePhase(enum.Enum):
    """Whether the prefetcher records the fetch order (the first pass) or replays it."""

    RECORDING = "recording"
    REPLAYING = "replaying"


class _Hold:
    """One owner of gathered parameters: a submodule's forward or its backward (see the notes)."""

    __slots__ = ("module", "phase", "states")

    def __init__(self, module: nn.Module, phase: HoldKind, states: list) -> None:
        self.module = module
        self.phase = phase
        self.states = states  # ZeroParamStates this owner holds, one hold each

    def __repr__(self) -> str:
        return f"{self.phase} of {type(self.module).__name__}"


def _by_full_buffer(states: list) -> list:
    """`states` grouped by the buffer their full tensors are views of (gather.py's `_FullBuffer`),
    in first-seen order; a state with no such buffer is a group of its own."""
    groups: dict = {}
    for s in states:
        owner = s.full_buffer
        groups.setdefault(id(s) if owner is None else id(owner), []).append(s)
    return list(groups.values())


def _full_buffer_elems(run: list) -> int:
    """Elements that keeping `run` (one group of `_by_full_buffer`) keeps in memory."""
    owner = run[0].full_buffer
    own = sum(s.numel for s in run)
    return own if owner is None else max(own, owner.buf.numel())


class _Prefetcher:
    """Holds parameters gathered ahead of use, following the recorded fetch trace."""

    def __init__(self, bucket_elems: int, max_live_elems: int, max_reuse_elems: int = 0) -> None:
        self.bucket_elems = bucket_elems
        self.max_live_elems = max_live_elems
        self.max_reuse_elems = max_reuse_elems
        self.trace: list = []  # per fetch, in order: the list of states fetched
        self.elems_before: list = []  # elements fetched before each trace entry (cumulative)
        self.uses: dict = {}  # ds_id -> trace positions that fetch it, ascending
        self.trace_phase = TracePhase.RECORDING  # until the first pass ends (finish_recording)
        self.position = 0
        # Trace entries before this one were examined by prefetch_next in this pass: each of
        # their parameters was held or gathered ahead then, so the next call starts here
        # rather than at `position` (walking the whole rest each time was quadratic in the
        # number of submodules when the bucket spans the model).
        self.scanned = 0
        self.held: dict = {}  # ds_id -> state the prefetcher holds
        self.charged: dict = {}  # ds_id -> elements it counts for in held_elems (see keep_for_reuse)
        self.held_elems = 0
        self.prefetched = 0  # parameters gathered ahead of use, for tests and benchmarks
        self.swapping = False  # NVMe: some traced partition swaps (read_ahead has work)

    def __repr__(self) -> str:
        return "prefetcher"

    @property
    def recording(self) -> bool:
        return self.trace_phase is TracePhase.RECORDING

    def record_or_advance(self, states: list) -> None:
        if self.recording:
            self.trace.append(states)
            return
        # Resync on the next trace entry that matches; a strayed pass just prefetches nothing.
        # Entries hold the same state objects pass after pass, and a state has no __eq__, so
        # list equality compares identities: the ds_ids, without building lists of them.
        for offset in range(self.position, len(self.trace)):
            if self.trace[offset] == states:
                self.position = offset + 1
                return

    def finish_recording(self) -> None:
        self.trace_phase = TracePhase.REPLAYING
        self.swapping = any(s.swapper is not None for entry in self.trace for s in entry)
        total = 0
        for index, entry in enumerate(self.trace):
            self.elems_before.append(total)
            total += sum(s.numel for s in entry)
            for s in entry:
                self.uses.setdefault(s.ds_id, []).append(index)

    def keep_for_reuse(self, states: list) -> list:
        """Take holds on those of `states` fetched again within `max_reuse_elems`; return the rest.

        A submodule releasing parameters that the trace says are needed again soon (its own
        backward, a reused layer) keeps them gathered instead of re-gathering them. Parameters
        whose full tensors share one buffer (a module's, gather.py's `_FullPool`) are kept all
        or none, and charged the buffer's size against `max_live_elems`: one kept bias would
        keep its module's whole buffer alive.
        """
        if self.recording or self.max_reuse_elems <= 0:
            return states
        if self.position >= len(self.trace):
            return states
        here = self.elems_before[self.position]
        free = []
        for run in _by_full_buffer(states):
            if not self._keep_run(run, here):
                free.extend(run)
        return free

    def _keep_run(self, run: list, here: int) -> bool:
        if any(s.ds_id in self.held for s in run):
            return False  # already the prefetcher's (gathered ahead of this use)
        charge = _full_buffer_elems(run)
        if self.held_elems + charge > self.max_live_elems:
            return False
        for s in run:
            uses = self.uses.get(s.ds_id, ())  # ascending trace positions
            after = bisect.bisect_left(uses, self.position)
            if after == len(uses) or self.elems_before[uses[after]] - here > self.max_reuse_elems:
                return False
        for s in run:
            s.hold(self)  # already gathered: holding it is all it takes to keep it
            self._take(s, s.numel)
        self._take(run[0], charge - sum(s.numel for s in run))  # the buffer's padding and slack
        return True

    def _take(self, s: Any, elems: int) -> None:
        self.held[s.ds_id] = s
        self.charged[s.ds_id] = self.charged.get(s.ds_id, 0) + elems
        self.held_elems += elems

    def hand_over(self, states: list) -> None:
        """The submodule now holds these: drop the prefetcher's holds on them."""
        mine = [s for s in states if s.ds_id in self.held]
        for s in mine:
            del self.held[s.ds_id]
            self.held_elems -= self.charged.pop(s.ds_id)
        if mine:
            gather.release_states(mine, self)

    def prefetch_next(self) -> None:
        if self.recording or self.bucket_elems <= 0:
            return
        # Parameters are taken in trace order while the bucket is not yet full, so the last
        # one may overshoot it: a parameter larger than the whole bucket (a big embedding, or
        # any layer when the bucket is small) is still gathered ahead, one at a time.
        wanted, budget, trace = [], self.bucket_elems, self.trace
        index = max(self.position, self.scanned)
        while index < len(trace):
            for s in trace[index]:
                if budget <= 0:
                    break
                if s.ds_id in self.held or s.persist:
                    continue
                if self.held_elems + s.numel > self.max_live_elems:
                    budget = 0
                    break
                wanted.append(s)
                budget -= s.numel
                self._take(s, s.numel)
            if budget <= 0:
                break  # this entry may have more to gather: the next call looks at it again
            index += 1
        self.scanned = index
        if wanted:
            wanted.sort(key=_ds_id)  # the gather's order (already so within one submodule)
            gather.fetch_states(wanted, self, async_op=True, quantized=True)
            self.prefetched += len(wanted)

    def read_ahead(self) -> None:
        """NVMe: issue reads of the partitions the trace fetches next ([Note: a swapped shard])."""
        if self.swapping:
            param_swap.read_ahead(self.trace, max(self.position, self.scanned))

    def end_pass(self) -> None:
        if self.held:
            gather.release_states(list(self.held.values()), self)
        self.held.clear()
        self.charged.clear()
        self.held_elems = 0
        self.position = 0
        self.scanned = 0


class ParameterCoordinator:
    """Installs the stage-3 hooks on every submodule of `module` and owns the holds they take."""

    def __init__(
        self,
        module: nn.Module,
        prefetch_bucket_size: int,
        max_live_parameters: int,
        max_reuse_distance: int = 0,
        on_leaf_backward_done: Optional[Any] = None,
    ) -> None:
        self.module = module
        self.phase = PassPhase.IDLE  # moves only as [Note: the pass phases] says
        self.prefetcher = _Prefetcher(
            int(prefetch_bucket_size), int(max_live_parameters), int(max_reuse_distance)
        )
        self.forward_holds: list = []  # _Holds of submodules whose forward is running, innermost last
        self.backward_holds: dict = {}  # id(module) -> [_Hold] for its backward, innermost last
        # id(module) -> [_Hold] of frozen parameters a recomputed forward saved (see the note)
        self.recompute_holds: dict = {}
        self.under_leaf: set = _under_leaves(module)  # ids of modules inside a leaf: they hold nothing
        # The engine's: called with a leaf module once the backward of its last forward use in
        # the pass is over (leaf_grads.py); id(leaf) -> forward uses whose backward is pending.
        self.on_leaf_backward_done = on_leaf_backward_done
        self.leaf_uses: dict = {}
        # id(ZeroParamState) -> the _Hold that keeps it whole while autograd accumulates a
        # gradient no submodule's backward was holding it for (see the note)
        self.gradient_holds: dict = {}
        # id(module) -> what its forward and backward hold, computed once per pass: backward
        # (and a checkpointed recomputation) reuses the forward's list. Cleared when a pass
        # starts, and per module when a parameter used outside it is registered with it.
        self._states_cache: dict = {}
        # [Note: the hooks under upstream's names]
        # Upstream's ZeRO-3 optimizer keeps its module hooks on `optimizer.parameter_offload`:
        # `module`, the `forward_hooks` / `backward_hooks` handle lists and
        # `_register_deepspeed_module(module)`. TRL's `unwrap_model_for_generation` removes the
        # handles in those lists, clears each parameter's `ds_active_sub_modules`, generates
        # with every parameter gathered, then registers the hooks again; the engine's
        # optimizer answers `parameter_offload` with this coordinator. Both lists are plain
        # attributes, which TRL sets to [] after removing the handles. Backward needs no
        # handle of its own here: its gradient hooks are set on tensors during each forward.
        self.forward_hooks: list = []
        self.backward_hooks: list = []
        self._take_over_hooks(module)
        self._register_deepspeed_module(module)

    def __repr__(self) -> str:
        return f"ParameterCoordinator({type(self.module).__name__})"

    def _take_over_hooks(self, module: nn.Module) -> None:
        """Remove the hooks of earlier coordinators of `module` or its parts (see the note)."""
        inside = {id(sub) for sub in module.modules()}
        for sub in module.modules():
            previous = sub.__dict__.get("_ds_coordinator")
            if previous is not None and previous is not self and id(previous.module) in inside:
                previous.remove_hooks()
            sub.__dict__["_ds_coordinator"] = self

    def _register_deepspeed_module(self, module: nn.Module) -> None:
        """Install the forward hooks on every submodule of `module` (see the note above), and
        give each its upstream `ds_external_parameters()` method, which TRL walks, and its
        `_external_params` table (upstream's name; code written for it reads the table)."""
        for sub in module.modules():
            sub.__dict__["ds_external_parameters"] = types.MethodType(named_external_parameters, sub)
            sub.__dict__.setdefault("_external_params", {})
            self.forward_hooks.append(sub.register_forward_pre_hook(self._pre_forward, with_kwargs=True))
            self.forward_hooks.append(
                sub.register_forward_hook(self._post_forward, with_kwargs=True, always_call=True)
            )

    # Upstream's name for the same before DeepSpeed 0.16.4, which TRL calls on older versions.
    _register_hooks_recursively = _register_deepspeed_module

    def exclude_from_compile(self) -> None:
        """Keep torch.compile out of the hooks (`engine.compile()`): they gather, release and
        count with Python state that a traced graph would freeze into guards, so they run eagerly
        and dynamo breaks its graph around them. Re-registers the forward hooks."""
        import torch.compiler

        for name in ("_pre_forward", "_post_forward", "enter_backward", "exit_backward", "_on_access"):
            setattr(self, name, torch.compiler.disable(getattr(self, name)))
        self.remove_hooks()
        self._register_deepspeed_module(self.module)

    def remove_hooks(self) -> None:
        """Remove the hooks and the submodules' references to this coordinator: they are how
        a model that outlives its engine (`destroy()`) would keep the engine, its optimizer
        and their state alive (the coordinator calls back into the engine)."""
        for handle in self.forward_hooks + self.backward_hooks:
            handle.remove()
        self.forward_hooks = []
        self.backward_hooks = []
        for sub in self.module.modules():
            if sub.__dict__.get("_ds_coordinator") is self:
                del sub.__dict__["_ds_coordinator"]

    # ------------------------------------------------------------------ fetch / release

    def _states_for(self, module: nn.Module) -> list:
        """What `module`'s forward or backward holds (see the leaf note); a new list each call.

        Persistent parameters are left out: they are gathered for good, so a hold on them
        would change nothing, and a module holding nothing else (a LayerNorm, a bias-only
        module) then skips the fetch, the release and both gradient hooks.
        """
        cached = self._states_cache.get(id(module))
        if cached is None:
            if id(module) in self.under_leaf:
                cached = []
            elif z3_leaf_module(module):
                cached = _leaf_states(module)
            else:
                cached = _module_states(module)
            cached = [s for s in cached if not s.persist]
            self._states_cache[id(module)] = cached
        return list(cached)  # a hold may append to its own list (_on_access)

    def _fetch(self, hold: _Hold) -> None:
        gather.fetch_states(hold.states, hold, quantized=True)
        self.prefetcher.hand_over(hold.states)
        self.prefetcher.record_or_advance(hold.states)
        self.prefetcher.prefetch_next()
        self.prefetcher.read_ahead()
        for s in hold.states:
            s.active_sub_modules.add(id(hold.module))

    def _release(self, hold: _Hold) -> None:
        for s in hold.states:
            s.active_sub_modules.discard(id(hold.module))
        self.prefetcher.keep_for_reuse(hold.states)  # holds what is needed again soon
        gather.release_states(hold.states, hold)

    # ------------------------------------------------------------------ forward

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict):
        if self.phase not in _FORWARD_RUNNING:
            self._begin_outer_forward()
        if id(module) not in self.under_leaf and z3_leaf_module(module) and not _in_backward():
            self.leaf_uses[id(module)] = self.leaf_uses.get(id(module), 0) + 1
        hold = _Hold(module, HoldKind.FORWARD, self._states_for(module))
        self.forward_holds.append(hold)
        if not hold.states:
            return None
        self._fetch(hold)
        if torch.is_grad_enabled():
            inputs = _grad_tensors((args, kwargs), [])
            if inputs:  # released once every input's gradient exists (see the note)
                _on_gradients(inputs, lambda grads: self.exit_backward(module), mode="all")
        return None

    def _post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any):
        hold = self._pop_forward_hold(module)
        if hold is None:
            return None  # the hooks were installed while this forward was running
        if hold.states and _in_backward():
            self._keep_frozen_for_backward(hold)
        if hold.states:
            self._hand_returned_parameters(hold, output)
            self._release(hold)
        if not self.forward_holds:
            self._end_outer_forward()
        if hold.states and output is not None and torch.is_grad_enabled():
            outputs = _grad_tensors(output, [])
            if outputs:  # gathered again before the submodule's backward (see the note)
                _on_gradients(outputs, lambda grad: self.enter_backward(module), mode="any")
        return None

    def _keep_frozen_for_backward(self, hold: _Hold) -> None:
        """A forward recomputed inside backward: its frozen parameters stay gathered (see the note)."""
        frozen = [s for s in hold.states if not s.param.requires_grad]
        if frozen:
            keep = _Hold(hold.module, HoldKind.RECOMPUTE, frozen)
            # one more hold on gathered tensors: no collective
            gather.fetch_states(frozen, keep, quantized=True)
            self.recompute_holds.setdefault(id(hold.module), []).append(keep)

    def _pop_forward_hold(self, module: nn.Module) -> Optional[_Hold]:
        """Pop `module`'s forward hold; holds above it belong to forwards that never returned."""
        for index in range(len(self.forward_holds) - 1, -1, -1):
            if self.forward_holds[index].module is module:
                for aborted in self.forward_holds[index + 1 :]:
                    if aborted.states:
                        self._release(aborted)
                hold = self.forward_holds[index]
                del self.forward_holds[index:]
                return hold
        return None

    def _begin_outer_forward(self) -> None:
        """IDLE -> FORWARD, AWAITING_BACKWARD -> RECOMPUTE or FORWARD ([Note: the pass phases])."""
        in_backward = _in_backward()
        if not in_backward:
            self.under_leaf = _under_leaves(self.module)  # leaves marked since the last pass count
            self._states_cache.clear()  # parameters registered or replaced since count too
        ACCESS_HOOK.push(self._on_access)
        if self.phase is PassPhase.AWAITING_BACKWARD and not in_backward:
            self.end_pass()  # the last pass had no backward (eval, generate): close it
        awaiting = self.phase is PassPhase.AWAITING_BACKWARD
        self.phase = PassPhase.RECOMPUTE if awaiting else PassPhase.FORWARD

    def _end_outer_forward(self) -> None:
        """FORWARD or RECOMPUTE -> AWAITING_BACKWARD or IDLE ([Note: the pass phases])."""
        ACCESS_HOOK.pop(self._on_access)
        awaiting = self.phase is PassPhase.RECOMPUTE
        self.phase = PassPhase.AWAITING_BACKWARD if awaiting else PassPhase.IDLE  # as before the forward
        if _in_backward():
            return  # a recomputation for activation checkpointing, inside the pass's backward
        if torch.is_grad_enabled():
            self.phase = PassPhase.AWAITING_BACKWARD
        else:
            self.end_pass()

    # ------------------------------------------------------------------ use outside the owner

    def _on_access(self, param: nn.Parameter) -> None:
        """A parameter used outside its module: gather it for the running submodule (see parameter.py)."""
        self._adopt(param)

    def _hand_returned_parameters(self, hold: _Hold, output: Any) -> None:
        """A forward that returns a parameter it holds (Megatron's "return bias"): the calling
        module uses it next, so it adopts the parameter before this module releases it, as it
        would at its first use; the parameter never goes empty in between.

        A parameter this module only passed on (registered with it as external, not its own)
        is from then on the caller's alone: the caller's forward and backward enclose this
        module's, so they cover it, and the parameter stays registered with exactly one
        module on the forward stack (where upstream's `_external_params` has it too)."""
        if output is None or not self.forward_holds:
            return
        held = {id(s) for s in hold.states}
        for param in zero_params_in(output, []):
            if id(param._zero_state) in held:
                self._adopt(param)
                if param.ds_id in hold.module.__dict__.get("_external_params", {}):
                    unregister_external_parameter(hold.module, param)
                    self._states_cache.pop(id(hold.module), None)

    def _adopt(self, param: nn.Parameter) -> None:
        """Register `param` with the running submodule (external from now on, so later passes
        fetch it with that module) and hold it until that submodule's forward ends."""
        state = param._zero_state
        # Inside a leaf the leaf is the unit: the use is registered with (and held by) it.
        hold = next(
            (h for h in reversed(self.forward_holds) if id(h.module) not in self.under_leaf),
            self.forward_holds[-1],
        )
        if state in hold.states:
            return  # already held by it (registered on an earlier pass)
        register_external_parameter(hold.module, param)  # from now on fetched with `hold.module`
        self._states_cache.pop(id(hold.module), None)
        gather.fetch_states([state], hold, quantized=True)
        hold.states.append(state)  # released with the submodule's own
        state.active_sub_modules.add(id(hold.module))

    # ------------------------------------------------------------------ backward

    def enter_backward(self, module: nn.Module) -> None:
        hold = _Hold(module, HoldKind.BACKWARD, self._states_for(module))
        self._fetch(hold)
        self.backward_holds.setdefault(id(module), []).append(hold)

    def exit_backward(self, module: nn.Module) -> None:
        for kept in self.recompute_holds.pop(id(module), []):
            self._release(kept)
        held = self.backward_holds.get(id(module))
        if held:
            hold = held.pop()
            if not held:
                del self.backward_holds[id(module)]
            self._release(hold)
        uses = self.leaf_uses.get(id(module))
        if uses is not None:
            if uses > 1:
                self.leaf_uses[id(module)] = uses - 1
            else:
                del self.leaf_uses[id(module)]
                if self.on_leaf_backward_done is not None:
                    self.on_leaf_backward_done(module)

    def gather_for_gradient(self, param: nn.Parameter, grad: Optional[torch.Tensor] = None) -> None:
        """A gradient for `param` is about to be accumulated: gather it if nothing holds it.
        A tensor hook on `param` (it passes `grad`, which goes on unchanged)."""
        state = param._zero_state
        if state.status is ZeroParamStatus.AVAILABLE or id(state) in self.gradient_holds:
            return  # whole already (a submodule's backward, a persistent or user-gathered one)
        hold = _Hold(self.module, HoldKind.GRADIENT, [state])
        gather.fetch_states(hold.states, hold, quantized=True)
        self.gradient_holds[id(state)] = hold

    def release_after_gradient(self, param: nn.Parameter) -> None:
        """`param.grad` was taken: drop the hold `gather_for_gradient` took, if it took one."""
        hold = self.gradient_holds.pop(id(param._zero_state), None)
        if hold is not None:
            gather.release_states(hold.states, hold)

    def finish_backward(self) -> None:
        """Release what the backward pass left held (see both notes) and close the pass."""
        self.end_pass()

    def end_pass(self) -> None:
        """Close the pass: release every hold it left, whoever ran its backward.

        Usually `finish_backward` calls it; the next outer forward does when the pass had no
        backward of this engine: an eval forward, or another model's backward that ran
        through this module (a GAN's generator loss through its discriminator), which enters
        and leaves submodules' backward without finishing this engine's.
        """
        for hold in reversed(self.forward_holds):  # forwards that never returned
            if hold.states:
                self._release(hold)
        for holds in self.backward_holds.values():  # backwards whose inputs needed no gradient
            for hold in holds:
                self._release(hold)
        self.backward_holds.clear()
        for holds in self.recompute_holds.values():  # submodules whose backward never ended
            for hold in holds:
                self._release(hold)
        self.recompute_holds.clear()
        for hold in self.gradient_holds.values():  # a gradient whose accumulation failed
            gather.release_states(hold.states, hold)
        self.gradient_holds.clear()
        self.leaf_uses.clear()
        if self.phase in _FORWARD_RUNNING:
            ACCESS_HOOK.pop(self._on_access)
        self.forward_holds.clear()
        self.phase = PassPhase.IDLE
        if self.prefetcher.recording and self.prefetcher.trace:
            self.prefetcher.finish_recording()
        self.prefetcher.end_pass()
        gather.drop_pooled_buffers()

    def pass_holds(self) -> list:
        """Forward and backward holds that are live now (none between passes)."""
        backward = [hold for holds in self.backward_holds.values() for hold in holds]
        backward += [hold for holds in self.recompute_holds.values() for hold in holds]
        backward += list(self.gradient_holds.values())
        return [hold for hold in self.forward_holds + backward if hold.states]


def _in_backward() -> bool:
    """Whether autograd is running a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


def persistent_states(module: nn.Module, threshold: int, model_threshold: Optional[int] = None) -> list:
    """Parameters small enough to stay gathered (`stage3_param_persistence_threshold`).

    They are taken in `module.parameters()` order (the same on every rank) while their total
    elements stay within `model_threshold` (`stage3_model_persistence_threshold`; None: no cap).
    """
    chosen, total = [], 0
    for p in module.parameters():
        if not is_zero_param(p) or p.ds_numel >= threshold:
            continue
        if model_threshold is not None and total + p.ds_numel > model_threshold:
            continue  # a smaller one later may still fit, as upstream counts
        chosen.append(p._zero_state)
        total += p.ds_numel
    return chosen


def mark_persistent(states: list) -> None:
    """Gather once and keep: the prefetcher's hold would otherwise come and go every pass."""
    for s in states:
        s.persist = True
    gather.fetch_states(states, mark_persistent)
    gather.release_states(states, mark_persistent)  # persistence, not a hold, keeps the tensor
