"""accelerate's sequence-parallel path on our package (issue 42): 2 CPU ranks, sp=2.

`Accelerator(parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=2))` calls
`UlyssesSPAttentionHF.register_with_transformers`, passes its mpu to `deepspeed.initialize`
and wraps the prepared loader in `UlyssesSPDataLoaderAdapter`. A tiny Llama trains on
sequences of 15 tokens (padded to 16) with the token-weighted loss of
docs/sequence_parallel.md, and its losses and final parameters match the same global batches
trained without sequence parallelism (tests/unit/test_sequence_parallel.py's reference).
"""

import pytest
import torch

from tests.clients import helpers
from tests.unit.common import DistributedTest
from tests.unit.test_sequence_parallel import (
    LOSS_RTOL,
    LR,
    MICRO,
    PARAM_ATOL,
    rank_batches,
    reference_run,
    sp_loss,
    tiny_llama,
)

pytestmark = pytest.mark.clients

LENGTH = 15


def make_accelerator():
    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.utils import DeepSpeedSequenceParallelConfig, InitProcessGroupKwargs, ParallelismConfig

    helpers.reset_clients()
    ds_config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    handler = DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="sdpa")
    return Accelerator(
        deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config),
        parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=2, sp_handler=handler),
        kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")],
    )


class TestAccelerateUlysses(DistributedTest):
    world_size = 2

    def test_sp2_trains_as_without_sequence_parallelism(self):
        import deepspeed
        import deepspeed.comm as dist
        from deepspeed.utils import groups

        accelerator = make_accelerator()
        world = dist.get_world_size()
        data = rank_batches(world, LENGTH)
        # accelerate gives rank r the global batches r, r + world, ...: lay them out so that
        # rank r's i-th batch is data[r][i]
        samples = [
            {"input_ids": batch["input_ids"][j], "labels": batch["labels"][j]}
            for i in range(len(data[0]))
            for r in range(world)
            for batch in [data[r][i]]
            for j in range(MICRO)
        ]
        loader = torch.utils.data.DataLoader(samples, batch_size=MICRO)
        with helpers.plain_construction():
            reference = tiny_llama("sdpa", 2)
            model = tiny_llama("sdpa", 2)
        engine, loader = accelerator.prepare(model, loader)
        assert type(loader).__name__ == "UlyssesSPDataLoaderAdapter" and len(loader) == 2 * len(data[0])
        assert engine.module.config._attn_implementation == "ulysses_sp_sdpa"
        assert engine.sequence_parallel_size == 2 and engine.dp_world_size == world
        sp_group = groups._get_sequence_parallel_group()
        losses = []
        for batch in loader:
            assert batch["input_ids"].shape == (MICRO, 8)
            logits = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
            loss = sp_loss(engine.module, logits, batch["shift_labels"], sp_group)
            accelerator.backward(loss)  # engine.backward and engine.step
            losses.append(loss.item())
        ref_losses, ref_params = reference_run(reference, data, 2)
        expected = torch.tensor([step[0] for step in ref_losses])
        loss_rel = ((torch.tensor(losses) - expected).abs() / expected.abs()).max().item()
        assert loss_rel <= LOSS_RTOL, f"losses {losses} vs {expected.tolist()}"
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            got = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        param_diff = max((got[n] - ref_params[n]).abs().max().item() for n in ref_params)
        assert param_diff <= PARAM_ATOL, f"final parameters differ by {param_diff:.3g}"
        if dist.get_rank() == 0:
            print(
                f"[sp parity] accelerate sp=2: max loss rel diff {loss_rel:.3g}, max param diff {param_diff:.3g}"
            )
