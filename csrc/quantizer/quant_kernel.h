// The block-wise int8 kernels, written once as plain loops and compiled once per instruction
// set: each quant_<isa>.cpp selects its target with `#pragma GCC target` and includes this
// file inside its own namespace, so the compiler vectorizes the same source for that ISA.
//
// [Note: bitwise equal to the torch path]
// Every float operation here is one IEEE operation the torch fallback
// (deepspeed/ops/quantizer/int8.py) also does, in the same order, so the results are equal
// bit for bit on every path (the library is built with -ffp-contract=off: no fused
// multiply-adds):
// - scale = max|x| / 127 (a division, as torch's `amax / 127`); |x| is compared as the bits
//   of x without its sign, which orders finite floats as their magnitudes;
// - code = x / scale, clamped to [-127, 127], then rounded to nearest even: adding and
//   subtracting 1.5 * 2^23 rounds any |v| <= 127 in the default rounding mode, the same as
//   torch.round; clamping first and rounding after gives what rounding then clamping gives,
//   since the bounds are integers. A block whose scale is 0 has codes 0 (torch divides by
//   1 there, and |x| / 1 <= 127 * 2^-150 rounds to 0).
// - dequantized = float(code) * scale; a sum over rows adds them in row order, starting
//   from row 0's values.
// Non-finite inputs are not part of that promise: a block holding inf or NaN gets a
// non-finite scale, so its dequantized values are non-finite on both paths (an overflow is
// still seen), but not necessarily the same ones.

// Expects <cstdint> and <cstring>, and DS_QBLOCK, included by the caller.

static inline uint32_t magnitude_bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b & 0x7fffffffu;
}

// One block of `len` (<= DS_QBLOCK) floats -> DS_QBLOCK codes (the tail zero) and its scale.
static inline float quantize_block(const float* x, int64_t len, int8_t* codes) {
  uint32_t top = 0;
  for (int64_t i = 0; i < len; ++i) {
    const uint32_t m = magnitude_bits(x[i]);
    top = m > top ? m : top;
  }
  float amax;
  std::memcpy(&amax, &top, sizeof amax);
  const float scale = amax / 127.0f;
  if (scale == 0.0f) {
    std::memset(codes, 0, DS_QBLOCK);
    return scale;
  }
  const float magic = 12582912.0f;  // 1.5 * 2^23
  for (int64_t i = 0; i < len; ++i) {
    float v = x[i] / scale;
    v = v > 127.0f ? 127.0f : v;
    v = v < -127.0f ? -127.0f : v;
    v = (v + magic) - magic;
    codes[i] = static_cast<int8_t>(static_cast<int32_t>(v));
  }
  if (len < DS_QBLOCK) std::memset(codes + len, 0, DS_QBLOCK - len);
  return scale;
}

// `len` values of one block: out[i] = float(codes[i]) * scale.
static inline void dequantize_block(const int8_t* codes, float scale, int64_t len, float* out) {
  for (int64_t i = 0; i < len; ++i) out[i] = static_cast<float>(codes[i]) * scale;
}

// `len` values of one block added: out[i] += float(codes[i]) * scale.
static inline void dequantize_add_block(const int8_t* codes, float scale, int64_t len, float* out) {
  for (int64_t i = 0; i < len; ++i) out[i] = out[i] + static_cast<float>(codes[i]) * scale;
}

static const ds_quant::Kernels& make_kernels(const char* name) {
  static const ds_quant::Kernels k{name, &quantize_block, &dequantize_block, &dequantize_add_block};
  return k;
}
