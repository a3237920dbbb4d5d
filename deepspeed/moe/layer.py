"""`deepspeed.moe.layer.MoE`: a mixture-of-experts layer over local experts (`ep_size=1`).

`forward(hidden_states)` returns `(output, l_aux, exp_counts)`, as upstream: the output has
the input's shape, `l_aux` is the load-balancing loss to add (scaled) to the model's loss,
and `exp_counts` how many tokens chose each expert. Routing is described in
sharded_moe.py's note. Every expert runs on every forward (on its possibly empty slot
buffer), so all ranks gather the same parameters in the same order under ZeRO-3.

Expert parallelism (`ep_size > 1`: experts spread over ranks, tokens exchanged with
all-to-all) is not implemented; it raises, naming `ep_size`, as do `use_tutel=True` and
`enable_expert_tensor_parallelism=True`.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import nn

from deepspeed.moe.sharded_moe import TopKGate


class Experts(nn.Module):
    """`num_local_experts` independent copies of `expert`."""

    def __init__(
        self, expert: nn.Module, num_local_experts: int = 1, expert_group_name: Optional[str] = None
    ):
        super().__init__()
        self.deepspeed_experts = nn.ModuleList([copy.deepcopy(expert) for _ in range(num_local_experts)])
        self.num_local_experts = num_local_experts
        for module in self.deepspeed_experts:
            for param in module.parameters():
                param.allreduce = False  # upstream's marks: an expert parameter, and its group
                param.group_name = expert_group_name

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """`inputs` [E, C, M] -> [E, C, M'], expert e on row e."""
        outputs = []
        for expert, chunk in zip(self.deepspeed_experts, inputs.unbind(dim=0)):
            out = expert(chunk)
            outputs.append(out[0] if isinstance(out, tuple) else out)  # Megatron-style (output, bias)
        return torch.stack(outputs, dim=0)


class MOELayer(nn.Module):
    """Gate, dispatch tokens to expert slots, run the experts, combine their outputs."""

    def __init__(self, gate: TopKGate, experts: Experts, num_local_experts: int) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.num_local_experts = num_local_experts
        self.l_aux: Optional[torch.Tensor] = None
        self.exp_counts: Optional[torch.Tensor] = None

    def forward(self, hidden_states: torch.Tensor, used_token: Optional[torch.Tensor] = None) -> torch.Tensor:
        model_dim = hidden_states.shape[-1]
        tokens = hidden_states.reshape(-1, model_dim)
        l_aux, combine, dispatch, exp_counts = self.gate(tokens, used_token)
        dispatched = torch.einsum("sec,sm->ecm", dispatch.to(tokens.dtype), tokens)
        expert_out = self.experts(dispatched)
        combined = torch.einsum("sec,ecm->sm", combine.to(expert_out.dtype), expert_out)
        self.l_aux, self.exp_counts = l_aux, exp_counts
        return combined.reshape(hidden_states.shape[:-1] + combined.shape[-1:])


class MoE(nn.Module):
    """Upstream's MoE layer; see the module docstring for what is supported."""

    def __init__(
        self,
        hidden_size: int,
        expert: nn.Module,
        num_experts: int = 1,
        ep_size: int = 1,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        use_residual: bool = False,
        noisy_gate_policy: Optional[str] = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        use_tutel: bool = False,
        enable_expert_tensor_parallelism: bool = False,
        top2_2nd_expert_sampling: bool = True,
    ) -> None:
        super().__init__()
        if ep_size != 1:
            raise ValueError(
                f"MoE: ep_size={ep_size} (expert parallelism) is not supported here; use ep_size=1 (every rank "
                "holds all experts, ZeRO partitions them)"
            )
        if use_tutel:
            raise ValueError("MoE: use_tutel=True is not supported (no Tutel kernels); pass use_tutel=False")
        if enable_expert_tensor_parallelism:
            raise ValueError(
                "MoE: enable_expert_tensor_parallelism=True is not supported (no tensor parallelism); pass False"
            )
        if num_experts < 1:
            raise ValueError(f"MoE: num_experts={num_experts} must be >= 1")
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        self.ep_size = ep_size
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        gate = TopKGate(
            hidden_size,
            num_experts,
            k,
            capacity_factor,
            eval_capacity_factor,
            min_capacity,
            noisy_gate_policy,
            drop_tokens,
            use_rts,
            top2_2nd_expert_sampling,
        )
        self.deepspeed_moe = MOELayer(gate, experts, self.num_local_experts)
        if use_residual:
            self.mlp = expert  # the module given, as upstream (the experts are its copies)
            self.coefficient = nn.Linear(hidden_size, 2)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Upstream creates expert-parallel groups here; with ep_size=1 there are none to make."""

    def forward(self, hidden_states: torch.Tensor, used_token: Optional[torch.Tensor] = None) -> tuple:
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            residual = self.mlp(hidden_states)
            if isinstance(residual, tuple):
                residual = residual[0]
            coef = torch.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + residual * coef[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts
