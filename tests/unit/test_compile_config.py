"""The config's `compile` block (issue 39, item 4): it supplies `engine.compile()`'s backend and
torch.compile arguments, and a compiled ZeRO-1/2/3 run trains as the eager one and plain PyTorch.

Backend "aot_eager" traces forward and backward through AOTAutograd and runs the captured graphs
without code generation: the full tracing path at a fraction of inductor's compile time; it
covers stage 3, whose hooks must stay out of the graphs. One inductor case runs the real code
generator at stage 1, where the module is one graph: 63 s cold (C++ kernels built) on this
2-core host under load, 21 s with inductor's cache warm; stage 3's graph breaks cost 84 s cold.
"""

import pytest
import torch

import deepspeed
from deepspeed.runtime.config import DeepSpeedConfig
from tests.unit.common import DistributedTest
from tests.unit.test_engine import TinyLM, assert_parity, batches, config, reference_run, train

COUNTING_BACKEND = "counting_aot_eager"
# Graphs the counting backend was handed, per process (ranks are pooled processes).
TRACED: list = []


def _register_counting_backend() -> None:
    """A backend that records each graph and hands it to aot_eager: shows that the config's
    backend, not a default, compiled the module, and that dynamo really traced something."""
    import torch._dynamo
    from torch._dynamo.backends.registry import lookup_backend

    try:
        lookup_backend(COUNTING_BACKEND)
        return  # registered by an earlier test in this pooled process
    except Exception:
        pass

    def counting(graph_module, example_inputs):
        TRACED.append(graph_module)
        return lookup_backend("aot_eager")(graph_module, example_inputs)

    torch._dynamo.register_backend(counting, name=COUNTING_BACKEND)


def _engine(stage: int, block=None):
    torch.manual_seed(42)
    cfg = config()
    cfg["zero_optimization"]["stage"] = stage
    if block is not None:
        cfg["compile"] = block
    return deepspeed.initialize(model=TinyLM(), config=cfg)[0]


def test_block_parses_as_axolotl_writes_it():
    cfg = DeepSpeedConfig({"train_batch_size": 1, "compile": {"disable": False, "backend": "inductor"}})
    assert (cfg.compile_config.disable, cfg.compile_config.backend, cfg.compile_config.kwargs) == (
        False,
        "inductor",
        {},
    )
    with pytest.raises(ValueError, match=r"compile\.deepcompile=True is not supported.*DeepCompile"):
        DeepSpeedConfig({"train_batch_size": 1, "compile": {"deepcompile": True}})


class TestCompileBlock(DistributedTest):
    world_size = [2]

    def test_block_compiles_every_stage_to_the_eager_losses(self):
        """Per stage: the eager engine, then the same run compiled through the block alone
        (`engine.compile()` with no arguments). Losses equal the eager engine's to 1e-6
        (relative; aot_eager runs the same kernels, only fused into graphs) and plain
        PyTorch's to 1e-5, parameters to 5e-5 (`assert_parity`)."""
        import torch._dynamo

        _register_counting_backend()
        data = batches(3, seed=11)
        reference, ref_losses = reference_run(data)
        block = {"disable": False, "backend": COUNTING_BACKEND, "kwargs": {"dynamic": False}}
        for stage in (1, 2, 3):
            eager = _engine(stage)
            eager_losses = train(eager, data)
            torch._dynamo.reset()
            TRACED.clear()
            engine = _engine(stage, block)
            assert not engine.is_compiled  # the block alone compiles nothing
            engine.compile()
            assert engine.is_compiled and engine.module._compiled_call_impl is not None
            losses = train(engine, data)
            assert TRACED, f"stage {stage}: the config's backend traced no graph"
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager_losses), rtol=1e-6, atol=0)
            assert_parity(engine, losses, reference, ref_losses)

    def test_arguments_override_the_block_and_disable_keeps_it_eager(self):
        engine = _engine(2, {"backend": "aot_eager", "kwargs": {"dynamic": False, "fullgraph": False}})
        seen = {}
        engine.module.compile = lambda **kwargs: seen.update(kwargs)  # record, compile nothing
        engine.compile(backend="eager", compile_kwargs={"dynamic": True})
        assert seen == {"backend": "eager", "dynamic": True, "fullgraph": False}

        engine = _engine(2, {"backend": "aot_eager"})
        engine.module.compile = lambda **kwargs: seen.update(kwargs)
        seen.clear()
        engine.compile()
        assert seen == {"backend": "aot_eager"}

        engine = _engine(3, {"disable": True, "backend": "aot_eager"})
        engine.compile()
        assert not engine.is_compiled and engine.module._compiled_call_impl is None

        with pytest.raises(ValueError, match=r"compile\.kwargs"):
            _engine(1, {"kwargs": {"backend": "eager"}}).compile()

    def test_inductor_trains_as_plain_pytorch(self):
        """Real code generation (C++ on the CPU), as axolotl's zero1_torch_compile.json asks:
        kernels may fuse and reorder float sums, yet the losses match plain PyTorch's to 1e-5
        relative and the parameters to 5e-5 (`assert_parity`)."""
        import torch._dynamo

        data = batches(3, seed=12)
        reference, ref_losses = reference_run(data)
        torch._dynamo.reset()
        engine = _engine(1, {"disable": False, "backend": "inductor"})
        engine.compile()
        losses = train(engine, data)
        assert engine.is_compiled
        assert_parity(engine, losses, reference, ref_losses)
