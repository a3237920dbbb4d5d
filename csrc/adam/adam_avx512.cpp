// The Adam kernel for x86-64 CPUs with AVX-512F: 16 floats per vector.
// Compiled with a per-function target attribute, so the library still loads on CPUs without
// AVX-512; cpu_adam.cpp calls in only when the CPU reports avx512f.

#include "adam_span.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))

#include <immintrin.h>

namespace {

using ds_adam::Bf16;
using ds_adam::Half;
using ds_adam::NoOut;

#define DS_TARGET __attribute__((target("avx512f,fma,f16c")))

struct V {
  using F = __m512;
  static constexpr int W = 16;

  DS_TARGET static F ld(const float* p) { return _mm512_loadu_ps(p); }
  DS_TARGET static void st(float* p, F x) { _mm512_storeu_ps(p, x); }

  // bf16 -> fp32 is exact: the 16 bits become the top half of the float.
  DS_TARGET static F ld(const Bf16* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  // fp32 -> bf16, round to nearest even; NaN stays a quiet NaN (0x7fc0), as c10::BFloat16.
  DS_TARGET static __m256i to_bf16(F x) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    rounded = _mm512_srli_epi32(rounded, 16);
    const __mmask16 ordered = _mm512_cmp_ps_mask(x, x, _CMP_ORD_Q);
    rounded = _mm512_mask_blend_epi32(ordered, _mm512_set1_epi32(0x7fc0), rounded);
    return _mm512_cvtepi32_epi16(rounded);
  }
  DS_TARGET static void st(Bf16* p, F x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(x)); }

  DS_TARGET static F ld(const Half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  DS_TARGET static void st(Half* p, F x) {
    const __m256i h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
  }
  DS_TARGET static void st(NoOut*, F) {}

  // Non-temporal stores for the bandwidth floor; the caller aligns p to the vector's width.
  DS_TARGET static void stream(float* p, F x) { _mm512_stream_ps(p, x); }
  DS_TARGET static void stream(Bf16* p, F x) { _mm256_stream_si256(reinterpret_cast<__m256i*>(p), to_bf16(x)); }
  DS_TARGET static void stream(Half* p, F x) {
    const __m256i h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), h);
  }
  DS_TARGET static void fence() { _mm_sfence(); }

  DS_TARGET static F set1(float x) { return _mm512_set1_ps(x); }
  DS_TARGET static F add(F a, F b) { return _mm512_add_ps(a, b); }
  DS_TARGET static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  DS_TARGET static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  DS_TARGET static F div(F a, F b) { return _mm512_div_ps(a, b); }
  DS_TARGET static F sqrt(F a) { return _mm512_sqrt_ps(a); }
  DS_TARGET static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
};

#include "adam_kernel.h"

}  // namespace

ds_adam::Kernels ds_adam::avx512_kernels() { return {"avx512", &adam_any, &floor_any}; }

#else

ds_adam::Kernels ds_adam::avx512_kernels() { return {"avx512", nullptr, nullptr}; }

#endif
