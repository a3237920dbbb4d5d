"""The stage-3 engine on ordinary training code: in-place ops, checkpointing, aborted forwards,
live gathers across step, parameters used by keyword or in lists, nested engines, direct calls.

Each parity case trains a model under ZeRO-3 and a plain copy from the same seed with a
DDP-style reference (every rank's micro-batch through the plain model, gradients averaged),
and compares losses per step and the final parameters.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import deepspeed
import deepspeed.comm as dist
from deepspeed.runtime.zero.lifecycle import ZeroParamStatus
from deepspeed.runtime.zero.utils import ZeRORuntimeException
from tests.unit.common import DistributedTest

BATCH, WIDTH = 8, 10


def sgd_config(**extra):
    cfg = {
        "train_micro_batch_size_per_gpu": BATCH // dist.get_world_size(),
        "gradient_clipping": 0.0,  # the plain references do not clip (the default clips at 1.0)
        "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 200},
    }
    cfg.update(extra)
    return cfg


def my_rows(tensor, rank=None):
    ws = dist.get_world_size()
    per = tensor.shape[0] // ws
    rank = dist.get_rank() if rank is None else rank
    return tensor[rank * per : (rank + 1) * per]


def make_data(steps, shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(BATCH, *shape, generator=gen), torch.randn(BATCH, 3, generator=gen))
        for _ in range(steps)
    ]


def reference_losses(model, data):
    """DDP-style: each rank's rows separately, gradients averaged; the mean loss per step."""
    ws = dist.get_world_size()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for x, y in data:
        opt.zero_grad()
        total = 0.0
        for r in range(ws):
            loss = F.mse_loss(model(my_rows(x, r)), my_rows(y, r))
            (loss / ws).backward()
            total += loss.item() / ws
        opt.step()
        losses.append(total)
    return losses


def engine_losses(engine, data, between_steps=None):
    losses = []
    for step, (x, y) in enumerate(data):
        loss = F.mse_loss(engine(my_rows(x)), my_rows(y))
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
        if between_steps is not None:
            between_steps(step)
    return losses


def assert_parity(engine, losses, reference, ref_losses):
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        got = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    for name, p in reference.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=0, atol=5e-5, msg=name)
    assert_nothing_held(engine)


def assert_nothing_held(engine):
    for p in engine.module.parameters():
        assert p._zero_state.holders == 0, p.ds_summary()
        assert p.ds_status is ZeroParamStatus.NOT_AVAILABLE, p.ds_summary()


def twin(build, **extra):
    """(engine, plain reference) built from one seed."""
    torch.manual_seed(7)
    zero_model = build()
    torch.manual_seed(7)
    reference = build()
    engine, *_ = deepspeed.initialize(model=zero_model, config=sgd_config(**extra))
    return engine, reference


class ResidualBlock(nn.Module):
    """A torchvision-style basic block: in-place ReLU on hooked outputs and `out += identity`."""

    def __init__(self, channels):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class TinyResNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(2, 4, 3, padding=1)
        self.act = nn.ReLU(inplace=True)
        self.block = ResidualBlock(4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h = self.block(self.act(self.stem(x)))
        return self.head(h.mean(dim=(2, 3)))


class CheckpointedMLP(nn.Module):
    def __init__(self, use_reentrant):
        super().__init__()
        self.use_reentrant = use_reentrant
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH)) for _ in range(3)
        )
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x):
        for block in self.blocks:
            x = x + checkpoint(block, x, use_reentrant=self.use_reentrant)
        return self.head(x)


class OutsideUses(nn.Module):
    """Parameters passed by keyword and inside a list, outside their own modules' forward."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(WIDTH, WIDTH)
        self.b = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(2 * WIDTH, 3)

    def forward(self, x):
        h = torch.tanh(F.linear(x, weight=self.a.weight, bias=self.a.bias))
        stacked = torch.cat([self.a.weight, self.b.weight])  # [2W, W]
        return self.head(F.linear(h, stacked))


class TestEngineRobustness(DistributedTest):
    world_size = [2]

    def test_in_place_relu_and_residual_add(self):
        engine, reference = twin(TinyResNet)
        data = make_data(3, (2, 5, 5))
        assert_parity(engine, engine_losses(engine, data), reference, reference_losses(reference, data))

    @pytest.mark.parametrize("use_reentrant", [False, True])
    def test_activation_checkpointing(self, use_reentrant):
        engine, reference = twin(lambda: CheckpointedMLP(use_reentrant))
        data = make_data(4, (WIDTH,))
        assert_parity(engine, engine_losses(engine, data), reference, reference_losses(reference, data))

    def test_parameters_by_keyword_and_in_lists(self):
        engine, reference = twin(OutsideUses)
        data = make_data(3, (WIDTH,))
        assert_parity(engine, engine_losses(engine, data), reference, reference_losses(reference, data))

    def test_gather_live_across_step_sees_the_update(self):
        engine, reference = twin(OutsideUses)
        data = make_data(3, (WIDTH,))
        weight = engine.module.head.weight
        live = deepspeed.zero.GatheredParameters(weight).start()
        seen = []
        losses = engine_losses(engine, data, between_steps=lambda step: seen.append(weight.detach().clone()))
        live.stop()
        ref_losses = reference_losses(reference, data)
        torch.testing.assert_close(seen[-1], reference.head.weight.detach(), rtol=0, atol=5e-5)
        assert not torch.equal(seen[0], seen[-1])
        assert_parity(engine, losses, reference, ref_losses)

    def test_gather_in_flight_at_step_sees_the_update(self):
        """A `start(async_op=True)` not yet waited on when step() runs: the step completes it
        before changing the shards, so once waited it shows the stepped values, not the old."""
        engine, reference = twin(OutsideUses)
        data = make_data(2, (WIDTH,))
        weight = engine.module.head.weight
        for step, (x, y) in enumerate(data):
            engine.backward(F.mse_loss(engine(my_rows(x)), my_rows(y)))
            if step == len(data) - 1:
                live = deepspeed.zero.GatheredParameters(weight).start(async_op=True)
                assert weight.ds_status is ZeroParamStatus.INFLIGHT
            engine.step()
        live.wait()
        seen = weight.detach().clone()
        live.stop()
        reference_losses(reference, data)
        torch.testing.assert_close(seen, reference.head.weight.detach(), rtol=0, atol=5e-5)
        assert_nothing_held(engine)

    def test_modifier_gather_across_step_keeps_the_edit(self):
        engine, reference = twin(OutsideUses)
        data = make_data(2, (WIDTH,))
        bias = engine.module.head.bias
        live = deepspeed.zero.GatheredParameters(bias, modifier_rank=0).start()
        bias.data.add_(1.0)  # every rank's forward sees it; the step must start from it too
        with torch.no_grad():
            reference.head.bias.add_(1.0)
        losses = engine_losses(engine, data)
        live.stop()
        assert_parity(engine, losses, reference, reference_losses(reference, data))

    def test_exception_in_forward_leaves_nothing_held(self):
        engine, reference = twin(OutsideUses)
        data = make_data(3, (WIDTH,))
        engine.module.b.register_forward_hook(lambda *a: None)  # an unrelated hook stays harmless

        def failing(module, args):
            raise ValueError("bad batch")

        handle = engine.module.head.register_forward_pre_hook(failing)
        with pytest.raises(ValueError, match="bad batch"):
            engine(my_rows(data[0][0]))
        handle.remove()
        assert_nothing_held(engine)
        assert_parity(engine, engine_losses(engine, data), reference, reference_losses(reference, data))

    def test_loss_backward_equals_engine_backward(self):
        # [Note: torch-style backward]: `loss.backward()` then `engine.step()`, as upstream 0.19
        # allows at stages 1-3 (and here at 0), bit for bit what engine.backward gives, with
        # gradient accumulation; the loss is built as HF models build theirs, from a returned
        # tensor that is returned too (dividing at every output divided twice), plus a second
        # forward, and a direct call of the module; part of the model is checkpointed.
        data = make_data(4, (WIDTH,))

        class ReturnsLossAndLogits(nn.Module):
            def __init__(self):
                super().__init__()
                self.pre = nn.Linear(WIDTH, WIDTH)
                self.net = nn.Linear(WIDTH, 3)

            def forward(self, x, y):
                # Reentrant checkpointing runs a backward of its own inside the outer one.
                h = checkpoint(lambda t: torch.tanh(self.pre(t)), x.requires_grad_(), use_reentrant=True)
                logits = self.net(h)
                return {"loss": F.mse_loss(logits, y), "logits": logits}

        def train(stage, torch_style):
            torch.manual_seed(0)
            config = sgd_config(
                zero_optimization={"stage": stage, "reduce_bucket_size": 50},
                gradient_accumulation_steps=2,
                train_micro_batch_size_per_gpu=BATCH // (2 * dist.get_world_size()),
            )
            engine, *_ = deepspeed.initialize(model=ReturnsLossAndLogits(), config=config)
            for x, y in data:
                for xs, ys in zip(my_rows(x).chunk(2), my_rows(y).chunk(2)):
                    out = engine(xs, ys)
                    direct = engine.module(xs * 0.5, ys)["logits"]  # the module itself, not the engine
                    loss = out["loss"] + out["logits"].pow(2).mean() + direct.pow(2).mean()
                    loss.backward() if torch_style else engine.backward(loss)
                    engine.step()
            with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
                return [p.detach().clone() for p in engine.module.parameters()]

        for stage in (0, 1, 2, 3):
            for a, b in zip(train(stage, False), train(stage, True)):
                # The direct call's checkpointed segment can finish its own backward before the
                # rest reaches a parameter; the engine then reduces in two parts: the same sum,
                # rounded otherwise at stages 0-1 (4e-9 measured). See torch_backward.py's note.
                torch.testing.assert_close(a, b, rtol=0, atol=1e-7, msg=f"stage {stage}")

    def test_input_gradients_are_not_divided_by_the_accumulation_steps(self):
        # A gradient penalty differentiates the output with respect to the input: plain PyTorch's
        # value, whatever gradient_accumulation_steps says (only parameters' gradients are divided).
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1))
        plain = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1))
        plain.load_state_dict(model.state_dict())
        config = sgd_config(zero_optimization={"stage": 1}, gradient_accumulation_steps=4)
        engine, *_ = deepspeed.initialize(model=model, config=config)
        x = torch.randn(2, WIDTH, requires_grad=True)
        (got,) = torch.autograd.grad(engine(x).sum(), x)
        (want,) = torch.autograd.grad(plain(x).sum(), x)
        assert torch.equal(got, want)

    def test_another_engines_backward_through_this_one_is_refused(self):
        # A GAN: the generator's engine.backward reaches the discriminator's parameters. Those
        # gradients are not the discriminator's backward: refused at its step, weights untouched,
        # unless its zero_grad discards them.
        x = torch.ones(BATCH // dist.get_world_size(), WIDTH)
        for stage in (0, 1, 2, 3):
            torch.manual_seed(0)
            config = sgd_config(zero_optimization={"stage": stage, "reduce_bucket_size": 10**6})
            gen, *_ = deepspeed.initialize(model=nn.Linear(WIDTH, WIDTH), config=config)
            disc, *_ = deepspeed.initialize(model=nn.Linear(WIDTH, 1), config=config)
            before = [p.detach().clone() for p in disc.module.parameters()] if stage < 3 else None
            gen.backward(disc(gen(x)).sum())
            with pytest.raises(
                RuntimeError,
                match=r"parameters \(.*weight.*\) came from a backward outside engine.backward\(loss\)",
            ):
                disc.step()
            if before is not None:
                assert all(torch.equal(a, p) for a, p in zip(before, disc.module.parameters()))
            gen.backward(disc(gen(x)).sum())
            disc.zero_grad()  # the usual fix: the discriminator's own backward then goes through
            disc.backward(disc(x).sum())
            disc.step()

    def test_fp16_loss_backward_needs_engine_scale(self):
        # A loss scale applied where gradients reach the parameters would come after fp16
        # underflow: a plain loss.backward() raises before any gradient is accumulated;
        # engine.scale(loss).backward() equals engine.backward bit for bit. A scale() whose
        # result was not backpropagated vouches for nothing later, and scaling twice is refused.
        data = make_data(3, (WIDTH,))

        def train(how):
            torch.manual_seed(0)
            config = sgd_config(
                fp16={"enabled": True, "initial_scale_power": 6}, zero_optimization={"stage": 2}
            )
            engine, *_ = deepspeed.initialize(model=nn.Linear(WIDTH, 3), config=config)
            for x, y in data:
                loss = F.mse_loss(engine(my_rows(x).half()).float(), my_rows(y))
                if how == "plain":
                    with pytest.raises(RuntimeError, match=r"engine.scale\(loss\).backward\(\)"):
                        loss.backward()
                    assert all(p.grad is None for p in engine.module.parameters())
                    loss = F.mse_loss(engine(my_rows(x).half()).float(), my_rows(y))  # that graph is spent
                    engine.scale(loss)  # only to log it: then engine.backward, and the scale is spent
                    engine.backward(loss)
                    engine.step()
                    with pytest.raises(RuntimeError, match=r"needs the loss scaled first"):
                        F.mse_loss(engine(my_rows(x).half()).float(), my_rows(y)).backward()
                    with pytest.raises(ValueError, match="scaled already"):
                        engine.scale(engine.scale(loss))
                    with pytest.raises(ValueError, match=r"not engine.scale\(loss\)"):
                        engine.backward(engine.scale(loss))
                    return None
                engine.scale(loss).backward() if how == "scale" else engine.backward(loss)
                engine.step()
            return [p.detach().clone() for p in engine.module.parameters()]

        train("plain")
        assert all(torch.equal(a, b) for a, b in zip(train("engine"), train("scale")))

    def test_a_torch_style_backward_that_raised_leaves_the_engine_usable(self):
        engine, reference = twin(OutsideUses)
        data = make_data(3, (WIDTH,))

        def failing(grad):
            raise ValueError("bad gradient")

        # Runs after the engine's own hook on the parameter, which began the backward.
        handle = engine.module.head.bias.register_hook(failing)
        with pytest.raises(ValueError, match="bad gradient"):
            F.mse_loss(engine(my_rows(data[0][0])), my_rows(data[0][1])).backward()
        handle.remove()
        engine.zero_grad()
        engine(my_rows(data[0][0]))  # the next forward closes the backward that never reached its end
        assert not engine._inside_backward  # else a later stray backward would pass for the engine's own
        assert_parity(engine, engine_losses(engine, data), reference, reference_losses(reference, data))
        assert_nothing_held(engine)

    def test_zero_grad_discards_a_micro_step_at_every_stage(self):
        # At stages 0-1 the gradients of a micro-step wait whole in param.grad until the
        # boundary; zero_grad (the engine's or the optimizer's) must drop them too, not only
        # the reduced shards, and a .grad left on the model before initialize as well.
        def run(stage, discard):
            torch.manual_seed(0)
            model = nn.Linear(WIDTH, 2)
            x = torch.ones(BATCH // (2 * dist.get_world_size()), WIDTH) * (dist.get_rank() + 1)
            if discard:
                model(x).sum().backward()  # a sanity check before initialize leaves a .grad
            config = sgd_config(zero_optimization={"stage": stage}, gradient_accumulation_steps=2)
            engine, optimizer, *_ = deepspeed.initialize(model=model, config=config)
            if discard:
                engine.backward(engine(x * 100).sum())
                (engine if discard == "engine" else optimizer).zero_grad()
            for _ in range(2):
                engine.backward(engine(x).sum())
                engine.step()
            with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
                return [p.detach().clone() for p in engine.module.parameters()]

        for stage in (0, 1, 2, 3):
            clean = run(stage, None)
            for discard in ("engine", "optimizer"):
                got = run(stage, discard)
                assert all(torch.equal(a, b) for a, b in zip(clean, got)), (stage, discard)

    def test_ranks_training_different_parameters_are_refused(self):
        # Rank 0 runs branch x, rank 1 branch y, both the same shape: the collectives match in
        # size, so without the check each rank's gradients were silently added to the other's.
        class TwoBranches(nn.Module):
            def __init__(self):
                super().__init__()
                self.a, self.x, self.y = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

            def forward(self, inp, use_x):
                h = self.a(inp)
                return self.x(h) if use_x else self.y(h)

        inp = torch.ones(BATCH // dist.get_world_size(), 4)
        for stage in (1, 2, 3):
            torch.manual_seed(0)
            config = sgd_config(zero_optimization={"stage": stage})
            engine, *_ = deepspeed.initialize(model=TwoBranches(), config=config)
            engine.backward(engine(inp, use_x=True).sum())  # the same branch everywhere: fine
            engine.step()
            engine.backward(engine(inp, use_x=dist.get_rank() == 0).sum())
            with pytest.raises(RuntimeError, match="reduced gradients of different parameters"):
                engine.step()
            # With accumulation the branches swap between micro-steps: by the step every rank has
            # gradients for both. Stages 2-3 reduced each micro-step's buckets, summed across the
            # branches: refused. Stage 1 reduces once after the boundary's backward, when every
            # rank holds both sums, so the same parameters are reduced everywhere: a correct step.
            torch.manual_seed(0)
            config = sgd_config(zero_optimization={"stage": stage}, gradient_accumulation_steps=2)
            engine, *_ = deepspeed.initialize(model=TwoBranches(), config=config)
            for micro in range(2):
                engine.backward(engine(inp, use_x=(dist.get_rank() + micro) % 2 == 0).sum())
                if micro == 0:
                    engine.step()  # not a boundary: nothing to check yet
            if stage == 1:
                engine.step()
                for p in engine.module.parameters():  # the replicated parameters agree
                    theirs = p.detach().clone()
                    dist.broadcast(theirs, src=0)
                    assert torch.equal(theirs, p.detach())
            else:
                with pytest.raises(RuntimeError, match="reduced gradients of different parameters"):
                    engine.step()

    def test_nested_engine_forward_keeps_the_outer_access_hook(self):
        torch.manual_seed(3)
        teacher_model = nn.Linear(WIDTH, WIDTH)
        teacher, *_ = deepspeed.initialize(
            model=teacher_model,
            config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}},
        )

        class Student(OutsideUses):
            def forward(self, x):
                with torch.no_grad():
                    x = teacher(x)  # the inner engine's forward, then parameters used outside
                return super().forward(x)

        class Reference(OutsideUses):
            def forward(self, x):
                with torch.no_grad():
                    x = teacher_plain(x)
                return super().forward(x)

        with deepspeed.zero.GatheredParameters(list(teacher_model.parameters())):
            teacher_plain = nn.Linear(WIDTH, WIDTH)
            teacher_plain.load_state_dict({k: v.clone() for k, v in teacher_model.state_dict().items()})
        torch.manual_seed(7)
        student = Student()
        torch.manual_seed(7)
        reference = Reference()
        engine, *_ = deepspeed.initialize(model=student, config=sgd_config())
        data = make_data(3, (WIDTH,))
        assert_parity(engine, engine_losses(engine, data), reference, reference_losses(reference, data))

    def test_direct_module_calls_keep_the_trace_bounded(self):
        engine, _ = twin(OutsideUses)
        data = make_data(2, (WIDTH,))
        engine_losses(engine, data)
        trace_length = len(engine.coordinator.prefetcher.trace)
        x = my_rows(data[0][0])
        with torch.no_grad():
            outputs = [engine.module(x) for _ in range(5)]  # an eval loop, generate
        for _ in range(3):
            engine.module(x)  # grad enabled, never backpropagated
        assert len(engine.coordinator.prefetcher.trace) == trace_length
        assert all(torch.equal(outputs[0], o) for o in outputs)
        engine(x).sum()  # a fresh pass closes the last one
        engine.coordinator.end_pass()
        assert_nothing_held(engine)

    def test_partition_drops_only_its_own_hold(self):
        engine, _ = twin(OutsideUses)
        weight = engine.module.a.weight
        live = deepspeed.zero.GatheredParameters(weight).start()
        weight.partition()  # nobody took an all_gather() hold: the live gather keeps it
        assert weight.ds_status is ZeroParamStatus.AVAILABLE and weight.numel() == WIDTH * WIDTH
        weight.all_gather()
        weight.partition()
        assert weight.ds_status is ZeroParamStatus.AVAILABLE
        live.stop()
        assert weight.ds_status is ZeroParamStatus.NOT_AVAILABLE
        weight.all_gather()
        weight.partition()
        assert weight.ds_status is ZeroParamStatus.NOT_AVAILABLE

    def test_bf16_engine_retypes_an_fp32_init_model_and_aliased_buffers(self):
        with deepspeed.zero.Init():  # no config: fp32
            model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.Linear(WIDTH, 3))
        alias = model[1].running_mean
        model[2].register_buffer("shared_mean", alias)
        engine, *_ = deepspeed.initialize(model=model, config=sgd_config(bf16={"enabled": True}))
        assert all(
            p.dtype == torch.bfloat16 and p.ds_tensor.dtype == torch.bfloat16 for p in model.parameters()
        )
        assert alias.dtype == torch.bfloat16 and model[2].shared_mean is alias
        x, y = make_data(1, (WIDTH,))[0]
        loss = F.mse_loss(engine(my_rows(x).bfloat16()).float(), my_rows(y))
        engine.backward(loss)
        engine.step()
        assert torch.isfinite(loss)

    def test_save_with_a_live_modifier_gather_keeps_the_edit(self, tmp_path):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        engine, _ = twin(OutsideUses)
        engine_losses(engine, make_data(1, (WIDTH,)))
        bias = engine.module.head.bias
        live = deepspeed.zero.GatheredParameters(bias, modifier_rank=0).start()
        bias.data.fill_(0.25)
        save_dir = str(tmp_path / "ckpt")  # the same path on every rank: tmp_path comes from the parent
        engine.save_checkpoint(save_dir)
        live.stop()
        dist.barrier()
        state = get_fp32_state_dict_from_zero_checkpoint(save_dir)
        assert torch.all(state["head.bias"] == 0.25)

    def test_sanity_checks_refuse_a_gathered_parameter_with_no_holder(self):
        from deepspeed.runtime.zero import gather

        zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "enable_sanity_checks": True}
        engine, _ = twin(OutsideUses, zero_optimization=zero)
        x, y = make_data(1, (WIDTH,))[0]
        loss = F.mse_loss(engine(my_rows(x)), my_rows(y))
        engine.backward(loss)
        state = engine.module.a.weight._zero_state
        gather.fetch_states([state], "test")
        state.holds.clear()  # what a lost release would leave
        with pytest.raises(RuntimeError, match="gathered with no holder"):
            engine.step()
        state.hold("test")
        gather.release_states([state], "test")


class TestReplicatedStages(DistributedTest):
    """Stages 1 and 2 keep full parameters; only this rank's slices exist for the optimizer."""

    world_size = [2]

    @pytest.mark.parametrize("stage", [0, 1, 2])
    def test_full_parameters_sharded_state_and_when_gradients_reduce(self, stage):
        # Several all-gather buckets after each step, with padded (head.bias: 3 elements over 2
        # ranks) and unpadded parameters in them (gather.gather_into_params).
        zero = {"stage": stage, "reduce_bucket_size": 200, "allgather_bucket_size": 40}
        engine, reference = twin(OutsideUses, zero_optimization=zero)
        model = engine.module
        assert model.head.bias.numel() % dist.get_world_size() and not model.a.weight.numel() % 2
        assert not any(hasattr(p, "ds_id") for p in model.parameters())  # HF reads ds_id as ZeRO-3
        assert engine.zero_optimization_stage() == stage and not engine.zero_optimization_partition_weights()
        assert engine.zero_optimization_partition_gradients() == (stage == 2)
        masters = engine.optimizer.masters
        total = sum(p.numel() for p in model.parameters())
        assert sum(m.numel() for m in masters.values()) == sum(
            -(-p.numel() // dist.get_world_size()) for p in model.parameters()
        )  # ceil(numel / ws) per parameter, not numel
        assert sum(m.numel() for m in masters.values()) < total
        data = make_data(3, (WIDTH,), seed=1)
        losses = engine_losses(engine, data)
        ref_losses = reference_losses(reference, data)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=5e-5, msg=name)

    @pytest.mark.parametrize("stage", [1, 2])
    def test_when_gradients_are_reduced(self, stage):
        torch.manual_seed(0)
        model = OutsideUses()
        cfg = sgd_config(zero_optimization={"stage": stage}, gradient_accumulation_steps=2)
        cfg["train_micro_batch_size_per_gpu"] //= 2
        engine, *_ = deepspeed.initialize(model=model, config=cfg)
        x, y = make_data(1, (WIDTH,))[0]
        rows, targets = my_rows(x), my_rows(y)
        half = rows.shape[0] // 2
        engine.backward(F.mse_loss(engine(rows[:half]), targets[:half]))
        if stage == 2:
            assert model.head.weight.grad is None  # reduce-scattered during backward
        else:
            assert model.head.weight.grad.shape == model.head.weight.shape  # accumulated whole
        engine.step()  # not a boundary: nothing reduced, nothing stepped
        engine.backward(F.mse_loss(engine(rows[half:]), targets[half:]))
        assert all(p.grad is None for p in model.parameters())  # the boundary's backward reduced
        assert deepspeed.utils.safe_get_full_grad(model.head.weight).shape == model.head.weight.shape
        engine.step()
        assert engine.global_steps == 1

    def test_a_model_built_under_init_is_made_whole_at_stage_2(self):
        """Parameters used outside their modules (by keyword, inside torch.cat) need no gather
        at stage 2 either: the partitioned ones are whole again after initialize, and train."""
        torch.manual_seed(0)
        reference = OutsideUses()
        torch.manual_seed(0)
        with deepspeed.zero.Init():
            model = OutsideUses()
        engine, *_ = deepspeed.initialize(model=model, config=sgd_config(zero_optimization={"stage": 2}))
        assert [p.shape for p in model.parameters()] == [p.shape for p in reference.parameters()]
        data = make_data(3, (WIDTH,), seed=2)
        losses = engine_losses(engine, data)
        ref_losses = reference_losses(reference, data)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)


class TestOptimizerOffload(DistributedTest):
    """offload_optimizer: masters, gradient slices and optimizer state on the CPU, at every stage."""

    world_size = [2]

    @pytest.mark.parametrize("stage", [1, 2, 3])
    def test_adam_config_steps_with_cpu_adam_on_cpu_masters(self, stage):
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        zero = {
            "stage": stage,
            "stage3_param_persistence_threshold": 0,
            "offload_optimizer": {"device": "cpu"},
        }
        adam = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}
        engine, reference = twin(OutsideUses, zero_optimization=zero, optimizer=adam, bf16={"enabled": True})
        assert isinstance(engine.optimizer.optimizer, DeepSpeedCPUAdam)
        x, y = make_data(1, (WIDTH,))[0]
        for _ in range(2):
            loss = F.mse_loss(engine(my_rows(x).bfloat16()).float(), my_rows(y))
            engine.backward(loss)
            engine.step()
        masters = list(engine.optimizer.masters.values())
        assert all(m.device.type == "cpu" and m.dtype == torch.float32 for m in masters)
        states = [t for s in engine.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        assert states and all(t.device.type == "cpu" for t in states)
        assert all(p.dtype == torch.bfloat16 for p in engine.module.parameters())
        assert torch.isfinite(loss)

    def test_a_client_optimizer_needs_the_opt_in(self):
        torch.manual_seed(0)
        model = OutsideUses()
        zero = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
        cfg = sgd_config(zero_optimization=zero)
        del cfg["optimizer"]
        # Upstream raises ZeRORuntimeException here: code that catches it must still catch ours.
        with pytest.raises(ZeRORuntimeException, match="zero_force_ds_cpu_optimizer") as refused:
            deepspeed.initialize(
                model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=cfg
            )
        assert isinstance(refused.value, ValueError)
        with pytest.raises(ValueError, match="nvme"):
            deepspeed.initialize(
                model=model,
                config=sgd_config(zero_optimization={"stage": 2, "offload_optimizer": {"device": "nvme"}}),
            )


class WideHead(nn.Module):
    """A weight whose optimizer state is over 2 MiB per rank, next to a small one."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(WIDTH, 160_000, bias=False)  # 1.6M: 3.2 MB of exp_avg per rank at 2 ranks
        self.head = nn.Linear(self.proj.out_features, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.proj(x)))


class TestOffloadCheckpointKeepsHugePages(DistributedTest):
    world_size = [2]

    def test_loaded_cpu_adam_states_are_back_in_huge_pages(self, tmp_path):
        from deepspeed.runtime import huge_pages

        if not huge_pages.huge_pages_available():
            pytest.skip("no transparent huge pages on this machine")
        zero = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
        adam = {"type": "AdamW", "params": {"lr": 1e-2}}
        engine, _ = twin(WideHead, zero_optimization=zero, optimizer=adam)
        data = make_data(3, (WIDTH,), seed=3)
        engine_losses(engine, data[:1])
        save_dir = str(tmp_path / "offload")
        engine.save_checkpoint(save_dir)
        continued = engine_losses(engine, data[1:])
        fresh, *_ = deepspeed.initialize(
            model=WideHead(), config=sgd_config(zero_optimization=zero, optimizer=adam)
        )
        fresh.load_checkpoint(save_dir)
        big = [
            t
            for st in fresh.optimizer.optimizer.state.values()
            for k, t in st.items()
            if k in ("exp_avg", "exp_avg_sq") and t.numel() * 4 >= huge_pages.HUGE_PAGE_BYTES
        ]
        assert len(big) == 2, [
            t.shape for st in fresh.optimizer.optimizer.state.values() for t in st.values()
        ]
        assert all(t.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0 for t in big)
        resumed = engine_losses(fresh, data[1:])
        torch.testing.assert_close(torch.tensor(resumed), torch.tensor(continued), rtol=1e-6, atol=0)


class TestCheckpointsAcrossStages(DistributedTest):
    """Every stage saves the same layout: a checkpoint loads at any stage and world size."""

    world_size = [2]

    @pytest.mark.parametrize("save_stage, load_stage", [(1, 1), (2, 2), (2, 3), (3, 1), (1, 2)])
    def test_save_at_one_stage_load_at_another(self, tmp_path, save_stage, load_stage):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        adam = {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}
        zero = {"stage": save_stage, "stage3_param_persistence_threshold": 0}
        engine, _ = twin(OutsideUses, zero_optimization=zero, optimizer=adam)
        data = make_data(4, (WIDTH,), seed=2)
        engine_losses(engine, data[:2])
        save_dir = str(tmp_path / f"s{save_stage}")  # the parent's tmp_path: the same on every rank
        engine.save_checkpoint(save_dir)
        continued = engine_losses(engine, data[2:])

        torch.manual_seed(99)  # different initial values: the load must overwrite them
        zero = {"stage": load_stage, "stage3_param_persistence_threshold": 0}
        fresh, *_ = deepspeed.initialize(
            model=OutsideUses(), config=sgd_config(zero_optimization=zero, optimizer=adam)
        )
        fresh.load_checkpoint(save_dir)
        resumed = engine_losses(fresh, data[2:])
        torch.testing.assert_close(torch.tensor(resumed), torch.tensor(continued), rtol=1e-5, atol=0)
        consolidated = get_fp32_state_dict_from_zero_checkpoint(save_dir)
        assert set(consolidated) == {n for n, _ in OutsideUses().named_parameters()}
