"""Ulysses sequence parallelism (issue 42): a tiny HF Llama trained with sp ranks splitting each
sequence, under ZeRO-3, against the same global batch trained without sequence parallelism.

The reference runs in every rank's process: a plain copy of the model, the whole sequences of
every data-parallel group's batch, each group's loss the token mean over its sequences
(HF's loss), averaged over the groups, then torch's SGD. The sequence-parallel side feeds each
rank its shard through `UlyssesSPDataLoaderAdapter` and combines the shard losses as HF
Trainer does (token-weighted, through a differentiable all-gather over the sp group).
"""

from __future__ import annotations

import copy

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError
from deepspeed.runtime.sequence_parallel.setup import configure_sequence_parallel
from deepspeed.runtime.sequence_parallel.ulysses_sp import (
    TiledFusedLogitsLoss,
    TiledMLP,
    UlyssesSPAttentionHF,
    UlyssesSPDataLoaderAdapter,
    prepare_sp_batch,
    shard_sp_batch,
)
from deepspeed.sequence.layer import DistributedAttention, token_weighted_loss
from deepspeed.utils import groups
from tests.unit.common import DistributedTest

transformers = pytest.importorskip("transformers")

LOSS_RTOL = 1e-5  # the zoo's fp32 tolerances (tests/zoo/harness.py)
PARAM_ATOL = 5e-5
LR = 0.1
STEPS_PER_RANK_BATCH = 2  # underlying loader batches per rank
MICRO = 2  # sequences per micro-batch


def tiny_llama(impl: str, kv_heads: int, heads: int = 4) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=8 * heads,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        use_cache=False,
        attn_implementation=impl,
    )
    torch.manual_seed(1234)
    return transformers.LlamaForCausalLM(config).float()


def rank_batches(world: int, length: int) -> list:
    """`[rank][i]`: the i-th batch of every rank's own loader, the same on every process. Some
    labels are -100 (a prompt), so the shards carry different numbers of tokens."""
    gen = torch.Generator().manual_seed(99)
    data = []
    for _ in range(world):
        batches = []
        for _ in range(STEPS_PER_RANK_BATCH):
            ids = torch.randint(0, 64, (MICRO, length), generator=gen)
            labels = ids.clone()
            labels[0, :3] = -100
            batches.append({"input_ids": ids, "labels": labels})
        data.append(batches)
    return data


def hf_loss(model: torch.nn.Module, logits: torch.Tensor, shift_labels: torch.Tensor) -> torch.Tensor:
    if logits.dim() == 0:  # already the loss (tiled_logits_loss)
        return logits
    return model.loss_function(logits=logits, labels=None, shift_labels=shift_labels, vocab_size=64)


def tiled_logits_loss(
    model: torch.nn.Module, hidden: torch.Tensor, shift_labels: torch.Tensor
) -> torch.Tensor:
    """HF's loss over the logits of `model.tiled_head`, two slices of the sequence at a time."""

    def loss_fn(head, x, y):
        return hf_loss(model, head(x), y)

    head = model.tiled_head
    return TiledFusedLogitsLoss.apply(
        loss_fn, head, hidden, shift_labels, shift_labels != -100, 2, [head.weight], "mean"
    )


def sp_loss(
    model: torch.nn.Module, logits: torch.Tensor, shift_labels: torch.Tensor, sp_group
) -> torch.Tensor:
    """The convention: every sp rank's loss is the token-weighted mean over the whole sequences
    (transformers' deepspeed_sp_compute_loss does the same with torch's all_gather)."""
    return token_weighted_loss(hf_loss(model, logits, shift_labels), shift_labels, sp_group)


def reference_run(model: torch.nn.Module, data: list, sp: int, gas: int = 1) -> tuple:
    """Per micro-step t: data-parallel group g trains rank (g*sp + t % sp)'s batch t // sp; the
    optimizer steps every `gas` micro-steps on their mean. Returns (losses[t][g], final parameters)."""
    world = len(data)
    dp = world // sp
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for t in range(STEPS_PER_RANK_BATCH * sp):
        if t % gas == 0:
            opt.zero_grad()
        step_losses, total = [], 0.0
        for g in range(dp):
            batch = data[g * sp + t % sp][t // sp]
            loss = hf_loss(model, model(input_ids=batch["input_ids"]).logits, whole_shift_labels(batch))
            step_losses.append(loss.item())
            total = total + loss / (dp * gas)
        total.backward()
        if (t + 1) % gas == 0:
            opt.step()
        losses.append(step_losses)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def whole_shift_labels(batch: dict) -> torch.Tensor:
    return torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=-100)


def tile_mlps(model: torch.nn.Module, shards: int = 3) -> list:
    """Run every decoder layer's MLP through TiledMLP (this instance only, not the class);
    returns a list that grows by one entry per slice computed, forward and backward."""
    calls = []

    def mlp_forward(mlp, x):
        calls.append(x.shape[1])
        return mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))

    for layer in model.model.layers:
        mlp = layer.mlp
        params = [mlp.down_proj.weight, mlp.gate_proj.weight, mlp.up_proj.weight]
        mlp.forward = lambda x, mlp=mlp, params=params: TiledMLP.apply(mlp_forward, mlp, x, shards, params)
    return calls


def sp_run(
    impl: str, kv_heads: int, length: int, sp: int, tiled: bool = False, gas: int = 1, labels_from=None
) -> tuple:
    """Train under Ulysses + ZeRO-3 (with `tiled`, the MLPs through TiledMLP); compare with the
    reference; with `tiled` also the logits and loss through TiledFusedLogitsLoss; `gas`
    micro-steps per optimizer step; `labels_from`: every label from that position on is -100.
    Returns (loss rel diff, param diff, the steps whose shard had no label on this rank)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    data = rank_batches(world, length)
    for batches in data if labels_from is not None else []:
        for batch in batches:
            batch["labels"][:, labels_from:] = -100
    reference = tiny_llama(impl, kv_heads)
    model = copy.deepcopy(reference)
    tiled_calls = tile_mlps(model) if tiled else None
    if tiled:  # the logits and loss through TiledFusedLogitsLoss: the model ends at its final norm
        model.tiled_head, model.lm_head = model.lm_head, torch.nn.Identity()
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model,
        core_attn_implementation=impl,
        sequence_parallel_size=sp,
        micro_batch_size=MICRO,
        seq_length=length,
    )
    assert model.config._attn_implementation == f"ulysses_sp_{impl}"
    assert reference.config._attn_implementation == impl  # the reference is not rerouted
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 500},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, config=config, mpu=mpu)
    assert engine.sequence_parallel_size == sp and engine.train_batch_size() == MICRO * gas * world // sp
    assert engine.dp_world_size == world  # ZeRO partitions over every rank
    sp_group = groups._get_sequence_parallel_group()
    loader = UlyssesSPDataLoaderAdapter(
        data[rank],
        sp_rank=groups._get_sequence_parallel_rank(),
        sp_group=sp_group,
        sp_world_size=groups._get_sequence_parallel_world_size(),
        device=engine.device,
    )
    assert len(loader) == STEPS_PER_RANK_BATCH * sp
    losses, unlabelled = [], 0
    for batch in loader:
        assert batch["input_ids"].shape[1] == -(-length // sp) * sp // sp and "labels" not in batch
        logits = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        if not (batch["shift_labels"] != -100).any():  # HF's mean over no token: 0 / 0
            unlabelled += 1
            assert tiled or hf_loss(engine.module, logits, batch["shift_labels"]).isnan()
        if tiled:
            logits = tiled_logits_loss(engine.module, logits, batch["shift_labels"])
        loss = sp_loss(engine.module, logits, batch["shift_labels"], sp_group)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    if tiled:  # 8 local tokens in slices of 3, 3, 2: forward, then again in backward, per layer and step
        assert tiled_calls[:6] == [3, 3, 2] * 2 and len(tiled_calls) == 6 * 2 * len(losses), tiled_calls
    ref_losses, ref_params = reference_run(reference, data, sp, gas)
    group_index = rank // sp
    mine = torch.tensor([step[group_index] for step in ref_losses])
    loss_rel = ((torch.tensor(losses) - mine).abs() / mine.abs()).max().item()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        got = {
            n.replace("tiled_head.", "lm_head."): p.detach().clone()
            for n, p in engine.module.named_parameters()
        }
    param_diff = max((got[n] - ref_params[n]).abs().max().item() for n in ref_params)
    moved = max(
        (ref_params[n] - p).abs().max().item() for n, p in tiny_llama(impl, kv_heads).named_parameters()
    )
    case = f"{impl} kv={kv_heads} L={length} sp={sp} world={world} gas={gas}" + (
        " TiledMLP+TiledFusedLogitsLoss" if tiled else ""
    )
    assert moved > 1e-3, f"{case}: the reference did not train"
    assert loss_rel <= LOSS_RTOL, f"{case}: losses {losses} vs {mine.tolist()} (rel {loss_rel:.3g})"
    assert param_diff <= PARAM_ATOL, f"{case}: final parameters differ by {param_diff:.3g}"
    if rank == 0:
        print(f"[sp parity] {case}: max loss rel diff {loss_rel:.3g}, max param diff {param_diff:.3g}")
    return loss_rel, param_diff, unlabelled


def zero3_engine(model: torch.nn.Module, mpu) -> object:
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 500},
    }
    return deepspeed.initialize(model=model, config=config, mpu=mpu)[0]


def sp2_engine(reference: torch.nn.Module, length: int) -> object:
    model = copy.deepcopy(reference)
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model, sequence_parallel_size=2, micro_batch_size=MICRO, seq_length=length
    )
    return zero3_engine(model, mpu)


def train_sp2(engine, batches: list) -> list:
    losses = []
    for batch in batches:
        logits = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        loss = sp_loss(engine.module, logits, batch["shift_labels"], groups._get_sequence_parallel_group())
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def full_params(engine) -> dict:
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def check_checkpoint_sp2(path: str) -> None:
    """sp=2 under ZeRO-3 saves after 2 of its 4 steps. A new sp=2 engine, and a new engine
    without sequence parallelism (ZeRO-3 over the same 2 ranks, each fed the group's whole
    batch), load it: both start from the saved weights and train the last 2 steps to the
    saver's losses and parameters."""
    length, world, rank = 15, dist.get_world_size(), dist.get_rank()
    data = rank_batches(world, length)
    reference = tiny_llama("sdpa", 2)
    saver = sp2_engine(reference, length)
    group = groups._get_sequence_parallel_group()
    batches = list(UlyssesSPDataLoaderAdapter(data[rank], rank, group, 2, saver.device))
    train_sp2(saver, batches[:2])
    saved = full_params(saver)
    saver.save_checkpoint(path, tag="half")
    expected = train_sp2(saver, batches[2:])
    expected_params = full_params(saver)

    same = sp2_engine(reference, length)
    same.load_checkpoint(path, tag="half")
    for name, value in full_params(same).items():
        torch.testing.assert_close(value, saved[name], rtol=0, atol=0, msg=f"sp=2 load: {name}")
    torch.testing.assert_close(train_sp2(same, batches[2:]), expected, rtol=LOSS_RTOL, atol=0)
    for name, value in full_params(same).items():
        torch.testing.assert_close(value, expected_params[name], rtol=0, atol=PARAM_ATOL)

    plain = zero3_engine(copy.deepcopy(reference), None)
    assert plain.sequence_parallel_size == 1
    plain.load_checkpoint(path, tag="half")
    losses = []
    for t in (2, 3):  # the adapter's step t is rank t % 2's batch t // 2, whole
        batch = data[t % 2][t // 2]
        loss = hf_loss(plain.module, plain(input_ids=batch["input_ids"]).logits, whole_shift_labels(batch))
        plain.backward(loss)
        plain.step()
        losses.append(loss.item())
    torch.testing.assert_close(losses, expected, rtol=LOSS_RTOL, atol=0)
    diff = max((v - expected_params[n]).abs().max().item() for n, v in full_params(plain).items())
    assert diff <= PARAM_ATOL, f"sp=2 checkpoint loaded without SP: parameters differ by {diff:.3g}"
    moved = max((expected_params[n] - v).abs().max().item() for n, v in saved.items())
    assert moved > 1e-3, "the steps after the checkpoint did not train"
    if rank == 0:
        print(f"[sp checkpoint] sp=2 -> sp=2 and -> no SP: losses {expected}, no-SP param diff {diff:.3g}")


class TestUlysses(DistributedTest):
    world_size = 2

    def test_bad_input_attention_and_parity(self):
        with pytest.raises(ValueError, match="sequence_parallel_size=3 does not divide the world size 2"):
            groups.initialize_sequence_parallel(3)
        with pytest.raises(RuntimeError, match="sequence parallelism is not set up"):
            groups._get_sequence_parallel_group()
        assert groups._get_sequence_parallel_world_size() == 1
        with pytest.raises(
            ValueError, match="3 attention heads are not divisible by sequence_parallel_size=2"
        ):
            UlyssesSPAttentionHF.register_with_transformers(
                tiny_llama("sdpa", 3, heads=3), sequence_parallel_size=2
            )
        with pytest.raises(ValueError, match="3 key/value heads neither divide"):
            UlyssesSPAttentionHF.register_with_transformers(
                tiny_llama("sdpa", 3, heads=6), sequence_parallel_size=2
            )
        with pytest.raises(ValueError, match="core_attn_implementation='flash_attention_2' is not supported"):
            UlyssesSPAttentionHF.register_with_transformers(
                tiny_llama("sdpa", 4), core_attn_implementation="flash_attention_2", sequence_parallel_size=2
            )
        assert groups._get_sequence_parallel_world_size() == 2
        assert groups.sequence_parallel_layout().ranks == (0, 1)
        with pytest.raises(ValueError, match="already set up with sequence_parallel_size=2"):
            groups.initialize_sequence_parallel(1)
        check_distributed_attention()
        for impl, kv_heads, length in [
            ("sdpa", 4, 16),
            ("sdpa", 4, 15),
            ("eager", 2, 15),  # GQA, kv heads split over sp
            ("eager", 1, 16),  # GQA, kv heads fewer than sp: replicated
            ("sdpa", 1, 13),
            ("eager", 4, 16),
        ]:
            sp_run(impl, kv_heads, length, sp=2)
        sp_run("sdpa", 2, 15, sp=2, tiled=True)

    def test_config_key_accumulation_checkpoint_unlabelled_shard(self, tmp_path):
        """The config key creates the groups; then, at parity with no sequence parallelism:
        gradient accumulation, a checkpoint loaded with and without sp, and shards with no label."""
        model = torch.nn.Linear(4, 4)
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "sequence_parallel_size": 2,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": 3},
        }
        engine, _, _, _ = deepspeed.initialize(model=model, config=config)
        assert engine.sequence_parallel_size == 2 and engine.train_batch_size() == 1
        assert groups._get_sequence_parallel_world_size() == 2
        assert groups._get_sequence_parallel_rank() == dist.get_rank()
        assert dist.get_world_size(groups._get_sequence_data_parallel_group()) == 2

        sp_run("sdpa", 2, 15, sp=2, gas=2)
        # Rank 1's shard (shifted labels 8..15, labels 9..15 and the padding) has no label.
        _, _, unlabelled = sp_run("sdpa", 2, 16, sp=2, labels_from=9)
        assert unlabelled == (4 if dist.get_rank() == 1 else 0), unlabelled
        _, _, unlabelled = sp_run("sdpa", 2, 16, sp=2, tiled=True, labels_from=9)
        assert unlabelled == (4 if dist.get_rank() == 1 else 0), unlabelled
        check_checkpoint_sp2(str(tmp_path / "ckpt"))


class TestUlyssesRouting(DistributedTest):
    world_size = 2

    def test_name_routing_eval_passthrough_and_reset(self, tmp_path):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        from deepspeed import process_state

        rank = dist.get_rank()
        gen = torch.Generator().manual_seed(3)
        ids = torch.randint(0, 64, (2, 12), generator=gen)
        window = slice(rank * 6, (rank + 1) * 6)
        positions = torch.arange(12).expand(2, 12)

        # A model object, eager core, disable_in_eval: eval runs whole sequences with the model's own mask.
        reference = tiny_llama("eager", 4)
        model = copy.deepcopy(reference)
        UlyssesSPAttentionHF.register_with_transformers(
            model, core_attn_implementation="eager", sequence_parallel_size=2, disable_in_eval=True
        )
        padding = torch.ones(2, 12, dtype=torch.long)
        padding[1, 9:] = 0
        model.eval()
        reference.eval()
        with torch.no_grad():
            torch.testing.assert_close(
                model(input_ids=ids, attention_mask=padding).logits,
                reference(input_ids=ids, attention_mask=padding).logits,
            )
            model.train()
            sharded = model(input_ids=ids[:, window], position_ids=positions[:, window]).logits
            torch.testing.assert_close(
                sharded, reference(input_ids=ids).logits[:, window], rtol=1e-5, atol=1e-5
            )

        # A name: every model loaded with the core implementation runs Ulysses, until reset.
        path = tmp_path / f"rank{rank}"
        reference.config.save_pretrained(path)
        UlyssesSPAttentionHF.register_with_transformers(str(path), sequence_parallel_size=2)
        assert isinstance(ALL_ATTENTION_FUNCTIONS["sdpa"], UlyssesSPAttentionHF)
        routed = tiny_llama("sdpa", 4)
        with torch.no_grad():
            sharded = routed(input_ids=ids[:, window], position_ids=positions[:, window]).logits
        torch.testing.assert_close(sharded, reference(input_ids=ids).logits[:, window], rtol=1e-5, atol=1e-5)
        process_state.reset()
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward
        assert "ulysses_sp_eager" not in ALL_ATTENTION_FUNCTIONS
        assert "ulysses_sp_eager" not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
        assert groups.sequence_parallel_layout() is None


def check_distributed_attention() -> None:
    """DistributedAttention on [s/P, b, h, d] shards: the output and the gradients of q, k, v
    are the unsharded attention's shards."""
    group = groups._get_sequence_parallel_group()
    sp, r = dist.get_world_size(group), dist.get_rank(group)
    gen = torch.Generator().manual_seed(7)
    s, b, h, d = 8, 2, 4, 3
    q, k, v = (torch.randn(s, b, h, d, generator=gen, requires_grad=True) for _ in range(3))
    weight = torch.randn(s, b, h, d, generator=gen)

    def local(q, k, v):  # [s, b, h', d] causal attention
        out = torch.nn.functional.scaled_dot_product_attention(
            q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), is_causal=True
        )
        return out.permute(2, 0, 1, 3)

    full = local(q, k, v)
    (full * weight).sum().backward()
    rows = slice(r * s // sp, (r + 1) * s // sp)
    shards = [t.detach()[rows].clone().requires_grad_(True) for t in (q, k, v)]
    out = DistributedAttention(local, group)(*shards)
    torch.testing.assert_close(out, full.detach()[rows], rtol=1e-5, atol=1e-6)
    (out * weight[rows]).sum().backward()
    for shard, whole in zip(shards, (q, k, v)):
        torch.testing.assert_close(shard.grad, whole.grad[rows], rtol=1e-5, atol=1e-6)


class TestUlyssesWithDataParallel(DistributedTest):
    world_size = 4

    @pytest.mark.slow
    def test_sp2_dp2_parity(self):
        assert groups.sequence_parallel_layout() is None
        sp_run("sdpa", 4, 15, sp=2)
        assert groups.sequence_parallel_layout().data_parallel_ranks == (
            dist.get_rank() % 2,
            dist.get_rank() % 2 + 2,
        )
        sp_run("eager", 1, 16, sp=2)


def test_prepare_pads_and_shifts_labels():
    ids = torch.arange(10).view(2, 5)
    labels = ids.clone()
    labels[1, :2] = -100
    batch = prepare_sp_batch({"input_ids": ids, "labels": labels, "attention_mask": torch.ones(2, 5)}, 2)
    assert sorted(batch) == ["input_ids", "position_ids", "shift_labels"]
    assert batch["input_ids"].tolist() == [[0, 1, 2, 3, 4, 0], [5, 6, 7, 8, 9, 0]]
    assert batch["shift_labels"].tolist() == [[1, 2, 3, 4, -100, -100], [-100, 7, 8, 9, -100, -100]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5]] * 2
    halves = [shard_sp_batch(batch, r, 2) for r in range(2)]
    assert halves[1]["input_ids"].tolist() == [[3, 4, 0], [8, 9, 0]]
    assert halves[1]["position_ids"].tolist() == [[3, 4, 5]] * 2
    assert torch.cat([h["shift_labels"] for h in halves], dim=1).tolist() == batch["shift_labels"].tolist()
    right = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    assert "attention_mask" not in prepare_sp_batch({"input_ids": ids, "attention_mask": right}, 2)
    with pytest.raises(ValueError, match="attention_mask is not right padding"):
        prepare_sp_batch({"input_ids": ids, "attention_mask": right.flip(1)}, 2)


def test_config_and_mpu_sizes_must_agree():
    base = {"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 3}
    with pytest.raises(
        DeepSpeedConfigError, match="sequence_parallel_size=3 does not divide the world size 4"
    ):
        DeepSpeedConfig(base, world_size=4)
    cfg = DeepSpeedConfig({**base, "sequence_parallel_size": 2}, world_size=4)
    assert cfg.world_size == 2 and cfg.train_batch_size == 2

    class SpMpu:
        def get_sequence_parallel_world_size(self):
            return 2

        def get_data_parallel_world_size(self):
            return 2

    assert DeepSpeedConfig({**base, "sequence_parallel_size": 2}, mpu=SpMpu()).world_size == 2
    with pytest.raises(
        ValueError, match="sequence_parallel_size=4 differs from the mpu's sequence-parallel size 2"
    ):
        configure_sequence_parallel(4, SpMpu())
    assert configure_sequence_parallel(1, SpMpu()) == 2


def _mlp() -> torch.nn.Module:
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(6, 24), torch.nn.GELU(), torch.nn.Linear(24, 6))


def _grads(module: torch.nn.Module) -> list:
    return [p.grad.clone() for p in module.parameters()]


def test_tiled_helpers_match_untiled():
    """TiledMLP, sequence_tiled_compute and TiledFusedLogitsLoss give the untiled outputs and
    gradients (of the input and the parameters), with a length no shard count divides."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import sequence_tiled_compute

    x0 = torch.randn(2, 13, 6, generator=torch.Generator().manual_seed(0))
    upstream = torch.randn(2, 13, 6, generator=torch.Generator().manual_seed(1))
    plain, tiled = _mlp(), _mlp()
    x_plain, x_tiled, x_generic = (x0.clone().requires_grad_(True) for _ in range(3))
    out = plain(x_plain)
    (out * upstream).sum().backward()
    got = TiledMLP.apply(lambda m, x: m(x), tiled, x_tiled, 4, list(tiled.parameters()))
    torch.testing.assert_close(got, out)
    (got * upstream).sum().backward()
    torch.testing.assert_close(x_tiled.grad, x_plain.grad)
    for a, b in zip(_grads(tiled), _grads(plain)):
        torch.testing.assert_close(a, b)

    generic = _mlp()
    got = sequence_tiled_compute(
        lambda x, module: module(x),
        13,
        5,
        {"x": x_generic},
        {"module": generic},
        "x",
        list(generic.parameters()),
    )
    (got * upstream).sum().backward()
    torch.testing.assert_close(x_generic.grad, x_plain.grad)
    for a, b in zip(_grads(generic), _grads(plain)):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="grad_requiring_tensor_key='y' is not one of"):
        sequence_tiled_compute(lambda x: x, 13, 2, {"x": x0}, {}, "y")

    # The logits and their loss: a mean over the tokens whose label is not -100.
    head_plain, head_tiled = torch.nn.Linear(6, 11), torch.nn.Linear(6, 11)
    head_tiled.load_state_dict(head_plain.state_dict())
    labels = torch.randint(0, 11, (2, 13), generator=torch.Generator().manual_seed(2))
    labels[0, :5] = -100
    labels[1, 10:] = -100

    def loss_fn(head, x, y):
        return torch.nn.functional.cross_entropy(head(x).flatten(0, 1), y.flatten(), ignore_index=-100)

    xa, xb = x0.clone().requires_grad_(True), x0.clone().requires_grad_(True)
    expected = loss_fn(head_plain, xa, labels)
    expected.backward()
    loss = TiledFusedLogitsLoss.apply(
        loss_fn, head_tiled, xb, labels, labels != -100, 3, [head_tiled.weight], "mean"
    )
    torch.testing.assert_close(loss, expected)
    loss.backward()
    torch.testing.assert_close(xb.grad, xa.grad)
    for a, b in zip(_grads(head_tiled), _grads(head_plain)):
        torch.testing.assert_close(a, b)
