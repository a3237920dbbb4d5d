// Fused Adam / AdamW step on contiguous fp32 CPU tensors, for DeepSpeedCPUAdam.
//
// [Note: matching torch.optim.Adam rounding]
// Each element goes through the same float operations, in the same order, as the
// single-tensor (foreach=False) path of torch.optim.Adam / AdamW:
//   AdamW: p = p * (1 - lr * wd)              Adam: g = g + wd * p   (fused multiply-add)
//   m = m + (1 - beta1) * (g - m)             (torch's lerp, a fused multiply-add)
//   v = v * beta2 + ((1 - beta2) * g) * g    (torch's addcmul, the last add fused)
//   p = p + (-step_size * m) / (sqrt(v) / sqrt(bias_correction2) + eps)
// The step scalars are computed in double and rounded to float once, as torch does with
// Python floats. The build passes -ffp-contract=off so that the compiler fuses nothing
// else; std::fma is used exactly where torch's vectorized (AVX2/AVX-512) kernels fuse.
// What remains is sqrt: torch's goes through MKL's vector math, which is not always
// correctly rounded, while std::sqrt is, so denom (and then param) can differ by an ulp.

#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

// Elements per OpenMP task: large enough to amortize scheduling, small enough to balance.
constexpr int64_t kChunk = 1 << 15;

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
// One clone per instruction set; the loader picks the best one for this CPU at start-up.
#define DS_CPU_CLONES __attribute__((target_clones("arch=skylake-avx512", "arch=haswell", "default")))
#else
#define DS_CPU_CLONES
#endif

enum class DecayMode { kNone, kL2, kDecoupled };

struct StepScalars {
  float one_minus_beta1;  // lerp weight for exp_avg
  float beta2;
  float one_minus_beta2;
  float bias_correction2_sqrt;
  float eps;
  float neg_step_size;  // -lr / bias_correction1
  float weight_decay;   // L2 mode: added to the gradient as wd * param
  float decay_factor;   // decoupled mode: param *= 1 - lr * wd
  DecayMode mode;
};

StepScalars make_scalars(int64_t step, double lr, double beta1, double beta2, double eps,
                         double weight_decay, bool bias_correction, bool adamw_mode) {
  TORCH_CHECK(step >= 1, "cpu_adam: step must be >= 1 (the count after this update), got ", step);
  const double steps = static_cast<double>(step);
  const double bias_correction1 = bias_correction ? 1.0 - std::pow(beta1, steps) : 1.0;
  const double bias_correction2 = bias_correction ? 1.0 - std::pow(beta2, steps) : 1.0;
  StepScalars s;
  s.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  s.bias_correction2_sqrt = static_cast<float>(std::pow(bias_correction2, 0.5));
  s.eps = static_cast<float>(eps);
  s.neg_step_size = static_cast<float>(-(lr / bias_correction1));
  s.weight_decay = static_cast<float>(weight_decay);
  s.decay_factor = static_cast<float>(1.0 - lr * weight_decay);
  if (weight_decay == 0.0) {
    s.mode = DecayMode::kNone;
  } else {
    s.mode = adamw_mode ? DecayMode::kDecoupled : DecayMode::kL2;
  }
  return s;
}

// The moment updates and the parameter step for one element; `g` already carries L2 decay.
inline __attribute__((always_inline)) float adam_element(float p, float g, float& m, float& v,
                                                         const StepScalars& s) {
  const float w = s.one_minus_beta1;
  // torch's lerp takes the other branch for weights >= 0.5 (beta1 <= 0.5).
  m = (std::fabs(w) < 0.5f) ? std::fma(w, g - m, m) : std::fma(w - 1.0f, g - m, g);
  v = std::fma(s.one_minus_beta2 * g, g, v * s.beta2);
  const float denom = std::sqrt(v) / s.bias_correction2_sqrt + s.eps;
  return p + (s.neg_step_size * m) / denom;
}

// One chunk [begin, end); the decay mode is hoisted out of the loop so each loop vectorizes.
DS_CPU_CLONES void adam_chunk(float* __restrict param, const float* __restrict grad,
                              float* __restrict exp_avg, float* __restrict exp_avg_sq, int64_t begin,
                              int64_t end, const StepScalars& s) {
  if (s.mode == DecayMode::kNone) {
    for (int64_t i = begin; i < end; ++i) {
      param[i] = adam_element(param[i], grad[i], exp_avg[i], exp_avg_sq[i], s);
    }
  } else if (s.mode == DecayMode::kL2) {
    for (int64_t i = begin; i < end; ++i) {
      const float g = std::fma(param[i], s.weight_decay, grad[i]);
      param[i] = adam_element(param[i], g, exp_avg[i], exp_avg_sq[i], s);
    }
  } else {
    for (int64_t i = begin; i < end; ++i) {
      param[i] = adam_element(param[i] * s.decay_factor, grad[i], exp_avg[i], exp_avg_sq[i], s);
    }
  }
}

template <typename T>
void copy_out_chunk(const float* __restrict src, T* __restrict dst, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    dst[i] = static_cast<T>(src[i]);  // c10::Half / c10::BFloat16 round to nearest even
  }
}

void check_fp32(const at::Tensor& t, const char* name, int64_t numel) {
  TORCH_CHECK(t.device().is_cpu(), "cpu_adam: ", name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.scalar_type() == at::kFloat, "cpu_adam: ", name, " must be float32, got ",
              t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), "cpu_adam: ", name, " must be contiguous");
  TORCH_CHECK(t.numel() == numel, "cpu_adam: ", name, " has ", t.numel(), " elements, param has ", numel);
}

void check_all(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
               const at::Tensor& exp_avg_sq) {
  const int64_t n = param.numel();
  check_fp32(param, "param", n);
  check_fp32(grad, "grad", n);
  check_fp32(exp_avg, "exp_avg", n);
  check_fp32(exp_avg_sq, "exp_avg_sq", n);
}

// Updates param, exp_avg and exp_avg_sq in place; when `out` is defined, also writes the new
// param into it (fp32, fp16 or bf16) chunk by chunk while the chunk is still in cache.
void run_step(at::Tensor& param, const at::Tensor& grad, at::Tensor& exp_avg,
              at::Tensor& exp_avg_sq, const StepScalars& s, at::Tensor* out) {
  const int64_t n = param.numel();
  float* p = param.data_ptr<float>();
  const float* g = grad.data_ptr<float>();
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  const auto out_type = out == nullptr ? at::kFloat : out->scalar_type();
  void* dst = out == nullptr ? nullptr : out->data_ptr();
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) if (chunks > 1)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t begin = c * kChunk;
    const int64_t end = std::min(n, begin + kChunk);
    adam_chunk(p, g, m, v, begin, end, s);
    if (dst == nullptr) continue;
    if (out_type == at::kBFloat16) {
      copy_out_chunk(p, static_cast<c10::BFloat16*>(dst), begin, end);
    } else if (out_type == at::kHalf) {
      copy_out_chunk(p, static_cast<c10::Half*>(dst), begin, end);
    } else {
      copy_out_chunk(p, static_cast<float*>(dst), begin, end);
    }
  }
}

void adam_update(at::Tensor param, at::Tensor grad, at::Tensor exp_avg, at::Tensor exp_avg_sq,
                 int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay,
                 bool bias_correction, bool adamw_mode) {
  check_all(param, grad, exp_avg, exp_avg_sq);
  const StepScalars s = make_scalars(step, lr, beta1, beta2, eps, weight_decay, bias_correction, adamw_mode);
  run_step(param, grad, exp_avg, exp_avg_sq, s, nullptr);
}

void adam_update_copy(at::Tensor param, at::Tensor grad, at::Tensor exp_avg,
                      at::Tensor exp_avg_sq, at::Tensor param_out, int64_t step, double lr,
                      double beta1, double beta2, double eps, double weight_decay, bool bias_correction,
                      bool adamw_mode) {
  check_all(param, grad, exp_avg, exp_avg_sq);
  const auto t = param_out.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kHalf || t == at::kBFloat16,
              "cpu_adam: param_out must be float32, float16 or bfloat16, got ", t);
  TORCH_CHECK(param_out.device().is_cpu() && param_out.is_contiguous(),
              "cpu_adam: param_out must be a contiguous CPU tensor");
  TORCH_CHECK(param_out.numel() == param.numel(), "cpu_adam: param_out has ", param_out.numel(),
              " elements, param has ", param.numel());
  const StepScalars s = make_scalars(step, lr, beta1, beta2, eps, weight_decay, bias_correction, adamw_mode);
  run_step(param, grad, exp_avg, exp_avg_sq, s, &param_out);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Fused Adam/AdamW step for fp32 CPU tensors (DeepSpeedCPUAdam)";
  m.def("adam_update", &adam_update, "One Adam/AdamW step, in place", py::arg("param"), py::arg("grad"),
        py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("step"), py::arg("lr"), py::arg("beta1"),
        py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("bias_correction"),
        py::arg("adamw_mode"), py::call_guard<py::gil_scoped_release>());
  m.def("adam_update_copy", &adam_update_copy,
        "One Adam/AdamW step, in place, also writing the new param into param_out (fp32/fp16/bf16)",
        py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("param_out"),
        py::arg("step"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("weight_decay"), py::arg("bias_correction"), py::arg("adamw_mode"),
        py::call_guard<py::gil_scoped_release>());
  m.def("has_openmp", []() {
#ifdef _OPENMP
    return true;
#else
    return false;
#endif
  });
}
