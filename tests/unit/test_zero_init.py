"""zero.Init and partitioned parameters on spawned gloo groups, against same-seed plain models."""

import gc
import inspect
import math
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

import deepspeed
import deepspeed.comm as dist
from deepspeed.runtime.zero import partition_parameters as pp
from deepspeed.runtime.zero.lifecycle import ZeroParamStatus, shard_sizes
from deepspeed.runtime.zero.patching import ORIGINAL_FACTORIES, originals_in_place
from tests.unit.common import DistributedTest


class Block(nn.Module):
    def __init__(self, width: int, odd: int):
        super().__init__()
        self.proj = nn.Linear(width, odd)  # odd sizes exercise padding
        self.norm = nn.LayerNorm(odd)
        self.scale = nn.Parameter(torch.randn(odd))
        self.register_buffer("steps", torch.zeros(1))

    def forward(self, x):
        return self.norm(self.proj(x)) * self.scale


class TinyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.block = Block(6, 7)
        self.head = nn.Linear(7, 3, bias=False)

    def forward(self, ids):
        return self.head(self.block(self.embed(ids)))


def build_reference(seed=1234):
    torch.manual_seed(seed)
    return TinyModel()


def gathered_copy(model):
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_equals_reference(model, reference):
    got = gathered_copy(model)
    for name, p in reference.named_parameters():
        assert torch.equal(got[name], p.detach()), name


class TestInitParity(DistributedTest):
    world_size = [1, 2, 4]

    def test_explicit_and_with_match_reference(self):
        ws, rank = dist.get_world_size(), dist.get_rank()
        reference = build_reference()

        torch.manual_seed(1234)
        init = deepspeed.zero.Init()
        assert init.start() is init
        explicit = TinyModel()
        assert init.stop() is None

        torch.manual_seed(1234)
        with deepspeed.zero.Init() as entered:
            assert isinstance(entered, deepspeed.zero.Init)
            with_model = TinyModel()

        assert originals_in_place()
        for model in (explicit, with_model):
            for name, p in model.named_parameters():
                ref = dict(reference.named_parameters())[name]
                assert p.ds_status is ZeroParamStatus.NOT_AVAILABLE
                assert p.data.shape == torch.Size([0]), name
                assert p.ds_shape == ref.shape and p.ds_numel == ref.numel()
                size, pad = shard_sizes(ref.numel(), ws)
                assert size == math.ceil(ref.numel() / ws) and p.partition_numel() == size
                assert p.padding_size() == pad and p.ds_tensor.numel() == size
                # this rank's shard is exactly its slice of the flat reference, zero padded
                flat = torch.cat([ref.detach().reshape(-1), torch.zeros(pad)])
                assert torch.equal(p.ds_tensor, flat[rank * size : (rank + 1) * size])
            assert_equals_reference(model, reference)
            assert not any(hasattr(b, "ds_id") for b in model.buffers())  # buffers stay whole

        ids = [p.ds_id for p in explicit.parameters()]
        assert len(set(ids)) == len(ids)
        everyone = [None] * ws
        dist.all_gather_object(everyone, ids)
        assert all(other == ids for other in everyone)  # ds_id agrees across ranks

    def test_ranks_agree_despite_different_seeds(self):
        torch.manual_seed(100 + dist.get_rank())  # rank-dependent init: rank 0's wins
        with deepspeed.zero.Init():
            model = nn.Linear(5, 5)
        full = gathered_copy(model)["weight"]
        everyone = [torch.empty_like(full) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, full)
        assert all(torch.equal(full, other) for other in everyone)

    def test_torch_transformer_parent_init_and_deepcopy(self):
        """MultiheadAttention zeroes its child's bias after building it; the encoder deep-copies."""

        def build():
            torch.manual_seed(5)
            layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=12, dropout=0.0, batch_first=True)
            return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

        reference = build()
        with deepspeed.zero.Init():
            model = build()
        ids = [p.ds_id for p in model.parameters()]
        assert len(set(ids)) == len(ids)  # copies got their own ds_ids
        assert_equals_reference(model, reference)
        bias = model.layers[0].self_attn.out_proj.bias
        assert torch.all(gathered_copy(model)["layers.0.self_attn.out_proj.bias"] == 0)
        with torch.no_grad():
            bias.fill_(3.0)  # outside Init an in-place call on a partitioned parameter is a no-op
        assert bias.ds_status is ZeroParamStatus.NOT_AVAILABLE

    def test_module_argument_converts_built_model(self):
        reference = build_reference()
        model = build_reference()
        deepspeed.zero.Init(module=model)
        assert all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE for p in model.parameters())
        assert_equals_reference(model, reference)

    def test_forward_under_gather_matches_reference(self):
        reference = build_reference()
        torch.manual_seed(1234)
        with deepspeed.zero.Init():
            model = TinyModel()
        ids = torch.tensor([[1, 2, 3], [4, 5, 10]])
        with deepspeed.zero.GatheredParameters(model.parameters()):
            out = model(ids)
        assert torch.equal(out, reference(ids))

    def test_param_api(self):
        with deepspeed.zero.Init():
            layer = nn.Linear(4, 3)
        w = layer.weight
        assert w.ds_process_group is dist.get_world_group() and w.ds_persist is False
        world = dist.get_world_group()
        with pytest.raises(ValueError, match="both data_parallel_group and sequence_data_parallel_group"):
            deepspeed.zero.Init(data_parallel_group=world, sequence_data_parallel_group=world)
        assert w.ds_active_sub_modules == set()
        summary = w.ds_summary()
        assert summary["ds_shape"] == (3, 4) and summary["status"] == "NOT_AVAILABLE"
        w.all_gather()
        assert w.ds_status is ZeroParamStatus.AVAILABLE and w.shape == (3, 4)
        w.data.fill_(2.0)
        w.partition(has_been_updated=True)  # keeps the edit
        assert w.ds_status is ZeroParamStatus.NOT_AVAILABLE and w.data.shape == (0,)
        handle = w.all_gather(async_op=True)
        handle.wait()
        assert torch.all(w.data == 2.0)
        w.data.fill_(5.0)
        w.partition()  # has_been_updated=False: the edit is lost
        handle = w.all_gather_coalesced([layer.weight, layer.bias])
        handle.wait()
        assert torch.all(layer.weight.data == 2.0) and layer.bias.shape == (3,)
        layer.weight.partition(param_list=[layer.weight, layer.bias])
        assert layer.bias.ds_status is ZeroParamStatus.NOT_AVAILABLE
        w.all_gather()
        with pytest.raises(NotImplementedError, match="free_data=False"):
            w.partition(free_data=False)  # would leave a full tensor behind a partitioned status
        assert w.ds_status is ZeroParamStatus.AVAILABLE  # refused before anything changed
        w.partition()
        # As upstream: gathering an all_gather()-ed parameter again does nothing, and one
        # partition() frees it (it was counted: two gathers needed two partitions).
        w.all_gather()
        w.all_gather(async_op=True).wait()
        layer.weight.all_gather_coalesced([layer.weight]).wait()
        w.partition()
        assert w.ds_status is ZeroParamStatus.NOT_AVAILABLE and w.data.shape == (0,)
        # ds_persist, settable as upstream's: a persistent parameter stays gathered once gathered.
        w.ds_persist = True
        w.all_gather()
        w.partition()
        assert w.ds_status is ZeroParamStatus.AVAILABLE and w.data.shape == (3, 4)
        w.ds_persist = False  # nobody holds it: freed at once
        assert w.ds_status is ZeroParamStatus.NOT_AVAILABLE and w.data.shape == (0,)

    def test_item_gathers_a_partitioned_scalar(self):
        """`param.item()` reads the value of a partitioned one-element parameter (upstream
        gathers first); it stays partitioned after, and an available one reads as it is."""

        class Scaled(nn.Module):
            def __init__(self):
                super().__init__()
                self.temperature = nn.Parameter(torch.tensor(2.5))

        with deepspeed.zero.Init():
            model = Scaled()
        t = model.temperature
        assert t.ds_status is ZeroParamStatus.NOT_AVAILABLE
        assert t.item() == 2.5
        assert t.ds_status is ZeroParamStatus.NOT_AVAILABLE and t.data.shape == (0,)
        with deepspeed.zero.GatheredParameters(t, modifier_rank=0):
            t.data.fill_(-1.0)
            assert t.item() == -1.0
        assert t.item() == -1.0


class TestInitDtypeAndFactories(DistributedTest):
    world_size = [2]

    def test_dtype_sources(self):
        with deepspeed.zero.Init(config_dict_or_path={"bf16": {"enabled": True}}):
            bf16 = nn.Linear(3, 3)
        with deepspeed.zero.Init(config_dict_or_path={"fp16": {"enabled": True}}):
            fp16 = nn.Linear(3, 3)
        with deepspeed.zero.Init(config_dict_or_path={"fp16": {"enabled": True}}, dtype=torch.float64):
            explicit = nn.Linear(3, 3)  # an explicit dtype is always honoured
        with deepspeed.zero.Init():
            fp32 = nn.Linear(3, 3)
        assert bf16.weight.ds_tensor.dtype == torch.bfloat16
        assert fp16.weight.ds_tensor.dtype == torch.float16
        assert explicit.weight.ds_tensor.dtype == torch.float64
        assert fp32.weight.ds_tensor.dtype == torch.float32

    def test_factories_patched_only_while_active(self):
        init = deepspeed.zero.Init(dtype=torch.bfloat16).start()
        try:
            assert torch.empty(2).dtype == torch.bfloat16
            assert torch.zeros(2, dtype=torch.float32).dtype == torch.bfloat16  # floating is cast
            assert torch.arange(4).dtype == torch.int64  # integers are left alone
            assert torch.tensor([1, 2]).dtype == torch.int64
            assert torch.randn(2).device.type == "cpu"
            assert torch.full((2,), 1.5).dtype == torch.bfloat16
            assert torch.eye(2).dtype == torch.bfloat16 and torch.ones(1).dtype == torch.bfloat16
        finally:
            init.stop()
        assert torch.empty(2).dtype == torch.float32 and originals_in_place()

    def test_swapped_wrapper_is_looked_up_at_start(self):
        calls = []
        original = pp.zero_wrapper_for_fp_tensor_constructor

        def spy(fn, dtype):
            calls.append(fn.__name__)
            return original(fn, dtype)

        pp.zero_wrapper_for_fp_tensor_constructor = spy
        try:
            with deepspeed.zero.Init():
                pass
        finally:
            pp.zero_wrapper_for_fp_tensor_constructor = original
        assert "empty" in calls and "arange" in calls
        assert pp._orig_torch_arange is ORIGINAL_FACTORIES["arange"]

    def test_nested_innermost_governs_and_lifo(self):
        outer = deepspeed.zero.Init(dtype=torch.float16).start()
        inner = deepspeed.zero.Init(dtype=torch.bfloat16).start()
        inner_layer = nn.Linear(2, 2)
        with pytest.raises(RuntimeError, match="inner zero.Init"):
            outer.stop()  # out of order: names both, changes nothing
        inner.stop()
        outer_layer = nn.Linear(2, 2)  # the outer one governs again
        outer.stop()
        assert inner_layer.weight.ds_tensor.dtype == torch.bfloat16
        assert outer_layer.weight.ds_tensor.dtype == torch.float16
        assert originals_in_place()

    def test_apply_gathers_and_broadcasts_from_rank0(self):
        def init_weights(module):
            if isinstance(module, nn.Linear):
                # each rank draws a different value; rank 0's must be what all keep
                module.weight.data.fill_(float(dist.get_rank() + 1))

        from deepspeed.runtime.zero.patching import _orig_module_apply

        with deepspeed.zero.Init():
            model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2))
            assert nn.Module.apply is not _orig_module_apply
            model.apply(init_weights)
        assert nn.Module.apply is _orig_module_apply
        full = gathered_copy(model)
        assert torch.all(full["0.weight"] == 1.0) and torch.all(full["1.weight"] == 1.0)

    def test_dynamic_and_mixin_classes(self):
        class Mixin:
            def __init__(self, width):
                nn.Module.__init__(self)
                self.w = nn.Parameter(torch.ones(width))

        with deepspeed.zero.Init():

            class DefinedWhileActive(nn.Module):
                def __init__(self):
                    super().__init__()
                    self.p = nn.Parameter(torch.ones(5))

            class Derived(Block):
                def __init__(self):
                    super().__init__(4, 3)
                    self.scale.data.fill_(7.0)  # tweaks what the parent made, before partitioning

            class WithMixin(Mixin, nn.Module):
                pass

            dynamic, derived, mixed = DefinedWhileActive(), Derived(), WithMixin(5)
        assert originals_in_place()
        assert "__init__" not in WithMixin.__dict__
        assert dynamic.p.ds_status is ZeroParamStatus.NOT_AVAILABLE
        assert mixed.w.ds_status is ZeroParamStatus.NOT_AVAILABLE
        assert torch.all(gathered_copy(derived)["scale"] == 7.0)
        assert torch.all(gathered_copy(dynamic)["p"] == 1.0)


class TestInitRemoteDevice(DistributedTest):
    world_size = [2]

    def test_offload_param_from_config(self):
        cfg = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True}}}
        init = deepspeed.zero.Init(config_dict_or_path=cfg)
        assert init.remote_device == "cpu" and init.pin_memory
        with init:
            layer = nn.Linear(3, 3)
        from deepspeed.runtime.zero.lifecycle import ZeroParamType

        assert layer.weight.ds_param_type is ZeroParamType.REMOTE
        nvme = {"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": "/tmp"}}}
        assert deepspeed.zero.Init(config_dict_or_path=nvme).remote_device == "nvme"  # test_param_swap.py
        del nvme["zero_optimization"]["offload_param"]["nvme_path"]
        with pytest.raises(ValueError, match="offload_param.device='nvme' needs .*nvme_path"):
            deepspeed.zero.Init(config_dict_or_path=nvme)

    def test_failed_start_leaves_no_stale_entry(self, monkeypatch):
        def broken(fn, dtype):
            raise OSError("wrapper failed")

        monkeypatch.setattr(pp, "zero_wrapper_for_fp_tensor_constructor", broken)
        init = deepspeed.zero.Init()
        with pytest.raises(OSError):
            init.start()
        assert pp._INIT_STACK.active == [] and originals_in_place()
        assert not init._tracker.active
        monkeypatch.undo()
        init.start().stop()

    def test_remote_cpu_and_pause(self):
        from deepspeed.runtime.zero.lifecycle import ZeroParamType

        init = deepspeed.zero.Init(remote_device="cpu", pin_memory=True).start()
        layer = nn.Linear(4, 4)
        pp.shutdown_init_context()
        plain = nn.Linear(4, 4)  # built while paused: not partitioned
        assert originals_in_place()
        pp.restore_init_context()
        again = nn.Linear(4, 4)
        init.stop()
        assert (
            layer.weight.ds_param_type is ZeroParamType.REMOTE and layer.weight.ds_tensor.device.type == "cpu"
        )
        assert not hasattr(plain.weight, "ds_id")
        assert again.weight.ds_status is ZeroParamStatus.NOT_AVAILABLE


class TestInitMisuse:
    """Single process: misuse must be loud even without ZeRO."""

    def test_tracker_misuse(self):
        init = deepspeed.zero.Init(enabled=False)
        with pytest.raises(RuntimeError, match=r"zero.Init\(.*enabled=False\)\.stop\(\) .*never started"):
            init.stop()
        init.start()
        with pytest.raises(RuntimeError, match="already active"):
            init.start()
        init.stop()
        init.start().stop()  # restartable

    def test_bad_arguments(self):
        with pytest.raises(ValueError, match="remote_device='nvme'"):
            deepspeed.zero.Init(remote_device="nvme")
        with pytest.raises(ValueError, match="dtype=torch.int32"):
            deepspeed.zero.Init(dtype=torch.int32)
        with pytest.raises(ValueError, match="config.json' does not exist"):
            deepspeed.zero.Init(config_dict_or_path="/no/such/config.json")
        with pytest.raises(NotImplementedError, match="quantized"):
            deepspeed.zero.Init(zero_quantized_weights=True)
        with pytest.raises(NotImplementedError, match="zero_param_parallel_group .*hpZ"):
            deepspeed.zero.Init(zero_param_parallel_group=object())
        # Accepted: the modules it builds keep torch's F.linear (test_linear_saved.py).
        assert deepspeed.zero.Init(mem_efficient_linear=False).mem_efficient_linear is False
        # Upstream's defaults parse.
        deepspeed.zero.Init(zero_param_parallel_group=None, mem_efficient_linear=True)

    def test_patches_undone_after_exception(self):
        class Boom(nn.Module):
            def __init__(self):
                super().__init__()
                self.w = nn.Parameter(torch.empty(3))
                raise KeyError("boom")

        with pytest.raises(KeyError):
            with deepspeed.zero.Init():
                Boom()
        assert originals_in_place()
        for name, original in ORIGINAL_FACTORIES.items():
            assert getattr(torch, name) is original
        assert nn.Linear.__init__.__qualname__ == "Linear.__init__"

    def test_context_methods_hold_no_logic(self):
        for cls in (deepspeed.zero.Init, deepspeed.zero.GatheredParameters):
            enter = inspect.getsource(cls.__enter__).strip().splitlines()
            exit_ = inspect.getsource(cls.__exit__).strip().splitlines()
            assert enter[-1].strip() == "return self.start()" and len(enter) == 2
            assert exit_[-1].strip() == "self.stop()" and len(exit_) == 2

    def test_leak_warning_names_start_site(self):
        init = deepspeed.zero.Init(enabled=False).start()
        assert any("zero.Init" in d for d, _ in deepspeed.zero.live_contexts())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            del init
            gc.collect()
        messages = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
        assert messages and "test_zero_init.py" in messages[0]
        assert not deepspeed.zero.live_contexts()

    def test_context_alive_at_interpreter_exit_exits_quietly(self):
        # Shutdown clears the tracker module's globals before the last owners are collected.
        script = "import deepspeed\nctx = deepspeed.zero.Init(enabled=False).start()\n"
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "Exception ignored" not in done.stderr, done.stderr
