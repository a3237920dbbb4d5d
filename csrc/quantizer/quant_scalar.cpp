// The block-wise int8 kernels one element at a time, for CPUs with none of the vector paths
// (and as the reference the vector paths are tested against).

#include <cstdint>
#include <cstring>

#include "quant_kernels.h"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("no-tree-vectorize")
#endif
namespace ds_quant_scalar {
#include "quant_kernel.h"
}  // namespace ds_quant_scalar
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

const ds_quant::Kernels& ds_quant::scalar_kernels() { return ds_quant_scalar::make_kernels("scalar"); }
