// The interface between the bindings (cpu_adam.cpp) and the per-instruction-set kernels
// (adam_avx512.cpp, adam_avx2.cpp, adam_neon.cpp, adam_scalar.cpp).
//
// Plain structs and function pointers only: the kernel files are compiled for instruction
// sets the CPU may lack, so they include no torch or standard-library header whose inline
// functions could be shared with (and replace) the baseline copies elsewhere in the library.

#pragma once

#include <cstdint>

namespace ds_adam {

// Element types a span can hold. States (exp_avg, exp_avg_sq) are always fp32.
enum class Dtype : int { kF32 = 0, kBF16 = 1, kF16 = 2, kNone = 3 };

// Element tags the kernels load and store (the bits of a bfloat16 or an IEEE half), and
// the tag of an absent copy-out.
struct Bf16 {
  uint16_t bits;
};
struct Half {
  uint16_t bits;
};
struct NoOut {};

enum class Decay : int { kNone = 0, kL2 = 1, kDecoupled = 2 };

// One step's float constants, rounded from doubles once (see [Note: matching torch rounding]).
struct Scalars {
  float lerp_coeff;       // exp_avg' = base + lerp_coeff * (g - exp_avg)
  bool lerp_from_avg;     // base is exp_avg (beta1 > 0.5, torch's small-weight branch) or g
  float beta2;
  float one_minus_beta2;
  float inv_bias_correction2_sqrt;  // 1 / sqrt(bias_correction2)
  float eps;
  float neg_step_size;    // -lr / bias_correction1
  float weight_decay;     // kL2: g += weight_decay * p
  float decay_factor;     // kDecoupled: p *= 1 - lr * weight_decay
  Decay decay;
};

// Elements [begin, end) of one parameter. `out`, when its type is not kNone, receives the
// updated parameter (rounded to its type) in the same pass.
struct Span {
  void* param;
  const void* grad;
  float* exp_avg;
  float* exp_avg_sq;
  void* out;
  int64_t begin;
  int64_t end;
  Dtype param_type;
  Dtype grad_type;
  Dtype out_type;
  const Scalars* scalars;
  // Software prefetch distance in elements (0: none), for every stream the step reads (see
  // [Note: software prefetch where the CPU needs it] in adam_kernel.h).
  int64_t prefetch_ahead;
};

using AdamFn = void (*)(const Span&);
// The bandwidth floor: param += grad, exp_avg += grad, exp_avg_sq += grad, the same reads
// and writes per element as an Adam step (param and grad both fp32, bf16 or fp16), with
// non-temporal stores when `stream` (see [Note: the bandwidth floor] in adam_kernel.h).
using FloorFn = void (*)(const Span&, bool stream);

struct Kernels {
  const char* name;  // "avx512", "avx2", "neon" or "scalar"
  AdamFn adam;       // null when this file was not compiled for this architecture
  FloorFn floor;
};

Kernels avx512_kernels();
Kernels avx2_kernels();
Kernels neon_kernels();
Kernels scalar_kernels();

}  // namespace ds_adam
