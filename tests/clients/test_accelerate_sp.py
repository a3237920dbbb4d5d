"""accelerate's sequence-parallel path on our package (issue 42): 2 CPU ranks, sp=2.

`Accelerator(parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=2))` calls
`UlyssesSPAttentionHF.register_with_transformers`, passes its mpu to `deepspeed.initialize`
and wraps the prepared loader in `UlyssesSPDataLoaderAdapter`. A tiny Llama trains on
sequences of 15 tokens (padded to 16) with the token-weighted loss of
docs/sequence_parallel.md, and its losses and final parameters match the same global batches
trained without sequence parallelism (tests/unit/test_sequence_parallel.py's reference).
Then the same with a config of the shape of LLaMA-Factory's ALST config (ZeRO-3, CPU offload,
bf16 "auto", which is off on CPU, the communication logger and monitor_config blocks), whose
logger records Ulysses' all-to-alls and whose CSV monitor records the losses.
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


PLAIN_CONFIG = {
    "train_micro_batch_size_per_gpu": MICRO,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
    "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}


def alst_shaped_config(csv_dir: str) -> dict:
    """The shape of LLaMA-Factory's ds_z3_alst_config.json (our own dict; the file exists only on
    pull-request branches, see tests/fixtures/shipped_configs/SOURCES.md): ZeRO-3 with optimizer
    and parameters offloaded to the CPU, bf16 "auto", "auto" batch sizes, and the
    `comms_logger`, `comms_config` and `monitor_config` blocks. It has no sequence-parallel
    key: accelerate's ParallelismConfig brings sp. Two changes for this test: an SGD optimizer
    block (the file leaves the optimizer to HF Trainer), so that it compares with the
    reference, and the CSV monitor on, so that its file can be read back. bf16 "auto" resolves
    to off here: accelerate's mixed precision is "no" on CPU."""
    return {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": "auto"},
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "offload_param": {"device": "cpu", "pin_memory": True},
            "overlap_comm": False,
            "contiguous_gradients": True,
            "sub_group_size": 1e9,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": 0,
            "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "steps_per_print": 10000000,
        "comms_logger": {"enabled": True, "verbose": False, "prof_all": True, "debug": False},
        "comms_config": {"verbose": False},
        "monitor_config": {
            "enabled": True,
            "tag": "DeepSpeedMonitor",
            "csv_monitor": {"enabled": True, "output_path": csv_dir, "job_name": "alst"},
        },
    }


def make_accelerator(ds_config: dict = PLAIN_CONFIG, **plugin):
    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.utils import DeepSpeedSequenceParallelConfig, InitProcessGroupKwargs, ParallelismConfig

    helpers.reset_clients()
    handler = DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="sdpa")
    return Accelerator(
        deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config, **plugin),
        parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=2, sp_handler=handler),
        kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")],
    )


class TestAccelerateUlysses(DistributedTest):
    world_size = 2

    def test_sp2_trains_as_without_sequence_parallelism(self, tmp_path):
        import deepspeed.comm as dist

        train_and_compare(make_accelerator(), "accelerate sp=2")
        # LLaMA-Factory's ALST config's shape, bf16 off on CPU: the same parity, and its
        # communication logger and CSV monitor record the run.
        csv_dir = str(tmp_path / "csv")
        # gradient_clipping "auto" takes the plugin's value, as HF Trainer fills it with
        # max_grad_norm: 0 (off), as in the reference.
        accelerator = make_accelerator(alst_shaped_config(csv_dir), gradient_clipping=0.0)
        dist.comms_logger.reset()
        engine, losses = train_and_compare(accelerator, "accelerate sp=2, LLaMA-Factory ALST-shaped config")
        assert engine.zero_optimization_stage() == 3 and not engine.bfloat16_enabled()
        assert engine.train_batch_size() == MICRO  # "auto": micro x accumulation x world / sp
        # Ulysses' all-to-alls are logged: per step and layer q, k, v and the output forward,
        # as many backward, and one for the token-weighted loss's backward.
        record = dist.comms_logger.comms_dict.get("all_to_all_single") or {}
        layers = engine.module.config.num_hidden_layers
        assert sum(entry[0] for entry in record.values()) == len(losses) * (8 * layers + 1), record
        if dist.get_rank() == 0:  # the CSV monitor logged the losses the run saw
            lines = (tmp_path / "csv" / "alst" / "Train_Samples_train_loss.csv").read_text().split()
            assert lines[0] == "step,train_loss", lines
            logged = [float(line.split(",")[1]) for line in lines[1:]]
            torch.testing.assert_close(logged, losses, rtol=1e-6, atol=0)


def train_and_compare(accelerator, case: str) -> tuple:
    """Train a tiny Llama on 2 ranks at sp=2 through `accelerator`; losses and final parameters
    match the same global batches without sequence parallelism."""
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.utils import groups

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
    assert loss_rel <= LOSS_RTOL, f"{case}: losses {losses} vs {expected.tolist()}"
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        got = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    param_diff = max((got[n] - ref_params[n]).abs().max().item() for n in ref_params)
    assert param_diff <= PARAM_ATOL, f"{case}: final parameters differ by {param_diff:.3g}"
    if dist.get_rank() == 0:
        print(f"[sp parity] {case}: max loss rel diff {loss_rel:.3g}, max param diff {param_diff:.3g}")
    return engine, losses
