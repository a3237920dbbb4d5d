"""DeepSpeedCPUAdam and the cpu_adam op against torch.optim.Adam / AdamW.

The op is compiled at most once per session: the builder in ALL_OPS keeps the loaded
module, and the library is cached in $TORCH_EXTENSIONS_DIR across sessions.

Tolerances (see [Note: matching torch rounding] in csrc/adam/adam_kernel.h): fp32 parameters
agree with torch.optim.AdamW(foreach=False) to rtol 1e-6 / atol 1e-6 after 20 steps (sqrt
may differ by an ulp), states to rtol 1e-6 / atol 1e-7 (test_parity_check_can_fail shows an
lr 0.1% off fails that check); bf16 / fp16 parameters agree with
fp32 AdamW rounded to the dtype after every step to one ulp of the dtype (an ulp moved in
fp32 can flip a rounding now and then); copies written in
the step's pass equal `param.to(dtype)` bitwise.
"""

import copy
import gc
import io
import os
import platform
import subprocess
import sys

import pytest
import torch

from deepspeed.ops.adam import DeepSpeedCPUAdam
from deepspeed.ops.adam.cpu_adam import PREFETCH, PREFETCH_ENV, PrefetchTuner, torch_adam_update
from deepspeed.ops.op_builder import ALL_OPS, CPUAdamBuilder, builder
from deepspeed.runtime import huge_pages

SIZES = (1, 7, 1023, 100003)  # odd sizes: every vector width leaves a tail; 100003 spans 2 threads
ISAS = ("avx512", "avx2", "neon", "scalar")
STEPS = 20
NATIVE = ALL_OPS["cpu_adam"].is_compatible()
needs_native = pytest.mark.skipif(not NATIVE, reason="cpu_adam cannot be built here (no compiler or ninja)")


class IncompatibleBuilder(CPUAdamBuilder):
    def incompatibility_reasons(self):
        return ["disabled by the test"]


def make_params(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=gen).to(dtype)) for n in SIZES]


def run_steps(opt, params, steps=STEPS, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()


def assert_parity(ours, params, ref, ref_params):
    for p, q in zip(params, ref_params):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(ours.state[p][key], ref.state[q][key], rtol=1e-6, atol=1e-7)


@pytest.fixture
def no_native(monkeypatch):
    monkeypatch.setitem(ALL_OPS, "cpu_adam", IncompatibleBuilder())


@pytest.fixture(params=ISAS)
def isa(request):
    """Each vector path in turn (skipped where this CPU or build lacks it), two threads."""
    if not NATIVE:
        pytest.skip("cpu_adam cannot be built here")
    op = ALL_OPS["cpu_adam"].load()
    if request.param == "neon" and platform.machine().lower() not in ("aarch64", "arm64"):
        pytest.skip(
            f"NEON runs only on Arm CPUs; this machine is {platform.machine()}, so the neon path is untested here"
        )
    if request.param not in op.available_isas():
        pytest.skip(f"{request.param} is not available here (available: {op.available_isas()})")
    previous, threads = op.set_isa(request.param), torch.get_num_threads()
    torch.set_num_threads(2)
    yield request.param
    op.set_isa(previous)
    torch.set_num_threads(threads)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1], ids=["no_decay", "decay"])
@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam_l2"])
def test_each_vector_path_matches_torch_fp32(isa, adamw_mode, weight_decay):
    kwargs = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay)
    params, ref_params = make_params(), make_params()
    opt = DeepSpeedCPUAdam(params, adamw_mode=adamw_mode, **kwargs)
    ref = (torch.optim.AdamW if adamw_mode else torch.optim.Adam)(ref_params, foreach=False, **kwargs)
    assert opt.uses_native and opt._native.isa() == isa
    run_steps(opt, params)
    run_steps(ref, ref_params)
    assert_parity(opt, params, ref, ref_params)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1], ids=["no_decay", "decay"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_each_vector_path_matches_torch_low_precision(isa, dtype, weight_decay):
    """bf16/fp16 params, fp32 states: AdamW in fp32 with the param rounded after each step."""
    kwargs = dict(lr=1e-2, weight_decay=weight_decay)
    params = make_params(dtype)
    ref_params = [torch.nn.Parameter(p.detach().float()) for p in params]
    opt = DeepSpeedCPUAdam(params, **kwargs)
    ref = torch.optim.AdamW(ref_params, foreach=False, **kwargs)
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        for p, q in zip(params, ref_params):
            p.grad = torch.randn(p.shape, generator=gen).to(dtype)
            q.grad = p.grad.float()
        opt.step()
        ref.step()
        with torch.no_grad():
            for q in ref_params:
                q.copy_(q.to(dtype))
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    for p, q in zip(params, ref_params):
        assert p.dtype == dtype and opt.state[p]["exp_avg"].dtype == torch.float32
        # one ulp apart at most (relative to the smaller value: up to 2 * 2**-mantissa_bits)
        torch.testing.assert_close(p.float(), q.detach(), rtol=2 * ulp, atol=1e-6)
        torch.testing.assert_close(
            opt.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"], rtol=1e-5, atol=1e-7
        )


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"]
)
def test_each_vector_path_writes_copies_in_the_pass(isa, dtype):
    params = make_params()
    opt = DeepSpeedCPUAdam(params, lr=1e-2, weight_decay=0.1)
    copies = [torch.empty(p.shape, dtype=dtype) for p in params]
    for step in range(3):
        for p in params:
            p.grad = torch.randn(p.shape) * 10.0 ** (step - 1)
        opt.step(fp16_param_groups=[copies])
        for p, c in zip(params, copies):
            assert torch.equal(c, p.detach().to(dtype))  # round to nearest even, bitwise


def test_each_vector_path_takes_low_precision_grads(isa):
    """fp32 master params with bf16 grads (the op widens them in its pass), one call for all."""
    op = ALL_OPS["cpu_adam"].load()
    params, ref_params = [p.detach() for p in make_params()], make_params()
    states = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]
    ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0, foreach=False)
    gen = torch.Generator().manual_seed(1)
    for step in range(1, 6):
        grads = [torch.randn(p.shape, generator=gen).to(torch.bfloat16) for p in params]
        for q, g in zip(ref_params, grads):
            q.grad = g.float()
        m, v = zip(*states)
        op.adam_step(params, grads, m, v, [], [step] * len(params), 1e-2, 0.9, 0.999, 1e-8, 0.0, True, True)
        ref.step()
    for p, q, (m, v) in zip(params, ref_params, states):
        torch.testing.assert_close(p, q.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(m, ref.state[q]["exp_avg"], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(v, ref.state[q]["exp_avg_sq"], rtol=1e-6, atol=1e-7)


def test_parity_check_can_fail(isa):
    """The tolerance is tight enough to catch a wrong update: lr off by 0.1% fails it."""
    params, ref_params = make_params(), make_params()
    opt = DeepSpeedCPUAdam(params, lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(ref_params, lr=1.001e-2, weight_decay=0.1, foreach=False)
    run_steps(opt, params, steps=5)
    run_steps(ref, ref_params, steps=5)
    with pytest.raises(AssertionError):
        assert_parity(opt, params, ref, ref_params)


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_each_vector_path_is_bitwise_the_same_with_and_without_prefetch(isa, param_dtype):
    """The prefetching loop stops `ahead` short of each span's end and the plain loop finishes
    it: a distance that is no multiple of the vector width, one longer than a small tensor
    and the default all give the same bits as no prefetch (params, states and copies)."""
    op = ALL_OPS["cpu_adam"].load()
    default = op.prefetch()
    results = {}
    try:
        for ahead in (0, 37, 1500, 512):
            op.set_prefetch(ahead)
            params = make_params(param_dtype)
            opt = DeepSpeedCPUAdam(params, lr=1e-2, weight_decay=0.1)
            copies = [torch.empty(p.shape, dtype=torch.bfloat16) for p in params]
            gen = torch.Generator().manual_seed(3)
            for _ in range(3):
                for p in params:
                    p.grad = torch.randn(p.shape, generator=gen).to(param_dtype)
                opt.step(fp16_param_groups=[copies] if param_dtype == torch.float32 else None)
            results[ahead] = [
                (p.detach().clone(), opt.state[p]["exp_avg_sq"].clone(), c) for p, c in zip(params, copies)
            ]
    finally:
        op.set_prefetch(default)
    for ahead in (37, 1500, 512):
        for (p, v, c), (p0, v0, c0) in zip(results[ahead], results[0]):
            assert torch.equal(p, p0) and torch.equal(v, v0), f"prefetch {ahead} changed the step"
            if param_dtype == torch.float32:
                assert torch.equal(c, c0)
    for bad in (-1, 2**16 + 1):
        with pytest.raises(RuntimeError, match=f"distance in elements >= 0 .* got {bad}"):
            op.set_prefetch(bad)
    with pytest.raises(RuntimeError, match="bandwidth_probe takes a distance"):
        n = 64
        op.bandwidth_probe(torch.zeros(n), torch.zeros(n), torch.zeros(n), torch.zeros(n), prefetch=-5)


@needs_native
def test_prefetch_is_on_by_default_on_intel_cpus_only():
    """The default the kernel note argues for: 512 elements on Intel CPUs, none elsewhere."""
    op = ALL_OPS["cpu_adam"].load()
    vendor = ""
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            vendor = next((line.split(":")[1].strip() for line in f if line.startswith("vendor_id")), "")
    code = "from deepspeed.ops.op_builder import ALL_OPS; print(ALL_OPS['cpu_adam'].load().prefetch())"
    fresh = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    expected = 512 if vendor == "GenuineIntel" and platform.machine() == "x86_64" else 0
    assert int(fresh.stdout.split()[-1]) == expected, f"vendor {vendor!r}"
    assert op.prefetch() == expected  # no test left it changed


class _FakeOp:
    """The op's prefetch setting alone, recording every distance set."""

    def __init__(self, default: int) -> None:
        self.distance, self.history = default, []

    def prefetch(self) -> int:
        return self.distance

    def set_prefetch(self, distance: int) -> None:
        if not 0 <= distance <= 2**16:
            raise RuntimeError(f"distance in elements >= 0 and <= 65536, got {distance}")
        self.distance = distance
        self.history.append(distance)


def _tune(default: int, ns_per_element: dict) -> tuple:
    """Drive a fresh tuner with steps costing `ns_per_element[distance]`; (result, distances timed)."""
    tuner, op, timed = PrefetchTuner(), _FakeOp(default), []
    n = tuner.MIN_ELEMENTS
    assert tuner.before(op, n, fresh=True) is None  # the first step touches fresh states
    assert tuner.before(op, n - 1, fresh=False) is None  # too small to time
    while not tuner.done:
        distance = tuner.before(op, n, fresh=False)
        timed.append(distance)
        tuner.after(op, distance, ns_per_element[distance] * n / 1e9, n)
    assert op.distance == tuner.result["distance"]
    return tuner.result, timed


@pytest.mark.parametrize(
    "default, costs, chosen",
    [
        (0, {0: 1.20, 512: 1.00}, 512),  # an Intel-like CPU the vendor rule missed
        (512, {0: 1.00, 512: 1.25}, 0),  # an AMD-like one
        (0, {0: 1.00, 512: 0.99}, 0),  # within the margin: the default stays
        (512, {0: 1.00, 512: 1.01}, 512),
    ],
)
def test_prefetch_tuner_keeps_the_faster_distance(default, costs, chosen):
    result, timed = _tune(default, costs)
    other = 512 if default == 0 else 0
    assert timed == [default, other, other, default, default, other]  # 3 each, drift cancels
    assert result["distance"] == chosen and result["source"] == "measured" and result["default"] == default
    assert result["ns_per_element"] == pytest.approx(costs)


def test_prefetch_tuner_small_steps_and_the_environment(monkeypatch):
    tuner, op = PrefetchTuner(), _FakeOp(512)
    for _ in range(tuner.GIVE_UP_AFTER):
        assert tuner.before(op, 1000, fresh=False) is None
    assert tuner.done and op.distance == 512 and tuner.result["source"].startswith("default")

    monkeypatch.setenv(PREFETCH_ENV, "128")
    tuner, op = PrefetchTuner(), _FakeOp(0)
    assert tuner.before(op, tuner.MIN_ELEMENTS, fresh=False) is None
    assert tuner.done and op.distance == 128 and tuner.result["source"] == PREFETCH_ENV
    for bad in ("far", "-4"):
        monkeypatch.setenv(PREFETCH_ENV, bad)
        with pytest.raises(ValueError, match=rf"{PREFETCH_ENV}='{bad}' is not a prefetch distance"):
            PrefetchTuner().before(_FakeOp(0), 1, fresh=False)


@needs_native
def test_the_first_large_steps_choose_the_distance_and_change_no_value():
    """A real optimizer: its first steps over `MIN_ELEMENTS` time both distances and leave the
    faster set; a second run, at that distance throughout, gives the same bits."""
    op = ALL_OPS["cpu_adam"].load()
    default = op.prefetch()

    def run() -> tuple:
        gen = torch.Generator().manual_seed(5)
        param = torch.nn.Parameter(torch.randn(PrefetchTuner.MIN_ELEMENTS, generator=gen))
        opt = DeepSpeedCPUAdam([param], lr=1e-2, weight_decay=0.1)
        for _ in range(1 + 2 * PrefetchTuner.TRIALS):
            param.grad = torch.randn(param.shape, generator=gen)
            opt.step()
        return param.detach(), opt.state[param]["exp_avg_sq"]

    PREFETCH.reset()
    try:
        tuned = run()
        assert PREFETCH.done and PREFETCH.result["source"] == "measured", PREFETCH.result
        assert op.prefetch() == PREFETCH.result["distance"] in PrefetchTuner.CANDIDATES
        again = run()  # no trial now: the chosen distance for every step
        assert all(torch.equal(a, b) for a, b in zip(tuned, again))
    finally:
        PREFETCH.reset()
        op.set_prefetch(default)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "nontemporal, contiguous, prefetch",
    [(False, False, 0), (False, True, 0), (True, True, 0), (False, False, 37)],
)
def test_each_vector_path_floor_does_the_steps_traffic(isa, dtype, nontemporal, contiguous, prefetch):
    """bandwidth_probe (the benchmark's floor) really reads and writes every element."""
    op = ALL_OPS["cpu_adam"].load()
    gen = torch.Generator().manual_seed(0)
    for n in SIZES:
        p, g = (torch.randn(n, generator=gen).to(dtype) for _ in range(2))
        m, v = (torch.randn(n, generator=gen) for _ in range(2))
        expected = ((p.float() + g.float()).to(dtype), m + g.float(), v + g.float())
        op.bandwidth_probe(p, g, m, v, nontemporal=nontemporal, contiguous=contiguous, prefetch=prefetch)
        for got, want in zip((p, m, v), expected):
            assert torch.equal(got, want)


@needs_native
def test_parallel_threads_follow_torch():
    """The op's OpenMP regions get torch.set_num_threads threads: one runtime, torch's."""
    op = ALL_OPS["cpu_adam"].load()
    saved = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert op.parallel_threads() == threads
    finally:
        torch.set_num_threads(saved)
    if sys.platform.startswith("linux") and op.has_openmp():
        with open("/proc/self/maps") as maps:
            runtimes = {line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line}
        assert len(runtimes) == 1, runtimes


@needs_native
def test_many_small_tensors_take_one_native_call(monkeypatch):
    """A group of 2,000 odd-sized tensors: one native call per step, results as torch's."""
    gen = torch.Generator().manual_seed(0)
    sizes = [int(torch.randint(1, 300, (1,), generator=gen)) for _ in range(2000)]
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = DeepSpeedCPUAdam(params, lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.1, foreach=False)
    calls = []
    real = opt._native

    class Spy:
        def adam_step_supported(self, *args):
            calls.append(len(args[0]))
            return real.adam_step_supported(*args)

        def __getattr__(self, name):  # the rest of the op (its prefetch setting) as it is
            return getattr(real, name)

    monkeypatch.setattr(opt, "_native", Spy())
    run_steps(opt, params, steps=3)
    run_steps(ref, ref_params, steps=3)
    assert calls == [len(sizes)] * 3
    assert_parity(opt, params, ref, ref_params)


@needs_native
def test_group_steps_what_the_op_takes_and_the_rest_one_by_one():
    """fp64 params, non-contiguous params and grads go around the group call, same results."""
    gen = torch.Generator().manual_seed(0)
    kinds = ["fp32", "fp64_param", "strided_param", "strided_grad", "fp32"]
    params = [torch.nn.Parameter(torch.randn(37, 3, generator=gen)) for _ in kinds]
    params[1] = torch.nn.Parameter(params[1].detach().double())
    params[2] = torch.nn.Parameter(torch.randn(3, 37, generator=gen).t())  # transposed: not contiguous
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = DeepSpeedCPUAdam(params, lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.1, foreach=False)
    skipped = []
    real = opt._native

    class Spy:
        def __getattr__(self, name):
            return getattr(real, name)

        def adam_step_supported(self, *args):
            skipped.append(real.adam_step_supported(*args))
            return skipped[-1]

    opt._native = Spy()
    for _ in range(3):
        for kind, p, q in zip(kinds, params, ref_params):
            grad = torch.randn(3, 37, generator=gen).t()  # non-contiguous
            p.grad = (grad if kind == "strided_grad" else grad.contiguous()).to(p.dtype)
            q.grad = p.grad.clone()
        opt.step()
        ref.step()
    assert skipped == [[1, 2, 3]] * 3
    for p, q in zip(params, ref_params):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)


@needs_native
def test_isa_can_be_forced_by_the_environment():
    code = (
        "from deepspeed.ops.op_builder import ALL_OPS; op = ALL_OPS['cpu_adam'].load(); "
        "assert op.isa() == 'scalar', op.isa(); print(op.available_isas())"
    )
    env = {**os.environ, "DS_CPU_ADAM_ISA": "scalar"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
    op = ALL_OPS["cpu_adam"].load()
    with pytest.raises(RuntimeError, match="not available on this CPU; choose one of"):
        op.set_isa("no_such_isa")


@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam_l2"])
@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.3, 0.95)], ids=["default_betas", "small_beta1"])
@pytest.mark.parametrize("native", [True, False], ids=["native", "torch_fallback"])
def test_matches_torch(request, adamw_mode, betas, native):
    if native and not NATIVE:
        pytest.skip("cpu_adam cannot be built here")
    if not native:
        request.getfixturevalue("no_native")
    kwargs = dict(lr=1e-2, betas=betas, eps=1e-8, weight_decay=0.1)
    params, ref_params = make_params(), make_params()
    opt = DeepSpeedCPUAdam(params, adamw_mode=adamw_mode, **kwargs)
    ref_cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    ref = ref_cls(ref_params, foreach=False, **kwargs)
    assert opt.uses_native is native
    run_steps(opt, params)
    run_steps(ref, ref_params)
    assert_parity(opt, params, ref, ref_params)


@needs_native
def test_native_op_is_loaded_and_used(monkeypatch):
    opt = DeepSpeedCPUAdam(make_params())
    op = ALL_OPS["cpu_adam"]
    assert opt.uses_native and op.is_built()
    assert op.load() is opt._native  # cached: the same module, no second build
    calls = []
    real = opt._native

    class Spy:
        def adam_step_supported(self, *args):
            calls.append(list(args[5]))  # the step counts: one call per param group
            return real.adam_step_supported(*args)

    monkeypatch.setattr(opt, "_native", Spy())
    run_steps(opt, [p for g in opt.param_groups for p in g["params"]], steps=2)
    assert calls == [[1] * len(SIZES), [2] * len(SIZES)]


def test_without_bias_correction_matches_reference(no_native):
    params = make_params()
    opt = DeepSpeedCPUAdam(params, lr=1e-2, bias_correction=False, weight_decay=0.01)
    run_steps(opt, params, steps=3)
    expected = make_params()
    states = [(torch.zeros_like(p), torch.zeros_like(p)) for p in expected]
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for step in range(1, 4):
            for p, (m, v) in zip(expected, states):
                grad = torch.randn(p.shape, generator=gen)
                torch_adam_update(p, grad, m, v, step, 1e-2, 0.9, 0.999, 1e-8, 0.01, False, True)
    for p, q in zip(params, expected):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch_fallback"])
def test_state_dict_round_trip(request, native):
    if native and not NATIVE:
        pytest.skip("cpu_adam cannot be built here")
    if not native:
        request.getfixturevalue("no_native")
    straight_params = make_params()
    straight = DeepSpeedCPUAdam(straight_params, lr=1e-2, weight_decay=0.1)
    run_steps(straight, straight_params, steps=10)

    params = make_params()
    first = DeepSpeedCPUAdam(params, lr=1e-2, weight_decay=0.1)
    run_steps(first, params, steps=5)
    saved_params = [p.detach().clone() for p in params]
    saved = copy.deepcopy(first.state_dict())

    resumed_params = [torch.nn.Parameter(p) for p in saved_params]
    resumed = DeepSpeedCPUAdam(resumed_params, lr=1e-2, weight_decay=0.1)
    resumed.load_state_dict(saved)
    assert resumed.state[resumed_params[0]]["step"] == 5
    run_steps_from(resumed, resumed_params, 5, skip=5)
    for p, q in zip(resumed_params, straight_params):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def run_steps_from(opt, params, steps, skip):
    """Like run_steps, but starting after `skip` steps' worth of gradients."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(skip):
        for p in params:
            torch.randn(p.shape, generator=gen)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()


def test_amsgrad_is_rejected_with_the_fix():
    with pytest.raises(ValueError, match="amsgrad=False"):
        DeepSpeedCPUAdam(make_params(), amsgrad=True)


@pytest.mark.parametrize(
    "kwargs, key", [({"lr": -1.0}, "lr"), ({"betas": (0.9, 1.0)}, "betas"), ({"eps": -1.0}, "eps")]
)
def test_bad_hyperparameters_name_the_key(kwargs, key, no_native):
    with pytest.raises(ValueError, match=key):
        DeepSpeedCPUAdam(make_params(), **kwargs)


def test_non_cpu_param_names_the_fix(no_native):
    param = torch.nn.Parameter(torch.empty(4, device="meta"))
    param.grad = torch.empty(4, device="meta")
    with pytest.raises(ValueError, match="offload_optimizer"):
        DeepSpeedCPUAdam([param]).step()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_params_keep_fp32_states(dtype):
    native_params, torch_params = make_params(dtype), make_params(dtype)
    opt = DeepSpeedCPUAdam(native_params, lr=1e-2)
    run_steps(opt, native_params, steps=5)
    ref = DeepSpeedCPUAdam(torch_params, lr=1e-2)
    ref._native = None  # the torch path, same math
    run_steps(ref, torch_params, steps=5)
    for p, q in zip(native_params, torch_params):
        assert p.dtype == dtype and opt.state[p]["exp_avg"].dtype == torch.float32
        torch.testing.assert_close(p, q, rtol=1e-2, atol=1e-2)  # at most an ulp of `dtype`
        torch.testing.assert_close(
            opt.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"], rtol=1e-5, atol=1e-7
        )
    reloaded = DeepSpeedCPUAdam(make_params(dtype), lr=1e-2)
    reloaded.load_state_dict(opt.state_dict())
    first = reloaded.param_groups[0]["params"][0]
    assert reloaded.state[first]["exp_avg"].dtype == torch.float32


def test_fp16_param_groups_receive_the_update():
    params = make_params()
    opt = DeepSpeedCPUAdam(params, lr=1e-2)
    copies = [torch.empty(p.shape, dtype=torch.bfloat16) for p in params]
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step(fp16_param_groups=[copies])
    for p, c in zip(params, copies):
        assert torch.equal(c, p.detach().to(torch.bfloat16))
    with pytest.raises(ValueError, match="one copy per parameter"):
        opt.step(fp16_param_groups=[copies[:1]])


@needs_native
def test_kernel_rejects_bad_tensors():
    op = ALL_OPS["cpu_adam"].load()
    good = [torch.zeros(8) for _ in range(4)]
    with pytest.raises(RuntimeError, match="float32"):
        op.adam_update(
            torch.zeros(8, dtype=torch.float64), *good[1:], 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, True
        )
    with pytest.raises(RuntimeError, match="elements"):
        op.adam_update(torch.zeros(9), *good[1:], 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, True)
    with pytest.raises(RuntimeError, match="step must be"):
        op.adam_update(*good, 0, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, True)


def test_fallback_warns_once(monkeypatch, no_native):
    warnings = []
    monkeypatch.setattr(builder.logger, "warning", lambda msg: warnings.append(msg))
    DeepSpeedCPUAdam(make_params())
    DeepSpeedCPUAdam(make_params())
    assert len(warnings) == 1 and "disabled by the test" in warnings[0] and "pure-torch" in warnings[0]


class BrokenBuilder(CPUAdamBuilder):
    NAME = "ds_test_broken_op"

    def __init__(self, root):
        super().__init__()
        self._root = root

    def csrc_root(self):
        return self._root


@needs_native
def test_failed_build_names_the_op_and_the_log(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    (tmp_path / "adam").mkdir()
    broken = BrokenBuilder(tmp_path)
    for src in broken.sources():
        (tmp_path / src).write_text("this is not C++\n")
    assert not broken.is_built()
    with pytest.raises(RuntimeError, match="ds_test_broken_op") as info:
        broken.load()
    log = broken.build_directory() / builder.ERROR_LOG_FILE
    assert str(log) in str(info.value) and log.is_file()
    with pytest.raises(RuntimeError, match="ds_test_broken_op"):  # cached: no second build
        broken.load()


def test_incompatible_builder_says_why():
    op = IncompatibleBuilder()
    assert not op.is_compatible() and not op.is_built()
    with pytest.raises(RuntimeError, match="disabled by the test"):
        op.load()
    assert op.try_load() is None


def test_import_compiles_nothing():
    code = (
        "import sys, deepspeed.ops, deepspeed.ops.op_builder as b; "
        "assert 'torch.utils.cpp_extension' not in sys.modules; "
        "import deepspeed.ops.adam; assert 'torch.utils.cpp_extension' not in sys.modules; "
        "assert b.ALL_OPS['cpu_adam']._module is None"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ----------------------------------------------------------------------------- huge pages

HUGE_N = (3 << 20) // 4 + 1001  # 3 MiB + a tail of fp32: one whole huge page, a partial one


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_huge_page_zeros_is_aligned_zeroed_and_exact(dtype):
    n = HUGE_N * 4 // torch.empty((), dtype=dtype).element_size()  # 3 MiB and a bit, any dtype
    shape = (n // 7, 7)
    t = huge_pages.huge_page_zeros(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous()
    assert not t.requires_grad and torch.count_nonzero(t) == 0
    # Exactly its own bytes: torch.save writes whole storages, padding would land in checkpoints.
    assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    if huge_pages.huge_pages_available():
        assert t.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0
    small = huge_pages.huge_page_zeros(1000, dtype)  # under one huge page: plain torch.zeros
    assert small.shape == (1000,) and small.dtype == dtype and torch.count_nonzero(small) == 0


@pytest.mark.skipif(not huge_pages.huge_pages_available(), reason="no transparent huge pages here")
def test_huge_page_zeros_really_gets_huge_pages():
    before = huge_pages.anon_huge_page_bytes()
    t = huge_pages.huge_page_zeros(16 << 20 >> 2)  # 16 MiB: 8 huge pages
    t.fill_(1.0)  # first touch faults the pages in
    grown = huge_pages.anon_huge_page_bytes() - before
    # The kernel may fall back to small pages when it finds no free 2 MiB block; most must be huge.
    assert grown >= 4 * huge_pages.HUGE_PAGE_BYTES, grown


def test_huge_page_tensor_outlives_its_maker_and_saves():
    t = huge_pages.huge_page_zeros(HUGE_N)
    view = t[123:456]
    view.fill_(2.0)
    del t
    gc.collect()
    assert view.sum().item() == 2.0 * 333  # the mapping is still there through the view
    buf = io.BytesIO()
    torch.save({"x": huge_pages.huge_page_zeros(HUGE_N).add_(3.0)}, buf)
    assert buf.tell() < HUGE_N * 4 + 65536  # no alignment padding in the file
    buf.seek(0)
    loaded = torch.load(buf)["x"]
    assert loaded.shape == (HUGE_N,) and bool((loaded == 3.0).all())


def _mapped(address: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if start <= address < end:
                return True
    return False


@pytest.mark.skipif(not huge_pages.huge_pages_available(), reason="no transparent huge pages here")
def test_huge_page_tensor_is_no_view_and_frees_its_mapping_when_repointed():
    """NVMe optimizer offload points each state at a sentinel with `set_` between steps: the
    tensor must own its storage (no `_base`), or the mapping stays alive behind it."""
    t = huge_pages.huge_page_zeros((HUGE_N // 4, 4))
    assert t._base is None and t.shape == (HUGE_N // 4, 4) and t.is_contiguous()
    address = t.data_ptr()
    assert _mapped(address)
    t.set_(torch.zeros(1).expand(HUGE_N // 4, 4))
    gc.collect()
    assert not _mapped(address), "the huge-page mapping outlived the only tensor on it"


def test_huge_page_zeros_falls_back_where_unavailable(monkeypatch):
    monkeypatch.setattr(huge_pages, "_why_not", lambda: "disabled by the test")
    t = huge_pages.huge_page_zeros((HUGE_N,), torch.float32)
    assert t.shape == (HUGE_N,) and torch.count_nonzero(t) == 0
    assert t.untyped_storage().nbytes() == HUGE_N * 4


def _large_params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (HUGE_N, 1023)]


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch_fallback"])
def test_large_states_in_huge_pages_match_torch(request, native):
    if native and not NATIVE:
        pytest.skip("cpu_adam cannot be built here")
    if not native:
        request.getfixturevalue("no_native")
    params, ref_params = _large_params(), _large_params()
    opt = DeepSpeedCPUAdam(params, lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.1, foreach=False)
    run_steps(opt, params, steps=4)
    run_steps(ref, ref_params, steps=4)
    assert_parity(opt, params, ref, ref_params)
    if huge_pages.huge_pages_available():
        for key in ("exp_avg", "exp_avg_sq"):
            assert opt.state[params[0]][key].data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0


def test_large_state_dict_round_trip_lands_in_huge_pages():
    straight_params = _large_params()
    straight = DeepSpeedCPUAdam(straight_params, lr=1e-2, weight_decay=0.1)
    run_steps(straight, straight_params, steps=6)

    params = _large_params()
    first = DeepSpeedCPUAdam(params, lr=1e-2, weight_decay=0.1)
    run_steps(first, params, steps=3)
    buf = io.BytesIO()
    torch.save({"params": [p.detach() for p in params], "opt": first.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)

    resumed_params = [torch.nn.Parameter(p) for p in saved["params"]]
    resumed = DeepSpeedCPUAdam(resumed_params, lr=1e-2, weight_decay=0.1)
    resumed.load_state_dict(saved["opt"])
    big = resumed.state[resumed_params[0]]
    for key in ("exp_avg", "exp_avg_sq"):
        # A copy, not the loaded tensor, and in a 2 MiB-aligned buffer of its own.
        assert big[key].data_ptr() != saved["opt"]["state"][0][key].data_ptr()
        torch.testing.assert_close(big[key], first.state[params[0]][key], rtol=0, atol=0)
        if huge_pages.huge_pages_available():
            assert big[key].data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0
    run_steps_from(resumed, resumed_params, 3, skip=3)
    for p, q in zip(resumed_params, straight_params):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
