"""Top-1 / top-2 gating with expert capacity and the load-balancing loss (GShard, Switch).

[Note: the routing]
For `S` tokens and `E` experts the gate's softmax gives each token a distribution `g[s, e]`.
- top-1: each token goes to its most likely expert; top-2: also to its best other expert
  (picked from Gumbel-perturbed logits when `top2_2nd_expert_sampling`, training only).
- capacity: an expert takes at most `C = max(ceil(k * S / E * capacity_factor), min_capacity)`
  tokens (`k` = 1 or 2); with `drop_tokens=False`, `C` is the largest expert load (as
  upstream: the configured capacity is not consulted), so none is dropped. Tokens over
  capacity are dropped (their output is zero): the first `C` in token order (upstream's tie
  order among them is torch.topk's, unspecified), or, with `use_rts` (random token
  selection, training only), a random `C`. Top-2 places second choices after every first choice.
- load-balancing loss: `l_aux = E * sum_e mean_s(g[s, e]) * fraction of tokens whose first
  choice is e`, which is 1 for a perfectly balanced router.
- combine weights: top-1 uses the chosen gate value; top-2 the two gate values renormalized
  to sum to 1. Returned: combine weights `[S, E, C]`, the dispatch mask, `l_aux`, and the
  number of tokens each expert was chosen for (before dropping), int64 as upstream's.

`ep_group`: upstream's expert-parallel group; only None (or a group of one rank) here.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from deepspeed import comm as dist

_NOISY_POLICIES = (None, "None", "Jitter", "RSample")


def capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int) -> int:
    return max(int(math.ceil(num_tokens / num_experts * capacity_factor)), int(min_capacity))


def _gumbel_like(t: torch.Tensor) -> torch.Tensor:
    uniform = torch.rand_like(t).clamp_(1e-9, 1.0 - 1e-9)
    return -torch.log(-torch.log(uniform))


def _keep_within_capacity(mask: torch.Tensor, cap: int, use_rts: bool) -> torch.Tensor:
    """Zero the entries of `mask` [S, E] beyond `cap` per expert (token order, or random)."""
    if use_rts:
        scores = mask * torch.rand_like(mask)
        k = min(cap, mask.shape[0])
        top = torch.topk(scores, k=k, dim=0).indices
        keep = torch.zeros_like(mask).scatter_(0, top, 1.0)
        return mask * keep
    positions = torch.cumsum(mask, dim=0) - 1
    return mask * (positions < cap)


def _one_hot_positions(mask: torch.Tensor, offset: Optional[torch.Tensor], cap: int) -> torch.Tensor:
    """[S, C]: each kept token's slot in its expert's buffer."""
    positions = torch.cumsum(mask, dim=0) - 1
    if offset is not None:
        positions = positions + offset
    slot = (positions * mask).sum(dim=1).long()
    return F.one_hot(slot.clamp(max=cap - 1), num_classes=cap).to(mask.dtype)


def _no_expert_parallelism(ep_group) -> None:
    if ep_group is not None and dist.get_world_size(ep_group) > 1:
        raise ValueError(
            "MoE gating: an ep_group of more than one rank (expert parallelism) is not supported here; "
            "pass ep_group=None (ep_size=1)"
        )


def _largest_load(exp_counts: torch.Tensor) -> int:
    return max(int(exp_counts.max().item()), 1)  # drop_tokens=False: room for every routed token


def _aux_loss(gates: torch.Tensor, first_mask: torch.Tensor) -> torch.Tensor:
    num_experts = gates.shape[1]
    return num_experts * torch.sum(gates.mean(dim=0) * first_mask.float().mean(dim=0))


def top1gating(
    logits: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    used_token: Optional[torch.Tensor] = None,
    noisy_gate_policy: Optional[str] = None,
    drop_tokens: bool = True,
    use_rts: bool = True,
    ep_group=None,
) -> tuple:
    """Route each token to one expert (see the note). Returns (l_aux, combine, dispatch, exp_counts)."""
    _no_expert_parallelism(ep_group)
    gates = F.softmax(logits, dim=1)
    chooser = logits + _gumbel_like(logits) if noisy_gate_policy == "RSample" else gates
    num_experts = gates.shape[1]
    mask1 = F.one_hot(torch.argmax(chooser, dim=1), num_classes=num_experts).to(gates.dtype)
    if used_token is not None:
        mask1 = mask1 * used_token.reshape(-1, 1).to(mask1.dtype)
    exp_counts = mask1.sum(dim=0).detach().to("cpu", torch.int64)
    cap = capacity(gates.shape[0], num_experts, capacity_factor, min_capacity)
    if not drop_tokens:
        cap = min(_largest_load(exp_counts), gates.shape[0])
    l_aux = _aux_loss(gates, mask1)
    mask1 = _keep_within_capacity(mask1, cap, use_rts)
    slots1 = _one_hot_positions(mask1, None, cap)
    gate1 = (gates * mask1).sum(dim=1)
    combine = gate1[:, None, None] * mask1[:, :, None] * slots1[:, None, :]
    return l_aux, combine, combine.bool(), exp_counts


def top2gating(
    logits: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    ep_group=None,
    top2_2nd_expert_sampling: bool = True,
) -> tuple:
    """Route each token to two experts (see the note). Returns (l_aux, combine, dispatch, exp_counts)."""
    _no_expert_parallelism(ep_group)
    gates = F.softmax(logits, dim=1)
    num_experts = gates.shape[1]
    mask1 = F.one_hot(torch.argmax(gates, dim=1), num_classes=num_experts).to(gates.dtype)
    second_logits = logits + _gumbel_like(logits) if top2_2nd_expert_sampling else logits
    second_logits = second_logits.masked_fill(mask1.bool(), float("-inf"))
    mask2 = F.one_hot(torch.argmax(second_logits, dim=1), num_classes=num_experts).to(gates.dtype)
    exp_counts = (mask1 + mask2).sum(dim=0).detach().to("cpu", torch.int64)
    cap = capacity(gates.shape[0], num_experts, 2 * capacity_factor, min_capacity)
    if not drop_tokens:
        cap = _largest_load(exp_counts)
    l_aux = _aux_loss(gates, mask1)
    first_per_expert = mask1.sum(dim=0, keepdim=True)
    positions2 = torch.cumsum(mask2, dim=0) - 1 + first_per_expert
    mask1 = mask1 * ((torch.cumsum(mask1, dim=0) - 1) < cap)
    mask2 = mask2 * (positions2 < cap)
    slots1 = _one_hot_positions(mask1, None, cap)
    slots2 = _one_hot_positions(mask2, first_per_expert, cap)
    gate1 = (gates * mask1).sum(dim=1)
    gate2 = (gates * mask2).sum(dim=1)
    denom = (gate1 + gate2).clamp(min=torch.finfo(gates.dtype).eps)
    gate1, gate2 = gate1 / denom, gate2 / denom
    combine = gate1[:, None, None] * mask1[:, :, None] * slots1[:, None, :]
    combine = combine + gate2[:, None, None] * mask2[:, :, None] * slots2[:, None, :]
    return l_aux, combine, combine.bool(), exp_counts


class TopKGate(torch.nn.Module):
    """The router: a bias-free linear map to expert logits (in fp32), then top-1 or top-2 gating."""

    def __init__(
        self,
        model_dim: int,
        num_experts: int,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 8,
        noisy_gate_policy: Optional[str] = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        top2_2nd_expert_sampling: bool = True,
    ) -> None:
        super().__init__()
        if k not in (1, 2):
            raise ValueError(f"MoE gating: k={k} is not supported; use k=1 or k=2")
        if noisy_gate_policy not in _NOISY_POLICIES:
            raise ValueError(
                f"MoE gating: noisy_gate_policy={noisy_gate_policy!r}; use one of {_NOISY_POLICIES}"
            )
        self.wg = torch.nn.Linear(model_dim, num_experts, bias=False).float()
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = None if noisy_gate_policy == "None" else noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling

    def forward(self, tokens: torch.Tensor, used_token: Optional[torch.Tensor] = None) -> tuple:
        # Random token selection and second-expert sampling are training's: eval routes
        # deterministically (upstream keeps drawing in eval, so its eval outputs vary by seed).
        x = tokens.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            x = x * torch.empty_like(x).uniform_(1.0 - 1e-2, 1.0 + 1e-2)
        logits = F.linear(x, self.wg.weight.float())
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            policy = self.noisy_gate_policy if self.training else None
            return top1gating(
                logits,
                factor,
                self.min_capacity,
                used_token,
                policy,
                self.drop_tokens,
                self.use_rts and self.training,
            )
        return top2gating(
            logits,
            factor,
            self.min_capacity,
            self.drop_tokens,
            top2_2nd_expert_sampling=self.top2_2nd_expert_sampling and self.training,
        )
