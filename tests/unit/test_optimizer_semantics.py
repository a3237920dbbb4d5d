"""Which parameters train, with which hyperparameters; stale masters at save; collective devices.

Each case trains under ZeRO-3 and as plain PyTorch from the same seed (the reference takes
the whole global batch, which equals averaging each rank's micro-batch gradients), then
compares the losses (rtol 1e-5) and the gathered parameters (abs 5e-5) in fp32. SGD with
momentum keeps the comparison meaningful (Adam turns rounding noise into lr-sized steps).
"""

import logging

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from deepspeed.utils import zero_to_fp32
from deepspeed.utils.logging import logger as ds_logger
from tests.unit.common import DistributedTest, LogRecords
from tests.unit.common import world_size as run_on
from tests.unit.test_engine import GLOBAL_BATCH, TinyLM, batches, gathered_params, my_slice, train

LR, MOMENTUM = 0.1, 0.9


def base_config(**extra):
    cfg = {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // dist.get_world_size(),
        "gradient_clipping": 0.0,  # the plain references do not clip (the default clips at 1.0)
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 300},
    }
    cfg.update(extra)
    return cfg


def build(seed=42):
    torch.manual_seed(seed)
    return TinyLM()


def decay_groups(model, decay_lr=0.05, plain_lr=0.2):
    """Two groups as HF Trainer builds them: weights decay, biases and norms do not."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "norm" not in n]
    plain = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "norm" not in n)]
    return [
        {"params": decay, "weight_decay": 0.1, "lr": decay_lr},
        {"params": plain, "weight_decay": 0.0, "lr": plain_lr},
    ]


def train_reference(model, opt, data, scheduler=None):
    losses = []
    for ids, labels in data:
        loss = model(ids, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses


def assert_parity(model, losses, reference, ref_losses):
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    got = gathered_params(model)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=0, atol=5e-5, msg=name)


class TestOptimizerSemantics(DistributedTest):
    world_size = [1, 2]

    def test_client_optimizer_on_a_subset_trains_exactly_it(self):
        data = batches(4, seed=21)
        reference = build()
        ref_losses = train_reference(
            reference, torch.optim.SGD(reference.head.parameters(), lr=LR, momentum=MOMENTUM), data
        )
        model = build()
        initial = {n: p.detach().clone() for n, p in model.named_parameters()}
        client = torch.optim.SGD(model.head.parameters(), lr=LR, momentum=MOMENTUM)
        engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=client, config=base_config())
        assert optimizer.optimizer is client
        head_ids = {p.ds_id for p in model.head.parameters()}
        assert set(optimizer.masters) == head_ids
        assert_parity(model, train(engine, data), reference, ref_losses)
        got = gathered_params(model)
        for name, p in model.named_parameters():
            if p.ds_id not in head_ids:
                assert torch.equal(got[name], initial[name]), f"{name} trained but is in no param group"
        # hyperparameters changed through engine.optimizer take effect at the next step
        for group in engine.optimizer.param_groups:
            group["lr"] = 0.0
            group["momentum"] = 0.0
        before = gathered_params(model)
        train(engine, data[:1])
        after = gathered_params(model)
        assert all(torch.equal(before[n], after[n]) for n in before)

    def test_two_param_groups_with_their_own_hyperparameters_and_scheduler(self):
        data = batches(4, seed=22)

        def halve(step):
            return 0.5**step

        reference = build()
        ref_opt = torch.optim.SGD(decay_groups(reference), lr=LR, momentum=MOMENTUM)
        ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, halve)
        ref_losses = train_reference(reference, ref_opt, data, ref_sched)
        model = build()
        client = torch.optim.SGD(decay_groups(model), lr=LR, momentum=MOMENTUM)
        sched = torch.optim.lr_scheduler.LambdaLR(client, halve)  # built on the client, before initialize
        engine, optimizer, _, scheduler = deepspeed.initialize(
            model=model,
            optimizer=client,
            lr_scheduler=sched,
            model_parameters=model.head.parameters(),  # ignored: the client's groups decide
            config=base_config(),
        )
        assert optimizer.optimizer is client and scheduler is sched
        assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
        assert len(optimizer.masters) == len(list(model.parameters()))
        assert_parity(model, train(engine, data), reference, ref_losses)
        assert engine.get_lr() == [g["lr"] for g in ref_opt.param_groups]

    def test_config_adamw_with_torch_fused_matches_torch_fused_adamw(self):
        """`optimizer.params.fused` reaches torch's AdamW (it was dropped once); every stage
        steps with the fused kernel and trains as plain PyTorch's fused AdamW does."""
        data = batches(3, seed=24)
        reference = build()
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
        ref_losses = train_reference(reference, ref_opt, data)
        params = {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True, "fused": True}
        for stage in (1, 2, 3):
            model = build()
            config = base_config(optimizer={"type": "AdamW", "params": params})
            config["zero_optimization"]["stage"] = stage
            engine, optimizer, _, _ = deepspeed.initialize(model=model, config=config)
            assert isinstance(optimizer.optimizer, torch.optim.AdamW)
            assert all(g["fused"] is True for g in optimizer.param_groups), stage
            losses = train(engine, data)
            # Adam turns the reduction's rounding into steps of up to lr, so looser than SGD's.
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=0)
            got = gathered_params(model)
            for name, p in reference.named_parameters():
                torch.testing.assert_close(
                    got[name], p.detach(), rtol=0, atol=2e-4, msg=f"stage {stage} {name}"
                )

    def test_config_lion_matches_plain_lion_at_every_stage_with_and_without_offload(self):
        """An optimizer block of type Lion builds FusedLion, and DeepSpeedCPULion under
        offload_optimizer; both train as plain Lion does. Lion steps by lr * sign(...), so
        rounding noise near zero can flip an element's step: all but a few elements must agree
        to 1e-6, and none by more than those flips (weight decay ignored would move them all)."""
        from deepspeed.ops.lion import DeepSpeedCPULion, FusedLion

        data, lr, steps = batches(3, seed=25), 0.01, 3
        reference = build()
        ref_losses = train_reference(
            reference, FusedLion(reference.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.5), data
        )
        params = {"lr": lr, "weight_decay": 0.5, "betas": [0.9, 0.99]}
        for stage in (1, 2, 3):
            for offload in (False, True):
                model = build()
                config = base_config(optimizer={"type": "Lion", "params": params})
                config["zero_optimization"]["stage"] = stage
                if offload:
                    config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
                engine, optimizer, _, _ = deepspeed.initialize(model=model, config=config)
                assert type(optimizer.optimizer) is (DeepSpeedCPULion if offload else FusedLion)
                assert optimizer.param_groups[0]["betas"] == (0.9, 0.99)
                losses = train(engine, data)
                torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=0)
                got = gathered_params(model)
                diffs = torch.cat(
                    [(got[n] - p.detach()).abs().flatten() for n, p in reference.named_parameters()]
                )
                assert diffs.max() <= 2 * lr * steps, (stage, offload, diffs.max())
                assert (diffs > 1e-6).float().mean() < 0.01, (stage, offload, (diffs > 1e-6).float().mean())

    def test_stage0_leaves_the_averaged_gradient_in_param_grad(self):
        """Stage 0, as upstream's engine without ZeRO: after the boundary's backward each
        `param.grad` holds the gradient averaged over the ranks (what plain PyTorch's backward
        on the whole batch gives), code that reads it before step() sees that, and the step's
        zero_grad clears it. It trains as plain PyTorch."""
        data = batches(3, seed=5)
        reference = build()
        ref_opt = torch.optim.SGD(reference.parameters(), lr=LR, momentum=MOMENTUM)
        sgd = {"type": "SGD", "params": {"lr": LR, "momentum": MOMENTUM}}
        config = base_config(optimizer=sgd)
        config["zero_optimization"]["stage"] = 0
        model = build()
        engine, *_ = deepspeed.initialize(model=model, config=config)
        params, losses, ref_losses = dict(model.named_parameters()), [], []
        for ids, labels in data:
            ref_opt.zero_grad()
            ref_loss = reference(ids, labels)
            ref_loss.backward()
            loss = engine(my_slice(ids), my_slice(labels))
            engine.backward(loss)
            for name, p in reference.named_parameters():
                torch.testing.assert_close(params[name].grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)
            engine.step()
            ref_opt.step()
            assert all(p.grad is None for p in model.parameters())
            # Two backwards before one step (two losses): the second adds to the averaged
            # first, and stepping applies the sum, as plain PyTorch's accumulation does.
            half = ids.shape[0] // 2
            ref_opt.zero_grad()
            reference(ids[:half], labels[:half]).backward()
            reference(ids[half:], labels[half:]).backward()
            engine.backward(engine(my_slice(ids[:half], gas=2), my_slice(labels[:half], gas=2)))
            engine.backward(engine(my_slice(ids[half:], gas=2), my_slice(labels[half:], gas=2)))
            for name, p in reference.named_parameters():
                torch.testing.assert_close(params[name].grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)
            engine.step()
            ref_opt.step()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item() / dist.get_world_size())
            ref_losses.append(ref_loss.item())
        assert_parity(model, losses, reference, ref_losses)

    def test_no_sync_accumulates_without_communication(self):
        """Stages 0-1: backward inside `no_sync()` reduces nothing, even at a boundary; the
        next backward outside it reduces the sum, which trains as plain PyTorch summing both
        batches' gradients. Misuse raises upstream's AssertionErrors."""
        from deepspeed.runtime.engine import NoSyncError

        data = batches(4, seed=31)
        reference = build()
        ref_opt = torch.optim.SGD(reference.parameters(), lr=LR, momentum=MOMENTUM)
        ref_losses = []
        for (ids_a, labels_a), (ids_b, labels_b) in zip(data[::2], data[1::2]):
            ref_opt.zero_grad()
            reference(ids_a, labels_a).backward()
            loss = reference(ids_b, labels_b)
            loss.backward()
            ref_opt.step()
            ref_losses.append(loss.item())
        sgd = {"type": "SGD", "params": {"lr": LR, "momentum": MOMENTUM}}
        for stage in (0, 1):
            model = build()
            config = base_config(optimizer=sgd)
            config["zero_optimization"]["stage"] = stage
            engine, *_ = deepspeed.initialize(model=model, config=config)
            # Upstream's class name for stages 0-2, which code checks with isinstance.
            assert type(engine.optimizer) is DeepSpeedZeroOptimizer
            losses = []
            for (ids_a, labels_a), (ids_b, labels_b) in zip(data[::2], data[1::2]):
                calls = engine.reducer.reduce_calls
                with engine.no_sync():
                    engine.backward(engine(my_slice(ids_a), my_slice(labels_a)))
                    assert engine.reducer.reduce_calls == calls, stage  # nothing left this rank
                    with torch.no_grad():
                        assert all(p.grad is not None for p in model.parameters()), stage
                    with pytest.raises(AssertionError, match="illegal to call Engine.step"):
                        engine.step()
                    with pytest.raises(NoSyncError, match="reentry is unsupported"):
                        with engine.no_sync():
                            pass
                loss = engine(my_slice(ids_b), my_slice(labels_b))
                engine.backward(loss)
                assert engine.reducer.reduce_calls > calls, stage
                engine.step()
                total = loss.detach().clone()
                dist.all_reduce(total)
                losses.append(total.item() / dist.get_world_size())
            assert_parity(model, losses, reference, ref_losses)
        config = base_config(optimizer=sgd)
        config["zero_optimization"]["stage"] = 2
        engine, *_ = deepspeed.initialize(model=build(), config=config)
        with pytest.raises(AssertionError, match="no_sync context manager is incompatible .* ZeRO stage 2"):
            with engine.no_sync():
                pass

    def test_backward_without_allreduce_then_allreduce_gradients(self):
        """Stages 0-1 with `enable_backward_allreduce = False`: backward leaves each rank's own
        gradient in param.grad; the caller may edit it (here: doubles it, as plain PyTorch
        does with its loss) and reduces it with `allreduce_gradients()`, with a bucket size
        of its own. A caller that forgets the call still steps on reduced gradients: step()
        reduces at the boundary. Stages 2-3, which reduce inside backward, refuse the switch."""
        data = batches(4, seed=33)
        reference = build()
        ref_opt = torch.optim.SGD(reference.parameters(), lr=LR, momentum=MOMENTUM)
        ref_losses = []
        for ids, labels in data:
            ref_opt.zero_grad()
            loss = reference(ids, labels)
            (2 * loss).backward()
            ref_opt.step()
            ref_losses.append(loss.item())
        sgd = {"type": "SGD", "params": {"lr": LR, "momentum": MOMENTUM}}
        for stage in (0, 1):
            for call_it in (True, False):
                model = build()
                config = base_config(optimizer=sgd)
                config["zero_optimization"]["stage"] = stage
                engine, *_ = deepspeed.initialize(model=model, config=config)
                engine.enable_backward_allreduce = False
                losses = []
                for step, (ids, labels) in enumerate(data):
                    calls = engine.reducer.reduce_calls
                    loss = engine(my_slice(ids), my_slice(labels))
                    engine.backward(loss)
                    assert engine.reducer.reduce_calls == calls, (stage, step)  # nothing sent yet
                    with torch.no_grad():
                        for p in model.parameters():
                            p.grad.mul_(2)  # this rank's own gradient, before any reduction
                    if call_it:
                        # One element per bucket: a collective per parameter, as asked.
                        engine.allreduce_gradients(bucket_size=1)
                        assert engine.reducer.reduce_calls - calls == len(list(model.parameters()))
                        engine.allreduce_gradients()  # nothing left: sends nothing
                        assert engine.reducer.reduce_calls - calls == len(list(model.parameters()))
                    engine.step()
                    assert engine.reducer.reduce_calls > calls, (stage, call_it)
                    total = loss.detach().clone()
                    dist.all_reduce(total)
                    losses.append(total.item() / dist.get_world_size())
                assert_parity(model, losses, reference, ref_losses)
                with pytest.raises(ValueError, match="bucket_size=0 must be a positive int"):
                    engine.allreduce_gradients(bucket_size=0)
        config = base_config(optimizer=sgd)
        config["zero_optimization"]["stage"] = 2
        engine, *_ = deepspeed.initialize(model=build(), config=config)
        engine.enable_backward_allreduce = False
        ids, labels = data[0]
        with pytest.raises(RuntimeError, match="enable_backward_allreduce=False .* ZeRO stage 2"):
            engine.backward(engine(my_slice(ids), my_slice(labels)))

    def test_bf16_whole_gradients_accumulate_in_fp32(self):
        """Stages 0-1 in bf16: the unreduced gradients of micro-steps before the boundary are
        summed in fp32 (they were summed in bf16 in param.grad, off by 0.5% of the largest
        element over 8 steps), so this rank's gradient so far is exactly the fp32 sum of its
        bf16 micro-step gradients."""
        from deepspeed.utils import safe_get_full_grad

        gas = 4
        ids_all, labels_all = batches(1, seed=32)[0]
        sgd = {"type": "SGD", "params": {"lr": LR}}
        for stage in (0, 1):
            config = base_config(optimizer=sgd, gradient_accumulation_steps=gas, bf16={"enabled": True})
            config["train_micro_batch_size_per_gpu"] //= gas
            config["zero_optimization"]["stage"] = stage
            engine, *_ = deepspeed.initialize(model=build(), config=config)
            reference = build().to(torch.bfloat16)
            expected = {n: torch.zeros(p.shape) for n, p in reference.named_parameters()}
            for micro in range(gas):
                ids, labels = my_slice(ids_all, micro, gas), my_slice(labels_all, micro, gas)
                assert len(ids) > 0
                reference.zero_grad()
                (reference(ids, labels).float() / gas).backward()
                for n, p in reference.named_parameters():
                    expected[n] += p.grad.float()
                engine.backward(engine(ids, labels))
                if micro < gas - 1:
                    for n, p in engine.module.named_parameters():
                        assert p.grad is None, (stage, n)  # folded into the fp32 sum
                        assert torch.equal(safe_get_full_grad(p), expected[n]), (stage, micro, n)
                engine.step()

        data = batches(3, seed=23)
        reference = build()
        ref_losses = train_reference(
            reference, torch.optim.SGD(decay_groups(reference), lr=LR, momentum=MOMENTUM), data
        )
        model = build()
        engine, optimizer, _, _ = deepspeed.initialize(
            model=model,
            optimizer=lambda groups: torch.optim.SGD(groups, lr=LR, momentum=MOMENTUM),
            model_parameters=decay_groups(model),
            config=base_config(),
        )
        assert [g["lr"] for g in optimizer.param_groups] == [0.05, 0.2]
        assert_parity(model, train(engine, data), reference, ref_losses)

    def test_trainable_parameters_in_no_group_keep_no_gradient(self):
        handler = LogRecords(logging.WARNING)
        ds_logger.addHandler(handler)
        try:
            model = build()
            cfg = base_config(optimizer={"type": "SGD", "params": {"lr": LR}})
            engine, optimizer, _, _ = deepspeed.initialize(
                model=model, model_parameters=model.head.parameters(), config=cfg
            )
        finally:
            ds_logger.removeHandler(handler)
        head_ids = {p.ds_id for p in model.head.parameters()}
        assert set(optimizer.masters) == head_ids
        train(engine, batches(3, seed=24))
        for name, p in model.named_parameters():
            assert p.grad is None, f"{name} keeps a .grad of {tuple(p.grad.shape)}"
        if dist.get_rank() == 0:
            named = [m for m in handler.messages if "embed.weight" in m and "requires_grad=False" in m]
            assert len(named) == 1, handler.messages
            assert "head.weight" not in named[0]

    @run_on(2)
    def test_bf16_edit_then_save_without_step(self, tmp_path):
        """Checkpoint, 16-bit export and zero_to_fp32 all contain an edit made after the last step."""
        cfg = base_config(
            bf16={"enabled": True},
            optimizer={"type": "SGD", "params": {"lr": 0.0}},
            zero_optimization={
                "stage": 3,
                "stage3_param_persistence_threshold": 0,
                "stage3_gather_16bit_weights_on_model_save": True,
            },
        )
        engine, _, _, _ = deepspeed.initialize(model=build(), config=cfg)
        train(engine, batches(1, seed=25))
        head = engine.module.head
        with deepspeed.zero.GatheredParameters(head.weight, modifier_rank=0):
            head.weight.data.fill_(0.5)
        save_dir = str(tmp_path / "ckpt")
        engine.save_checkpoint(save_dir, tag="edited")
        engine.save_16bit_model(str(tmp_path / "export"))
        dist.barrier()
        exported = torch.load(str(tmp_path / "export" / "pytorch_model.bin"), weights_only=True)
        fp32 = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(save_dir, tag="edited")
        assert torch.all(exported["head.weight"] == 0.5)
        assert torch.all(fp32["head.weight"] == 0.5)
        for name, value in exported.items():
            assert torch.equal(fp32[name].to(value.dtype), value), name

        fresh, _, _, _ = deepspeed.initialize(model=build(seed=1), config=cfg)
        fresh.load_checkpoint(save_dir, tag="edited")
        loaded = gathered_params(fresh.module)
        assert all(torch.equal(loaded[n], fp32[n]) for n in loaded)
        train(fresh, batches(1, seed=26))  # lr 0: the step keeps the loaded masters
        assert torch.equal(gathered_params(fresh.module)["head.weight"], fp32["head.weight"])

    @run_on(2)
    def test_every_collective_tensor_is_on_the_communication_device(self, monkeypatch, tmp_path):
        """Train, save and load, recording each tensor handed to a collective.

        On a CPU machine every tensor is on the CPU, so a tensor that skipped its move to the
        communication device would pass unseen. The default device is set to `meta` while
        the engine runs: a tensor the code did not place explicitly lands there and is caught
        (an NCCL group rejects such a tensor in the same way).
        """
        expected = torch.device(get_accelerator().current_device_name())
        seen = []

        def recording(name, original):
            def call(*args, **kwargs):
                values = list(args) + list(kwargs.values())
                tensors = [a for a in values if torch.is_tensor(a)]
                tensors += [
                    t for a in values if isinstance(a, (list, tuple)) for t in a if torch.is_tensor(t)
                ]
                for t in tensors:
                    assert t.device == expected, f"{name} got a tensor on {t.device}, not on {expected}"
                seen.append(name)
                return original(*args, **kwargs)

            return call

        for name in (
            "all_reduce",
            "broadcast",
            "reduce",
            "all_gather",
            "all_gather_into_tensor",
            "all_gather_into_columns",
            "reduce_scatter_tensor",
            "reduce_scatter_columns",
        ):
            monkeypatch.setattr(deepspeed.comm, name, recording(name, getattr(deepspeed.comm, name)))
        cfg = base_config(
            optimizer={"type": "SGD", "params": {"lr": LR, "momentum": MOMENTUM}},
            gradient_clipping=0.5,
            zero_optimization={
                "stage": 3,
                "stage3_param_persistence_threshold": 50,
                "stage3_gather_16bit_weights_on_model_save": True,
            },
        )
        model = build()
        ids, labels = batches(1, seed=27)[0]
        with torch.device("meta"):
            engine, _, _, _ = deepspeed.initialize(model=model, config=cfg)
            for _ in range(2):
                engine.backward(engine(my_slice(ids), my_slice(labels)))
                engine.step()
            with deepspeed.zero.GatheredParameters(model.head.weight, modifier_rank=0):
                model.head.weight.data.mul_(0.5)
            engine.save_checkpoint(str(tmp_path / "ckpt"))
            engine.load_checkpoint(str(tmp_path / "ckpt"))
            engine.save_16bit_model(str(tmp_path / "export"))
        assert "all_reduce" in seen and "all_gather_into_tensor" in seen
        assert {"reduce_scatter_tensor", "reduce_scatter_columns"} & set(seen)
