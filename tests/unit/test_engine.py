"""The stage-3 engine on spawned gloo groups against a single-process torch reference."""

import copy
import itertools
import math

import pytest
import torch
from torch import nn

import deepspeed
import deepspeed.comm as dist
from deepspeed.runtime.zero.lifecycle import ZeroParamStatus
from tests.unit.common import DistributedTest
from tests.unit.common import world_size as run_on

VOCAB, WIDTH, SEQ, GLOBAL_BATCH = 23, 12, 5, 8


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.up = nn.Linear(WIDTH, 3 * WIDTH + 1)  # odd sizes exercise padding
        self.down = nn.Linear(3 * WIDTH + 1, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids, labels):
        h = self.embed(ids)
        h = self.norm(h + self.down(torch.nn.functional.gelu(self.up(h))))
        logits = self.head(h)
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


class _SelfGatheringMatmul(torch.autograd.Function):
    """`h @ weight.T` on a weight read directly, as fused LM heads do (TRL's): the owning module
    never runs, so no engine hook holds the weight. It gathers the weight in forward (TRL's
    distillation loss is handed it partitioned; its SFT head gathers around `apply`, which
    this then only holds again) and in backward, and autograd accumulates its gradient after
    that gather ended, into a parameter that is partitioned again."""

    @staticmethod
    def forward(ctx, h, weight):
        ctx.save_for_backward(h, weight)
        with deepspeed.zero.GatheredParameters([weight]):
            return h @ weight.t()

    @staticmethod
    def backward(ctx, grad):
        h, weight = ctx.saved_tensors
        with deepspeed.zero.GatheredParameters([weight]):
            grad_h = grad @ weight
        grad_w = grad.reshape(-1, grad.shape[-1]).t() @ h.reshape(-1, h.shape[-1])
        return grad_h, grad_w


class FusedHeadLM(TinyLM):
    gather_around_apply = True  # TRL's SFT head; False: its distillation loss

    def forward(self, ids, labels):
        h = self.embed(ids)
        h = self.norm(h + self.down(torch.nn.functional.gelu(self.up(h))))
        with deepspeed.zero.GatheredParameters([self.head.weight], enabled=self.gather_around_apply):
            logits = _SelfGatheringMatmul.apply(h, self.head.weight)
        logits = logits + self.head.bias
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


class PartitionedHeadLM(FusedHeadLM):
    gather_around_apply = False


def batches(steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=gen),
            torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=gen),
        )
        for _ in range(steps)
    ]


def my_slice(tensor, micro_index=0, gas=1):
    """This rank's rows of a global batch, for micro-step `micro_index` of `gas`."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    per = GLOBAL_BATCH // (ws * gas)
    start = (micro_index * ws + rank) * per
    return tensor[start : start + per]


def config(gas=1, clip=0.0, lr=3e-3, **extra):
    micro = GLOBAL_BATCH // (dist.get_world_size() * gas)
    cfg = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 300},
    }
    cfg.update(extra)
    return cfg


def reference_run(data, lr=3e-3, clip=0.0, model_cls=TinyLM):
    torch.manual_seed(42)
    model = model_cls()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    losses = []
    for ids, labels in data:
        loss = model(ids, labels)
        opt.zero_grad()
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return model, losses


def engine_run(data, gas=1, clip=0.0, build_under_init=False, prepare=None, model_cls=TinyLM, **extra):
    """Train on `data` (one step per global batch); `prepare(engine)` runs before the first step."""
    torch.manual_seed(42)
    cfg = config(gas=gas, clip=clip, **extra)
    init = deepspeed.zero.Init(config_dict_or_path=cfg, enabled=build_under_init).start()
    model = model_cls()
    init.stop()
    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=cfg)
    if prepare is not None:
        prepare(engine)
    losses = []
    for ids, labels in data:
        step_loss = 0.0
        for micro in range(gas):
            loss = engine(my_slice(ids, micro, gas), my_slice(labels, micro, gas))
            returned = engine.backward(loss)
            assert torch.equal(returned, loss.detach() / gas), (
                "backward returns the loss it scaled, as upstream"
            )
            engine.step()
            step_loss += loss.detach()
        total = step_loss / gas
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
    return engine, losses


def train(engine, data):
    """One step per global batch, each rank on its slice; the losses averaged over ranks."""
    losses = []
    for ids, labels in data:
        loss = engine(my_slice(ids), my_slice(labels))
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
    return losses


def gathered_params(model):
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone().float() for n, p in model.named_parameters()}


def assert_parity(engine, losses, reference, ref_losses):
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    got = gathered_params(engine.module)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=0, atol=5e-5, msg=name)


class TestEngineParity(DistributedTest):
    world_size = [1, 2, 4]

    def test_adamw_matches_single_process(self):
        data = batches(10)
        reference, ref_losses = reference_run(data)
        engine, losses = engine_run(data)
        assert_parity(engine, losses, reference, ref_losses)
        assert engine.global_steps == 10
        # after step() nothing stays gathered (persistence threshold 0)
        assert all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE for p in engine.module.parameters())
        assert all(p._zero_state.holders == 0 for p in engine.module.parameters())

    def test_gradient_of_a_weight_its_module_never_held(self):
        """A custom autograd function gathers the head's weight itself in forward and backward
        (TRL's fused LM head, and its distillation loss, which hands the weight over partitioned:
        autograd once refused its full gradient against the [0] shape): its gradient lands
        after that gather ended, and must train exactly as the plain run, with nothing left
        gathered."""
        data = batches(4, seed=3)
        reference, ref_losses = reference_run(data, model_cls=FusedHeadLM)
        for model_cls in (FusedHeadLM, PartitionedHeadLM):
            engine, losses = engine_run(data, model_cls=model_cls, build_under_init=True)
            assert_parity(engine, losses, reference, ref_losses)
            assert all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE for p in engine.module.parameters())
            assert not engine.optimizer.parameter_offload.gradient_holds
            # the bias, used directly in the root's forward, was registered with the root
            external = [p for _, p in engine.module.ds_external_parameters()]
            assert len(external) == 1 and external[0] is engine.module.head.bias

    @run_on(2)
    def test_a_second_engine_on_the_same_module_takes_the_hooks_over(self):
        """TRL's DPO with precompute_ref_log_probs: an inference engine scores with the model,
        then the training engine wraps the same model. One set of hooks stays (the newest
        engine's), training matches the plain run, and the first engine still answers."""
        data = batches(3, seed=8)
        reference, ref_losses = reference_run(data)
        torch.manual_seed(42)
        model = TinyLM()
        cfg = config()
        scorer, *_ = deepspeed.initialize(
            model=model, config={k: v for k, v in cfg.items() if k != "optimizer"}
        )
        ids, labels = my_slice(data[0][0]), my_slice(data[0][1])
        with torch.no_grad():
            scorer(ids, labels)
        engine, *_ = deepspeed.initialize(model=model, config=cfg)
        assert all(len(m._forward_pre_hooks) == 1 for m in model.modules()), "one set of hooks"
        losses = train(engine, data)
        assert_parity(engine, losses, reference, ref_losses)
        with torch.no_grad():
            assert torch.equal(scorer(ids, labels), engine(ids, labels))
        assert all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE for p in model.parameters())

    @run_on(2)
    def test_hooks_removed_and_registered_again_as_trl_generates(self):
        """TRL's `unwrap_model_for_generation` at ZeRO-3: with every parameter gathered, it removes
        the engine's module hooks through `optimizer.parameter_offload`, runs the bare module, and
        registers them again; training before and after must match the plain run, and equal,
        bit for bit, the same engine run without that step."""
        data = batches(4, seed=5)
        reference, ref_losses = reference_run(data)
        engine, losses = engine_run(data[:2])
        offload = engine.optimizer.parameter_offload
        assert offload.module is engine.module and offload.forward_hooks
        ids, labels = data[0]
        with deepspeed.zero.GatheredParameters(engine.module.parameters()):
            # TRL's iter_params: every module answers ds_external_parameters() with (name, param)
            named = itertools.chain(
                offload.module.named_parameters(recurse=True), offload.module.ds_external_parameters()
            )
            for _, param in named:
                param.ds_active_sub_modules.clear()
            for handle in offload.forward_hooks + offload.backward_hooks:
                handle.remove()
            offload.forward_hooks, offload.backward_hooks = [], []
            assert not any(m._forward_pre_hooks or m._forward_hooks for m in engine.module.modules())
            with torch.no_grad():
                bare = engine.module(my_slice(ids), my_slice(labels))  # no engine hook runs
            offload._register_deepspeed_module(offload.module)
        assert all(len(m._forward_pre_hooks) == 1 for m in engine.module.modules())
        assert not offload.pass_holds()
        with torch.no_grad():
            hooked = engine.module(my_slice(ids), my_slice(labels))  # the hooks gather again
        assert torch.equal(bare, hooked)
        losses += train(engine, data[2:])
        _, uninterrupted = engine_run(data)  # the same engine run without the generation step
        assert losses == uninterrupted, "lifting and restoring the hooks changed training"
        assert_parity(engine, losses, reference, ref_losses)
        assert all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE for p in engine.module.parameters())

    @run_on(2)
    def test_upstreams_unwrap_model_for_generation(self):
        """`deepspeed.runtime.zero.unwrap_model_for_generation(engine)`, upstream's own: inside,
        every parameter is gathered and no hook runs; after it (also after an error inside) the
        hooks are back, nothing stays gathered, and training matches the plain run."""
        from deepspeed.runtime.zero import unwrap_model_for_generation

        data = batches(4, seed=6)
        reference, ref_losses = reference_run(data)
        engine, losses = engine_run(data[:2])
        ids, labels = data[0]
        with unwrap_model_for_generation(engine) as unwrapped:
            assert unwrapped is engine
            assert all(p.ds_status is ZeroParamStatus.AVAILABLE for p in engine.module.parameters())
            assert not any(m._forward_pre_hooks or m._forward_hooks for m in engine.module.modules())
            with torch.no_grad():
                bare = engine.module(my_slice(ids), my_slice(labels))
        assert all(len(m._forward_pre_hooks) == 1 for m in engine.module.modules())
        assert all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE for p in engine.module.parameters())
        with torch.no_grad():
            assert torch.equal(bare, engine.module(my_slice(ids), my_slice(labels)))
        with pytest.raises(KeyError):
            with unwrap_model_for_generation(engine):
                raise KeyError("inside")
        assert all(len(m._forward_pre_hooks) == 1 for m in engine.module.modules())
        losses += train(engine, data[2:])
        assert_parity(engine, losses, reference, ref_losses)

    @run_on(2)
    def test_gan_loop_discards_the_other_models_gradients_on_zero_grad(self):
        """A conditional GAN step: the generator's loss backpropagates through the
        discriminator, whose gradients from it are dropped by its zero_grad before its own
        backward, as in plain PyTorch (engine.zero_grad and the optimizer's zero_grad both do
        it). At stage 3 that backward also gathered the label embedding, whose input needs no
        gradient: its hold ends with the discriminator's next pass (hooks.py's `end_pass`)."""

        class Critic(nn.Module):
            def __init__(self):
                super().__init__()
                self.label = nn.Embedding(3, 4)
                self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

            def forward(self, x, labels):
                return self.body(x + self.label(labels))

        def models():
            torch.manual_seed(3)
            return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)), Critic()

        data = torch.Generator().manual_seed(4)
        noise = torch.randn(3, GLOBAL_BATCH, 4, generator=data)
        real = torch.randn(3, GLOBAL_BATCH, 4, generator=data)
        labels = torch.randint(0, 3, (3, GLOBAL_BATCH), generator=data)

        def run(gen, disc, opt_g, opt_d, backward, part):
            for step in range(3):
                z, x, y = part(noise[step]), part(real[step]), part(labels[step])
                opt_d.zero_grad()
                backward(disc, disc(x, y).mean() - disc(gen(z).detach(), y).mean())
                opt_d.step()
                opt_g.zero_grad()
                backward(gen, -disc(gen(z), y).mean())  # reaches the discriminator's parameters too
                opt_g.step()

        ref_g, ref_d = models()
        sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)  # noqa: E731
        run(ref_g, ref_d, sgd(ref_g), sgd(ref_d), lambda m, loss: loss.backward(), lambda t: t)
        for stage in (1, 2, 3):
            gen, disc = models()
            cfg = config(zero_optimization={"stage": stage, "stage3_param_persistence_threshold": 0})
            del cfg["optimizer"]
            engines = [deepspeed.initialize(model=m, optimizer=sgd(m), config=cfg)[0] for m in (gen, disc)]
            eng_g, eng_d = engines
            # G through its optimizer (as Fabric steps), D through the engine: both zero_grads discard.
            run(eng_g, eng_d, eng_g.optimizer, eng_d, lambda e, loss: e.backward(loss), my_slice)
            for engine, ref in zip(engines, (ref_g, ref_d)):
                got = gathered_params(engine.module)
                for name, p in ref.named_parameters():
                    torch.testing.assert_close(
                        got[name], p.detach(), rtol=0, atol=1e-6, msg=f"{stage} {name}"
                    )
            if stage == 3:
                with torch.no_grad():
                    eng_d(my_slice(real[0]), my_slice(labels[0]))  # the next pass closes the last one
                assert not eng_d.coordinator.pass_holds()

    def test_gradient_accumulation_and_clipping(self):
        data = batches(10, seed=1)
        reference, ref_losses = reference_run(data, clip=0.5)
        engine, losses = engine_run(data, gas=2, clip=0.5, build_under_init=True)
        assert_parity(engine, losses, reference, ref_losses)
        assert engine.global_steps == 10 and engine.micro_steps == 20
        norm = engine.get_global_grad_norm()  # as upstream: a 0-dim tensor, so `.item()` works
        assert isinstance(norm, torch.Tensor) and norm.dim() == 0 and norm.item() > 0
        assert engine.basic_optimizer is engine.optimizer.optimizer  # upstream's name for the torch optimizer
        assert engine.sparse_tensor_module_names == set() and engine.sparse_gradients_enabled() is False
        assert isinstance(engine.basic_optimizer, torch.optim.AdamW)

    def test_model_built_under_init_trains_whole_at_stages_0_to_2(self):
        """Stages 0-2 keep parameters whole: those zero.Init partitioned are gathered back into
        plain parameters at initialize (the same objects), and train as the plain run."""
        data = batches(4, seed=5)
        reference, ref_losses = reference_run(data)
        for stage in (0, 1, 2):
            engine, losses = engine_run(data, build_under_init=True, zero_optimization={"stage": stage})
            assert_parity(engine, losses, reference, ref_losses)
            params = list(engine.module.parameters())
            assert all(type(p) is torch.nn.Parameter and not hasattr(p, "ds_id") for p in params)
        # what initialize converted: Init partitions whatever stage the config names
        init = deepspeed.zero.Init(config_dict_or_path=config(zero_optimization={"stage": 1})).start()
        built = TinyLM()
        init.stop()
        assert all(p.ds_tensor is not None and p.numel() == 0 for p in built.parameters())

    def test_sharded_memory_is_one_nth(self):
        engine, _ = engine_run(batches(1))
        ws = dist.get_world_size()
        params = list(engine.module.parameters())
        full = sum(p.ds_numel for p in params)
        pad = sum(p.padding_size() for p in params)
        local_params = sum(p.ds_tensor.numel() for p in params)
        masters = engine.optimizer.masters.values()
        assert all(m.grad is None for m in masters)  # gradient shards are freed after each step
        # Buffers pooled for reuse within a pass are freed by its end and after the step.
        from deepspeed.runtime.zero import gather

        assert not any(gather.SCRATCH._free.values()) and not any(gather.FULLS._free.values())
        ids, labels = batches(1, seed=2)[0]
        engine.backward(engine(my_slice(ids), my_slice(labels)))
        local_grads = sum(m.grad.numel() for m in masters)
        local_state = sum(
            t.numel() for s in engine.optimizer.state.values() for t in s.values() if t.dim() > 0
        )
        assert local_params * ws == full + pad
        assert local_grads == local_params and local_state == 2 * local_params  # Adam: two moments
        assert all(p.grad is None for p in params)  # full gradients were freed once reduced
        # fp32 training: each master shares its parameter's shard instead of copying it
        assert all(engine.optimizer.masters[p.ds_id].data_ptr() == p.ds_tensor.data_ptr() for p in params)

    def test_gathered_buffers_die_with_the_pass_without_the_garbage_collector(self):
        """Every module's full buffer is freed by reference counting once the step dropped the
        pools: nothing the gather keeps (its shared-memory plan included) forms a cycle that
        would hold a module's gathered memory until the collector ran."""
        import gc
        import weakref

        from deepspeed.runtime.zero import gather

        engine, _ = engine_run(batches(1))
        made = []
        original = gather.FULLS.take

        def take(*args, **kwargs):
            fb = original(*args, **kwargs)
            made.append(weakref.ref(fb.buf))  # the memory, which views of it would keep too
            return fb

        gather.FULLS.take = take
        gc.disable()
        try:
            ids, labels = batches(1, seed=3)[0]
            engine.backward(engine(my_slice(ids), my_slice(labels)))
            engine.step()
            assert made and not [ref for ref in made if ref() is not None]
        finally:
            gc.enable()
            gather.FULLS.take = original


class WithSpareHead(TinyLM):
    """TinyLM with a second head its forward never uses."""

    def __init__(self):
        super().__init__()
        self.spare = nn.Linear(WIDTH, 3)


class TestIgnoreUnusedParameters(DistributedTest):
    world_size = [2]

    def test_false_refuses_a_step_with_a_parameter_that_got_no_gradient(self):
        from deepspeed.runtime.zero.stage3 import UnusedParametersError

        data = batches(2, seed=7)
        reference, ref_losses = reference_run(data)
        for stage in (1, 2, 3):
            zero = {"stage": stage, "ignore_unused_parameters": False}
            # every parameter used: trains as plain PyTorch
            engine, losses = engine_run(data, zero_optimization=zero)
            assert_parity(engine, losses, reference, ref_losses)
            # a spare head no forward uses: every rank raises at the step, naming it
            with pytest.raises(
                UnusedParametersError, match=r"2 trainable parameters .*spare\.weight, spare\.bias"
            ):
                engine_run(data, model_cls=WithSpareHead, zero_optimization=zero)
            with pytest.raises(AssertionError, match="ignore_unused_parameters"):  # upstream raises this
                engine_run(data, model_cls=WithSpareHead, zero_optimization=zero)
        # the default leaves the spare head untouched, as torch does
        engine, losses = engine_run(data, model_cls=WithSpareHead, zero_optimization={"stage": 2})
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)


class TestEngineFeatures(DistributedTest):
    world_size = [2]

    def test_compile_traces_the_module_and_trains_as_eager(self):
        """engine.compile() (accelerate calls it under dynamo) at every stage: dynamo traces
        the module (backend "eager" runs the captured graphs, the cheap way to trace), the
        ZeRO-3 hooks stay out of the graphs, and training matches the uncompiled engine."""
        import torch._dynamo

        data = batches(3, seed=9)
        reference, ref_losses = reference_run(data)
        for stage in (1, 2, 3):
            torch._dynamo.reset()
            torch.manual_seed(42)
            cfg = config()
            cfg["zero_optimization"]["stage"] = stage
            engine, *_ = deepspeed.initialize(model=TinyLM(), config=cfg)
            engine.compile(backend="eager")
            engine.compile(backend="eager")  # a second call changes nothing
            assert engine.is_compiled and engine.module._compiled_call_impl is not None
            assert_parity(engine, train(engine, data), reference, ref_losses)
        with pytest.raises(NotImplementedError, match="compiled_autograd_enabled"):
            deepspeed.initialize(model=TinyLM(), config=config())[0].compile(compiled_autograd_enabled=True)
        with pytest.raises(ValueError, match="backend"):
            deepspeed.initialize(model=TinyLM(), config=config())[0].compile(
                compile_kwargs={"backend": "eager"}
            )

    def test_every_stage_starts_from_rank_0s_weights(self):
        """Ranks that drew different initial weights (a per-rank seed) train rank 0's model at
        every stage, as upstream broadcasts at initialize; frozen weights agree too."""
        data = batches(2, seed=5)
        for stage in (0, 1, 2, 3):
            torch.manual_seed(100 + dist.get_rank())
            model = TinyLM()
            model.embed.weight.requires_grad_(False)
            rank0 = {n: p.detach().clone() for n, p in model.named_parameters()}
            for value in rank0.values():
                dist.broadcast(value, src=0)
            cfg = config()
            cfg["zero_optimization"]["stage"] = stage
            engine, *_ = deepspeed.initialize(model=model, config=cfg)
            for name, value in gathered_params(engine.module).items():
                assert torch.equal(value, rank0[name]), (stage, name)
            train(engine, data)
            frozen = gathered_params(engine.module)["embed.weight"]
            assert torch.equal(frozen, rank0["embed.weight"]), stage

    def test_model_parallel_mpu_is_refused_where_it_would_mix_shards(self):
        """Two model-parallel ranks (each its own data-parallel group): every stage that would
        shard or reduce over both is refused, naming the size; stage 3 under Init(mpu) trains."""

        class ModelParallel:
            def __init__(self, size, dp_group):
                self.size, self.dp_group = size, dp_group

            def get_model_parallel_world_size(self):
                return self.size

            def get_model_parallel_rank(self):
                return dist.get_rank() if self.size > 1 else 0

            def get_data_parallel_group(self):
                return self.dp_group

            def get_data_parallel_world_size(self):
                return dist.get_world_size(self.dp_group)

            def get_data_parallel_rank(self):
                return dist.get_rank(self.dp_group)

        alone = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]
        mpu = ModelParallel(2, alone)
        for stage in (0, 1, 2, 3):
            cfg = config()
            cfg["zero_optimization"]["stage"] = stage
            with pytest.raises(ValueError, match="model-parallel size 2"):
                deepspeed.initialize(model=TinyLM(), config=cfg, mpu=mpu)
        cfg = config()
        with deepspeed.zero.Init(mpu=mpu):
            model = TinyLM()
        engine, *_ = deepspeed.initialize(model=model, config=cfg, mpu=mpu)
        train(engine, batches(1, seed=2))
        with pytest.raises(ValueError, match="gradient_clipping"):
            deepspeed.initialize(model=model, config=config(clip=1.0), mpu=mpu)
        omitted = config()
        del omitted["gradient_clipping"]  # the default clips at 1.0, as upstream's: refused too, saying how
        with pytest.raises(
            ValueError, match=r'gradient_clipping=1.0 \(1.0 when the config omits it.*"gradient_clipping": 0'
        ):
            deepspeed.initialize(model=model, config=omitted, mpu=mpu)
        cfg = config()
        cfg["zero_optimization"]["stage"] = 1
        deepspeed.initialize(model=TinyLM(), config=cfg, mpu=ModelParallel(1, dist.get_world_group()))

    @pytest.mark.parametrize("stage", [1, 2])
    def test_replicated_slices_live_in_the_parameters(self, stage):
        """Stages 1-2, fp32: an evenly split parameter's master is its own row (no copy), a
        padded one's is a copy, training matches torch, and a parameter whose `.data` is
        replaced after initialize still gets the trained values (the master stays the truth)."""
        data = batches(4)
        reference, ref_losses = reference_run(data)
        engine, losses = engine_run(data[:2], zero_optimization={"stage": stage, "reduce_bucket_size": 300})
        ws, rank = dist.get_world_size(), dist.get_rank()
        evenly = 0
        for name, p in engine.module.named_parameters():
            master = engine.optimizer.masters[engine.replicated[id(p)].ds_id]
            if p.numel() % ws == 0:
                evenly += 1
                assert master.data_ptr() == p.data.view(ws, -1)[rank].data_ptr(), name
            else:
                assert master.untyped_storage().data_ptr() != p.untyped_storage().data_ptr(), name
        assert 0 < evenly < len(list(engine.module.parameters()))  # both kinds are exercised
        head = engine.module.head.weight
        assert head.numel() % ws == 0
        head.data = head.data.clone()  # the master no longer lies in the parameter
        losses += train(engine, data[2:])
        assert_parity(engine, losses, reference, ref_losses)
        master = engine.optimizer.masters[engine.replicated[id(head)].ds_id]
        assert torch.equal(head.data.view(ws, -1)[rank], master.data)
        # Two parameters over one memory keep copies: aliased masters would each update it.
        twins = nn.Linear(4, 4, bias=False)
        twins.twin = nn.Parameter(twins.weight.data)
        twin_engine, _, _, _ = deepspeed.initialize(
            model=twins, config=config(zero_optimization={"stage": stage})
        )
        for p in twin_engine.module.parameters():
            master = twin_engine.optimizer.masters[twin_engine.replicated[id(p)].ds_id]
            assert master.untyped_storage().data_ptr() != p.untyped_storage().data_ptr()

    @pytest.mark.parametrize("stage", [2, 3])
    def test_offloaded_gradients_land_in_kept_buffers(self, stage):
        """Optimizer offload as on a GPU (pinned masters, here forced on the CPU, where pinning
        means nothing): each master's gradient lands in one buffer kept across steps, the next
        micro-step's slice in a second one added when the copies settle at the end of backward,
        and training with accumulation matches torch."""
        data = batches(3)
        reference, ref_losses = reference_run(data)
        seen, settles = [], []

        def force_pinned_path(engine):
            optimizer = engine.optimizer
            optimizer.pin_masters = True
            settle = optimizer.settle_gradients

            def counted_settle():
                settles.append(optimizer._host_grads_in_flight)
                settle()

            engine.reducer.settle = counted_settle
            original_step = optimizer.step

            def step():
                assert not optimizer._host_grads_in_flight  # nothing read before it landed
                assert not optimizer._pending_adds  # the second micro-step's slices were added
                kept = [("grad", optimizer._host_grads), ("staging", optimizer._host_staging)]
                seen.append({(kind, i): b.data_ptr() for kind, buffers in kept for i, b in buffers.items()})
                grads = {ds_id: m.grad for ds_id, m in optimizer.masters.items()}
                assert all(grads[i] is optimizer._host_grads[i] for i in optimizer._host_grads)
                return original_step()

            optimizer.step = step

        zero = {"stage": stage, "reduce_bucket_size": 300, "offload_optimizer": {"device": "cpu"}}
        engine, losses = engine_run(
            data, gas=2, prepare=force_pinned_path, zero_optimization=zero, zero_force_ds_cpu_optimizer=False
        )
        assert_parity(engine, losses, reference, ref_losses)
        assert len(seen) == 3 and seen[0] and seen[0] == seen[1] == seen[2]  # the same buffers every step
        assert len(seen[0]) == 2 * len(engine.optimizer.masters)  # a gradient and a staging buffer each
        assert settles and any(settles)  # backward ended with copies to settle
        # Three slices for one master before a settle: each reuse of the staging buffer
        # settles the slice before it first, so none is lost.
        optimizer = engine.optimizer
        state = optimizer.states[0]
        master = optimizer.masters[state.ds_id]
        master.grad = torch.zeros_like(master)
        for _ in range(3):
            optimizer.accumulate_grad(state, torch.ones(master.numel()), 0.5)
        optimizer.settle_gradients()
        assert torch.equal(master.grad, torch.full_like(master, 1.5))

    def test_bf16_tracks_fp32(self):
        data = batches(6, seed=3)
        _, fp32_losses = engine_run(data)
        engine, bf16_losses = engine_run(data, bf16={"enabled": True})
        assert next(engine.module.parameters()).ds_tensor.dtype == torch.bfloat16
        assert all(m.dtype == torch.float32 for m in engine.optimizer.masters.values())
        torch.testing.assert_close(torch.tensor(bf16_losses), torch.tensor(fp32_losses), rtol=0.03, atol=0.03)
        assert bf16_losses[-1] < bf16_losses[0]

    def test_edit_after_initialize_reaches_the_master(self):
        """A modifier_rank edit of a bf16 parameter is not overwritten by the next step."""
        cfg = config(bf16={"enabled": True}, optimizer={"type": "SGD", "params": {"lr": 0.0}})
        torch.manual_seed(0)
        engine, _, _, _ = deepspeed.initialize(model=TinyLM(), config=cfg)
        ids, labels = batches(1)[0]
        engine.backward(engine(my_slice(ids), my_slice(labels)))
        engine.step()
        head = engine.module.head
        with deepspeed.zero.GatheredParameters(head.weight, modifier_rank=0):
            head.weight.data.fill_(0.5)
        engine.backward(engine(my_slice(ids), my_slice(labels)))
        engine.step()  # lr 0: the step must keep the edit, not restore the stale master
        assert torch.all(gathered_params(engine.module)["head.weight"] == 0.5)

    def test_fp16_overflow_skips_step_and_lowers_scale(self, tmp_path):
        cfg = config(
            fp16={"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 1}
        )
        torch.manual_seed(0)
        engine, optimizer, _, _ = deepspeed.initialize(model=TinyLM(), config=cfg)
        ids, labels = batches(1)[0]
        scale = optimizer.loss_scale
        assert optimizer.dynamic_loss_scale and engine.dynamic_loss_scale()
        before = gathered_params(engine.module)
        loss = engine(my_slice(ids), my_slice(labels))
        engine.backward(loss * float("inf"))  # every gradient overflows
        engine.step()
        assert optimizer.overflow and optimizer.loss_scale == scale / 2
        assert engine.get_global_grad_norm() == float("inf")  # as upstream reports a skipped step
        after = gathered_params(engine.module)
        assert all(torch.equal(before[n], after[n]) for n in before)  # the step was skipped
        assert engine.skipped_steps == 1
        # A resumed run goes on counting, with the lowered scale (as upstream's load restores them).
        engine.save_checkpoint(str(tmp_path), tag="overflowed")
        torch.manual_seed(0)
        resumed, resumed_optimizer, _, _ = deepspeed.initialize(model=TinyLM(), config=cfg)
        resumed.load_checkpoint(str(tmp_path), tag="overflowed")
        assert resumed.skipped_steps == 1, resumed.skipped_steps
        assert resumed_optimizer.loss_scale == scale / 2, (resumed_optimizer.loss_scale, scale)
        assert resumed.global_steps == engine.global_steps
        for clean in range(1, 4):
            engine.backward(engine(my_slice(ids), my_slice(labels)))
            engine.step()
            # As upstream: the scale grows on the clean step after `loss_scale_window` (2) of them.
            assert not optimizer.overflow and optimizer.loss_scale == (scale if clean == 3 else scale / 2)
            assert math.isfinite(engine.get_global_grad_norm())

    def test_one_reduce_scatter_per_bucket(self, monkeypatch):
        calls = []  # elements sent per reduce-scatter, packed (gloo) or as blocks (shared memory)
        packed, blocks = deepspeed.comm.reduce_scatter_tensor, deepspeed.comm.reduce_scatter_columns

        def counting_packed(*args, **kwargs):
            calls.append(args[1].numel())
            return packed(*args, **kwargs)

        def counting_blocks(output, parts, **kwargs):
            calls.append(sum(p.numel() for p in parts))
            return blocks(output, parts, **kwargs)

        monkeypatch.setattr(deepspeed.comm, "reduce_scatter_tensor", counting_packed)
        monkeypatch.setattr(deepspeed.comm, "reduce_scatter_columns", counting_blocks)
        ids, labels = batches(1)[0]
        for bucket, expect_one in ((10**9, True), (300, False)):
            cfg = config(
                zero_optimization={
                    "stage": 3,
                    "reduce_bucket_size": bucket,
                    "stage3_param_persistence_threshold": 0,
                }
            )
            torch.manual_seed(0)
            engine, _, _, _ = deepspeed.initialize(model=TinyLM(), config=cfg)
            calls.clear()
            engine.backward(engine(my_slice(ids), my_slice(labels)))
            n_params = len(list(engine.module.parameters()))
            total = sum(p.partition_numel() * dist.get_world_size() for p in engine.module.parameters())
            assert sum(calls) == total  # every gradient element sent once
            assert (len(calls) == 1) if expect_one else (1 < len(calls) < n_params)

    def test_inference_without_optimizer(self):
        torch.manual_seed(42)
        reference = TinyLM()
        model = copy.deepcopy(reference)
        cfg = {
            "train_micro_batch_size_per_gpu": 1,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        }
        engine, optimizer, _, _ = deepspeed.initialize(model=model, config=cfg)
        assert optimizer is None
        ids, labels = batches(1)[0]
        with torch.no_grad():
            assert torch.equal(engine(ids, labels), reference(ids, labels))
        assert all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE for p in model.parameters())
        with pytest.raises(RuntimeError, match="needs an optimizer"):
            engine.step()
        # accelerate's free_memory() destroys engines (Trainer.train() at its start); a ZeRO-3
        # forward after that cannot gather: it says so rather than failing in a kernel.
        engine.destroy()
        with pytest.raises(RuntimeError, match=r"forward\(\) on an engine after its destroy\(\)"):
            engine(ids, labels)
        deepspeed.initialize(model=model, config=cfg)  # a new engine's hooks gather for the old one too
        with torch.no_grad():
            assert torch.equal(engine(ids, labels), reference(ids, labels))
        cfg["zero_optimization"]["stage"] = 2  # parameters are whole: a forward still works
        engine, *_ = deepspeed.initialize(model=copy.deepcopy(reference), config=cfg)
        engine.destroy()
        with torch.no_grad():
            assert torch.equal(engine(ids, labels), reference(ids, labels))

    def test_a_destroyed_engine_is_freed_while_its_model_lives(self):
        """RLHF loops keep the model and build engines around it in turn: a destroyed engine,
        once dropped, must take its optimizer (fp32 masters, Adam state) with it. At stage 3
        each submodule referred to the engine's hook coordinator, which calls back into the
        engine, so both lived as long as the model."""
        import gc
        import weakref

        ids, labels = batches(1)[0]
        for stage in (1, 2, 3):
            torch.manual_seed(42)
            model = TinyLM()
            cfg = config(zero_optimization={"stage": stage, "stage3_param_persistence_threshold": 0})
            engine, optimizer, _, _ = deepspeed.initialize(model=model, config=cfg)
            engine.backward(engine(my_slice(ids), my_slice(labels)))
            engine.step()
            alive = (weakref.ref(engine), weakref.ref(optimizer))
            engine.destroy()
            del engine, optimizer
            gc.collect()
            assert [ref() is None for ref in alive] == [True, True], stage
            engine, *_ = deepspeed.initialize(model=model, config=cfg)  # the model trains on
            engine.backward(engine(my_slice(ids), my_slice(labels)))
            engine.step()

    def test_gathered_parameters_live_across_forward(self):
        engine, _ = engine_run(batches(1))
        head = engine.module.head
        gather = deepspeed.zero.GatheredParameters(head.weight).start()
        ids, labels = batches(1, seed=9)[0]
        loss = engine(my_slice(ids), my_slice(labels))  # the engine is a second holder
        assert head.weight.ds_status is ZeroParamStatus.AVAILABLE  # our hold keeps it
        engine.backward(loss)
        engine.step()
        gather.stop()
        assert head.weight.ds_status is ZeroParamStatus.NOT_AVAILABLE

    def test_external_parameter_tied_weights(self):
        class Tied(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Embedding(VOCAB, WIDTH)
                self.proj = nn.Linear(WIDTH, WIDTH)

            def forward(self, ids, labels):
                logits = self.proj(self.embed(ids)) @ self.embed.weight.t()  # used outside its owner
                return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))

        def build():
            torch.manual_seed(3)
            return Tied()

        reference = build()
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=3e-3, weight_decay=0.01)
        with deepspeed.zero.Init():
            model = build()
        deepspeed.zero.register_external_parameter(model, model.embed.weight)
        engine, _, _, _ = deepspeed.initialize(model=model, config=config())
        for ids, labels in batches(3, seed=4):
            loss = engine(my_slice(ids), my_slice(labels))
            engine.backward(loss)
            engine.step()
            ref_loss = reference(ids, labels)
            ref_opt.zero_grad()
            ref_loss.backward()
            ref_opt.step()
        got = gathered_params(model)
        for name, p in reference.named_parameters():
            torch.testing.assert_close(got[name], p.detach(), rtol=0, atol=5e-5, msg=name)

    def test_parameters_used_outside_their_module(self):
        """nn.MultiheadAttention reads out_proj.weight without calling out_proj."""

        class Encoder(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Embedding(VOCAB, 8)
                self.layer = nn.TransformerEncoderLayer(
                    8, 2, dim_feedforward=16, dropout=0.0, batch_first=True
                )
                self.head = nn.Linear(8, VOCAB)

            def forward(self, ids, labels):
                logits = self.head(self.layer(self.embed(ids)))
                return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))

        torch.manual_seed(11)
        reference = Encoder()
        model = copy.deepcopy(reference)
        # SGD: the key bias's true gradient is zero, and Adam would blow its rounding noise up.
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        cfg = config(optimizer={"type": "SGD", "params": {"lr": 0.1}})
        engine, _, _, _ = deepspeed.initialize(model=model, config=cfg)
        for ids, labels in batches(3, seed=12):
            engine.backward(engine(my_slice(ids), my_slice(labels)))
            engine.step()
            ref_opt.zero_grad()
            reference(ids, labels).backward()
            ref_opt.step()
        got = gathered_params(model)
        for name, p in reference.named_parameters():
            torch.testing.assert_close(got[name], p.detach(), rtol=0, atol=5e-5, msg=name)
        from deepspeed.runtime.zero.partition_parameters import external_parameters

        mha = model.layer.self_attn
        assert {p.ds_id for p in external_parameters(mha)} == {
            mha.out_proj.weight.ds_id,
            mha.out_proj.bias.ds_id,
        }
        assert all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE for p in model.parameters())

    def test_client_optimizer_scheduler_and_persistence(self):
        torch.manual_seed(0)
        model = TinyLM()
        client = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        cfg = config(
            scheduler={
                "type": "WarmupLR",
                "params": {
                    "warmup_min_lr": 0.0,
                    "warmup_max_lr": 0.1,
                    "warmup_num_steps": 4,
                    "warmup_type": "linear",
                },
            }
        )
        del cfg["optimizer"]
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 50
        engine, optimizer, _, scheduler = deepspeed.initialize(model=model, optimizer=client, config=cfg)
        assert optimizer.optimizer is client and scheduler is not None
        small = [p for p in model.parameters() if p.ds_numel < 50]
        assert small and all(p.ds_persist and p.ds_status is ZeroParamStatus.AVAILABLE for p in small)
        ids, labels = batches(1)[0]
        for _ in range(2):
            engine.backward(engine(my_slice(ids), my_slice(labels)))
            engine.step()
        assert engine.get_lr() == [pytest.approx(0.1 * 1 / 4)]  # two steps: iterations 0 and 1
        # persistent parameters stay gathered and equal their updated shards
        full = gathered_params(model)
        for name, p in model.named_parameters():
            if p.ds_persist:
                assert torch.equal(p.data.float(), full[name])
        large = [p for p in model.parameters() if not p.ds_persist]
        assert all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE for p in large)

    def test_stepping_the_client_optimizer_directly_is_refused(self):
        """A tutorial loop's `optimizer.step()` on the optimizer it passed to initialize would
        step this rank's master shards behind the engine's back (the ranks drift apart,
        silently); it raises at every stage, and engine.step() then trains as plain SGD, with
        a torch scheduler made before initialize stepping as usual and not warning."""
        import warnings

        data = batches(2, seed=3)
        torch.manual_seed(42)
        reference = TinyLM()
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
        ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
        for ids, labels in data:
            ref_opt.zero_grad()
            reference(ids, labels).backward()
            ref_opt.step()
            ref_sched.step()
        for stage in (1, 2, 3):
            torch.manual_seed(42)
            model = TinyLM()
            client = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
            scheduler = torch.optim.lr_scheduler.StepLR(client, step_size=1, gamma=0.5)
            cfg = config(zero_optimization={"stage": stage, "stage3_param_persistence_threshold": 0})
            del cfg["optimizer"]
            engine, *_ = deepspeed.initialize(
                model=model, optimizer=client, lr_scheduler=scheduler, config=cfg
            )
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # torch's "optimizer.step() has been overridden" among them
                for i, (ids, labels) in enumerate(data):
                    engine.backward(engine(my_slice(ids), my_slice(labels)))
                    if i == 0:
                        with pytest.raises(
                            RuntimeError, match="SGD passed to deepspeed.initialize was stepped"
                        ):
                            client.step()
                    engine.step()
            assert scheduler.get_last_lr() == ref_sched.get_last_lr() == [0.125], stage
            got = gathered_params(model)
            for name, p in reference.named_parameters():
                torch.testing.assert_close(got[name], p.detach(), rtol=1e-5, atol=1e-6, msg=f"{stage} {name}")


class TestPrefetch(DistributedTest):
    world_size = [2]

    def test_trace_drives_prefetch_without_changing_results(self, monkeypatch):
        data = batches(4, seed=5)
        _, no_prefetch = engine_run(
            data,
            zero_optimization={
                "stage": 3,
                "stage3_prefetch_bucket_size": 0,
                "stage3_param_persistence_threshold": 0,
            },
        )
        engine, with_prefetch = engine_run(data)
        assert with_prefetch == no_prefetch  # prefetching changes timing, never values
        prefetcher = engine.coordinator.prefetcher
        assert not prefetcher.recording and prefetcher.trace and prefetcher.prefetched > 0
        assert prefetcher.held == {}  # every prefetched hold was handed over or released

        # A bucket smaller than every parameter still prefetches, one parameter at a time.
        tiny, with_tiny_bucket = engine_run(
            data,
            zero_optimization={
                "stage": 3,
                "stage3_prefetch_bucket_size": 1,
                "stage3_param_persistence_threshold": 0,
            },
        )
        assert with_tiny_bucket == no_prefetch
        assert tiny.coordinator.prefetcher.prefetched > 0 and tiny.coordinator.prefetcher.held == {}

        # with a trace, a step waits on far fewer synchronous gathers (issued with inflight=False;
        # counted where gathers are issued, whichever collective then moves the bytes)
        from deepspeed.runtime.zero import gather

        waits = []
        original = gather._GatherBucket.issue

        def counting(bucket, device, inflight=True):
            waits.append(inflight)
            return original(bucket, device, inflight)

        monkeypatch.setattr(gather._GatherBucket, "issue", counting)
        ids, labels = data[0]
        engine.backward(engine(my_slice(ids), my_slice(labels)))
        engine.step()
        assert waits and sum(waits) >= len(waits) // 2  # most gathers were issued ahead, async

    def test_persistent_parameters_take_no_module_holds(self):
        # Small parameters stay gathered; the hooks hold, trace and prefetch only the others,
        # and a module with nothing else (the LayerNorm, 2 x 12 elements) is skipped, with
        # the same numbers as plain PyTorch.
        data = batches(3, seed=7)
        reference, ref_losses = reference_run(data)
        zero = {"stage": 3, "stage3_param_persistence_threshold": 50, "reduce_bucket_size": 300}
        engine, losses = engine_run(data, zero_optimization=zero)
        assert_parity(engine, losses, reference, ref_losses)
        norm = {p._zero_state.ds_id for p in engine.module.norm.parameters()}
        assert norm and all(p.ds_persist for p in engine.module.norm.parameters())
        trace = engine.coordinator.prefetcher.trace
        assert trace and all(entry and not any(s.persist for s in entry) for entry in trace)
        assert not norm & {s.ds_id for entry in trace for s in entry}


class TestReuseDistance(DistributedTest):
    world_size = [2]

    def test_reused_parameters_stay_gathered(self, monkeypatch):
        data = batches(3, seed=6)
        from deepspeed.runtime.zero import gather

        gathered = []
        original = gather._GatherBucket.issue

        def counting(bucket, device, inflight=True):
            gathered.append(sum(s.world_size * s.partition_size for s in bucket.states))
            return original(bucket, device, inflight)

        results = {}
        for reuse in (0, 10**9):
            # A small prefetch window: a large one already keeps what it will need again soon.
            zero = {
                "stage": 3,
                "stage3_param_persistence_threshold": 0,
                "stage3_prefetch_bucket_size": 50,
                "stage3_max_reuse_distance": reuse,
            }
            engine, losses = engine_run(data[:2], zero_optimization=zero)
            monkeypatch.setattr(gather._GatherBucket, "issue", counting)
            gathered.clear()
            ids, labels = data[2]
            engine.backward(engine(my_slice(ids), my_slice(labels)))
            engine.step()
            monkeypatch.undo()
            results[reuse] = (losses, sum(gathered))
            assert all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE for p in engine.module.parameters())
        assert results[0][0] == results[10**9][0]  # same values
        assert results[10**9][1] < results[0][1]  # backward re-gathers nothing that forward kept

    def test_kept_parameters_are_charged_the_buffer_they_keep(self, monkeypatch):
        """A parameter kept for reuse keeps the whole buffer its full tensor is a view of (its
        module's): parameters sharing one are kept all or none, and the buffer's size counts
        against max_live_parameters, so a kept bias cannot pin its module's weight."""
        data = batches(3, seed=7)
        hooks = __import__("deepspeed.runtime.zero.hooks", fromlist=["_Prefetcher"])
        original = hooks._Prefetcher.keep_for_reuse
        seen = []

        def checked(prefetcher, states):
            free = original(prefetcher, states)
            held = list(prefetcher.held.values())
            buffers = {id(s.full_buffer): s.full_buffer for s in held if s.full_buffer is not None}
            for fb in buffers.values():  # all or none of a buffer's parameters
                assert fb.live == sum(s.full_buffer is fb for s in held), "part of a buffer kept"
            kept = sum(fb.buf.numel() for fb in buffers.values())
            seen.append(kept)
            assert kept <= prefetcher.held_elems <= prefetcher.max_live_elems
            return free

        # Unbounded, everything is kept; at WIDTH**2 no Linear's buffer fits, but its bias would.
        for live in (10**9, WIDTH * WIDTH):
            zero = {
                "stage": 3,
                "stage3_param_persistence_threshold": 0,
                "stage3_prefetch_bucket_size": 50,
                "stage3_max_live_parameters": live,
                "stage3_max_reuse_distance": 10**9,
            }
            monkeypatch.setattr(hooks._Prefetcher, "keep_for_reuse", checked)
            seen.clear()
            _, losses = engine_run(data, zero_optimization=zero, build_under_init=True)
            monkeypatch.undo()
            assert seen and max(seen) > 0, seen
            if live == 10**9:
                reference = losses
            else:
                assert losses == reference  # what is kept changes no value


class TestInitializeMisuse:
    def test_missing_config_and_model(self):
        with pytest.raises(ValueError, match="no config"):
            deepspeed.initialize(model=nn.Linear(2, 2))
        with pytest.raises(ValueError, match="model is required"):
            deepspeed.initialize(config={"train_micro_batch_size_per_gpu": 1})
