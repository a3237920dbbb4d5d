// Python bindings of the fused CPU Adam / AdamW step (DeepSpeedCPUAdam).
//
// One call steps a whole param group: the tensors are cut into spans of at most kSpan
// elements, and the spans are shared out between torch's OpenMP threads (the library links
// the same libgomp as torch, so torch.set_num_threads applies). Each span makes one pass over
// param, grad, exp_avg and exp_avg_sq, and writes the low-precision copy of the new parameter
// in that pass when one is asked for.
//
// The vector kernel (adam_avx512.cpp, adam_avx2.cpp, adam_neon.cpp, or adam_scalar.cpp) is
// chosen when the library loads: the widest one this CPU supports, or the one named by the
// environment variable DS_CPU_ADAM_ISA. `set_isa` switches at run time (the tests run every
// path the machine supports).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "../common/isa_registry.h"
#include "adam_span.h"

namespace {

using ds_adam::Dtype;
using ds_adam::Kernels;

// Elements per span: 64 Ki floats are 256 KiB per stream, long enough for the hardware
// prefetchers to lock on, short enough to even out the threads (see [Note: spans shared out
// dynamically]).
constexpr int64_t kSpan = 1 << 16;
// Below this many elements in a call, a single thread is faster than waking the others.
constexpr int64_t kParallelMin = 1 << 15;

bool cpu_supports(const std::string& isa) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  if (isa == "avx512") return __builtin_cpu_supports("avx512f");
  if (isa == "avx2") {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  }
#endif
  return isa == "scalar" || (isa == "neon" && ds_adam::neon_kernels().adam != nullptr);
}

bool usable(const Kernels& k) { return k.adam != nullptr && cpu_supports(k.name); }

// The builds this CPU runs, best first, and the active one (DS_CPU_ADAM_ISA if set, else the best).
ds_isa::Registry<Kernels>& kernels() {
  static ds_isa::Registry<Kernels> registry(
      "cpu_adam",
      {ds_adam::avx512_kernels(), ds_adam::avx2_kernels(), ds_adam::neon_kernels(), ds_adam::scalar_kernels()},
      usable, "DS_CPU_ADAM_ISA");
  return registry;
}

const Kernels* active() { return &kernels().active(); }

std::vector<std::string> available_isas() { return kernels().names(); }

std::string isa() { return active()->name; }

// Elements the kernels prefetch ahead at load: 512 on Intel CPUs, 0 elsewhere (see [Note: software
// prefetch where the CPU needs it] in adam_kernel.h for what each was measured at); the
// Python optimizer then measures both on its first large steps (PrefetchTuner).
int64_t default_prefetch() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  if (__builtin_cpu_is("intel")) return 512;
#endif
  return 0;
}

int64_t& prefetch_ahead() {
  static int64_t ahead = default_prefetch();
  return ahead;
}

// A distance the loops can use: at least 0 (none) and at most a span, since the prefetching
// loop stops that far short of a span's end (a larger one would prefetch nothing).
void check_prefetch(int64_t elements, const char* caller) {
  TORCH_CHECK(elements >= 0 && elements <= kSpan, "cpu_adam: ", caller,
              " takes a distance in elements >= 0 (0: none) and <= ", kSpan, " (one span), got ", elements);
}

// Sets the prefetch distance in elements (0: none); returns the previous one.
int64_t set_prefetch(int64_t elements) {
  check_prefetch(elements, "set_prefetch");
  const int64_t previous = prefetch_ahead();
  prefetch_ahead() = elements;
  return previous;
}

// Selects a kernel by name; returns the previous one's name.
std::string set_isa(const std::string& name) { return kernels().set(name); }

ds_adam::Scalars make_scalars(int64_t step, double lr, double beta1, double beta2, double eps,
                              double weight_decay, bool bias_correction, bool adamw_mode) {
  TORCH_CHECK(step >= 1, "cpu_adam: step must be >= 1 (the count after this update), got ", step);
  const double steps = static_cast<double>(step);
  const double bias_correction1 = bias_correction ? 1.0 - std::pow(beta1, steps) : 1.0;
  const double bias_correction2 = bias_correction ? 1.0 - std::pow(beta2, steps) : 1.0;
  ds_adam::Scalars s;
  const float weight = static_cast<float>(1.0 - beta1);
  s.lerp_from_avg = std::fabs(weight) < 0.5f;  // torch's lerp switches branch at weight 0.5
  s.lerp_coeff = s.lerp_from_avg ? weight : weight - 1.0f;
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  s.inv_bias_correction2_sqrt = static_cast<float>(1.0 / std::sqrt(bias_correction2));
  s.eps = static_cast<float>(eps);
  s.neg_step_size = static_cast<float>(-(lr / bias_correction1));
  s.weight_decay = static_cast<float>(weight_decay);
  s.decay_factor = static_cast<float>(1.0 - lr * weight_decay);
  if (weight_decay == 0.0) {
    s.decay = ds_adam::Decay::kNone;
  } else {
    s.decay = adamw_mode ? ds_adam::Decay::kDecoupled : ds_adam::Decay::kL2;
  }
  return s;
}

Dtype dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return Dtype::kF32;
    case at::kBFloat16: return Dtype::kBF16;
    case at::kHalf: return Dtype::kF16;
    default: return Dtype::kNone;
  }
}

void check_tensor(const at::Tensor& t, const char* name, size_t index, int64_t numel) {
  TORCH_CHECK(t.defined() && t.device().is_cpu(), "cpu_adam: ", name, "[", index, "] must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), "cpu_adam: ", name, "[", index, "] must be contiguous");
  TORCH_CHECK(t.numel() == numel, "cpu_adam: ", name, "[", index, "] has ", t.numel(),
              " elements, param has ", numel);
}

// Checks tensor `i` of a group and describes it as one span (cut into pieces later).
ds_adam::Span describe(size_t i, const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                       const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& out) {
  const int64_t n = param.numel();
  check_tensor(param, "params", i, n);
  check_tensor(grad, "grads", i, n);
  check_tensor(exp_avg, "exp_avgs", i, n);
  check_tensor(exp_avg_sq, "exp_avg_sqs", i, n);
  const Dtype pt = dtype_of(param);
  const Dtype gt = dtype_of(grad);
  TORCH_CHECK(pt != Dtype::kNone, "cpu_adam: params[", i, "] must be float32, bfloat16 or float16, got ",
              param.scalar_type());
  // fp32 params take fp32/bf16/fp16 grads; low-precision params take fp32 or their own dtype.
  TORCH_CHECK(gt != Dtype::kNone && (pt == Dtype::kF32 || gt == Dtype::kF32 || gt == pt), "cpu_adam: grads[", i,
              "] must be float32 or the param's dtype (", param.scalar_type(), "), got ", grad.scalar_type());
  TORCH_CHECK(exp_avg.scalar_type() == at::kFloat && exp_avg_sq.scalar_type() == at::kFloat,
              "cpu_adam: exp_avgs[", i, "] and exp_avg_sqs[", i, "] must be float32, got ",
              exp_avg.scalar_type(), " and ", exp_avg_sq.scalar_type());
  ds_adam::Span span{param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(),
                     nullptr, 0, n, pt, gt, Dtype::kNone, nullptr, prefetch_ahead()};
  if (out.has_value()) {
    check_tensor(*out, "outs", i, n);
    span.out_type = dtype_of(*out);
    TORCH_CHECK(span.out_type != Dtype::kNone, "cpu_adam: outs[", i,
                "] must be float32, bfloat16 or float16, got ", out->scalar_type());
    TORCH_CHECK(pt == Dtype::kF32, "cpu_adam: outs[", i, "] is only supported for float32 params, got ",
                param.scalar_type(), "; a low-precision param is itself updated in place");
    span.out = out->data_ptr();
  }
  return span;
}

// [Note: spans shared out dynamically]
// Every tensor is cut into spans of at most kSpan elements and the threads take spans in
// turn (schedule(dynamic)) rather than in fixed halves. Interleaving costs the hardware
// prefetchers nothing measurable (a span is 256 KiB per stream); but when another process
// takes a core from one thread mid-step, the other thread keeps taking spans instead of
// idling at the barrier until its partner's fixed half is done, which on a shared machine
// is the common case.
template <class Fn>
void run_spans(const std::vector<ds_adam::Span>& whole, Fn fn) {
  std::vector<ds_adam::Span> spans;
  int64_t total = 0;
  for (const ds_adam::Span& t : whole) {
    total += t.end;
    for (int64_t begin = 0; begin < t.end; begin += kSpan) {
      ds_adam::Span piece = t;
      piece.begin = begin;
      piece.end = std::min(t.end, begin + kSpan);
      spans.push_back(piece);
    }
  }
  const int64_t count = static_cast<int64_t>(spans.size());
  const int threads = total < kParallelMin ? 1 : static_cast<int>(std::min<int64_t>(at::get_num_threads(), count));
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
  for (int64_t k = 0; k < count; ++k) {
    fn(spans[k]);
  }
}

// Whether describe() would take tensor i as it is; never throws. A tensor it would refuse
// (another dtype, layout or device, a size mismatch) is left to the caller's fallback.
bool supported(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
               const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& out) {
  if (!param.defined()) return false;
  const int64_t n = param.numel();
  const auto dense = [n](const at::Tensor& t) {
    return t.defined() && t.layout() == at::kStrided && t.device().is_cpu() && t.numel() == n && t.is_contiguous();
  };
  if (!dense(param) || !dense(grad) || !dense(exp_avg) || !dense(exp_avg_sq)) return false;
  const Dtype pt = dtype_of(param);
  const Dtype gt = dtype_of(grad);
  if (pt == Dtype::kNone || gt == Dtype::kNone || !(pt == Dtype::kF32 || gt == Dtype::kF32 || gt == pt)) return false;
  if (exp_avg.scalar_type() != at::kFloat || exp_avg_sq.scalar_type() != at::kFloat) return false;
  return !out.has_value() || (pt == Dtype::kF32 && dense(*out) && dtype_of(*out) != Dtype::kNone);
}

// One Adam/AdamW step of a whole param group, in place. `steps[i]` is tensor i's step count
// after this update; `outs`, when given, holds per tensor a copy target or None. With
// `skip_unsupported`, tensors the kernel cannot take are left untouched and their indices
// returned; without, they raise.
std::vector<int64_t> step_group(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                                const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                                const std::vector<std::optional<at::Tensor>>& outs,
                                const std::vector<int64_t>& steps, double lr, double beta1, double beta2,
                                double eps, double weight_decay, bool bias_correction, bool adamw_mode,
                                bool skip_unsupported) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && steps.size() == n &&
                  (outs.empty() || outs.size() == n),
              "cpu_adam: params, grads, exp_avgs, exp_avg_sqs and steps (and outs, if given) must have one "
              "entry per tensor; got ",
              n, ", ", grads.size(), ", ", exp_avgs.size(), ", ", exp_avg_sqs.size(), ", ", steps.size(),
              " and ", outs.size());
  // One Scalars per distinct step count (a group's tensors usually share one).
  std::vector<ds_adam::Scalars> scalars;
  std::vector<size_t> scalars_of(n);
  std::vector<ds_adam::Span> spans;
  std::vector<int64_t> skipped;
  int64_t last_step = 0;
  spans.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const std::optional<at::Tensor> out = outs.empty() ? std::nullopt : outs[i];
    if (skip_unsupported && !supported(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], out)) {
      skipped.push_back(static_cast<int64_t>(i));
      continue;
    }
    if (scalars.empty() || steps[i] != last_step) {
      scalars.push_back(make_scalars(steps[i], lr, beta1, beta2, eps, weight_decay, bias_correction, adamw_mode));
      last_step = steps[i];
    }
    scalars_of[spans.size()] = scalars.size() - 1;
    spans.push_back(describe(i, params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], out));
  }
  for (size_t k = 0; k < spans.size(); ++k) spans[k].scalars = &scalars[scalars_of[k]];  // `scalars` no longer moves
  const ds_adam::AdamFn kernel = active()->adam;
  pybind11::gil_scoped_release no_gil;
  run_spans(spans, kernel);
  return skipped;
}

void adam_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
               const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
               const std::vector<std::optional<at::Tensor>>& outs, const std::vector<int64_t>& steps, double lr,
               double beta1, double beta2, double eps, double weight_decay, bool bias_correction,
               bool adamw_mode) {
  step_group(params, grads, exp_avgs, exp_avg_sqs, outs, steps, lr, beta1, beta2, eps, weight_decay,
             bias_correction, adamw_mode, false);
}

std::vector<int64_t> adam_step_supported(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                                         const std::vector<at::Tensor>& exp_avgs,
                                         const std::vector<at::Tensor>& exp_avg_sqs,
                                         const std::vector<std::optional<at::Tensor>>& outs,
                                         const std::vector<int64_t>& steps, double lr, double beta1, double beta2,
                                         double eps, double weight_decay, bool bias_correction, bool adamw_mode) {
  return step_group(params, grads, exp_avgs, exp_avg_sqs, outs, steps, lr, beta1, beta2, eps, weight_decay,
                    bias_correction, adamw_mode, true);
}

// One tensor: the group step with a group of one (kept for callers of the single-tensor API).
void adam_update(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                 const at::Tensor& exp_avg_sq, int64_t step, double lr, double beta1, double beta2, double eps,
                 double weight_decay, bool bias_correction, bool adamw_mode) {
  adam_step({param}, {grad}, {exp_avg}, {exp_avg_sq}, {}, {step}, lr, beta1, beta2, eps, weight_decay,
            bias_correction, adamw_mode);
}

void adam_update_copy(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                      const at::Tensor& exp_avg_sq, const at::Tensor& param_out, int64_t step, double lr,
                      double beta1, double beta2, double eps, double weight_decay, bool bias_correction,
                      bool adamw_mode) {
  adam_step({param}, {grad}, {exp_avg}, {exp_avg_sq}, {param_out}, {step}, lr, beta1, beta2, eps, weight_decay,
            bias_correction, adamw_mode);
}

// The bandwidth floor for benchmarks (see [Note: the bandwidth floor] in adam_kernel.h): the
// bytes of an Adam step with the same threads, either shared out in spans as adam_step does
// (`contiguous` false) or as one contiguous stretch per thread, as STREAM does;
// `prefetch`: elements to prefetch ahead (0: none), whatever the step's setting.
void bandwidth_probe(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                     const at::Tensor& exp_avg_sq, bool nontemporal, bool contiguous, int64_t prefetch) {
  check_prefetch(prefetch, "bandwidth_probe");
  ds_adam::Span span = describe(0, param, grad, exp_avg, exp_avg_sq, std::nullopt);
  span.prefetch_ahead = prefetch;
  TORCH_CHECK(span.param_type == span.grad_type, "cpu_adam: bandwidth_probe takes a grad of the param's dtype");
  const ds_adam::FloorFn floor = active()->floor;
  pybind11::gil_scoped_release no_gil;
  if (!contiguous) {
    run_spans({span}, [floor, nontemporal](const ds_adam::Span& piece) { floor(piece, nontemporal); });
    return;
  }
  const int64_t n = span.end;
  const int threads = n < kParallelMin ? 1 : at::get_num_threads();
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
#ifdef _OPENMP
    const int64_t parts = omp_get_num_threads(), me = omp_get_thread_num();
#else
    const int64_t parts = 1, me = 0;
#endif
    const int64_t share = (n + parts - 1) / parts;
    const int64_t aligned = (share + 63) / 64 * 64;  // 64 elements: every vector stays aligned
    ds_adam::Span mine = span;
    mine.begin = std::min(n, me * aligned);
    mine.end = std::min(n, (me + 1) * aligned);
    if (mine.begin < mine.end) floor(mine, nontemporal);
  }
}

// How many threads the spans of a large step are shared between right now: what
// torch.set_num_threads set, if the library shares torch's OpenMP runtime.
int parallel_threads() {
  int seen = 1;
  const int threads = at::get_num_threads();
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
#ifdef _OPENMP
#pragma omp single
    seen = omp_get_num_threads();
#endif
  }
  return seen;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Fused Adam/AdamW step for CPU tensors (DeepSpeedCPUAdam)";
  m.def("adam_step", &adam_step,
        "One Adam/AdamW step of a param group, in place; outs (optional) receive the new params",
        py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("outs"),
        py::arg("steps"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("weight_decay"), py::arg("bias_correction"), py::arg("adamw_mode"));
  m.def("adam_step_supported", &adam_step_supported,
        "adam_step for the tensors the kernel takes as they are; returns the indices of the others, "
        "left untouched",
        py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("outs"),
        py::arg("steps"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("weight_decay"), py::arg("bias_correction"), py::arg("adamw_mode"));
  m.def("adam_update", &adam_update, "One Adam/AdamW step of one tensor, in place", py::arg("param"),
        py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("step"), py::arg("lr"),
        py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("bias_correction"),
        py::arg("adamw_mode"));
  m.def("adam_update_copy", &adam_update_copy,
        "One Adam/AdamW step of one fp32 tensor, in place, also writing the new param into param_out",
        py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("param_out"),
        py::arg("step"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("weight_decay"), py::arg("bias_correction"), py::arg("adamw_mode"));
  m.def("bandwidth_probe", &bandwidth_probe, "p += g, m += g, v += g: the memory floor of a step",
        py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("nontemporal") = false, py::arg("contiguous") = false,
        py::arg("prefetch") = 0);
  m.def("isa", &isa, "The active kernel: avx512, avx2, neon or scalar");
  m.def("set_isa", &set_isa, "Switch kernels by name; returns the previous name", py::arg("name"));
  m.def("prefetch", []() { return prefetch_ahead(); }, "Elements the kernel prefetches ahead (0: none)");
  m.def("set_prefetch", &set_prefetch, "Set the prefetch distance in elements (0: none); returns the previous one",
        py::arg("elements"));
  m.def("available_isas", &available_isas, "Kernels this CPU can run, best first");
  m.def("parallel_threads", &parallel_threads,
        "Threads a parallel region of this library gets now (torch.set_num_threads applies)");
  m.def("has_openmp", []() {
#ifdef _OPENMP
    return true;
#else
    return false;
#endif
  });
}
