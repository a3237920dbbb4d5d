"""GatheredParameters: start()/stop() and `with` on spawned gloo groups, against plain runs."""

import contextlib
import copy as copy_module
import gc
import warnings
import weakref

import numpy
import pytest
import torch
from torch import nn

import deepspeed
import deepspeed.comm as dist
from deepspeed.runtime.zero.lifecycle import ZeroParamStatus
from tests.unit.common import DistributedTest
from tests.unit.common import world_size as run_at

VOCAB, NEW_VOCAB, HIDDEN = 13, 17, 6


def build_heads(zero3: bool, seed: int = 7):
    """An old and a new LM head, built under Init when `zero3`."""
    init = deepspeed.zero.Init(enabled=zero3).start()
    torch.manual_seed(seed)
    old = nn.Linear(HIDDEN, VOCAB, bias=True)
    new = nn.Linear(HIDDEN, NEW_VOCAB, bias=True)
    init.stop()
    return old, new


def resize_written_once(old, new, zero3: bool):
    """HF transformers' LM-head copy (the proposal), written once for ZeRO-3 and plain runs.

    Every rank copies; with ZeRO-3, rank 0's result is broadcast (`modifier_rank=0`).
    """
    n = min(VOCAB, NEW_VOCAB)
    params = [old.weight, old.bias, new.weight, new.bias]
    gather = deepspeed.zero.GatheredParameters(params, modifier_rank=0, enabled=zero3).start()
    new.weight.data[:n, :] = old.weight.data[:n, :]
    new.bias.data[:n] = old.bias.data[:n]
    gather.stop()


def resize_with_block(old, new):
    """The proposal's ZeRO-3 branch as upstream users write it: only rank 0 edits."""
    n = min(VOCAB, NEW_VOCAB)
    with deepspeed.zero.GatheredParameters([old.weight, old.bias, new.weight, new.bias], modifier_rank=0):
        if dist.get_rank() == 0:
            new.weight.data[:n, :] = old.weight.data[:n, :]
            new.bias.data[:n] = old.bias.data[:n]


def full_copy(*params):
    with deepspeed.zero.GatheredParameters(list(params)):
        return [p.detach().clone() for p in params]


def pad_bytes(param):
    """Bytes of padding after `param`'s elements in its gathered buffer (world x partition size)."""
    return (param.partition_numel() * dist.get_world_size() - param.ds_numel) * param.element_size()


class CountingComm:
    """Counts the facade collectives that ZeRO code calls (STYLE 12)."""

    def __init__(self, monkeypatch):
        self.calls = []
        # An all-gather is one of two calls: into one tensor, or split into columns as it lands.
        kinds = {"all_gather_into_tensor": "all_gather", "all_gather_into_columns": "all_gather"}
        for name in ("all_gather_into_tensor", "all_gather_into_columns", "broadcast", "all_reduce"):
            original = getattr(dist, name)
            monkeypatch.setattr(dist, name, self._wrap(kinds.get(name, name), original))

    def _wrap(self, kind, original):
        def counted(*args, **kwargs):
            self.calls.append(kind)
            return original(*args, **kwargs)

        return counted

    def count(self, name):
        return self.calls.count(name)


class TestLmHeadResize(DistributedTest):
    world_size = [1, 2, 4]

    def test_three_ways_agree(self):
        plain_old, plain_new = build_heads(zero3=False)
        resize_written_once(plain_old, plain_new, zero3=False)

        explicit_old, explicit_new = build_heads(zero3=True)
        resize_written_once(explicit_old, explicit_new, zero3=True)

        with_old, with_new = build_heads(zero3=True)
        resize_with_block(with_old, with_new)

        for old, new in ((explicit_old, explicit_new), (with_old, with_new)):
            assert all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE for p in (old.weight, new.weight))
            got = full_copy(new.weight, new.bias, old.weight)
            want = [plain_new.weight, plain_new.bias, plain_old.weight]
            for g, w in zip(got, want):
                assert torch.equal(g, w.detach())

    def test_modifier_rank_change_reaches_every_rank(self):
        _, new = build_heads(zero3=True)
        last = dist.get_world_size() - 1
        gather = deepspeed.zero.GatheredParameters(new.weight, modifier_rank=last).start()
        new.weight.data.fill_(float(dist.get_rank()))  # only rank `last`'s value may survive
        gather.stop()
        (weight,) = full_copy(new.weight)
        assert torch.all(weight == float(last))

    def test_modifier_rank_write_back_of_a_whole_module(self, monkeypatch):
        """A whole module's gathered tensors are views of one buffer, broadcast as it in one
        collective; a tensor the body put in a parameter's place goes the per-tensor way."""
        _, new = build_heads(zero3=True)
        last = dist.get_world_size() - 1
        sent = []  # (address, elements) of each broadcast tensor
        original = dist.broadcast
        monkeypatch.setattr(
            dist,
            "broadcast",
            lambda t, *a, **k: sent.append((t.data_ptr(), t.numel())) or original(t, *a, **k),
        )
        whole = dist.get_world_size() * (new.weight.partition_numel() + new.bias.partition_numel())
        for replace in (False, True):
            sent.clear()
            with deepspeed.zero.GatheredParameters(new.parameters(), modifier_rank=last):
                buffer = (new.weight.data.data_ptr(), whole)  # the weight comes first in the module's buffer
                if replace:
                    new.weight.data = torch.full_like(new.weight.data, 10.0 + dist.get_rank())
                else:
                    new.weight.data.fill_(float(dist.get_rank()))
                new.bias.data.fill_(-1.0 - dist.get_rank())
            weight, bias = full_copy(new.weight, new.bias)
            assert torch.all(weight == (10.0 + last if replace else float(last))), replace
            assert torch.all(bias == -1.0 - last), replace
            # The whole buffer, padding included; else the tensors themselves.
            assert sent == [buffer] if not replace else buffer not in sent, (replace, sent, buffer)


class TestGatherMechanics(DistributedTest):
    world_size = [1, 2, 4]

    def test_one_all_gather_per_group_and_dtype(self, monkeypatch):
        with deepspeed.zero.Init():
            layers = nn.ModuleList(nn.Linear(3, 5) for _ in range(25))  # 50 parameters
        with deepspeed.zero.Init(dtype=torch.bfloat16):
            half = nn.ModuleList(nn.Linear(2, 3) for _ in range(5))
        counter = CountingComm(monkeypatch)
        params = list(layers.parameters())
        assert len(params) == 50
        with deepspeed.zero.GatheredParameters(params):
            assert all(p.shape == p.ds_shape for p in params)
        assert counter.count("all_gather") == 1

        counter.calls.clear()
        gather = deepspeed.zero.GatheredParameters(params + list(half.parameters())).start()
        gather.stop()
        assert counter.count("all_gather") == 2  # fp32 and bf16

        counter.calls.clear()
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
            pass
        assert counter.count("broadcast") == 1  # the write-back is coalesced too

    @run_at(2)
    def test_only_a_partitioned_parameter_pays_the_dispatch(self):
        """A gathered parameter's class disables torch-function dispatch; a partitioned one's
        intercepts (parameter.py's note): the class follows the status through every change."""
        from deepspeed.runtime.zero.parameter import GatheredZeroParameter, ZeroParameter

        disabled = torch._C._disabled_torch_function_impl
        with deepspeed.zero.Init():
            layer = nn.Linear(4, 6)
        weight = layer.weight
        assert type(weight) is ZeroParameter and weight.ds_status is ZeroParamStatus.NOT_AVAILABLE
        assert type(weight).__torch_function__ is not disabled
        gather = deepspeed.zero.GatheredParameters(weight).start()
        assert type(weight) is GatheredZeroParameter and type(weight).__torch_function__ is disabled
        assert isinstance(weight, ZeroParameter) and weight.ds_shape == (6, 4)
        out = torch.nn.functional.linear(torch.ones(1, 4), weight)
        assert type(out) is torch.Tensor and out.shape == (1, 6)
        gather.stop()
        assert type(weight) is ZeroParameter and weight.shape == (0,)
        copy = copy_module.deepcopy(layer)  # a copy starts partitioned
        assert type(copy.weight) is ZeroParameter and copy.weight.ds_status is ZeroParamStatus.NOT_AVAILABLE

    def test_none_duplicates_and_plain_tensors(self, monkeypatch):
        with deepspeed.zero.Init():
            a, b = nn.Linear(2, 2), nn.Linear(2, 2)
        plain = nn.Parameter(torch.ones(3))
        gather = deepspeed.zero.GatheredParameters(
            [b.weight, None, a.weight, plain, b.weight, torch.zeros(1)]
        )
        assert [p.ds_id for p in gather.params] == sorted([a.weight.ds_id, b.weight.ds_id])
        counter = CountingComm(monkeypatch)
        with deepspeed.zero.GatheredParameters([plain, None]):  # no ZeRO parameter: no collective
            plain.data.add_(1)
        with deepspeed.zero.GatheredParameters(a.weight, enabled=False):
            assert a.weight.ds_status is ZeroParamStatus.NOT_AVAILABLE
        assert counter.calls == [] and torch.all(plain == 2)

    def test_exception_in_body_releases_and_propagates(self):
        with deepspeed.zero.Init():
            layer = nn.Linear(4, 4)
        with pytest.raises(ZeroDivisionError):
            with deepspeed.zero.GatheredParameters(layer.parameters(), modifier_rank=0):
                layer.weight.data.fill_(3.0)
                raise ZeroDivisionError("in the body")
        assert layer.weight.ds_status is ZeroParamStatus.NOT_AVAILABLE
        assert layer.weight._zero_state.holders == 0
        (weight,) = full_copy(layer.weight)
        assert not torch.any(weight == 3.0)  # a body that raised commits no edit (stop's note)

        gather = deepspeed.zero.GatheredParameters(layer.weight).start()
        try:
            raise KeyError("explicit path")
        except KeyError:
            gather.stop()
        assert layer.weight.ds_status is ZeroParamStatus.NOT_AVAILABLE

    @run_at(2)
    def test_body_raising_on_one_rank_raises_on_every_rank(self):
        with deepspeed.zero.Init():
            layer = nn.Linear(4, 4)
        (before,) = full_copy(layer.weight)
        with pytest.raises((ZeroDivisionError, RuntimeError)) as caught:
            with deepspeed.zero.GatheredParameters(layer.weight, modifier_rank=0):
                layer.weight.data.fill_(3.0)
                if dist.get_rank() == 1:
                    raise ZeroDivisionError("only here")
        if dist.get_rank() == 1:
            assert caught.type is ZeroDivisionError
        else:
            assert caught.type is RuntimeError and "rank(s) [1]" in str(caught.value)
        (after,) = full_copy(layer.weight)  # the ranks are still in step: this gather works
        assert torch.equal(after, before) and layer.weight._zero_state.holders == 0
        # An exception already being handled around start()/stop() is not the body's.
        try:
            raise KeyError("handled outside")
        except KeyError:
            with deepspeed.zero.GatheredParameters(layer.weight, modifier_rank=0):
                layer.weight.data.fill_(5.0)
        (edited,) = full_copy(layer.weight)
        assert torch.all(edited == 5.0)

    @run_at(2)
    def test_a_stop_after_a_handled_exception(self):
        """`__exit__` knows its body did not raise (an ExitStack closed in an `except` block
        commits); a stop() called by hand inside an `except` block cannot tell, discards the
        edits on every rank and warns where it ran."""
        with deepspeed.zero.Init():
            layer = nn.Linear(4, 4)
        try:
            raise FileNotFoundError("no pretrained rows")
        except FileNotFoundError:
            with contextlib.ExitStack() as stack:
                stack.enter_context(deepspeed.zero.GatheredParameters(layer.weight, modifier_rank=0))
                layer.weight.data.fill_(5.0)
                stack.close()
        (committed,) = full_copy(layer.weight)
        assert torch.all(committed == 5.0)

        gather = deepspeed.zero.GatheredParameters(layer.weight, modifier_rank=0).start()
        layer.weight.data.fill_(6.0)
        rank = dist.get_rank()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if rank == 1:
                try:
                    raise FileNotFoundError("no pretrained rows")
                except FileNotFoundError:
                    gather.stop()
            else:
                with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\]"):
                    gather.stop()
        dropped = [w for w in caught if issubclass(w.category, RuntimeWarning)]
        if rank == 1:
            message = str(dropped[0].message)
            assert len(dropped) == 1 and "FileNotFoundError" in message and "`except` block" in message
            assert dropped[0].filename == __file__  # points at the stop() call, not into deepspeed
        else:
            assert dropped == []
        (after,) = full_copy(layer.weight)  # discarded on every rank, and the ranks in step
        assert torch.all(after == 5.0) and layer.weight._zero_state.holders == 0

    @run_at(2)
    def test_math_on_a_partitioned_parameter_names_the_cause(self):
        with deepspeed.zero.Init():
            layer = nn.Linear(4, 3)
        with pytest.raises(RuntimeError) as caught:  # the kernel's own error, kept as it was
            layer(torch.ones(2, 4))
        notes = "\n".join(getattr(caught.value, "__notes__", []))
        assert "partitioned here" in notes and f"ds_id={layer.weight.ds_id} (3, 4)" in notes
        assert "GatheredParameters" in notes
        with deepspeed.zero.GatheredParameters(list(layer.parameters())):
            assert layer(torch.ones(2, 4)).shape == (2, 3)  # gathered: no dispatch, no note

    def test_restart_and_discarded_edits(self):
        with deepspeed.zero.Init():
            layer = nn.Linear(3, 3)
        (before,) = full_copy(layer.weight)
        gather = deepspeed.zero.GatheredParameters(layer.weight)
        for _ in range(3):
            gather.start()
            assert torch.equal(layer.weight.data, before)
            layer.weight.data.add_(1.0)  # modifier_rank=None: discarded on stop
            gather.stop()
            assert layer.weight.ds_status is ZeroParamStatus.NOT_AVAILABLE

    def test_async_start(self):
        with deepspeed.zero.Init():
            layers = nn.Sequential(nn.Linear(5, 5), nn.Linear(5, 5))
        (expected,) = full_copy(layers[1].weight)
        gather = deepspeed.zero.GatheredParameters(layers.parameters(), modifier_rank=0)
        assert gather.start(async_op=True) is gather
        statuses = {p.ds_status for p in layers.parameters()}
        assert statuses <= {ZeroParamStatus.INFLIGHT, ZeroParamStatus.AVAILABLE}
        gather.wait()
        assert all(p.ds_status is ZeroParamStatus.AVAILABLE for p in layers.parameters())
        assert torch.equal(layers[1].weight.data, expected)
        gather.stop()
        # stop() alone also completes an async start
        again = deepspeed.zero.GatheredParameters(layers.parameters()).start(async_op=True)
        again.stop()
        assert all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE for p in layers.parameters())

    def test_overlapping_holders_are_refcounted(self, monkeypatch):
        with deepspeed.zero.Init():
            layer = nn.Linear(4, 2)
        counter = CountingComm(monkeypatch)
        reader = deepspeed.zero.GatheredParameters(layer.weight).start()
        writer = deepspeed.zero.GatheredParameters([layer.weight, layer.bias], modifier_rank=0).start()
        assert counter.count("all_gather") == 2  # the second gathers only the bias
        layer.weight.data.fill_(9.0)
        writer.stop()  # writes back even though `reader` still holds the weight
        assert layer.weight.ds_status is ZeroParamStatus.AVAILABLE
        assert layer.bias.ds_status is ZeroParamStatus.NOT_AVAILABLE
        reader.stop()  # the last holder frees it
        assert layer.weight.ds_status is ZeroParamStatus.NOT_AVAILABLE
        (weight,) = full_copy(layer.weight)
        assert torch.all(weight == 9.0)

        first = deepspeed.zero.GatheredParameters(layer.weight).start(async_op=True)
        second = deepspeed.zero.GatheredParameters(layer.weight).start()  # waits on first's gather
        assert layer.weight.ds_status is ZeroParamStatus.AVAILABLE
        first.stop()
        second.stop()
        assert layer.weight._zero_state.holders == 0

    def test_module_buffer_is_reused_but_never_under_a_kept_tensor(self):
        """A module's full tensors share one buffer, reused by its next gather unless someone kept one."""
        with deepspeed.zero.Init():
            layer = nn.Linear(7, 5)  # odd sizes: padded shards
        params = [layer.weight, layer.bias]
        expected = full_copy(*params)
        with deepspeed.zero.GatheredParameters(params):
            first = layer.weight.data.data_ptr()
            assert layer.bias.data.data_ptr() == first + layer.weight.numel() * 4 + pad_bytes(layer.weight)
        with deepspeed.zero.GatheredParameters(params):
            assert layer.weight.data.data_ptr() == first  # the released buffer came back
            kept = layer.weight.data  # a caller keeps the gathered tensor past stop()
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
            assert layer.weight.data.data_ptr() != kept.data_ptr()  # not handed out again
            for p in params:
                p.data.fill_(3.0)
        assert torch.equal(kept, expected[0])  # untouched by the later gathers and edits
        assert all(torch.all(t == 3.0) for t in full_copy(*params))
        # Partial release: the buffer stays until the module's last gathered parameter goes.
        both = deepspeed.zero.GatheredParameters(params).start()
        weight_only = deepspeed.zero.GatheredParameters(layer.weight).start()
        both.stop()
        assert layer.bias.ds_status is ZeroParamStatus.NOT_AVAILABLE
        assert torch.all(layer.weight.data == 3.0)
        weight_only.stop()
        assert all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE and p.data.numel() == 0 for p in params)

    def test_fwd_module_registers_external(self):
        from deepspeed.runtime.zero.partition_parameters import external_parameters

        with deepspeed.zero.Init():
            shared = nn.Linear(3, 3)
            user = nn.Linear(3, 3)
        with deepspeed.zero.GatheredParameters(shared.weight, fwd_module=user):
            pass
        assert [p.ds_id for p in external_parameters(user)] == [shared.weight.ds_id]
        deepspeed.zero.register_external_parameter(user, shared.bias)
        assert len(external_parameters(user)) == 2
        deepspeed.zero.unregister_external_parameter(user, shared.bias)
        assert len(external_parameters(user)) == 1
        with pytest.raises(TypeError, match="nn.Module"):
            deepspeed.zero.register_external_parameter("not a module", shared.bias)

    def test_modifier_rank_out_of_range(self):
        with deepspeed.zero.Init():
            layer = nn.Linear(2, 2)
        ws = dist.get_world_size()
        with pytest.raises(ValueError, match=f"modifier_rank={ws} is outside"):
            deepspeed.zero.GatheredParameters(layer.weight, modifier_rank=ws)
        with pytest.raises(TypeError, match="modifier_rank='0'"):
            deepspeed.zero.GatheredParameters(layer.weight, modifier_rank="0")
        with pytest.raises(TypeError, match="modifier_rank=True"):
            deepspeed.zero.GatheredParameters(layer.weight, modifier_rank=True)
        last = ws - 1  # an integer-like (numpy's, a 0-d integer tensor) is the int it holds
        for rank in (numpy.int64(last), torch.tensor(last)):
            gather = deepspeed.zero.GatheredParameters(layer.weight, modifier_rank=rank)
            assert type(gather.modifier_rank) is int and gather.modifier_rank == last
            with gather:
                layer.weight.data.fill_(float(dist.get_rank()))
            (edited,) = full_copy(layer.weight)
            assert torch.all(edited == float(last))


class TestSanityChecks(DistributedTest):
    world_size = [2]

    def test_discarded_edit_detected_on_every_rank(self):
        cfg = {"zero_optimization": {"stage": 3, "enable_sanity_checks": True}}
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            layer = nn.Linear(3, 3)
        gather = deepspeed.zero.GatheredParameters(layer.weight).start()
        if dist.get_rank() == 1:
            layer.weight.data[0, 0] += 1.0  # only rank 1 edits; every rank must raise
        with pytest.raises(RuntimeError, match="would discard edits"):
            gather.stop()
        assert layer.weight.ds_status is ZeroParamStatus.NOT_AVAILABLE
        with deepspeed.zero.GatheredParameters(layer.weight):  # untouched: no error
            pass


class TestReplacedTensor(DistributedTest):
    world_size = [2]

    def test_a_replaced_tensor_of_another_shape_is_refused_on_every_rank(self):
        # Broadcasting it would not match the other ranks' receive: gloo aborted the process.
        with deepspeed.zero.Init():
            layer = nn.Linear(4, 2)
        with deepspeed.zero.GatheredParameters(layer.bias):
            before = layer.bias.data.clone()
        expected = (
            (ValueError, "replaced parameters")
            if dist.get_rank() == 0
            else (RuntimeError, r"rank\(s\) \[0\]")
        )
        with pytest.raises(expected[0], match=expected[1]):
            with deepspeed.zero.GatheredParameters(layer.bias, modifier_rank=0):
                if dist.get_rank() == 0:
                    layer.bias.data = torch.zeros(3)
        assert layer.bias.ds_status is ZeroParamStatus.NOT_AVAILABLE
        with deepspeed.zero.GatheredParameters(layer.bias):
            assert torch.equal(layer.bias.data, before)  # the edit was discarded everywhere


class TestDroppedGather(DistributedTest):
    world_size = [2]

    def test_a_dropped_gather_of_zero_params_is_reported_when_collected(self):
        # The parameters' holds belong to a GatherHold, not to the GatheredParameters, so the
        # dropped object is collected (and reported) at once, not at interpreter exit.
        with deepspeed.zero.Init():
            layer = nn.Linear(3, 3)

        def leak():
            gather = deepspeed.zero.GatheredParameters(layer.weight, modifier_rank=0).start()
            return weakref.ref(gather)

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dropped = leak()
            gc.collect()
        assert dropped() is None
        messages = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
        assert messages and "in leak" in messages[0] and "without stop()" in messages[0]
        # As documented, the parameters stay gathered, and the holder says whose hold it is.
        assert layer.weight.ds_status is ZeroParamStatus.AVAILABLE
        assert layer.weight.ds_summary()["held_by"] == ["GatheredParameters(1 ZeRO params, modifier_rank=0)"]


class TestGatherMisuse:
    """Single process, no ZeRO: unbalanced calls still raise."""

    def test_unbalanced_calls_raise_when_disabled(self):
        gather = deepspeed.zero.GatheredParameters(nn.Linear(2, 2).weight, enabled=False)
        with pytest.raises(RuntimeError, match=r"GatheredParameters\(0 ZeRO params.*stop\(\).*never started"):
            gather.stop()
        gather.start()
        with pytest.raises(RuntimeError, match="already active"):
            gather.start()
        gather.stop()
        with pytest.raises(RuntimeError, match="not active"):
            gather.wait()
        with pytest.raises(TypeError, match="got int"):
            deepspeed.zero.GatheredParameters(3)
        with pytest.raises(TypeError, match="got int"):
            deepspeed.zero.GatheredParameters(3, enabled=False)  # checked even when disabled
        with pytest.raises(TypeError, match="got str"):
            deepspeed.zero.GatheredParameters("weight")

    def test_entries_that_are_not_tensors_raise(self):
        """Upstream drops whatever lacks a `ds_id`: a module or named_parameters() gathered nothing."""
        model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        with pytest.raises(
            TypeError, match=r"params\[0\] is a tuple; pass module.parameters\(\), not named_parameters"
        ):
            deepspeed.zero.GatheredParameters(model.named_parameters())
        with pytest.raises(
            TypeError, match=r"params\[0\] is a Linear; pass tensors \(module.parameters\(\)\)"
        ):
            deepspeed.zero.GatheredParameters(model)  # a Sequential iterates over its modules
        with pytest.raises(TypeError, match=r"params\[1\] is a str"):
            deepspeed.zero.GatheredParameters([model[0].weight, "bias"], enabled=False)
        with pytest.raises(TypeError, match="got Linear"):
            deepspeed.zero.GatheredParameters(model[0])
        gather = deepspeed.zero.GatheredParameters([model[0].weight, None, model[0].bias])
        assert gather.params == []  # None and plain tensors are still dropped: no ZeRO here

    def test_leak_warning(self):
        def leak():
            deepspeed.zero.GatheredParameters(None).start()  # dropped without stop()

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            leak()
            gc.collect()
        messages = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
        assert messages and "in leak" in messages[0] and "without stop()" in messages[0]


def test_full_buffer_pool_reuses_a_buffer_only_up_to_twice_a_run():
    """A released module's buffer serves the next gather of at most its size, but not a run
    much smaller: a bias laid out in an MLP weight's buffer would hold all of it."""
    from types import SimpleNamespace

    from deepspeed.runtime.zero.gather import _FullPool

    def run(*sizes):
        base = torch.zeros(sum(sizes))  # the shards' flat buffer: what a run is known by
        return [
            SimpleNamespace(
                ds_id=i,
                shard_base=base,
                world_size=2,
                partition_size=n,
                padding=0,
                numel=2 * n,
                shape=(2 * n,),
            )
            for i, n in enumerate(sizes)
        ]

    pool = _FullPool()
    big = pool.take(run(500, 12), torch.float32, torch.device("cpu"))
    pool.give_back(big)
    small = pool.take(run(6), torch.float32, torch.device("cpu"))
    assert small is not big and small.buf.numel() == 12  # 12 elements get their own buffer
    half = pool.take(run(300), torch.float32, torch.device("cpu"))
    assert half is big and half.flat.numel() == 600  # 600 of 1024: the buffer is reused
