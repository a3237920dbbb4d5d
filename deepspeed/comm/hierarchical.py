"""Two-hop all-gathers for groups that span nodes (MiCS's `mics_hierarchical_params_gather`).

[Note: the two-hop all-gather]
A group of `n` nodes with `p` consecutive ranks on each (group rank `i * p + j` is node `i`'s
`j`-th rank) gathers `k` elements per rank in two hops: first across nodes, among the `n` ranks
with the same `j` (each receives `n * k` elements, one slice per node, and only these bytes
cross nodes), then within the node, among its `p` ranks, which exchange what they received.
The result `[j][i]` is transposed to the group's rank order `[i][j]`. It is the same bytes in
the same places as one all-gather over the group. `deepspeed.utils.groups` builds the hop
groups and registers a plan for the group here; `comm.all_gather_into_tensor` and
`all_gather_into_columns` on that group then go through it (blocking: an async caller gets a
completed handle). The communication logger records the call once, as one all-gather of this
rank's `k` elements; `hops` counts the plan's gathers, for tests.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
import torch.distributed as _dist

from deepspeed import process_state


class TwoHopPlan:
    """How one group gathers in two hops (see the note)."""

    def __init__(self, nodes: int, per_node: int, across: Any, within: Any) -> None:
        self.nodes = nodes  # n
        self.per_node = per_node  # p
        self.across = across  # this rank's group of the n ranks with its position on their nodes
        self.within = within  # this rank's group of its node's p ranks
        self.hops = 0  # two-hop gathers done

    def all_gather(self, output: torch.Tensor, input_tensor: torch.Tensor) -> None:
        """`output` (`n * p * k` elements, rank-major) from every rank's `input_tensor` (`k`)."""
        n, p = self.nodes, self.per_node
        k = input_tensor.numel()
        flat_in = input_tensor.reshape(-1).contiguous()
        by_node = torch.empty(n * k, dtype=flat_in.dtype, device=flat_in.device)
        _dist.all_gather(list(by_node.view(n, k).unbind(0)), flat_in, group=self.across)
        by_position = torch.empty(p * n * k, dtype=flat_in.dtype, device=flat_in.device)
        _dist.all_gather(list(by_position.view(p, n * k).unbind(0)), by_node, group=self.within)
        output.view(n, p, k).copy_(by_position.view(p, n, k).transpose(0, 1))
        self.hops += 1


# Each group's plan, keyed weakly by the group (an entry lives and dies with its group).
_PLANS: weakref.WeakKeyDictionary = process_state.register(
    "deepspeed.comm.hierarchical._PLANS", weakref.WeakKeyDictionary(), lambda: _PLANS.clear()
)


def register(group: Any, plan: TwoHopPlan) -> None:
    """Gathers on `group` go through `plan` from now on."""
    _PLANS[group] = plan


def plan_for(group: Any) -> Optional[TwoHopPlan]:
    """The group's plan, or None (one all-gather). The world group has none."""
    return None if group is None or not _PLANS else _PLANS.get(group)
