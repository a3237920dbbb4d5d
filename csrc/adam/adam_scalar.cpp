// The Adam kernel one element at a time, for CPUs with none of the vector paths (and as the
// reference the vector paths are tested against). Built for the baseline instruction set.

#include <cmath>
#include <cstring>

#include "adam_span.h"

namespace {

using ds_adam::Bf16;
using ds_adam::Half;
using ds_adam::NoOut;

#define DS_TARGET

struct V {
  using F = float;
  static constexpr int W = 1;

  static uint32_t bits_of(float x) {
    uint32_t b;
    std::memcpy(&b, &x, sizeof b);
    return b;
  }
  static float from_bits(uint32_t b) {
    float x;
    std::memcpy(&x, &b, sizeof x);
    return x;
  }
  // IEEE binary16 <-> binary32, round to nearest even (subnormals included).
  static float half_to_float(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
    const uint32_t exp = (h >> 10) & 0x1f;
    const uint32_t man = h & 0x3ff;
    if (exp == 0x1f) return from_bits(sign | 0x7f800000 | (man << 13));
    if (exp != 0) return from_bits(sign | ((exp + 112) << 23) | (man << 13));
    const float magnitude = std::ldexp(static_cast<float>(man), -24);  // subnormal or zero
    return sign ? -magnitude : magnitude;
  }
  static uint16_t float_to_half(float x) {
    const uint32_t b = bits_of(x);
    const uint16_t sign = static_cast<uint16_t>((b >> 16) & 0x8000);
    const float a = std::fabs(x);
    if (std::isnan(x)) return sign | 0x7e00;
    if (a >= 65520.0f) return sign | 0x7c00;  // rounds to infinity
    if (a < 6.103515625e-05f) {               // below the smallest normal half: subnormal
      return sign | static_cast<uint16_t>(std::nearbyint(a * 16777216.0f));  // units of 2^-24
    }
    const uint32_t ab = bits_of(a);
    const uint32_t lsb = (ab >> 13) & 1;
    const uint32_t rounded = ab + 0xfff + lsb;  // round the 13 dropped bits to nearest even
    return sign | static_cast<uint16_t>((rounded - (112u << 23)) >> 13);
  }

  static F ld(const float* p) { return *p; }
  static void st(float* p, F x) { *p = x; }
  static F ld(const Bf16* p) { return from_bits(static_cast<uint32_t>(p->bits) << 16); }
  static void st(Bf16* p, F x) {
    const uint32_t b = bits_of(x);
    p->bits = std::isnan(x) ? 0x7fc0 : static_cast<uint16_t>((b + 0x7fff + ((b >> 16) & 1)) >> 16);
  }
  static F ld(const Half* p) { return half_to_float(p->bits); }
  static void st(Half* p, F x) { p->bits = float_to_half(x); }
  static void st(NoOut*, F) {}

  // No non-temporal store here: the floor's streaming variant uses plain stores.
  template <class T>
  static void stream(T* p, F x) {
    st(p, x);
  }
  static void fence() {}

  static F set1(float x) { return x; }
  static F add(F a, F b) { return a + b; }
  static F sub(F a, F b) { return a - b; }
  static F mul(F a, F b) { return a * b; }
  static F div(F a, F b) { return a / b; }
  static F sqrt(F a) { return std::sqrt(a); }
  static F fmadd(F a, F b, F c) { return std::fma(a, b, c); }
};

#include "adam_kernel.h"

}  // namespace

ds_adam::Kernels ds_adam::scalar_kernels() { return {"scalar", &adam_any, &floor_any}; }
