"""HF Trainer's sequence-parallel path on our package (issue 42): 2 CPU ranks, sp=2, ZeRO-3.

`TrainingArguments(parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=2))`:
the Trainer prepares the model through accelerate (which calls
`register_with_transformers` and passes the mpu to `deepspeed.initialize`), wraps its loader
in `UlyssesSPDataLoaderAdapter` and computes the loss with transformers'
`deepspeed_sp_compute_loss` (token-weighted over the sp group). With sequential sampling the
batches are known, and the logged losses and final parameters match the same batches trained
without sequence parallelism (tests/unit/test_sequence_parallel.py's reference).
"""

import pytest

from tests.clients import helpers
from tests.clients.test_hf_trainer import configure_state
from tests.unit.common import DistributedTest
from tests.unit.test_sequence_parallel import (
    LOSS_RTOL,
    LR,
    MICRO,
    PARAM_ATOL,
    rank_batches,
    reference_run,
    tiny_llama,
)

pytestmark = pytest.mark.clients

LENGTH = 15


class TestHFTrainerUlysses(DistributedTest):
    world_size = 2
    timeout_s = 240

    def test_sp2_trains_as_without_sequence_parallelism(self, tmp_path):
        from accelerate.utils import DeepSpeedSequenceParallelConfig, ParallelismConfig
        from transformers import Trainer, TrainingArguments

        import deepspeed.comm as dist

        configure_state()
        world = dist.get_world_size()
        data = rank_batches(world, LENGTH)
        steps = 2 * len(data[0])  # every rank's batches, each trained by the sp group in turn
        # sequential sampling, batch-wise sharding: rank r's i-th batch is global batch i * world + r
        samples = [
            {"input_ids": data[r][i]["input_ids"][j], "labels": data[r][i]["labels"][j]}
            for i in range(len(data[0]))
            for r in range(world)
            for j in range(MICRO)
        ]
        ds_config = {
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto",
            "gradient_clipping": "auto",
            "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        }
        handler = DeepSpeedSequenceParallelConfig(
            sp_seq_length_is_variable=True, sp_attn_implementation="sdpa"
        )
        args = TrainingArguments(
            output_dir=str(tmp_path / "run"),
            per_device_train_batch_size=MICRO,
            gradient_accumulation_steps=1,
            max_steps=steps,
            learning_rate=LR,
            lr_scheduler_type="constant",
            max_grad_norm=0.0,
            weight_decay=0.0,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            train_sampling_strategy="sequential",
            disable_tqdm=True,
            deepspeed=ds_config,
            parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=2, sp_handler=handler),
            accelerator_config={"use_configured_state": True},
        )
        with helpers.plain_construction():
            model = tiny_llama("sdpa", 2)
            reference = tiny_llama("sdpa", 2)
        trainer = Trainer(model=model, args=args, train_dataset=samples)
        trainer.train()
        assert trainer.model.config._attn_implementation == "ulysses_sp_sdpa"
        logged = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        ref_losses, ref_params = reference_run(reference, data, 2)
        expected = [step[0] for step in ref_losses]
        assert len(logged) == steps, trainer.state.log_history
        loss_rel = max(abs(a - b) / abs(b) for a, b in zip(logged, expected))
        assert loss_rel <= LOSS_RTOL, f"logged {logged} vs {expected}"
        got = helpers.full_params(trainer.model)
        param_diff = max((got[n] - ref_params[n]).abs().max().item() for n in ref_params)
        assert param_diff <= PARAM_ATOL, f"final parameters differ by {param_diff:.3g}"
        if dist.get_rank() == 0:
            print(
                f"[sp parity] HF Trainer sp=2: max logged-loss rel diff {loss_rel:.3g}, param diff {param_diff:.3g}"
            )
        helpers.reset_clients()
