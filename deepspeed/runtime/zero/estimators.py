"""Memory estimates for model states (parameters, gradients, optimizer states) per GPU and CPU.

Upstream 0.19's formulas, in bytes, for `P` total parameters, `L` parameters of the
largest layer (module), `G = num_gpus_per_node * num_nodes` GPUs, `N = num_nodes` and a host
buffer factor `b` (default 1.5); CPU figures are per node. Mixed precision with Adam: 2 bytes
per 16-bit parameter and gradient, 16 bytes per fp32 master + momentum + variance (+2 more
when ZeRO-3 offloads parameters too).

ZeRO-2 (`estimate_zero2_*`):
- offload_optimizer=cpu: GPU `2P`; CPU `P * max(4G, 16) * b`
- offload_optimizer=none: GPU `2P + 18P/G` (16-bit parameters, and per GPU its share of
  16-bit and fp32 gradients, fp32 masters and Adam state); CPU `4P * num_gpus_per_node * b`

ZeRO-3 (`estimate_zero3_*`), with the largest layer gathered in fp32-sized room `4L`; with
offload, each node's CPU holds its nodes' share (`/ N`):
- offload_param=cpu, offload_optimizer=cpu: GPU `4L`;
  CPU `18P/N * b` with zero_init, else `P * max(4 * num_gpus_per_node, 18/N) * b`
- offload_param=none, offload_optimizer=cpu: GPU `4L + 2P/G`;
  CPU `16P/N * b` with zero_init, else `P * max(4 * num_gpus_per_node, 16/N) * b`
- offload_param=none, offload_optimizer=none: GPU `4L + 18P/G`;
  CPU `4L * num_gpus_per_node * b` with zero_init, else `4P * num_gpus_per_node * b`

The `*_all_live` functions take a model (partitioned or not) and count it; the `*_all_cold`
ones take the counts. Both print a table, as upstream, and return its rows.
"""

from __future__ import annotations

from torch import nn

_GB = 2**30


def model_to_params(model: nn.Module) -> tuple:
    """`(total parameters, parameters of the largest module)`, counting partitioned ones whole."""

    def count(params) -> int:
        return sum(getattr(p, "ds_numel", p.numel()) for p in params)

    total = count(model.parameters())
    largest = max((count(m.parameters(recurse=False)) for m in model.modules()), default=0)
    return total, largest


def _check_counts(num_gpus_per_node: int, num_nodes: int, additional_buffer_factor: float) -> None:
    if num_gpus_per_node < 1 or num_nodes < 1:
        raise ValueError(f"num_gpus_per_node={num_gpus_per_node} and num_nodes={num_nodes} must both be >= 1")
    if additional_buffer_factor < 1.0:
        raise ValueError(f"additional_buffer_factor={additional_buffer_factor} must be >= 1.0")


# ============================================================================ ZeRO-2


def estimate_zero2_model_states_mem_needs(
    total_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    additional_buffer_factor: float = 1.5,
) -> tuple:
    """`(cpu_bytes, gpu_bytes)` per the module docstring's ZeRO-2 formulas."""
    _check_counts(num_gpus_per_node, num_nodes, additional_buffer_factor)
    gpus = num_gpus_per_node * num_nodes
    if cpu_offload:
        gpu_mem = 2 * total_params
        cpu_mem = total_params * max(4 * gpus, 16) * additional_buffer_factor
    else:
        gpu_mem = 2 * total_params + int(18 * total_params / gpus)
        cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem)


def estimate_zero2_model_states_mem_needs_all_cold(
    total_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1, additional_buffer_factor: float = 1.5
) -> list:
    """Print and return the ZeRO-2 estimates for both offload choices."""
    rows = []
    for offload in (True, False):
        cpu, gpu = estimate_zero2_model_states_mem_needs(
            total_params, num_gpus_per_node, num_nodes, offload, additional_buffer_factor
        )
        rows.append({"offload_optimizer": "cpu" if offload else "none", "cpu_mem": cpu, "gpu_mem": gpu})
    _print_table(rows, num_gpus_per_node, num_nodes, f"Model with {_millions(total_params)} total params.")
    return rows


def estimate_zero2_model_states_mem_needs_all_live(
    model: nn.Module, num_gpus_per_node: int = 1, num_nodes: int = 1, additional_buffer_factor: float = 1.5
) -> list:
    """Count `model` and print and return the ZeRO-2 estimates."""
    total, _ = model_to_params(model)
    return estimate_zero2_model_states_mem_needs_all_cold(
        total, num_gpus_per_node, num_nodes, additional_buffer_factor
    )


# ============================================================================ ZeRO-3


def estimate_zero3_model_states_mem_needs(
    total_params: int,
    largest_layer_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    cpu_offload_params: bool = True,
    zero_init: bool = True,
    additional_buffer_factor: float = 1.5,
) -> tuple:
    """`(cpu_bytes, gpu_bytes, largest_layer_bytes)` per the module docstring's ZeRO-3 formulas."""
    _check_counts(num_gpus_per_node, num_nodes, additional_buffer_factor)
    gpus = num_gpus_per_node * num_nodes
    largest_layer_memory = 4 * largest_layer_params
    per_node = num_gpus_per_node
    node_share = 1 / num_nodes  # offloaded state: each node's CPU holds its ranks' part
    if cpu_offload and cpu_offload_params:
        gpu_mem = largest_layer_memory
        factor = 18 * node_share if zero_init else max(4 * per_node, 18 * node_share)
        cpu_mem = total_params * factor * additional_buffer_factor
    elif cpu_offload:
        gpu_mem = largest_layer_memory + int(2 * total_params / gpus)
        factor = 16 * node_share if zero_init else max(4 * per_node, 16 * node_share)
        cpu_mem = total_params * factor * additional_buffer_factor
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / gpus)
        counted = largest_layer_params if zero_init else total_params
        cpu_mem = counted * 4 * per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem), largest_layer_memory


def estimate_zero3_model_states_mem_needs_all_cold(
    total_params: int,
    largest_layer_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    additional_buffer_factor: float = 1.5,
) -> list:
    """Print and return the ZeRO-3 estimates for every offload and zero_init choice."""
    rows = []
    for offload_param, offload_optimizer in (("cpu", "cpu"), ("none", "cpu"), ("none", "none")):
        for zero_init in (True, False):
            cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
                total_params,
                largest_layer_params,
                num_gpus_per_node,
                num_nodes,
                cpu_offload=offload_optimizer == "cpu",
                cpu_offload_params=offload_param == "cpu",
                zero_init=zero_init,
                additional_buffer_factor=additional_buffer_factor,
            )
            rows.append(
                {
                    "offload_param": offload_param,
                    "offload_optimizer": offload_optimizer,
                    "zero_init": int(zero_init),
                    "cpu_mem": cpu,
                    "gpu_mem": gpu,
                }
            )
    model = f"Model with {_millions(total_params)} total params, {_millions(largest_layer_params)} largest layer params."
    _print_table(rows, num_gpus_per_node, num_nodes, model)
    return rows


def estimate_zero3_model_states_mem_needs_all_live(
    model: nn.Module, num_gpus_per_node: int = 1, num_nodes: int = 1, additional_buffer_factor: float = 1.5
) -> list:
    """Count `model` and print and return the ZeRO-3 estimates."""
    total, largest = model_to_params(model)
    return estimate_zero3_model_states_mem_needs_all_cold(
        total, largest, num_gpus_per_node, num_nodes, additional_buffer_factor
    )


# ============================================================================ printing


def _millions(count: int) -> str:
    return f"{round(count / 1e6)}M"


def _print_table(rows: list, num_gpus_per_node: int, num_nodes: int, model_line: str) -> None:
    nodes = "node" if num_nodes == 1 else "nodes"
    gpus = "GPU" if num_gpus_per_node == 1 else "GPUs"
    lines = [
        "Estimated memory needed for params, optim states and gradients for a:",
        f"HW: Setup with {num_nodes} {nodes}, {num_gpus_per_node} {gpus} per node.",
        f"SW: {model_line}",
        "  per CPU  |  per GPU |   Options",
    ]
    for row in rows:
        options = ", ".join(f"{k}={v}" for k, v in row.items() if k not in ("cpu_mem", "gpu_mem"))
        lines.append(f"  {row['cpu_mem'] / _GB:6.2f}GB | {row['gpu_mem'] / _GB:6.2f}GB | {options}")
    print("\n".join(lines))
