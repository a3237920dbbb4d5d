// The block-wise int8 kernels compiled for x86-64 CPUs with AVX512 (quant_kernel.h's loops,
// vectorized by the compiler for this target; quantizer.cpp calls in only when the CPU has it).

#include <cstdint>
#include <cstring>

#include "quant_kernels.h"

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")
namespace ds_quant_avx512 {
#include "quant_kernel.h"
}  // namespace ds_quant_avx512
#pragma GCC pop_options

const ds_quant::Kernels& ds_quant::avx512_kernels() { return ds_quant_avx512::make_kernels("avx512"); }
#else
const ds_quant::Kernels& ds_quant::avx512_kernels() {
  static const Kernels none{"avx512", nullptr, nullptr, nullptr};
  return none;
}
#endif
