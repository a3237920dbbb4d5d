"""TRL 1.16 trainers on our package, 2 CPU ranks (gloo), against the same trainer without DeepSpeed.

Each workflow (tests/clients/trl_workflows.py) trains a tiny Llama a few steps under ZeRO and
once more as plain DDP from the same seed; the losses TRL logs must agree (fp32, the same
HF AdamW; the ZeRO runs reduce in another order, hence the tolerance). What each exercises:
- SFT: TRL's fused LM head reads `lm_head.weight` itself and gathers it in forward and
  backward, so its gradient lands on a parameter no submodule holds (hooks.py's note).
- GRPO: generation inside `unwrap_model_for_generation`, which at ZeRO-3 lifts the engine's
  hooks through `optimizer.parameter_offload` with every parameter gathered, or (with
  `ds3_gather_for_generation=False`) generates through the hooks.
- DPO: the reference model is its own inference engine (TRL's `prepare_deepspeed`); at
  ZeRO-3 TRL writes dotted keys ("zero_optimization.reduce_bucket_size") into its config.
- Reward modelling: a sequence-classification head.
The ZeRO-3 cases run in `make test`; the stage-2 / offload grid is marked `slow`.
"""

import pytest

from tests.clients import trl_workflows
from tests.unit.common import DistributedTest

pytestmark = pytest.mark.clients


def assert_trains_as_ddp(name: str, tmp_path, stage: int, offload: bool = False) -> None:
    run = trl_workflows.WORKFLOWS[name]
    plain = run(tmp_path / f"{name}-ddp", None)
    ours = run(tmp_path / f"{name}-z{stage}", stage, offload)
    trl_workflows.assert_trained_as(ours, plain, name, f"{name} at stage {stage} (offload {offload})")


class TestTRL(DistributedTest):
    world_size = 2
    timeout_s = 600

    def test_sft_grpo_reward_at_zero3(self, tmp_path):
        for name in ["sft", "sft_gc", "grpo", "grpo_nogather", "reward"]:
            assert_trains_as_ddp(name, tmp_path, 3)

    def test_dpo_at_zero3(self, tmp_path):
        """Needs dotted config keys applied to the nested key (issue 39, item 3)."""
        for name in ["dpo", "dpo_precompute"]:
            assert_trains_as_ddp(name, tmp_path, 3)

    @pytest.mark.slow
    def test_stage2_and_offload_grid(self, tmp_path):
        for name, offload in [
            ("sft", True),
            ("dpo", True),
            ("dpo_precompute", False),
            ("grpo", False),
            ("reward", True),
        ]:
            assert_trains_as_ddp(name, tmp_path, 2, offload)
