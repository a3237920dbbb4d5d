"""The TRL and PEFT workflows the client suite runs, in one place for both of their callers.

`tests/clients/test_trl.py` and `test_peft.py` run them on our package inside a
`DistributedTest`; `benchmarks/trl_compare.py` runs the same functions under torchrun on
ours and on upstream DeepSpeed 0.19.8 (its own venv) and prints the losses side by side.
So this module imports nothing of ours beyond `tests.clients.helpers`, and no `deepspeed`
at import time.

Every workflow builds a tiny Llama from a config and a word-level tokenizer in code (nothing
downloads), trains a few steps with fp32 on CPU ranks over gloo, and returns the losses
the trainer logged at each step, plus what the workflow's own check needs.
"""

from __future__ import annotations

import os

import torch

from tests.clients import helpers

STEPS = 3
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0..3, as the model config says
WORDS = [f"w{i}" for i in range(helpers.VOCAB - len(SPECIALS))]


def tokenizer():
    """A word-level tokenizer over `WORDS` whose ids fill the tiny model's vocabulary exactly."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + WORDS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def _model_config(**overrides):
    return helpers.tiny_llama_config(pad_token_id=0, bos_token_id=1, eos_token_id=2, **overrides)


def causal_lm():
    """Built plainly even under a ZeRO-3 config (the engine partitions it at initialize), so
    every run, DDP or any stage, starts from the same weights: HF's construction under
    zero.Init draws its initial values in another order."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with helpers.plain_construction():
        return AutoModelForCausalLM.from_config(_model_config())


def reward_model():
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    with helpers.plain_construction():
        return AutoModelForSequenceClassification.from_config(_model_config(num_labels=1))


def _sentence(gen: torch.Generator, n: int) -> str:
    ids = torch.randint(0, len(WORDS), (n,), generator=gen).tolist()
    return " ".join(WORDS[i] for i in ids)


def text_dataset(n: int = 16, seed: int = 0):
    from datasets import Dataset

    gen = torch.Generator().manual_seed(seed)
    return Dataset.from_list([{"text": _sentence(gen, 8)} for _ in range(n)])


def preference_dataset(n: int = 16, seed: int = 0):
    from datasets import Dataset

    gen = torch.Generator().manual_seed(seed)
    rows = [
        {"prompt": _sentence(gen, 4), "chosen": _sentence(gen, 4), "rejected": _sentence(gen, 4)}
        for _ in range(n)
    ]
    return Dataset.from_list(rows)


def on_disk(dataset, path):
    """`dataset` saved by the main process and read back by every rank: TRL's
    `precompute_ref_log_probs` writes its cache next to the dataset's files, which an
    in-memory dataset keeps in a temporary folder of each process's own."""
    from accelerate import PartialState
    from datasets import load_from_disk

    state = PartialState()
    if state.is_main_process:
        dataset.save_to_disk(str(path))
    state.wait_for_everyone()
    return load_from_disk(str(path))


def prompt_dataset(n: int = 16, seed: int = 0):
    from datasets import Dataset

    gen = torch.Generator().manual_seed(seed)
    return Dataset.from_list([{"prompt": _sentence(gen, 4)} for _ in range(n)])


def ds_config(stage: int, offload: bool = False) -> dict:
    """HF's documented config, every fillable value "auto"; optionally the optimizer on the CPU.

    TRL hands the reference model's copy to `deepspeed.initialize` before HF fills the
    model-size values: at ZeRO-3 its dotted keys fill them, below 3 their defaults apply."""
    sizes = dict.fromkeys(
        ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"), "auto"
    )
    zero: dict = {"stage": stage, "overlap_comm": False, "contiguous_gradients": True}
    zero["reduce_bucket_size"] = sizes["reduce_bucket_size"]
    if stage == 3:
        zero.update(
            {
                "stage3_prefetch_bucket_size": sizes["stage3_prefetch_bucket_size"],
                "stage3_param_persistence_threshold": sizes["stage3_param_persistence_threshold"],
                "stage3_gather_16bit_weights_on_model_save": True,
            }
        )
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    return {
        "fp16": {"enabled": "auto"},
        "bf16": {"enabled": "auto"},
        "zero_optimization": zero,
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "steps_per_print": 2000,
    }


def configure_state(stage) -> None:
    """On CPU, the Trainer must find a configured gloo process group (see test_hf_trainer.py).
    `stage` None: no DeepSpeed at all, the plain DDP run the ZeRO runs are compared with."""
    from accelerate import PartialState

    helpers.reset_clients()
    if stage is not None:
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        PartialState(backend="gloo")
    else:  # without cpu=True, accelerate sees no distributed setup on CPU and skips DDP
        PartialState(cpu=True, backend="gloo")


def common_args(output_dir, stage, offload: bool) -> dict:
    """TrainingArguments shared by every workflow; `stage` None: plain DDP (no DeepSpeed)."""
    return dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        max_steps=STEPS,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
        data_seed=0,
        bf16=False,
        disable_tqdm=True,
        deepspeed=None if stage is None else ds_config(stage, offload),
        use_cpu=stage is None,
        accelerator_config={"use_configured_state": True},
    )


def result(trainer, **extra) -> dict:
    """The losses TRL logged and the trained weights, whole (gathered under ZeRO-3)."""
    return {"losses": logged(trainer), "weights": helpers.full_params(trainer.model), **extra}


def logged(trainer, key: str = "loss") -> list:
    return [round(float(e[key]), 6) for e in trainer.state.log_history if key in e and "step" in e][:STEPS]


def run_sft(output_dir, stage: int, offload: bool = False, gradient_checkpointing: bool = False) -> dict:
    from trl import SFTConfig, SFTTrainer

    configure_state(stage)
    args = SFTConfig(
        **common_args(output_dir, stage, offload),
        max_length=16,
        gradient_checkpointing=gradient_checkpointing,
    )
    trainer = SFTTrainer(
        model=causal_lm(), args=args, train_dataset=text_dataset(), processing_class=tokenizer()
    )
    trainer.train()
    trainer.save_model()
    return result(trainer)


def run_sft_gc(output_dir, stage: int, offload: bool = False) -> dict:
    return run_sft(output_dir, stage, offload, gradient_checkpointing=True)


def run_dpo(output_dir, stage: int, offload: bool = False, precompute: bool = False) -> dict:
    """DPO against a reference model. With `precompute`, TRL scores the data with the policy
    before training and keeps no reference model; without it, the reference model goes
    through TRL's `prepare_deepspeed` (an inference engine: its own `deepspeed.initialize`)."""
    from trl import DPOConfig, DPOTrainer

    configure_state(stage)
    common = common_args(output_dir, stage, offload)
    args = DPOConfig(**common, max_length=16, precompute_ref_log_probs=precompute)
    ref_model = None if precompute else causal_lm()
    trainer = DPOTrainer(
        model=causal_lm(),
        ref_model=ref_model,
        args=args,
        train_dataset=on_disk(preference_dataset(), os.path.join(str(output_dir), "data")),
        processing_class=tokenizer(),
    )
    trainer.train()
    trainer.save_model()
    return result(trainer)


def run_dpo_precompute(output_dir, stage: int, offload: bool = False) -> dict:
    return run_dpo(output_dir, stage, offload, precompute=True)


def distinct_words(completions, **kwargs) -> list:
    """A reward that varies between completions, so GRPO's advantages (and loss) are not zero."""
    return [float(len(set(text.split()))) for text in completions]


def run_grpo(output_dir, stage: int, offload: bool = False, gather_for_generation: bool = True) -> dict:
    """GRPO: each step generates inside TRL's `unwrap_model_for_generation`, which at ZeRO-3
    lifts the engine's hooks with every parameter gathered (`ds3_gather_for_generation`), or
    generates through the hooks, gathering layer by layer, when that is off."""
    from trl import GRPOConfig, GRPOTrainer

    configure_state(stage)
    args = GRPOConfig(
        **common_args(output_dir, stage, offload),
        num_generations=2,
        max_completion_length=6,
        ds3_gather_for_generation=gather_for_generation,
    )
    trainer = GRPOTrainer(
        model=causal_lm(),
        reward_funcs=distinct_words,
        args=args,
        train_dataset=prompt_dataset(),
        processing_class=tokenizer(),
    )
    trainer.train()
    trainer.save_model()
    return result(trainer, rewards=logged(trainer, "reward"))


def run_grpo_nogather(output_dir, stage: int, offload: bool = False) -> dict:
    return run_grpo(output_dir, stage, offload, gather_for_generation=False)


def run_reward(output_dir, stage: int, offload: bool = False) -> dict:
    from trl import RewardConfig, RewardTrainer

    configure_state(stage)
    args = RewardConfig(**common_args(output_dir, stage, offload), max_length=16)
    trainer = RewardTrainer(
        model=reward_model(), args=args, train_dataset=preference_dataset(), processing_class=tokenizer()
    )
    trainer.train()
    trainer.save_model()
    return result(trainer)


def run_peft_lora(output_dir, stage: int, offload: bool = False) -> dict:
    """LoRA (`get_peft_model`) in HF Trainer. Returns the trained adapter weights (gathered)
    and the ones `PeftModel.from_pretrained` reads back from `save_model`'s output."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    configure_state(stage)
    args = TrainingArguments(**common_args(output_dir, stage, offload))  # before the model (zero.Init)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = get_peft_model(causal_lm(), lora)
    tok = tokenizer()
    data = text_dataset().map(lambda row: tok(row["text"]), remove_columns=["text"])
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=data,
        data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
    )
    trainer.train()
    trainer.save_model()
    trainer.accelerator.wait_for_everyone()  # rank 0 writes the adapter the others read back
    out = result(trainer)
    trained = {n: t for n, t in out["weights"].items() if "lora_" in n}
    with helpers.plain_construction():
        reloaded = PeftModel.from_pretrained(causal_lm(), str(output_dir))
    loaded = {n: p.detach().clone() for n, p in reloaded.named_parameters() if "lora_" in n}
    return dict(out, trained=trained, reloaded=loaded)


WORKFLOWS = {
    "sft": run_sft,
    "sft_gc": run_sft_gc,
    "dpo": run_dpo,
    "dpo_precompute": run_dpo_precompute,
    "grpo": run_grpo,
    "grpo_nogather": run_grpo_nogather,
    "reward": run_reward,
    "peft_lora": run_peft_lora,
}


def initial_weights(name: str) -> dict:
    """The weights workflow `name` starts from (its model before training), by name."""
    model = reward_model() if name == "reward" else causal_lm()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_trained_as(ours: dict, plain: dict, name: str, what: str, base_trains: bool = True) -> None:
    """The losses logged and the weights after our run equal the plain DDP run's at a
    tolerance (fp32, reductions in another order), and training moved the weights."""
    assert len(ours["losses"]) == STEPS, f"{what}: logged {ours['losses']}"
    torch.testing.assert_close(
        torch.tensor(ours["losses"]), torch.tensor(plain["losses"]), rtol=1e-5, atol=0, msg=f"{what}: losses"
    )
    assert set(ours["weights"]) == set(plain["weights"]), what
    start = initial_weights(name) if base_trains else {}
    moved = []
    for key, want in plain["weights"].items():
        got = ours["weights"][key]
        torch.testing.assert_close(
            got, want, rtol=1e-4, atol=1e-5, msg=lambda m, key=key: f"{what}: {key}: {m}"
        )
        if key in start and not torch.equal(got, start[key]):
            moved.append(key)
    assert moved or not base_trains, f"{what}: training changed no weight"
