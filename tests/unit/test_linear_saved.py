"""ZeRO-3's nn.Linear: autograd keeps no gathered weight from forward to backward
([Note: what autograd keeps of a gathered weight] in deepspeed/runtime/zero/linear.py)."""

import copy
import io

import torch
from torch import nn

import deepspeed
import deepspeed.comm as dist
import deepspeed.runtime.zero.gather as gather
from deepspeed.runtime.zero.linear import LinearSavingParameter, route_linears
from tests.unit.common import DistributedTest

LAYERS, WIDTH = 6, 64


def _config():
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_max_reuse_distance": 0,  # release after each layer: nothing kept for reuse
            "stage3_prefetch_bucket_size": 0,
        },
    }


def _model(seed=3):
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(LAYERS)])


class _SelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = nn.MultiheadAttention(WIDTH, 4)

    def forward(self, x):
        seq = x.view(x.shape[0], 2, WIDTH).transpose(0, 1)  # each row: a sequence of two tokens
        return self.attention(seq, seq, seq, need_weights=False)[0].transpose(0, 1).reshape(x.shape)


def _attention_model(seed=3):
    torch.manual_seed(seed)
    return nn.Sequential(*[_SelfAttention() for _ in range(LAYERS // 2)])


class TestLinearSavesTheParameter(DistributedTest):
    world_size = [2]

    def test_gathered_weights_are_free_after_forward_and_training_matches(self):
        self._check(_model, gathers=LAYERS, features=WIDTH)

    def test_attention_projections_too(self):
        # Each attention gathers its in-projection, and its out_proj (a Linear) apart.
        self._check(_attention_model, gathers=LAYERS // 2, features=2 * WIDTH)

    def test_persistent_weights_after_empty_partition_cache(self):
        # Small layers stay gathered (persistent); empty_partition_cache() partitions them, and
        # the next forward gathers them where torch first touches them: the routed Linear must
        # too, before autograd records the weight's shape.
        config = _config()
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 10**6
        engine, *_ = deepspeed.initialize(model=_model(), config=config)
        self._train_against_plain(engine, seed=5, before_forward=engine.empty_partition_cache)

    def test_init_without_mem_efficient_linear_keeps_torch_linear(self):
        # Upstream's opt-out: the Linears this Init builds are not routed, so autograd keeps
        # a view of each gathered weight until backward; training is the same.
        with deepspeed.zero.Init(config_dict_or_path=_config(), mem_efficient_linear=False):
            model = _model()
        engine, *_ = deepspeed.initialize(model=model, config=_config())
        linears = [m for m in engine.module.modules() if isinstance(m, nn.Linear)]
        assert len(linears) == LAYERS and all("forward" not in vars(m) for m in linears)
        self._train_against_plain(engine, seed=7)

    @staticmethod
    def _train_against_plain(engine, seed, before_forward=lambda: None):
        """Two steps of the engine (this rank's rows) and of a plain model on whole batches."""
        reference = _model()
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        rank = dist.get_rank()
        gen = torch.Generator().manual_seed(seed)
        for _ in range(2):
            before_forward()
            batch = torch.randn(4, WIDTH, generator=gen)
            loss = engine(batch[2 * rank : 2 * rank + 2]).pow(2).mean()
            assert loss.grad_fn is not None
            engine.backward(loss)
            engine.step()
            ref_opt.zero_grad()
            reference(batch).pow(2).mean().backward()
            ref_opt.step()
        for name, p in reference.named_parameters():
            got = dict(engine.module.named_parameters())[name]
            with deepspeed.zero.GatheredParameters(got):
                torch.testing.assert_close(got.data, p.detach(), rtol=1e-5, atol=1e-6, msg=name)

    @staticmethod
    def _check(build, gathers, features):
        taken = []
        original_take = gather.FULLS.take

        def take(*args, **kwargs):
            buffer = original_take(*args, **kwargs)
            taken.append(buffer)
            return buffer

        reference = build()
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        engine, *_ = deepspeed.initialize(model=build(), config=_config())
        gen = torch.Generator().manual_seed(11)
        rank = dist.get_rank()
        gather.FULLS.take = take
        try:
            for _ in range(3):
                batch = torch.randn(4, features, generator=gen)
                taken.clear()
                loss = engine(batch[2 * rank : 2 * rank + 2]).pow(2).mean()
                # Every Linear's gathered weight was released with its module, and nothing
                # (autograd's saved tensors included) shares its buffer any more.
                assert len(taken) >= gathers, len(taken)
                assert all(b.storage_refs() == b.refs for b in taken), len(taken)
                engine.backward(loss)
                engine.step()
                ref_opt.zero_grad()
                reference(batch).pow(2).mean().backward()
                ref_opt.step()
        finally:
            gather.FULLS.take = original_take
        for name, p in reference.named_parameters():
            got = dict(engine.module.named_parameters())[name]
            with deepspeed.zero.GatheredParameters(got):
                torch.testing.assert_close(got.data, p.detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_function_matches_f_linear_and_its_gradients():
    torch.manual_seed(0)
    for shape, bias in (((5, 7), True), ((2, 3, 7), True), ((7,), True), ((4, 7), False)):
        layer = nn.Linear(7, 4, bias=bias)
        x = torch.randn(*shape, requires_grad=True)
        expected = nn.functional.linear(x, layer.weight, layer.bias)
        expected.pow(2).sum().backward()
        want = [t.grad.clone() for t in (x, layer.weight, layer.bias) if t is not None]
        for t in (x, layer.weight, layer.bias):
            if t is not None:
                t.grad = None
        got = LinearSavingParameter.apply(x, layer.weight, layer.bias)
        assert torch.equal(got, expected), shape  # the same addmm as F.linear
        got.pow(2).sum().backward()
        have = [t.grad for t in (x, layer.weight, layer.bias) if t is not None]
        for a, b in zip(have, want):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


class _CustomLinear(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


def test_route_linears_leaves_custom_forwards_and_autocast_alone():
    model = nn.Sequential(nn.Linear(3, 3), _CustomLinear(3, 3))
    assert route_linears(model) == 1 and "forward" in vars(model[0]) and "forward" not in vars(model[1])
    assert route_linears(model) == 0  # already routed
    x = torch.randn(2, 3)
    # The routed module still pickles whole and deep-copies, routed to its copy.
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    copied = copy.deepcopy(model)
    for twin in (loaded, copied):
        assert twin[0].forward.args[0] is twin[0]
        torch.testing.assert_close(twin(x), model(x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model[0](x)
    assert out.dtype == torch.bfloat16 and out.grad_fn.name() != "LinearSavingParameterBackward"


def test_upstream_names_compute_torchs_linear():
    """`LinearFunctionForZeroStage3` (bias optional), `zero3_linear_wrap` and
    `LinearModuleForZeroStage3`: torch's linear, values and gradients."""
    from deepspeed.runtime.zero.linear import (
        LinearFunctionForZeroStage3,
        LinearModuleForZeroStage3,
        zero3_linear_wrap,
    )

    torch.manual_seed(0)
    x, w, b = torch.randn(2, 3, 4), torch.randn(5, 4), torch.randn(5)
    for call in (LinearFunctionForZeroStage3.apply, zero3_linear_wrap):
        for args in ((x, w), (x, w, b)):
            ours = [a.clone().requires_grad_() for a in args]
            theirs = [a.clone().requires_grad_() for a in args]
            call(*ours).square().sum().backward()
            torch.nn.functional.linear(*theirs).square().sum().backward()
            for a, t in zip(ours, theirs):
                torch.testing.assert_close(a.grad, t.grad)
    module = LinearModuleForZeroStage3(4, 5)
    assert isinstance(module, torch.nn.Linear)
    torch.testing.assert_close(module(x), torch.nn.functional.linear(x, module.weight, module.bias))
