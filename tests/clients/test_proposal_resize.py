"""The start()/stop() proposal on real code: transformers' token-embedding resize, written once.

transformers writes each gathered step of `resize_token_embeddings` twice (`if zero3: with
GatheredParameters(...): X else: X`). `resize_token_embeddings_once` below is the same
algorithm with every step written once, gathered by `GatheredParameters(..., enabled=z3)
.start()` and released by `.stop()`. On 2 ranks, tiny GPT-2 (tied head) and Llama (untied
head) are built plainly and under `zero.Init` (through `HfDeepSpeedConfig`), then resized by
transformers' own method and by the written-once one: all four results agree exactly, and the
old rows are the model's rows before the resize.

With `EXPECT_REWRITTEN_TRANSFORMERS=1` the test also checks that the transformers it imported
is the copy rewritten by `python -m deepspeed.tools.zero_codemod` (see
docs/start_stop_in_practice.md), so that its own resize runs the rewritten code.
"""

from __future__ import annotations

import inspect
import os

import pytest
import torch
from torch import nn

import deepspeed
from tests.clients import helpers
from tests.unit.common import DistributedTest

pytestmark = pytest.mark.clients

ZERO3 = {
    "train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}
MODELS = {"gpt2": helpers.tiny_gpt2_config, "llama": helpers.tiny_llama_config}
NEW_VOCAB = {"grow": helpers.VOCAB + 7, "shrink": helpers.VOCAB - 5}
CASES = [("gpt2", "grow"), ("llama", "grow"), ("llama", "shrink")]


# ----------------------------------------------------------------------------- written once


def _gathered(params, z3: bool, modifier_rank=None):
    return deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank, enabled=z3).start()


def resized_embedding_once(model, old: nn.Embedding, new_num_tokens: int, mean_resizing: bool, z3: bool):
    """`old` with `new_num_tokens` rows: shared rows copied, added rows initialized as HF does."""
    gather = _gathered(old.weight, z3)
    old_num_tokens, dim = old.weight.shape
    gather.stop()

    # Built outside zero.Init, as transformers does: its shape is read right after.
    new = nn.Embedding(new_num_tokens, dim, device=old.weight.device, dtype=old.weight.dtype)
    added = new_num_tokens - old_num_tokens
    if added > 0 and not mean_resizing:
        model._init_weights(new)
    elif added > 0:
        gather = _gathered([old.weight], z3)
        model._init_added_embeddings_weights_with_mean(old, new, old_num_tokens, added)
        gather.stop()

    n = min(old_num_tokens, new_num_tokens)
    gather = _gathered([old.weight, new.weight], z3, modifier_rank=0)
    new.weight.data[:n, :] = old.weight.data[:n, :]
    gather.stop()

    # Keep the module (its class may be a custom Embedding); swap in the new weight.
    old.weight = new.weight
    old.num_embeddings = new_num_tokens
    if old.padding_idx is not None and old.padding_idx >= new_num_tokens:
        old.padding_idx = None
    return old


def resized_lm_head_once(model, old: nn.Linear, new_num_tokens: int, mean_resizing: bool, z3: bool):
    """A new `nn.Linear` head with `new_num_tokens` outputs; shared rows (and bias) copied."""
    gather = _gathered(old.weight, z3)
    old_num_tokens, dim = old.weight.shape
    gather.stop()

    has_bias = old.bias is not None
    new = nn.Linear(dim, new_num_tokens, bias=has_bias, device=old.weight.device, dtype=old.weight.dtype)
    added = new_num_tokens - old_num_tokens
    if added > 0 and not mean_resizing:
        model._init_weights(new)
    elif added > 0:
        gather = _gathered([old.weight, old.bias], z3)
        model._init_added_lm_head_weights_with_mean(old, new, dim, old_num_tokens, added, False)
        if has_bias:
            model._init_added_lm_head_bias_with_mean(old, new, added)
        gather.stop()

    n = min(old_num_tokens, new_num_tokens)
    gather = _gathered([old.weight, old.bias, new.weight, new.bias], z3, modifier_rank=0)
    model._copy_lm_head_original_to_resized(new, old, n, False, has_bias)
    gather.stop()
    new._is_hf_initialized = True
    return new


def resize_token_embeddings_once(model, new_num_tokens: int, mean_resizing: bool, z3: bool):
    """`model.resize_token_embeddings(new_num_tokens)`, each gathered step written once."""
    embeddings = model.get_input_embeddings()
    requires_grad = embeddings.weight.requires_grad
    embeddings = resized_embedding_once(model, embeddings, new_num_tokens, mean_resizing, z3)
    embeddings.requires_grad_(requires_grad)
    model.set_input_embeddings(embeddings)

    head = model.get_output_embeddings()
    if head is not None:
        requires_grad = head.weight.requires_grad
        head = resized_lm_head_once(model, head, new_num_tokens, mean_resizing, z3)
        head.requires_grad_(requires_grad)
        model.set_output_embeddings(head)

    model.config.get_text_config().vocab_size = new_num_tokens
    model.vocab_size = new_num_tokens
    model.tie_weights()
    return model.get_input_embeddings()


# ----------------------------------------------------------------------------- the test


def _build(make_config, z3: bool):
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    keep = HfDeepSpeedConfig(dict(ZERO3)) if z3 else None
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_config())
    if z3:
        assert all(hasattr(p, "ds_id") for p in model.parameters()), "not built under zero.Init"
    return model, keep


def _resize(make_config, new_num_tokens: int, z3: bool, hf: bool, mean_resizing: bool, weights: dict):
    """Build with `weights`, snapshot, resize (transformers' method or ours), snapshot again.

    Plain builds take the ZeRO-3 build's weights: transformers' initialization under
    zero.Init draws its random numbers in another order than a plain build.
    """
    model, keep = _build(make_config, z3)
    if not z3:
        with torch.no_grad():
            for pname, param in model.named_parameters():
                param.copy_(weights[pname])
    before = helpers.full_params(model)
    torch.manual_seed(1)  # the added rows are random; every variant draws them from one state
    if hf:
        model.resize_token_embeddings(new_num_tokens, mean_resizing=mean_resizing)
    else:
        resize_token_embeddings_once(model, new_num_tokens, mean_resizing, z3)
    after = helpers.full_params(model)
    shapes = (
        model.get_input_embeddings().num_embeddings,
        model.config.get_text_config().vocab_size,
        model.get_output_embeddings().weight.shape[0],
    )
    del keep
    helpers.reset_clients()
    return before, after, shapes


class TestResizeWrittenOnce(DistributedTest):
    world_size = 2

    def test_transformers_resize_and_written_once_agree(self):
        if os.environ.get("EXPECT_REWRITTEN_TRANSFORMERS") == "1":
            from transformers import PreTrainedModel

            source = inspect.getsource(PreTrainedModel._get_resized_lm_head)
            assert ".start()" in source and "with deepspeed.zero.GatheredParameters" not in source

        helpers.reset_clients()
        for name, change in CASES:
            make_config, new_num_tokens = MODELS[name], NEW_VOCAB[change]
            model, keep = _build(make_config, z3=True)
            weights = helpers.full_params(model)
            del model, keep
            helpers.reset_clients()
            mean_resizing = name == "gpt2"  # both of transformers' ways to fill added rows
            results = {
                (z3, hf): _resize(make_config, new_num_tokens, z3, hf, mean_resizing, weights)
                for z3 in (False, True)
                for hf in (True, False)
            }
            reference_before, reference_after, _ = results[(False, True)]
            n = min(helpers.VOCAB, new_num_tokens)
            for (z3, hf), (before, after, shapes) in results.items():
                case = f"{name}/{change}/{'zero3' if z3 else 'plain'}/{'hf' if hf else 'once'}"
                assert shapes == (new_num_tokens,) * 3, case
                for pname, tensor in before.items():
                    assert torch.equal(tensor, reference_before[pname]), f"{case}: {pname} built"
                assert sorted(after) == sorted(reference_after), case
                for pname, tensor in after.items():
                    if tensor.shape[0] == new_num_tokens and before[pname].shape[0] == helpers.VOCAB:
                        # the old rows, kept exactly
                        assert torch.equal(tensor[:n], before[pname][:n]), f"{case}: {pname} old rows"
                    assert torch.equal(tensor, reference_after[pname]), f"{case}: {pname}"
