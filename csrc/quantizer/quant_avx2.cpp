// The block-wise int8 kernels compiled for x86-64 CPUs with AVX2 (quant_kernel.h's loops,
// vectorized by the compiler for this target; quantizer.cpp calls in only when the CPU has it).

#include <cstdint>
#include <cstring>

#include "quant_kernels.h"

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace ds_quant_avx2 {
#include "quant_kernel.h"
}  // namespace ds_quant_avx2
#pragma GCC pop_options

const ds_quant::Kernels& ds_quant::avx2_kernels() { return ds_quant_avx2::make_kernels("avx2"); }
#else
const ds_quant::Kernels& ds_quant::avx2_kernels() {
  static const Kernels none{"avx2", nullptr, nullptr, nullptr};
  return none;
}
#endif
