// The per-block kernels of one instruction set (see quant_kernel.h) and where to find them.

#pragma once

#include <cstdint>

#define DS_QBLOCK 256  // elements per scale (deepspeed/ops/quantizer/int8.py's BLOCK)

namespace ds_quant {

struct Kernels {
  const char* name;  // "avx512", "avx2", "neon", "scalar"
  float (*quantize)(const float* x, int64_t len, int8_t* codes);
  void (*dequantize)(const int8_t* codes, float scale, int64_t len, float* out);
  void (*dequantize_add)(const int8_t* codes, float scale, int64_t len, float* out);
};

// Each returns kernels with null function pointers where its ISA was not compiled in.
const Kernels& avx512_kernels();
const Kernels& avx2_kernels();
const Kernels& neon_kernels();
const Kernels& scalar_kernels();

}  // namespace ds_quant
