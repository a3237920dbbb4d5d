// The Adam kernel for x86-64 CPUs with AVX2, FMA and F16C: 8 floats per vector.
// Compiled with a per-function target attribute, so the library still loads on older CPUs;
// cpu_adam.cpp calls in only when the CPU reports avx2, fma and f16c.

#include "adam_span.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))

#include <immintrin.h>

namespace {

using ds_adam::Bf16;
using ds_adam::Half;
using ds_adam::NoOut;

#define DS_TARGET __attribute__((target("avx2,fma,f16c")))

struct V {
  using F = __m256;
  static constexpr int W = 8;

  DS_TARGET static F ld(const float* p) { return _mm256_loadu_ps(p); }
  DS_TARGET static void st(float* p, F x) { _mm256_storeu_ps(p, x); }

  // bf16 -> fp32 is exact: the 16 bits become the top half of the float.
  DS_TARGET static F ld(const Bf16* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  // fp32 -> bf16, round to nearest even; NaN stays a quiet NaN (0x7fc0), as c10::BFloat16.
  DS_TARGET static __m128i to_bf16(F x) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    rounded = _mm256_srli_epi32(rounded, 16);
    const __m256i ordered = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_ORD_Q));
    rounded = _mm256_blendv_epi8(_mm256_set1_epi32(0x7fc0), rounded, ordered);
    return _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
  }
  DS_TARGET static void st(Bf16* p, F x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bf16(x)); }

  DS_TARGET static F ld(const Half* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  DS_TARGET static void st(Half* p, F x) {
    const __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
  }
  DS_TARGET static void st(NoOut*, F) {}

  // Non-temporal stores for the bandwidth floor; the caller aligns p to the vector's width.
  DS_TARGET static void stream(float* p, F x) { _mm256_stream_ps(p, x); }
  DS_TARGET static void stream(Bf16* p, F x) { _mm_stream_si128(reinterpret_cast<__m128i*>(p), to_bf16(x)); }
  DS_TARGET static void stream(Half* p, F x) {
    const __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_stream_si128(reinterpret_cast<__m128i*>(p), h);
  }
  DS_TARGET static void fence() { _mm_sfence(); }

  DS_TARGET static F set1(float x) { return _mm256_set1_ps(x); }
  DS_TARGET static F add(F a, F b) { return _mm256_add_ps(a, b); }
  DS_TARGET static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  DS_TARGET static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  DS_TARGET static F div(F a, F b) { return _mm256_div_ps(a, b); }
  DS_TARGET static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  DS_TARGET static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
};

#include "adam_kernel.h"

}  // namespace

ds_adam::Kernels ds_adam::avx2_kernels() { return {"avx2", &adam_any, &floor_any}; }

#else

ds_adam::Kernels ds_adam::avx2_kernels() { return {"avx2", nullptr, nullptr}; }

#endif
