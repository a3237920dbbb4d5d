"""ZeRO++ qwZ, qgZ and quantized frozen weights (issue 43 item 4): block-wise int8 collectives.

The bound checked throughout ([Note: block-wise int8] in deepspeed/runtime/zero/quantized.py):
each element of a dequantized block differs from the original by at most scale / 2, with
scale = max|block| / 127. Training with quantization is compared with plain ZeRO-3 at a
looser tolerance (`QUANT_RTOL`), since the gathered weights and the reduced gradients carry
that error.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
from types import SimpleNamespace
from typing import Optional

import pytest
import torch
import torch.nn as nn

import deepspeed
import deepspeed.comm as dist
from deepspeed.ops.quantizer import int8
from deepspeed.runtime.zero import edits, gather
from deepspeed.runtime.zero import quantized as qz
from deepspeed.utils import groups
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from tests.unit.common import DistributedTest
from tests.unit.test_node_traffic import by_kind, traffic_config
from tests.zoo import models as zm
from tests.zoo.harness import Case, run_engine

QUANT_RTOL = 2e-2  # the per-step loss of a quantized run against plain ZeRO-3
ULP = 1e-4  # fp32 rounding of x / scale and of q * scale (|x| <= 127 scale), relative to scale / 2


def _scales_per_element(scales: torch.Tensor, numel: int) -> torch.Tensor:
    return scales.repeat_interleave(qz.BLOCK)[:numel]


@pytest.mark.parametrize("numel", [1, 255, 256, 257, 1000, 4096 + 3])
def test_quantize_error_bound(numel):
    torch.manual_seed(numel)
    x = torch.randn(numel) * torch.logspace(-3, 2, numel)  # blocks of very different magnitude
    codes, scales = qz.quantize(x)
    assert codes.dtype == torch.int8 and codes.numel() == qz.blocks_of(numel) * qz.BLOCK
    assert scales.numel() == qz.blocks_of(numel) and codes.abs().max() <= 127
    back = qz.dequantize(codes, scales, numel)
    bound = _scales_per_element(scales, numel) / 2 * (1 + ULP)
    assert ((x - back).abs() <= bound).all()
    blocks = torch.nn.functional.pad(x, (0, codes.numel() - numel)).view(-1, qz.BLOCK)
    assert torch.equal(scales, blocks.abs().amax(1) / 127)
    assert qz.payload_bytes(numel) == codes.numel() + 4 * scales.numel()


def test_zero_blocks_and_bf16():
    x = torch.zeros(600)
    x[300] = -2.5
    codes, scales = qz.quantize(x)
    assert scales[0] == 0 and scales[2] == 0 and torch.equal(qz.dequantize(codes, scales, 600), x)
    y = torch.randn(777).to(torch.bfloat16)
    codes, scales = qz.quantize(y)
    back = qz.dequantize(codes, scales, 777)
    assert ((y.float() - back).abs() <= _scales_per_element(scales, 777) / 2 * (1 + ULP)).all()


def test_stage_below_3_is_refused():
    cfg = {"train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    cfg["zero_optimization"] = {"stage": 2, "zero_quantized_gradients": True}
    with pytest.raises(ValueError, match=r"zero_quantized_gradients=True needs ZeRO stage 3"):
        deepspeed.initialize(model=nn.Linear(2, 2), config=cfg)


def quant_case(name: str, steps: int = 20, build=zm.TokenMLP, **zero) -> Case:
    return Case(
        name, build, zm.token_batch, zm.lm_loss, steps=steps, config_extra={"zero_optimization": zero}
    )


def _max_rel(a: list, b: list) -> float:
    la, lb = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return ((la - lb).abs() / lb.abs()).max().item()


def exact_full(state) -> torch.Tensor:
    """The parameter's full value from the (never quantized) shards, padding included."""
    out = torch.empty(state.world_size * state.partition_size, dtype=state.shard.dtype)
    dist.all_gather_into_tensor(out, state.shard.detach().clone(), group=state.group)
    return out


@contextlib.contextmanager
def compute_gather(states: list):
    """Gather `states` as the hooks do for a forward or backward (qwZ's int8 path); a
    GatheredParameters gathers exactly (see `check_exact_user_gathers`)."""
    owner = object()  # a holder of its own, as each hook is
    gather.fetch_states(states, owner, quantized=True)
    try:
        yield
    finally:
        gather.release_states(states, owner)


def check_gathered_bound(engine) -> float:
    """Each parameter gathered alone (one bucket) equals every rank's shard quantized and
    dequantized, and differs from the exact values by at most scale / 2. Returns the largest error."""
    worst = 0.0
    for s in engine.zero.zero_states:
        exact = exact_full(s)
        rows = exact.view(s.world_size, s.partition_size)
        codes, scales = qz.quantize_rows(rows)
        want = qz.dequantize_rows(codes, scales, s.partition_size).reshape(-1)[: s.numel]
        with compute_gather([s]):
            got = s.param.data.reshape(-1).clone()
        assert torch.equal(got, want), s.ds_id
        bound = scales.repeat_interleave(qz.BLOCK, dim=1)[:, : s.partition_size].reshape(-1)[: s.numel] / 2
        err = (got - exact[: s.numel]).abs()
        assert (err <= bound * (1 + ULP)).all(), s.ds_id
        worst = max(worst, err.max().item())
    return worst


def check_exact_user_gathers(engine) -> None:
    """GatheredParameters shows the exact values, and a modifier_rank gather with no edit
    leaves every shard (so every fp32 master) bit-equal: before the fix it gathered the
    quantized copy and wrote it back, quantizing the shards for good (off by 0.016 here)."""
    states = engine.zero.zero_states
    before = [s.shard.clone() for s in states]
    with deepspeed.zero.GatheredParameters([s.param for s in states]):
        for s in states:
            assert torch.equal(s.param.data.reshape(-1), exact_full(s)[: s.numel]), s.ds_id
    with deepspeed.zero.GatheredParameters([s.param for s in states], modifier_rank=0):
        pass
    assert all(torch.equal(a, s.shard) for a, s in zip(before, states))


def masters_untouched() -> bool:
    """qwZ with lr 0: two steps leave every shard bit-equal to its start while the gathered
    copies are quantized (the shards, thus the fp32 masters, never see the quantization)."""
    case = Case("lr0", zm.TokenMLP, zm.token_batch, zm.lm_loss, steps=2, lr=0.0)
    case.config_extra = {"zero_optimization": {"zero_quantized_weights": True}}
    data = case.micro_batches(dist.get_world_size())
    first = run_engine(case, data[:1])
    before = [s.shard.clone() for s in first.engine.zero.zero_states]
    run_engine(case, data[1:], engine=first.engine)
    after = [s.shard for s in first.engine.zero.zero_states]
    quantized_somewhere = False
    for s in first.engine.zero.zero_states:
        with compute_gather([s]):
            quantized_somewhere |= not torch.equal(s.param.data.reshape(-1), exact_full(s)[: s.numel])
    return quantized_somewhere and all(torch.equal(a, b) for a, b in zip(before, after))


def gather_bytes(per_node: int, **zero) -> dict:
    """{kind: (cross, within)} bytes this rank received in one step of a wider two-layer model."""
    os.environ[groups.RANKS_PER_NODE_ENV] = str(per_node)
    groups._TOPOLOGY.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 64, bias=False))
    engine, *_ = deepspeed.initialize(model=model, config=traffic_config(**zero))
    x = torch.randn(2, 64)
    dist.count_node_traffic(groups.node_layout())
    try:
        engine.backward(engine(x).sum())
        engine.step()
        return by_kind(dist.node_traffic_totals())
    finally:
        dist.count_node_traffic(None)
        del os.environ[groups.RANKS_PER_NODE_ENV]
        groups._TOPOLOGY.reset()


def check_bytes() -> dict:
    """The gathers and the reduce-scatter move exactly the int8 payload's bytes (2 ranks as 2
    nodes of 1: all of it crosses)."""
    world = dist.get_world_size()
    modules = ((64 * 512, 512), (512 * 64,))
    parts = [sum(math.ceil(n / world) for n in m) for m in modules]
    plain = gather_bytes(1)
    both = gather_bytes(1, zero_quantized_weights=True, zero_quantized_gradients=True)
    fp32_gather = 2 * sum(parts) * 4 * (world - 1)
    int8_gather = 2 * sum(qz.payload_bytes(math.ceil(n / world)) for m in modules for n in m) * (world - 1)
    assert plain["gather"][0] == fp32_gather and both["gather"][0] == int8_gather, (plain, both)
    assert both["all_to_all_single"][0] == qz.payload_bytes(sum(parts)) * (world - 1), both
    assert "reduce_scatter" not in both
    return {
        "gather_fp32": fp32_gather,
        "gather_int8": int8_gather,
        "reduce_fp32": plain["reduce_scatter"][0],
        "reduce_int8": both["all_to_all_single"][0],
    }


class LoraLike(nn.Module):
    """A frozen base (two Linear layers, LoRA's usual target) with small trainable adapters."""

    def __init__(self, width: int = 64, hidden: int = 256, rank: int = 4) -> None:
        super().__init__()
        self.base_in = nn.Linear(width, hidden)
        self.base_out = nn.Linear(hidden, width)
        self.lora_a = nn.Linear(width, rank, bias=False)
        self.lora_b = nn.Linear(rank, hidden, bias=False)
        for p in (*self.base_in.parameters(), *self.base_out.parameters()):
            p.requires_grad_(False)

    def first(self, x):
        return self.base_in(x) + self.lora_b(self.lora_a(x))

    def forward(self, x):
        return self.base_out(torch.relu(self.first(x)))


def fp32_storages() -> dict:
    """{data_ptr: bytes} of the fp32 storages alive in this process."""
    gc.collect()
    found = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.dtype == torch.float32 and obj.device.type == "cpu":
            try:
                storage = obj.untyped_storage()
                found[storage.data_ptr()] = storage.nbytes()
            except RuntimeError:
                continue  # a fake tensor some earlier test's compile left alive: it holds no memory
    return found


def lora_engine(stored: bool, ckpt: Optional[str] = None):
    torch.manual_seed(3)
    cfg = traffic_config(zero_quantized_nontrainable_weights=stored)
    cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.1}}
    engine, *_ = deepspeed.initialize(model=LoraLike(), config=cfg)
    if ckpt is not None:
        engine.load_checkpoint(ckpt, tag="lora")
    return engine


def lora_steps(engine, steps: range) -> list:
    losses = []
    for step in steps:
        x = torch.randn(2, 64, generator=torch.Generator().manual_seed(100 * step + dist.get_rank()))
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def check_frozen_storage(ws: int, tmp: str) -> dict:
    """Frozen weights stored quantized: the partition bytes drop about 4x, the forward output
    stays within the bound the stored error gives, a checkpoint holds the dequantized values
    (zero_to_fp32 too) and a resumed run equals the uninterrupted one."""
    plain = lora_engine(False)
    known = fp32_storages()
    quant = lora_engine(True)
    # No full-precision copy of a frozen shard survives: the quantized engine made no fp32
    # storage as large as the frozen Linear's flat shard buffer (the plain engine made two).
    assert not [n for ptr, n in fp32_storages().items() if ptr not in known and n >= 32 * 1024]
    p_states, q_states = plain.zero.zero_states, quant.zero.zero_states
    frozen = [i for i, s in enumerate(q_states) if not s.param.requires_grad]
    assert all(q_states[i].stored is not None for i in frozen)
    before = qz.partition_bytes([p_states[i] for i in frozen])
    after = qz.partition_bytes([q_states[i] for i in frozen])
    whole = (qz.partition_bytes(p_states), qz.partition_bytes(q_states))
    assert after == sum(qz.payload_bytes(q_states[i].partition_size) for i in frozen)
    assert 0.25 <= after / before <= 0.26, (before, after)
    # The first layer's output: |dy_i| <= sum_j |x_j| * s_ij / 2 + |db_i|, s the stored scales.
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(7))
    weight, bias = (q_states[i] for i in frozen[:2])
    bounds = []
    for s, p in ((weight, p_states[frozen[0]]), (bias, p_states[frozen[1]])):
        original = exact_full(p)[: p.numel]
        got = exact_full(s)[: s.numel]  # every reader sees the stored values: the shard, gathers
        stored_scales = s.stored.payload[qz.blocks_of(s.partition_size) * qz.BLOCK :].view(torch.float32)
        every_scale = torch.empty(ws * stored_scales.numel())
        dist.all_gather_into_tensor(every_scale, stored_scales.contiguous())
        per_element = every_scale.view(ws, -1).repeat_interleave(qz.BLOCK, 1)[:, : s.partition_size]
        bound = per_element.reshape(-1)[: s.numel] / 2 * (1 + ULP)
        assert ((got - original).abs() <= bound).all()
        bounds.append((bound.view(s.shape), original.view(s.shape)))
    with torch.no_grad(), deepspeed.zero.GatheredParameters(list(quant.module.parameters())):
        y_quant = quant.module.first(x)
    with torch.no_grad(), deepspeed.zero.GatheredParameters(list(plain.module.parameters())):
        y_exact = plain.module.first(x)
    (w_bound, _), (b_bound, _) = bounds
    out_bound = x.abs() @ w_bound.t() + b_bound
    out_err = (y_quant - y_exact).abs()
    assert (out_err <= out_bound * (1 + 1e-4) + 1e-6).all() and out_err.max() > 0
    # Checkpoint: the dequantized values are saved; a load re-quantizes them to the same codes.
    whole_run = lora_steps(lora_engine(True), range(4))
    first = lora_steps(quant, range(2))
    quant.save_checkpoint(tmp, tag="lora")
    fp32 = get_fp32_state_dict_from_zero_checkpoint(tmp, tag="lora")
    with deepspeed.zero.GatheredParameters(list(quant.module.parameters())):
        live = {n: p.detach().clone() for n, p in quant.module.named_parameters()}
    assert all(torch.equal(fp32[n], live[n]) for n in live), "zero_to_fp32 differs from the live values"
    fresh = lora_engine(True, tmp)
    assert all(
        torch.equal(a.stored.payload, b.stored.payload)
        for a, b in zip(fresh.zero.zero_states, q_states)
        if b.stored is not None
    )
    assert first + lora_steps(fresh, range(2, 4)) == whole_run
    # An edit written back through GatheredParameters(modifier_rank=0) is re-quantized.
    weight = fresh.module.base_in.weight
    old = weight._zero_state.stored.payload.clone()
    with deepspeed.zero.GatheredParameters([weight], modifier_rank=0):
        if dist.get_rank() == 0:
            weight.data[0].fill_(0.5)  # the largest value of its block: kept exactly
    with deepspeed.zero.GatheredParameters([weight]):
        assert (weight.data[0] - 0.5).abs().max() <= 0.5 / 254 * ULP
    assert dist.get_rank() != 0 or not torch.equal(old, weight._zero_state.stored.payload)
    return {"frozen_bytes": (before, after), "all_bytes": whole, "out_err": out_err.max().item()}


def check_qgz_bound() -> None:
    """The int8 reduce-scatter of random slices: within sum_r scale_r / 2 of the exact sum."""
    world, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(0)
    sends = [torch.randn(world, 1000, generator=gen) * (r + 1) for r in range(world)]  # every rank's
    got = qz.reduce_scatter(sends[rank].clone(), None)
    exact = sum(send[rank] for send in sends)
    bound = sum(_scales_per_element(qz.quantize(send[rank])[1], 1000) / 2 for send in sends)
    assert ((got - exact).abs() <= bound * (1 + 1e-5) + 1e-6).all()
    assert not torch.equal(got, exact)


def check_same_without_overlap_or_kernel(data: list, zero: dict, steps: int = 20) -> None:
    """qgZ's buckets are issued asynchronously under overlap_comm (the stage-3 default) and
    completed in issue order, and the native quantizer equals the torch path bit for bit: a
    synchronous run, and a run on the torch path, give the same losses bit for bit. The zoo's
    buckets are small, so several are in flight at once (two-hop ones advance to their second hop)."""
    run = run_engine(quant_case("q_overlap", steps=steps, **zero), data)
    assert run.engine.reducer.async_calls > steps
    sync = run_engine(quant_case("q_sync", steps=steps, overlap_comm=False, **zero), data)
    assert sync.engine.reducer.async_calls == 0 and sync.losses == run.losses
    if int8.native() is None:
        return  # the op cannot be built here: every run above was on the torch path
    real = int8._on_cpu
    int8._on_cpu = lambda t: None
    try:
        torch_path = run_engine(quant_case("q_torch", steps=steps, **zero), data)
    finally:
        int8._on_cpu = real
    assert torch_path.losses == run.losses


class TestQuantized(DistributedTest):
    world_size = 2

    def test_training_bounds_and_bytes(self):
        ws = dist.get_world_size()
        check_qgz_bound()
        data = quant_case("plain").micro_batches(ws)
        plain = run_engine(quant_case("plain"), data)
        gaps = {}
        for name, zero in {
            "qwz": {"zero_quantized_weights": True},
            "qgz": {"zero_quantized_gradients": True},
            "both": {"zero_quantized_weights": True, "zero_quantized_gradients": True},
        }.items():
            run = run_engine(quant_case(name, **zero), data)
            gaps[name] = _max_rel(run.losses, plain.losses)
            assert 0 < gaps[name] <= QUANT_RTOL, (name, gaps[name])
            if "zero_quantized_weights" in zero:
                states = run.engine.zero.zero_states
                assert all(s.qwz is qz.QuantizedGatherBucket for s in states)
                gaps[name + "_weight_err"] = check_gathered_bound(run.engine)
                states = run.engine.zero.zero_states
                with compute_gather(states):
                    assert edits.find_discarded_edits(states) == []  # quantized copies are no edits
                check_exact_user_gathers(run.engine)
            if "zero_quantized_gradients" in zero:
                assert run.engine.reducer.quantized
            if name == "both":
                check_same_without_overlap_or_kernel(data, zero)
        assert masters_untouched()
        sizes = check_bytes()
        if dist.get_rank() == 0:
            print(f"\nloss gaps (max rel over 20 steps): {gaps}\nbytes per step, 2 ranks: {sizes}")

    def test_frozen_weights_quantized(self, tmp_path):
        ws = dist.get_world_size()
        zero = {"zero_quantized_nontrainable_weights": True}
        data = quant_case("f", build=zm.frozen_token_mlp, steps=6).micro_batches(ws)
        plain = run_engine(quant_case("f", build=zm.frozen_token_mlp, steps=6), data)
        run = run_engine(quant_case("fq", build=zm.frozen_token_mlp, steps=6, **zero), data)
        assert 0 < _max_rel(run.losses, plain.losses) <= QUANT_RTOL
        states = run.engine.zero.zero_states
        frozen = [s for s in states if not s.param.requires_grad]
        assert frozen and all(s.qwz is not None and s.qwz_frozen for s in frozen)
        assert all(s.qwz is None for s in states if s.param.requires_grad)
        differs = []
        for s, p in zip(states, plain.engine.zero.zero_states):  # frozen: never stepped, p has them exact
            with compute_gather([s]):
                got = s.param.data.reshape(-1).clone()
            assert torch.equal(got, exact_full(s)[: s.numel])  # a gather adds no error to what is stored
            if not s.param.requires_grad:
                assert s.stored is not None and s._shard is None  # the full-precision shard is gone
                original = exact_full(p)[: p.numel]
                differs.append(not torch.equal(got, original))  # LayerNorm's ones and zeros quantize exactly
                assert (got - original).abs().max() <= original.abs().max() / 254 * (1 + ULP)
        assert any(differs)
        # Trainable shards that shared a flat buffer with a stored one (blocks[0].up's weight and
        # its frozen bias) moved out, so no buffer keeps a frozen shard's full-precision copy.
        kept = sum(s.stored.nbytes if s.stored is not None else s.partition_size * 4 for s in states)
        assert qz.partition_bytes(states) == kept
        # With qwZ on too, one bucket mixes stored codes and freshly quantized shards: each
        # parameter gathers as it does alone.
        both = run_engine(
            quant_case("fqw", build=zm.frozen_token_mlp, steps=6, zero_quantized_weights=True, **zero), data
        )
        assert 0 < _max_rel(both.losses, plain.losses) <= QUANT_RTOL
        states = both.engine.zero.zero_states
        assert any(s.stored is not None for s in states) and any(s.stored is None for s in states)
        alone = []
        for s in states:
            with compute_gather([s]):
                alone.append(s.param.data.clone())
        with compute_gather(states):
            assert all(torch.equal(s.param.data, a) for s, a in zip(states, alone))
        sizes = check_frozen_storage(ws, str(tmp_path))
        if dist.get_rank() == 0:
            print(f"\nfrozen weights stored quantized (LoraLike, {ws} ranks): {sizes}")

    def test_variants_and_checkpoint(self, tmp_path):
        """qwZ + qgZ with accumulation and clipping, bf16, AdamW, hpZ, and a save / load
        round trip (the continuation after a load equals the uninterrupted run bit for bit)."""
        ws = dist.get_world_size()
        both = {"zero_quantized_weights": True, "zero_quantized_gradients": True}
        adamw = lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1)  # noqa: E731
        variants = (
            {"gas": 2, "clip": 0.05},
            {"bf16": True},
            {"optimizer": adamw},
            {"hpz": 2, "gas": 2},
        )
        gaps = []
        for i, kwargs in enumerate(variants):
            kwargs = dict(kwargs)
            hpz_size = kwargs.pop("hpz", None)
            extra = {**both, "zero_hpz_partition_size": hpz_size} if hpz_size else both
            case = Case(f"v{i}q", zm.TokenMLP, zm.token_batch, zm.lm_loss, steps=8, **kwargs)
            case.config_extra = {"zero_optimization": extra}
            ref = Case(f"v{i}", zm.TokenMLP, zm.token_batch, zm.lm_loss, steps=8, **kwargs)
            data = case.micro_batches(ws)
            gap = _max_rel(run_engine(case, data).losses, run_engine(ref, data).losses)
            tol = 4e-2 if kwargs.get("bf16") else QUANT_RTOL
            assert gap <= tol, (kwargs, gap)
            gaps.append(gap)
        # Small parameters persist (gathered across steps, refreshed quantized after each step).
        both["stage3_param_persistence_threshold"] = 100
        case = quant_case("ckpt", steps=6, **both)
        data = case.micro_batches(ws)
        whole = run_engine(case, data)
        assert any(s.persist for s in whole.engine.zero.zero_states)
        first = run_engine(case, data[:3])
        first.engine.save_checkpoint(str(tmp_path), tag="q")
        fresh = run_engine(quant_case("ckpt", steps=0, **both), [])
        fresh.engine.load_checkpoint(str(tmp_path), tag="q")
        rest = run_engine(case, data[3:], fresh.engine)
        assert first.losses + rest.losses == whole.losses
        if dist.get_rank() == 0:
            print(f"\nvariants (gas+clip, bf16, adamw, hpz): max rel loss gaps {gaps}")


def causal_decoder() -> nn.Module:
    """A small decoder: embedding, two causal transformer layers (width 32), a head."""

    class Decoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(zm.VOCAB, 32)
            self.pos = nn.Parameter(torch.randn(zm.SEQ, 32) * 0.02)
            layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
            self.layers = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = nn.Linear(32, zm.VOCAB)

        def forward(self, ids):
            mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
            return self.head(self.layers(self.embed(ids) + self.pos, mask=mask, is_causal=True))

    return Decoder()


def learnable_batch(gen: torch.Generator, rows: int = 2) -> tuple:
    """Sequences t, 3t+1, ... mod VOCAB from a random start: the next token is learnable."""
    start = torch.randint(2, zm.VOCAB, (rows, 1), generator=gen)
    ids = start.clone()
    for _ in range(zm.SEQ):
        ids = torch.cat([ids, (ids[:, -1:] * 3 + 1) % zm.VOCAB], dim=1)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def decoder_case(name: str, **zero) -> Case:
    return Case(
        name,
        causal_decoder,
        learnable_batch,
        zm.lm_loss,
        steps=200,
        lr=0.02,
        config_extra={"zero_optimization": zero},
    )


@pytest.mark.slow
class TestQuantizedDecoder(DistributedTest):
    world_size = 2

    def test_200_steps_within_2_percent(self):
        data = decoder_case("d").micro_batches(dist.get_world_size())
        plain = run_engine(decoder_case("d"), data)
        both = run_engine(
            decoder_case("dq", zero_quantized_weights=True, zero_quantized_gradients=True), data
        )
        la, lb = torch.tensor(both.losses[-50:]), torch.tensor(plain.losses[-50:])
        gap = ((la - lb).abs() / lb).mean().item()
        assert all(math.isfinite(x) for x in both.losses)
        assert plain.losses[-1] < 0.5 * plain.losses[0]  # it learns, so the curves mean something
        assert gap <= 0.02, gap
        if dist.get_rank() == 0:
            print(
                f"\ndecoder 200 steps: first {plain.losses[0]:.4f}, last plain {plain.losses[-1]:.4f} "
                f"quantized {both.losses[-1]:.4f}; mean rel gap over the last 50: {gap:.5f}"
            )


@pytest.mark.slow
class TestQuantizedFourRanks(DistributedTest):
    world_size = 4

    def test_four_ranks_as_two_nodes(self):
        """2 nodes of 2: qgZ goes in two hops (exact against a local simulation, within the
        two-hop bound), its cross-node bytes are half the one hop's, and training with qwZ,
        qgZ and hpZ stays within the tolerance of plain ZeRO-3."""
        os.environ[groups.RANKS_PER_NODE_ENV] = "2"
        groups._TOPOLOGY.reset()
        try:
            check_qgz_bound()
            check_two_hop_bound()
            data = quant_case("p4", steps=10).micro_batches(4)
            plain = run_engine(quant_case("p4", steps=10), data)
            zero = {
                "zero_quantized_weights": True,
                "zero_quantized_gradients": True,
                "zero_hpz_partition_size": 2,
            }
            run = run_engine(quant_case("q4", steps=10, **zero), data)
            assert run.engine.reducer.two_hop is not None
            gap = _max_rel(run.losses, plain.losses)
            assert 0 < gap <= QUANT_RTOL
            check_same_without_overlap_or_kernel(data, zero, steps=10)
        finally:
            del os.environ[groups.RANKS_PER_NODE_ENV]
            groups._TOPOLOGY.reset()
        both = gather_bytes(2, zero_quantized_gradients=True)["all_to_all_single"]
        row = qz.payload_bytes(2 * (64 * 512 // 4) + 512 // 4)
        assert both == (row, 2 * row), both  # one hop would be (2 * row, row)
        if dist.get_rank() == 0:
            print(f"\n4 ranks as 2x2: loss gap {gap:.2e}; qgZ bytes (cross, within) {both}")


def check_two_hop_bound() -> None:
    world, rank, p = 4, dist.get_rank(), 2
    cfg = SimpleNamespace(zero_config=SimpleNamespace(zero_quantized_gradients=True))
    plan = qz.two_hop_reduce(cfg, None)
    assert plan is not None and (plan.nodes, plan.per_node) == (2, 2)
    gen = torch.Generator().manual_seed(1)
    sends = [torch.randn(world, 700, generator=gen) * (r + 1) for r in range(world)]
    got = plan.reduce_scatter(sends[rank].clone())

    def qd(x):  # quantize and dequantize one row; its per-element bound
        codes, scales = qz.quantize(x)
        return qz.dequantize(codes, scales, x.numel()), _scales_per_element(scales, x.numel()) / 2

    partials, bound = [], torch.zeros(700)
    for node in range(2):
        rows = [qd(sends[node * p + local][rank]) for local in range(p)]
        partials.append(torch.stack([r[0] for r in rows]).sum(0))
        bound += sum(r[1] for r in rows)
    second = [qd(x) for x in partials]
    want = torch.stack([x[0] for x in second]).sum(0)
    bound += sum(x[1] for x in second)
    exact = sum(send[rank] for send in sends)
    assert torch.allclose(got, want, rtol=0, atol=1e-5)
    assert ((got - exact).abs() <= bound * (1 + ULP) + 1e-5).all()
