// The block-wise int8 kernels for 64-bit Arm (NEON is part of the baseline there, so the
// compiler vectorizes quant_kernel.h's loops without a target pragma).

#include <cstdint>
#include <cstring>

#include "quant_kernels.h"

#if defined(__aarch64__)
namespace ds_quant_neon {
#include "quant_kernel.h"
}  // namespace ds_quant_neon

const ds_quant::Kernels& ds_quant::neon_kernels() { return ds_quant_neon::make_kernels("neon"); }
#else
const ds_quant::Kernels& ds_quant::neon_kernels() {
  static const Kernels none{"neon", nullptr, nullptr, nullptr};
  return none;
}
#endif
