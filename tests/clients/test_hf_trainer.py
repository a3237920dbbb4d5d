"""HF Trainer on our package, 2 CPU ranks, at ZeRO stages 1, 2 and 3.

The DeepSpeed config is the one HF documents: every value the Trainer can fill is "auto".
Each case trains with gradient accumulation 2, saving a checkpoint halfway, then checks
`evaluate` against the plain model, `save_model` against the consolidated weights (and
reloads it with `from_pretrained`), and resumes from the halfway checkpoint, expecting the
same losses. The optimizer comes from the config's `optimizer` block, or (no block) is HF's
own AdamW with its decay / no-decay parameter groups.

On CPU the Trainer must be given an already configured process group:
`PartialState(backend="gloo")` with ACCELERATE_USE_DEEPSPEED set, and
`accelerator_config={"use_configured_state": True}`.
"""

import math
import os

import pytest
import torch

from tests.clients import helpers
from tests.unit.common import DistributedTest

pytestmark = pytest.mark.clients

SEQ = 8
MAX_STEPS = 4
SAVE_AT = 2


def auto_config(stage: int, with_optimizer: bool) -> dict:
    zero = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": "auto"}
    if stage == 3:
        zero.update(
            {
                "sub_group_size": 1e9,
                "stage3_prefetch_bucket_size": "auto",
                "stage3_param_persistence_threshold": "auto",
                "stage3_max_live_parameters": 1e9,
                "stage3_max_reuse_distance": 1e9,
                "stage3_gather_16bit_weights_on_model_save": True,
            }
        )
    else:
        zero.update({"allgather_partitions": True, "allgather_bucket_size": 2e8, "reduce_scatter": True})
    config = {
        "fp16": {"enabled": "auto"},
        "bf16": {"enabled": "auto"},
        "zero_optimization": zero,
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "steps_per_print": 2000,
        "wall_clock_breakdown": False,
    }
    if with_optimizer:
        config["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        }
        config["scheduler"] = {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": "auto",
                "warmup_max_lr": "auto",
                "warmup_num_steps": "auto",
                "total_num_steps": "auto",
            },
        }
    return config


def samples(n: int, seed: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, helpers.VOCAB, (n, SEQ), generator=gen)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def configure_state() -> None:
    from accelerate import PartialState

    helpers.reset_clients()
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")


def make_trainer(output_dir, stage: int, with_optimizer: bool):
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    configure_state()
    args = TrainingArguments(  # before the model: it switches ZeRO-3 construction on
        output_dir=str(output_dir),
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=MAX_STEPS,
        learning_rate=1e-2,
        weight_decay=0.01,
        warmup_steps=1,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="steps",
        save_steps=SAVE_AT,
        report_to="none",
        seed=0,
        data_seed=0,
        disable_tqdm=True,
        deepspeed=auto_config(stage, with_optimizer),
        accelerator_config={"use_configured_state": True},
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(helpers.tiny_llama_config())
    return Trainer(model=model, args=args, train_dataset=samples(16, 0), eval_dataset=samples(8, 1))


def train_losses(trainer) -> dict:
    return {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}


def plain_eval_loss(weights: dict) -> float:
    """The mean per-batch loss the Trainer reports, computed on a plain model."""
    from transformers import AutoModelForCausalLM

    with helpers.plain_construction():
        model = AutoModelForCausalLM.from_config(helpers.tiny_llama_config())
    model.load_state_dict(weights)
    model.eval()
    batches = samples(8, 1)
    losses = []
    with torch.no_grad():
        for i in range(0, len(batches), 2):
            ids = torch.stack([b["input_ids"] for b in batches[i : i + 2]])
            losses.append(model(input_ids=ids, labels=ids).loss)
    return torch.stack(losses).mean().item()


class TestHFTrainer(DistributedTest):
    world_size = 2
    timeout_s = 240

    @pytest.mark.parametrize("with_optimizer", [True, False], ids=["config_optimizer", "hf_adamw"])
    @pytest.mark.parametrize("stage", [1, 2, 3])
    def test_train_evaluate_save_resume(self, stage, with_optimizer, tmp_path):
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        out = tmp_path / "run"
        trainer = make_trainer(out, stage, with_optimizer)
        trainer.train()
        losses = train_losses(trainer)
        assert sorted(losses) == list(range(1, MAX_STEPS + 1)), losses
        assert all(math.isfinite(v) for v in losses.values()), losses
        if not with_optimizer:
            groups = trainer.optimizer.param_groups
            assert len(groups) == 2, f"HF AdamW builds decay and no-decay groups, got {len(groups)}"

        weights = helpers.full_params(trainer.model)
        metrics = trainer.evaluate()
        assert math.isclose(metrics["eval_loss"], plain_eval_loss(weights), rel_tol=1e-5), metrics

        saved_dir = tmp_path / "saved"
        trainer.save_model(str(saved_dir))
        helpers.barrier()
        saved = load_file(str(saved_dir / "model.safetensors"))
        helpers.assert_same_tensors(saved, weights, f"stage {stage} save_model")
        reloaded = AutoModelForCausalLM.from_pretrained(str(saved_dir))
        helpers.assert_same_tensors(helpers.full_params(reloaded), weights, f"stage {stage} from_pretrained")
        del trainer, reloaded

        resumed = make_trainer(out, stage, with_optimizer)
        resumed.train(resume_from_checkpoint=str(out / f"checkpoint-{SAVE_AT}"))
        again = train_losses(resumed)
        tail = {s: v for s, v in losses.items() if s > SAVE_AT}
        assert {s: again.get(s) for s in tail} == tail, f"resumed losses {again}, first run {losses}"
        helpers.assert_same_tensors(
            helpers.full_params(resumed.model), weights, f"stage {stage} resumed weights"
        )
        helpers.reset_clients()
