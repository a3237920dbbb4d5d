"""Every ZeRO config that LLaMA-Factory and axolotl ship, through `deepspeed.initialize` and 3
steps on 2 CPU ranks (issue 39, item 5). The files are byte-identical copies, listed with their
origin in tests/fixtures/shipped_configs/SOURCES.md.

Both frameworks train through HF Trainer, so each config gets its "auto" values filled by HF's
own code (`HfTrainerDeepSpeedConfig.trainer_config_process` / `trainer_config_finalize`) for a
tiny Llama, and the engine gets what the Trainer and accelerate pass when the config has no
`optimizer` block: HF's AdamW (torch's, here without weight decay), which accelerate swaps for
DeepSpeedCPUAdam when the optimizer is offloaded, and ``zero_allow_untested_optimizer``.
Precision: `"enabled": "auto"` is filled as for an fp32 run (``--bf16`` and ``--fp16`` off), so
that the losses can be held to plain PyTorch's at fp32 tolerance; the configs that set
``"bf16": {"enabled": true}`` outright (axolotl's zero3_bf16*) are filled as HF requires for
them, as a ``--bf16`` run (any other choice is an HF mismatch error), and train in bfloat16,
held to the fp32 reference at a bfloat16 tolerance. The compile configs get
`engine.compile(backend="aot_eager")`, as accelerate calls it with the run's own backend; a
second test runs axolotl's zero1_torch_compile.json through HF Trainer itself with
`torch_compile=True`, where accelerate makes that call.

Exactly the configs in `REFUSED` are refused, each naming a feature not built yet; every
other one trains. Measured with the same run on upstream DeepSpeed 0.19.8 (its own venv): the
same losses to 6 decimals in fp32 (4.149083, 4.157174, 4.201473), 4.201276 against our 4.201289
at the third bf16 step; upstream refuses axolotl's two compile configs (`disable` and `backend`
are not keys of its `compile` block).
"""

import copy
import hashlib
import json
import math
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.clients import helpers
from tests.unit.common import DistributedTest

pytestmark = pytest.mark.clients

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "shipped_configs"
CONFIGS = sorted(str(p.relative_to(FIXTURES)) for p in FIXTURES.glob("*/*.json"))
REFUSED = {
    "llamafactory/ds_z2_autotp_config.json": (
        r"tensor_parallel=\{'autotp_size': 2\} is not supported by this implementation; "
        r"AutoTP tensor parallelism is not implemented"
    ),
}
STEPS, MICRO, SEQ, LR, CLIP = 3, 2, 8, 1e-2, 1.0
# fp32: the sharded step sums in another order than one process. bf16: 3 steps of bfloat16
# forward and backward against the fp32 reference (measured: 4.4e-5 at the third step).
LOSS_RTOL = {False: 1e-5, True: 2e-4}


def test_fixtures_are_byte_identical_to_the_blobs_sources_md_lists():
    listed = (FIXTURES / "SOURCES.md").read_text()
    assert len(CONFIGS) == 15
    for name in CONFIGS:
        data = (FIXTURES / name).read_bytes()
        blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git's object id
        assert f"| `{name}` |" in listed and f"`{blob}`" in listed, f"{name} differs from SOURCES.md's blob"
        json.loads(data)


def hf_filled(raw: dict, model, world_size: int) -> tuple[dict, bool]:
    """`raw` with "auto" filled by HF's code for this run, and whether the run is bf16."""
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig, unset_hf_deepspeed_config

    bf16 = (raw.get("bf16") or {}).get("enabled") is True
    args = SimpleNamespace(
        world_size=world_size,
        per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=1,
        max_grad_norm=CLIP,
        learning_rate=LR,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        weight_decay=0.0,
        save_on_each_node=False,
        fp16=False,
        fp16_full_eval=False,
        bf16=bf16,
        bf16_full_eval=False,
        get_warmup_steps=lambda num_training_steps: 0,
    )
    hf = HfTrainerDeepSpeedConfig(raw)  # copies `raw`
    hf.trainer_config_process(args)
    hf.trainer_config_finalize(args, model, STEPS)
    config = hf.config
    unset_hf_deepspeed_config()  # the models here are built plainly, as the reference is
    if "optimizer" not in config:
        config["zero_allow_untested_optimizer"] = True  # what the Trainer sets with its own AdamW
    return config, bf16


def client_optimizer(model, config: dict):
    """What accelerate passes to `initialize`: HF's AdamW, swapped for DeepSpeedCPUAdam (in
    AdamW mode, by accelerate's own function) when the config offloads the optimizer and does
    not set zero_force_ds_cpu_optimizer false."""
    from accelerate.utils.deepspeed import map_pytorch_optim_to_deepspeed

    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    offload = (config["zero_optimization"].get("offload_optimizer") or {}).get("device", "none")
    if offload != "none" and config.get("zero_force_ds_cpu_optimizer", True):
        optimizer = map_pytorch_optim_to_deepspeed(optimizer)
    return optimizer


def batches(world_size: int) -> list:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, helpers.VOCAB, (MICRO * world_size, SEQ), generator=gen) for _ in range(STEPS)]


def reference_losses(model, data) -> list:
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for ids in data:
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        losses.append(loss.item())
    return losses


def engine_losses(engine, data) -> list:
    import deepspeed.comm as dist

    rank, ws = dist.get_rank(), dist.get_world_size()
    losses = []
    for ids in data:
        mine = ids[rank * MICRO : (rank + 1) * MICRO]
        loss = engine(input_ids=mine, labels=mine).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(total.item() / ws)
    return losses


def run_config(name: str, data) -> tuple:
    """('trained', losses, bf16) or ('refused', message)."""
    import torch._dynamo
    from transformers import LlamaForCausalLM

    import deepspeed

    helpers.reset_clients()
    torch.manual_seed(0)
    model = LlamaForCausalLM(helpers.tiny_llama_config())
    raw = json.loads((FIXTURES / name).read_text())
    config, bf16 = hf_filled(raw, model, world_size=2)
    optimizer = client_optimizer(model, config)
    try:
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    except (ValueError, NotImplementedError) as err:
        return ("refused", str(err))
    if "compile" in raw:
        torch._dynamo.reset()
        engine.compile(backend="aot_eager")
        assert engine.is_compiled, name
    dtype = next(engine.module.parameters()).dtype
    assert dtype == (torch.bfloat16 if bf16 else torch.float32), (name, dtype)
    return ("trained", engine_losses(engine, data), bf16)


class TestShippedConfigs(DistributedTest):
    world_size = [2]

    def test_every_shipped_config_trains_or_names_what_is_missing(self):
        from transformers import LlamaForCausalLM

        data = batches(2)
        torch.manual_seed(0)
        model = LlamaForCausalLM(helpers.tiny_llama_config())
        with torch.no_grad():
            untrained = [model(input_ids=ids, labels=ids).loss.item() for ids in data]
        ref = reference_losses(copy.deepcopy(model), data)
        # The steps move the loss far more than the tolerance: a run that skipped them would fail.
        assert abs(ref[-1] - untrained[-1]) > 10 * max(LOSS_RTOL.values()) * ref[-1], (ref, untrained)
        outcomes = {name: run_config(name, data) for name in CONFIGS}
        refused = {name: out[1] for name, out in outcomes.items() if out[0] == "refused"}
        assert set(refused) == set(REFUSED), refused
        for name, message in refused.items():
            assert re.search(REFUSED[name], message), (name, message)
        for name, out in outcomes.items():
            if out[0] == "trained":
                _, losses, bf16 = out
                torch.testing.assert_close(
                    torch.tensor(losses), torch.tensor(ref), rtol=LOSS_RTOL[bf16], atol=0, msg=name
                )


def trainer_losses(config_name: str, output_dir, compile_backend=None) -> tuple:
    """3 HF Trainer steps with a shipped config as axolotl runs it: the file given as
    `deepspeed=`, `torch_compile` set when a backend is given (accelerate then calls
    `engine.compile(backend=...)`). Returns (losses by step, whether the engine compiled)."""
    from accelerate import PartialState
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    helpers.reset_clients()
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")
    compile_args = (
        {"torch_compile": True, "torch_compile_backend": compile_backend} if compile_backend else {}
    )
    args = TrainingArguments(
        output_dir=str(output_dir),
        per_device_train_batch_size=MICRO,
        max_steps=STEPS,
        learning_rate=LR,
        weight_decay=0.0,
        max_grad_norm=CLIP,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
        data_seed=0,
        disable_tqdm=True,
        deepspeed=str(FIXTURES / config_name),
        accelerator_config={"use_configured_state": True},
        **compile_args,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(helpers.tiny_llama_config())
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, helpers.VOCAB, (MICRO * 2 * STEPS, SEQ), generator=gen)
    trainer = Trainer(
        model=model, args=args, train_dataset=[{"input_ids": r, "labels": r.clone()} for r in ids]
    )
    trainer.train()
    losses = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
    compiled = trainer.model_wrapped.is_compiled
    helpers.reset_clients()
    return losses, compiled


class TestAxolotlCompileThroughTrainer(DistributedTest):
    world_size = [2]

    def test_torch_compile_config_trains_as_its_eager_twin(self, tmp_path):
        """axolotl's zero1_torch_compile.json differs from zero1.json only by its compile
        block. Through HF Trainer with `torch_compile` (backend aot_eager: inductor's code
        generation costs a minute here), the engine is compiled and the losses equal the
        eager twin's to 1e-6 relative."""
        import torch._dynamo

        twin = json.loads((FIXTURES / "axolotl/zero1_torch_compile.json").read_text())
        assert twin.pop("compile") == {"disable": False, "backend": "inductor"}
        assert twin == json.loads((FIXTURES / "axolotl/zero1.json").read_text())
        eager, eager_compiled = trainer_losses("axolotl/zero1.json", tmp_path / "eager")
        torch._dynamo.reset()
        compiled, was_compiled = trainer_losses(
            "axolotl/zero1_torch_compile.json", tmp_path / "c", "aot_eager"
        )
        assert not eager_compiled and was_compiled
        assert sorted(compiled) == list(range(1, STEPS + 1)), compiled
        for step, loss in eager.items():
            assert math.isclose(compiled[step], loss, rel_tol=1e-6), (step, compiled, eager)
