"""Model zoo under ZeRO-Infinity (issue 44 item 5): stage 3 with `offload_param` AND
`offload_optimizer` on "nvme" against the same config with both on "cpu", 2 ranks.

Swapping moves where partitions, masters and optimizer state live between uses, never the
arithmetic, so the two runs must agree bit for bit: every loss, every clipped norm, every
`between` output, every buffer and every gathered parameter (max difference 0). The knobs
are small so the swapping really happens: `max_in_cpu` about a quarter of a rank's partition
elements (partitions are written out and read back within a step), a tiny prefetch bucket
(reads issued ahead along the trace), 3 pool buffers, and `sub_group_size` about a third of a
rank's elements (the optimizer steps several sub-groups through its files, pipelined).

One 2-rank group runs GPT-2 (accumulation 2) and a clipped token MLP in the default run, the
rest of the zoo (frozen parameters included) behind the `slow` marker (which `make test` runs).
"""

import dataclasses

import pytest
import torch

from deepspeed.runtime.zero import param_swap
from tests.unit.common import DistributedTest
from tests.zoo.harness import Case, gathered, record, recorded, run_engine
from tests.zoo.test_zoo_hierarchical import frozen_cases, gpt2_case, slow_cases, token_mlp

pytestmark = pytest.mark.zoo

WORLD = 2


def rank_elements(case: Case) -> tuple:
    """About how many parameter elements one rank's partitions hold: (all, trainable)."""
    torch.manual_seed(0)
    params = list(case.build().parameters())
    trainable = [p for p in params if p.requires_grad]
    return sum(p.numel() for p in params) // WORLD, sum(p.numel() for p in trainable) // WORLD


def offloaded(case: Case, device: str, folder) -> Case:
    """`case` with offload_param and offload_optimizer on `device` (swap files under `folder`)."""
    per_rank, trainable = rank_elements(case)  # the optimizer's masters are the trainable ones
    param, opt = {"device": device}, {"device": device}
    if device == "nvme":
        param.update(nvme_path=str(folder), buffer_count=3, max_in_cpu=per_rank // 4)
        opt.update(nvme_path=str(folder), buffer_count=6, pipeline_read=True, pipeline_write=True)
    extra = dict(case.config_extra)
    extra["zero_optimization"] = {
        **extra.get("zero_optimization", {}),
        "offload_param": param,
        "offload_optimizer": opt,
        "sub_group_size": trainable // 3 + 1,  # the same cut in both runs
        "stage3_prefetch_bucket_size": 600,
    }
    extra["zero_force_ds_cpu_optimizer"] = False  # the config's SGD steps the CPU masters
    return dataclasses.replace(case, name=f"{case.name}~{device}", config_extra=extra)


def param_swapper(model):
    found = param_swap.swappers_of([p._zero_state for p in model.parameters()])
    assert len(found) == 1
    return found[0]


def exact_diff(a: dict, b: dict) -> tuple:
    """(largest |a - b|, names that are not bitwise equal)."""
    unequal = [n for n in a if not torch.equal(a[n], b[n])]
    worst = max(((a[n].double() - b[n].double()).abs().max().item() for n in unequal), default=0.0)
    return worst, unequal


def check_nvme_parity(case: Case, folder) -> None:
    cpu, nvme = offloaded(case, "cpu", folder), offloaded(case, "nvme", folder)
    with recorded(nvme.name):
        data = case.micro_batches(WORLD)
        ref = run_engine(cpu, data)
        got = run_engine(nvme, data)
        param_diff, params = exact_diff(gathered(got.model), gathered(ref.model))
        buffer_diff, buffers = exact_diff(got.buffers, ref.buffers)
        losses = torch.tensor(got.losses, dtype=torch.float64) - torch.tensor(ref.losses, dtype=torch.float64)
        record(nvme.name, "ok", loss_abs=losses.abs().max().item(), param=param_diff, buffer=buffer_diff)
        assert got.losses == ref.losses, (nvme.name, got.losses, ref.losses)
        assert got.grad_norms == ref.grad_norms, (nvme.name, got.grad_norms, ref.grad_norms)
        assert not params and not buffers, (nvme.name, params, buffers, param_diff, buffer_diff)
        for a, b in zip(got.outputs, ref.outputs):
            assert (a is None and b is None) or torch.equal(a, b), nvme.name
        # The swapping really happened: partitions went out and came back, some read ahead,
        # and the optimizer stepped several sub-groups through its files.
        stats = param_swapper(got.model).stats
        assert stats["writes"] > 0 and stats["reads"] > 0 and stats["read_ahead"] > 0, (nvme.name, stats)
        assert len(got.engine.optimizer.swapper.groups) >= 3, nvme.name
        got.engine.destroy()
        ref.engine.destroy()


def default_cases() -> list:
    return [gpt2_case(), token_mlp("clip_accum", clip=0.05, gas=2)]


class TestZooNvme(DistributedTest):
    world_size = WORLD
    timeout_s = 300.0

    def test_gpt2_and_clipping(self, tmp_path):
        for case in default_cases():
            check_nvme_parity(case, tmp_path)

    @pytest.mark.slow
    def test_the_rest_of_the_zoo(self, tmp_path):
        rest = slow_cases() + frozen_cases()
        for case in rest:
            check_nvme_parity(case, tmp_path)
