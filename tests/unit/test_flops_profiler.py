"""The FLOPs profiler (deepspeed/profiling/flops_profiler): exact counts for small models worked
out by hand, totals against torch's FlopCounterMode on tiny GPT-2 and Llama, ZeRO-3 parameters
at full size, the engine's config path, and nothing left installed after end_profile()."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch.utils.flop_counter import FlopCounterMode

import deepspeed
from deepspeed.profiling.flops_profiler import (
    FlopsProfiler,
    flops_to_string,
    get_model_profile,
    get_module_flops,
    get_module_macs,
    macs_to_string,
    number_to_string,
    params_to_string,
)
from deepspeed.runtime.config import DeepSpeedConfig
from tests.unit.common import DistributedTest


def profile(model: nn.Module, *inputs, **kwargs) -> FlopsProfiler:
    """A stopped profile of one forward of `model` (end_profile() is the caller's)."""
    profiler = FlopsProfiler(model)
    profiler.start_profile()
    try:
        with torch.no_grad():
            model(*inputs, **kwargs)
    finally:
        profiler.stop_profile()
    return profiler


# ---------------------------------------------------------------------- exact counts


class Functional(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def test_mlp_counts_worked_out_by_hand():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    prof = profile(model, torch.randn(3, 8))
    # Linear: batch x in x out MACs, 2 flops each (bias not counted); ReLU: 1 per element
    macs = 3 * 8 * 16 + 3 * 16 * 4
    assert prof.get_total_macs() == macs == 576
    assert prof.get_total_flops() == 2 * macs + 3 * 16
    assert prof.get_total_params() == 8 * 16 + 16 + 16 * 4 + 4
    assert [get_module_flops(m) for m in model] == [2 * 384, 48, 2 * 192]
    assert get_module_macs(model[0]) == 384 and model[2].__params__ == 68
    assert prof.get_total_flops(as_string=True) == "1.2 K"
    assert prof.get_total_macs(as_string=True) == "576 MACs"
    prof.end_profile()
    with pytest.raises(AttributeError, match="between FlopsProfiler.stop_profile"):
        get_module_flops(model)

    prof.start_profile(ignore_list=[nn.ReLU])  # no hooks of its own: its work counts in its parent
    model(torch.randn(3, 8))
    prof.stop_profile()
    assert prof.get_total_flops() == 1200 and [get_module_flops(m) for m in model] == [768, 0, 384]
    prof.end_profile()


def test_convolutions_and_norms_worked_out_by_hand():
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2)).eval()
    prof = profile(model, torch.randn(2, 3, 10, 10))
    out_positions = 2 * 10 * 10  # batch x output pixels
    conv_macs = out_positions * 8 * 3 * 3 * 3  # out channels x in channels x kernel
    # eval batch norm with affine: 2 per element; ReLU 1; max pool 1 per input element
    elements = 2 * 8 * 10 * 10
    assert prof.get_total_macs() == conv_macs
    assert prof.get_total_flops() == 2 * conv_macs + 2 * elements + elements + elements
    prof.end_profile()

    cases = [
        # (module, input, MACs, flops)
        (nn.Conv1d(4, 6, 3, groups=2), (2, 4, 9), 2 * 7 * 6 * 2 * 3, None),
        (nn.Conv3d(2, 3, (1, 2, 2)), (1, 2, 3, 4, 4), 3 * 3 * 3 * 3 * 2 * 4, None),
        # transposed: MACs per input position: in channels x out channels x kernel
        (nn.ConvTranspose2d(3, 5, 2, stride=2), (1, 3, 4, 4), 16 * 3 * 5 * 4, None),
        (nn.LayerNorm(8), (2, 5, 8), 0, 5 * 80),
        (nn.LayerNorm(8, elementwise_affine=False), (2, 5, 8), 0, 4 * 80),
        (nn.GroupNorm(2, 4), (2, 4, 3), 0, 5 * 24),
        # RMS norm: 4 per element with a weight; where torch decomposes it (the CPU) its operators
        # count one by one: square, mean, x * rsqrt, * weight (4 per element) + eps add, rsqrt per row
        (nn.RMSNorm(8), (2, 8), 0, None),
        (nn.BatchNorm1d(4).train(), (3, 4), 0, 5 * 12),
        (nn.Embedding(10, 4), None, 0, 0),
        (nn.Softmax(-1), (2, 8), 0, 16),
        (nn.GELU(), (2, 8), 0, 16),
        (nn.SiLU(), (2, 8), 0, 16),
    ]
    for module, shape, macs, flops in cases:
        x = torch.randint(0, 10, (2, 3)) if shape is None else torch.randn(shape)
        prof = profile(module, x)
        assert prof.get_total_macs() == macs, module
        if isinstance(module, nn.RMSNorm):
            fused = "aten._fused_rms_norm" in prof.get_op_counts()
            flops = 4 * 16 if fused else 4 * 16 + 2 * 2
        assert prof.get_total_flops() == (2 * macs if flops is None else flops), module
        prof.end_profile()


def test_products_and_attention_worked_out_by_hand():
    a, b = torch.randn(2, 3, 4), torch.randn(4, 5)
    bb, bias = torch.randn(2, 4, 5), torch.randn(2, 3, 5)
    macs = 2 * 3 * 4 * 5
    for fn, args in [
        (torch.matmul, (a, b)),
        (lambda x, y: x @ y, (a, bb)),
        (torch.bmm, (a, bb)),
        (torch.baddbmm, (bias, a, bb)),  # the added matrix is not counted
        (lambda x, y: torch.einsum("bij,bjk->bik", x, y), (a, bb)),
        (lambda x, w: F.linear(x, w.t()), (a, b)),
    ]:
        prof = profile(Functional(fn), *args)
        assert (prof.get_total_flops(), prof.get_total_macs()) == (2 * macs, macs)
        prof.end_profile()

    # attention: q k^T and p v over the whole s_q x s_k square, causal or not (FlopCounterMode's rule)
    q, k, v = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 3)
    attention_macs = 1 * 2 * 6 * 6 * 8 + 1 * 2 * 6 * 6 * 3
    for causal in (False, True):
        fn = Functional(lambda q, k, v, c=causal: F.scaled_dot_product_attention(q, k, v, is_causal=c))
        prof = profile(fn, q, k, v)
        assert prof.get_total_macs() == attention_macs, causal
        with FlopCounterMode(display=False) as counter:
            fn(q, k, v)
        counted = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
        kernel = "aten._scaled_dot_product_flash_attention_for_cpu"
        if kernel in prof.get_op_counts():  # the CPU kernel, which FlopCounterMode has no rule for
            assert prof.get_total_flops() == 2 * attention_macs and not counted
        else:
            assert sum(counted.values()) == 2 * attention_macs
        prof.end_profile()


# ---------------------------------------------------------------------- against FlopCounterMode


def tiny_model(kind: str, attention: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(
            n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=32, bos_token_id=0, eos_token_id=0,
            attn_implementation=attention,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(config).eval()
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=32, attn_implementation=attention,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


# The one operator with MACs that FlopCounterMode has no rule for: the CPU's fused attention.
NOT_IN_FLOP_COUNTER = {"aten._scaled_dot_product_flash_attention_for_cpu"}


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_totals_against_flop_counter_mode(kind, attention):
    model, ids = tiny_model(kind, attention), torch.randint(0, 128, (2, 16))
    prof = profile(model, ids)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(ids)
    theirs = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    ours = prof.get_op_counts()
    for op, flops in theirs.items():  # every operator both count: the same number
        assert ours[op][0] == flops, op
    with_macs = {op for op, (flops, macs, calls) in ours.items() if macs}
    assert with_macs - set(theirs) <= NOT_IN_FLOP_COUNTER
    # what FlopCounterMode does not count: that kernel, and every non-product operator
    extra = sum(flops for op, (flops, macs, calls) in ours.items() if op not in theirs)
    assert prof.get_total_flops() == counter.get_total_flops() + extra
    assert prof.get_total_params() == sum(p.numel() for p in model.parameters())
    # the products are the same work whichever attention runs them
    eager = profile(tiny_model(kind, "eager"), ids)
    assert prof.get_total_macs() == eager.get_total_macs()
    eager.end_profile()
    prof.end_profile()


def test_get_model_profile_returns_upstreams_triple(tmp_path, capsys):
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    flops, macs, params = get_model_profile(model, input_shape=(3, 8), print_profile=False, as_string=False)
    assert (flops, macs, params) == (1200, 576, 212)
    assert capsys.readouterr().out == ""
    assert get_model_profile(model, args=[torch.randn(3, 8)], print_profile=False) == (
        "1.2 K",
        "576 MACs",
        "212",
    )
    out = tmp_path / "sub" / "profile.txt"
    get_model_profile(model, kwargs={"input": torch.randn(3, 8)}, output_file=str(out), top_modules=2)
    text = out.read_text()
    assert "Profile Summary at step 1:" in text and "fwd MACs per GPU:" in text
    assert (
        "depth 1:\n    params      - {'Linear': '212', 'ReLU': '0'}\n    MACs        - {'Linear': '576 MACs', 'ReLU': '0 MACs'}"
        in text
    )
    assert "(0): Linear(144, 67.92% Params, 384 MACs, 66.67% MACs," in text
    with pytest.raises(ValueError, match="input_shape, or args"):
        get_model_profile(model)
    assert number_to_string(1234567) == "1.23 M" and params_to_string(7e9) == "7 B"
    assert macs_to_string(3.13993e12) == "3.14 TMACs" and flops_to_string(0.5) == "500 mFLOPS"


# ---------------------------------------------------------------------- nothing left behind


def _installed_state(model: nn.Module) -> dict:
    return {
        "functional": {k: id(v) for k, v in vars(F).items()},
        "torch": {k: id(v) for k, v in vars(torch).items() if callable(v)},
        "tensor": {k: id(v) for k, v in vars(torch.Tensor).items()},
        "mode": _get_current_dispatch_mode(),
        "hooks": [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()],
        "attrs": [sorted(vars(m)) for m in model.modules()],
    }


def test_nothing_left_installed_after_end_profile():
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 2)))
    before = _installed_state(model)
    prof = FlopsProfiler(model)
    prof.start_profile()
    assert _get_current_dispatch_mode() is not None
    with pytest.raises(RuntimeError, match="already profiling"):
        prof.start_profile()
    model(torch.randn(2, 4))
    other = FlopCounterMode(display=False)
    other.__enter__()
    with pytest.raises(RuntimeError, match="another TorchDispatchMode"):
        prof.stop_profile()  # refused, and nothing changed: it can be stopped once the other is left
    other.__exit__(None, None, None)
    prof.stop_profile()
    assert _get_current_dispatch_mode() is None
    prof.end_profile()
    assert _installed_state(model) == before

    def fail(module, args):
        raise ValueError("boom")

    handle = model[1][1].register_forward_pre_hook(fail)
    before = _installed_state(model)
    with pytest.raises(ValueError, match="boom"):
        get_model_profile(model, input_shape=(2, 4), print_profile=False)
    assert _installed_state(model) == before  # a forward that raised leaves nothing either
    handle.remove()


# ---------------------------------------------------------------------- config


def test_config_section_typed_with_upstreams_defaults():
    cfg = DeepSpeedConfig({"train_batch_size": 1})
    fp = cfg.flops_profiler_config
    assert (fp.enabled, fp.recompute_fwd_factor, fp.profile_step, fp.module_depth) == (False, 0.0, 1, -1)
    assert (fp.top_modules, fp.detailed, fp.output_file) == (1, True, None)
    assert not cfg.wall_clock_breakdown
    cfg = DeepSpeedConfig({"train_batch_size": 1, "flops_profiler": {"enabled": True, "profile_step": 3}})
    assert cfg.flops_profiler_config.profile_step == 3 and cfg.wall_clock_breakdown  # as upstream
    assert not DeepSpeedConfig({"train_batch_size": 1, "flops_profiler": None}).flops_profiler_config.enabled
    with pytest.raises(ValueError, match="flops_profiler.recompute_fwd_factor"):
        DeepSpeedConfig({"train_batch_size": 1, "flops_profiler": {"recompute_fwd_factor": 2.0}})


# ---------------------------------------------------------------------- ZeRO-3 and the engine


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(23, 12)
        self.up = nn.Linear(12, 37)
        self.down = nn.Linear(37, 12)
        self.norm = nn.LayerNorm(12)
        self.head = nn.Linear(12, 23)

    def forward(self, ids):
        h = self.embed(ids)
        h = self.norm(h + self.down(F.gelu(self.up(h))))
        return self.head(h).float().logsumexp(-1).mean()


def _engine_config(**extra) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3},
        **extra,
    }


class TestZero3Profile(DistributedTest):
    world_size = 2

    def test_full_size_parameters_and_the_engine_config_path(self, tmp_path):
        ids = torch.randint(0, 23, (2, 5))
        torch.manual_seed(0)
        reference = profile(TinyLM(), ids)
        output = tmp_path / "flops" / "profile.txt"
        cfg = _engine_config(flops_profiler={"enabled": True, "profile_step": 1, "output_file": str(output)})
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = TinyLM()
        assert all(p.numel() == 0 for p in model.parameters())  # partitioned: empty until gathered
        engine, *_ = deepspeed.initialize(model=model, config=cfg)

        # the API around a ZeRO-3 engine's forward: the same figures as the whole model's
        prof = FlopsProfiler(engine.module)
        prof.start_profile()
        engine(ids)
        prof.stop_profile()
        assert (
            prof.get_total_params()
            == reference.get_total_params()
            == sum(p.ds_numel for p in model.parameters())
        )
        assert prof.get_total_flops() == reference.get_total_flops()
        assert prof.get_total_macs() == reference.get_total_macs()
        assert prof.get_op_counts() == reference.get_op_counts()
        prof.end_profile()

        # the config path: rank 0 profiles global step 1's forward and writes at its step()
        for step in range(3):
            loss = engine(ids)
            assert _get_current_dispatch_mode() is None  # stopped after the forward
            engine.backward(loss)
            engine.step()
            deepspeed.comm.barrier()
            assert output.exists() == (step >= 1), step  # only rank 0 writes it, at step 1
        text = output.read_text()
        assert "Profile Summary at step 1:" in text
        assert f"params per GPU:{' ' * 57}{params_to_string(reference.get_total_params())}" in text
        assert f"fwd MACs per GPU:{' ' * 55}{macs_to_string(reference.get_total_macs())}" in text
        for label in ("world size:", "bwd latency:", "step latency:", "samples/second:", "TinyLM("):
            assert label in text
        assert "world size:" + " " * 61 + "2" in text
        assert engine.flops_profiler is not None and not engine.flops_profiler.started
        assert all("__flops__" not in vars(m) for m in engine.module.modules())


def test_get_model_profile_of_generate():
    model, ids = tiny_model("gpt2", "sdpa"), torch.randint(1, 128, (1, 16))
    forward, _, _ = get_model_profile(model, args=[ids], print_profile=False, as_string=False)
    kwargs = {
        "input_ids": ids,
        "max_new_tokens": 3,
        "min_new_tokens": 3,
        "do_sample": False,
        "pad_token_id": 0,
    }
    generate, _, params = get_model_profile(
        model, kwargs=kwargs, mode="generate", warm_up=0, print_profile=False, as_string=False
    )
    # the prompt's forward, then one forward per further token (over the cache)
    assert forward < generate < 2 * forward and params == sum(p.numel() for p in model.parameters())
    with pytest.raises(ValueError, match="mode='backward'"):
        get_model_profile(model, args=[ids], mode="backward")
