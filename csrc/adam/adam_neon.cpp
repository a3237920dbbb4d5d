// The Adam kernel for AArch64 (NEON is part of the base instruction set): 4 floats per vector.
// On other architectures this file compiles to an empty kernel table.

#include "adam_span.h"

#if defined(__aarch64__)

#include <arm_neon.h>

namespace {

using ds_adam::Bf16;
using ds_adam::Half;
using ds_adam::NoOut;

#define DS_TARGET

struct V {
  using F = float32x4_t;
  static constexpr int W = 4;

  static F ld(const float* p) { return vld1q_f32(p); }
  static void st(float* p, F x) { vst1q_f32(p, x); }

  // bf16 -> fp32 is exact: the 16 bits become the top half of the float.
  static F ld(const Bf16* p) {
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p)), 16));
  }
  // fp32 -> bf16, round to nearest even; NaN stays a quiet NaN (0x7fc0), as c10::BFloat16.
  static void st(Bf16* p, F x) {
    const uint32x4_t bits = vreinterpretq_u32_f32(x);
    const uint32x4_t lsb = vandq_u32(vshrq_n_u32(bits, 16), vdupq_n_u32(1));
    uint32x4_t rounded = vshrq_n_u32(vaddq_u32(bits, vaddq_u32(lsb, vdupq_n_u32(0x7fff))), 16);
    rounded = vbslq_u32(vceqq_f32(x, x), rounded, vdupq_n_u32(0x7fc0));
    vst1_u16(reinterpret_cast<uint16_t*>(p), vmovn_u32(rounded));
  }

  static F ld(const Half* p) {
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p))));
  }
  static void st(Half* p, F x) {
    vst1_u16(reinterpret_cast<uint16_t*>(p), vreinterpret_u16_f16(vcvt_f16_f32(x)));
  }
  static void st(NoOut*, F) {}

  // No non-temporal store here: the floor's streaming variant uses plain stores.
  template <class T>
  static void stream(T* p, F x) {
    st(p, x);
  }
  static void fence() {}

  static F set1(float x) { return vdupq_n_f32(x); }
  static F add(F a, F b) { return vaddq_f32(a, b); }
  static F sub(F a, F b) { return vsubq_f32(a, b); }
  static F mul(F a, F b) { return vmulq_f32(a, b); }
  static F div(F a, F b) { return vdivq_f32(a, b); }
  static F sqrt(F a) { return vsqrtq_f32(a); }
  static F fmadd(F a, F b, F c) { return vfmaq_f32(c, a, b); }
};

#include "adam_kernel.h"

}  // namespace

ds_adam::Kernels ds_adam::neon_kernels() { return {"neon", &adam_any, &floor_any}; }

#else

ds_adam::Kernels ds_adam::neon_kernels() { return {"neon", nullptr, nullptr}; }

#endif
