"""Shared pieces of the client suite: tiny model configs, state resets, comparisons.

Every client keeps process-wide state (accelerate's `PartialState` / `AcceleratorState`
singletons, transformers' global `HfDeepSpeedConfig` reference, the `ACCELERATE_*`
environment variables the Trainer and `DeepSpeedPlugin` export). The ranks of
`DistributedTest` are pooled across tests, so each test starts by calling `reset_clients()`.
"""

from __future__ import annotations

import contextlib
import os

import torch

VOCAB = 64


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def tiny_gpt2_config(**overrides):
    from transformers import GPT2Config

    kwargs = dict(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=64)
    kwargs.update(overrides)
    return GPT2Config(**kwargs)


def reset_clients() -> None:
    """Forget every client's process-wide state left by an earlier test on this rank."""
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    PartialState._reset_state()
    for key in [k for k in os.environ if k.startswith(("ACCELERATE_", "FSDP_"))]:
        del os.environ[key]


@contextlib.contextmanager
def plain_construction():
    """Build plain (unpartitioned) HF models inside, even while a ZeRO-3 config is live."""
    import transformers.integrations.deepspeed as hf_ds

    saved = hf_ds._hf_deepspeed_config_weak_ref
    hf_ds._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_ds._hf_deepspeed_config_weak_ref = saved


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of `model` as a full fp32 CPU copy (gathered under ZeRO-3), by name."""
    import deepspeed

    out = {}
    for name, param in model.named_parameters():
        with deepspeed.zero.GatheredParameters(param):
            out[name] = param.detach().clone().float().cpu()
    return out


def assert_same_tensors(actual: dict, expected: dict, what: str, exact: bool = True) -> None:
    missing = sorted(set(expected) - set(actual))
    extra = sorted(set(actual) - set(expected))
    assert not missing and not extra, f"{what}: missing {missing}, unexpected {extra}"
    for name, want in expected.items():
        got = actual[name]
        assert tuple(got.shape) == tuple(want.shape), (
            f"{what}: {name} has shape {tuple(got.shape)}, want {tuple(want.shape)}"
        )
        if exact:
            assert torch.equal(got.float(), want.float()), f"{what}: {name} differs"
        else:
            torch.testing.assert_close(got.float(), want.float(), msg=lambda m, n=name: f"{what}: {n}: {m}")


def rank() -> int:
    return int(os.environ["RANK"])


def barrier() -> None:
    import deepspeed.comm as dist

    dist.barrier()
