"""PEFT 0.21 LoRA (`get_peft_model`) in HF Trainer under ZeRO-3, 2 CPU ranks (gloo).

The LoRA run must train as the same run without DeepSpeed (DDP, same seed: the weights after
it agree), and the adapter `save_model` writes must read back with
`PeftModel.from_pretrained` equal, bit for bit, to the trained (gathered) adapter weights.
"""

import pytest

from tests.clients import helpers, trl_workflows
from tests.unit.common import DistributedTest

pytestmark = pytest.mark.clients


class TestPEFT(DistributedTest):
    world_size = 2
    timeout_s = 300

    def test_lora_zero3_trains_saves_and_reloads(self, tmp_path):
        plain = trl_workflows.run_peft_lora(tmp_path / "ddp", None)
        ours = trl_workflows.run_peft_lora(tmp_path / "z3", 3)
        trl_workflows.assert_trained_as(ours, plain, "peft_lora", "LoRA at stage 3", base_trains=False)
        assert ours["trained"], "the model has LoRA weights"
        helpers.assert_same_tensors(ours["reloaded"], ours["trained"], "reloaded adapter")
        moved = [n for n, t in ours["trained"].items() if "lora_B" in n and t.abs().sum() > 0]
        assert moved, "training moved the LoRA B matrices (they start at zero)"
