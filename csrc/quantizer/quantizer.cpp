// Python bindings of the fused block-wise int8 quantizer (ZeRO++ qwZ and qgZ).
//
// One payload row is `nb` blocks of DS_QBLOCK int8 codes followed by the `nb` fp32 scales'
// bytes (deepspeed/ops/quantizer/int8.py's note on the layout). Each call makes one pass:
// `quantize_into` reads a row of floats and writes its codes and scales straight into the
// payload (no padded copy, no concatenation); `dequantize_into` writes floats;
// `dequantize_sum_into` sums the rows' dequantized values in row order (a reduce-scatter's
// sum) without materialising any row. The blocks are shared out between torch's OpenMP
// threads (at::parallel_for; torch.set_num_threads applies).
//
// The per-block loops (quant_kernel.h) are compiled for AVX-512, AVX2, NEON and the baseline;
// the widest the CPU supports runs, or the one named by DS_QUANTIZER_ISA; `set_isa` switches
// at run time (the tests run every path the machine supports, and they agree bit for bit).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "../common/isa_registry.h"
#include "quant_kernels.h"

namespace {

using ds_quant::Kernels;

constexpr int64_t kBlock = DS_QBLOCK;
constexpr int64_t kRowBytesPerBlock = kBlock + 4;  // codes and one fp32 scale
// Blocks per task: 64 blocks are 64 KiB of floats, enough to pay for waking a thread.
constexpr int64_t kGrain = 64;

bool cpu_supports(const std::string& isa) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  if (isa == "avx512") {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  }
  if (isa == "avx2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  return isa == "scalar" || (isa == "neon" && ds_quant::neon_kernels().quantize != nullptr);
}

bool usable(const Kernels& k) { return k.quantize != nullptr && cpu_supports(k.name); }

// The builds this CPU runs, best first, and the active one (DS_QUANTIZER_ISA if set, else the best).
ds_isa::Registry<Kernels>& kernels() {
  static ds_isa::Registry<Kernels> registry(
      "quantizer",
      {ds_quant::avx512_kernels(), ds_quant::avx2_kernels(), ds_quant::neon_kernels(), ds_quant::scalar_kernels()},
      usable, "DS_QUANTIZER_ISA");
  return registry;
}

const Kernels* active() { return &kernels().active(); }

std::vector<std::string> available_isas() { return kernels().names(); }

std::string isa() { return active()->name; }

std::string set_isa(const std::string& name) { return kernels().set(name); }

// A 2D CPU tensor of `dtype` whose rows are contiguous (any row stride).
void check_rows(const at::Tensor& t, at::ScalarType dtype, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), "quantizer: ", what, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, "quantizer: ", what, " must be ", c10::toString(dtype), ", got ",
              t.scalar_type());
  TORCH_CHECK(t.dim() == 2 && (t.size(1) <= 1 || t.stride(1) == 1), "quantizer: ", what,
              " must be 2D with contiguous rows, got sizes ", t.sizes(), " strides ", t.strides());
}

// Blocks per payload row, from its width in bytes.
int64_t blocks_of_payload(const at::Tensor& payload) {
  const int64_t width = payload.size(1);
  TORCH_CHECK(width % kRowBytesPerBlock == 0, "quantizer: a payload row is a multiple of ", kRowBytesPerBlock,
              " bytes (", kBlock, " codes and a 4-byte scale per block), got ", width);
  return width / kRowBytesPerBlock;
}

// x [rows, n] fp32 -> payload [rows, nb * (kBlock + 4)] int8, nb = ceil(n / kBlock).
void quantize_into(const at::Tensor& x, at::Tensor& payload) {
  check_rows(x, at::kFloat, "x");
  check_rows(payload, at::kChar, "payload");
  const int64_t rows = x.size(0), n = x.size(1), nb = (n + kBlock - 1) / kBlock;
  TORCH_CHECK(payload.size(0) == rows && payload.size(1) == nb * kRowBytesPerBlock, "quantizer: payload for x ",
              x.sizes(), " must be [", rows, ", ", nb * kRowBytesPerBlock, "], got ", payload.sizes());
  const Kernels& k = *active();
  const float* xs = x.data_ptr<float>();
  int8_t* ps = payload.data_ptr<int8_t>();
  const int64_t xstride = x.stride(0), pstride = payload.stride(0);
  at::parallel_for(0, rows * nb, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / nb, b = i % nb;
      const int64_t len = std::min(kBlock, n - b * kBlock);
      int8_t* row = ps + r * pstride;
      const float scale = k.quantize(xs + r * xstride + b * kBlock, len, row + b * kBlock);
      std::memcpy(row + nb * kBlock + 4 * b, &scale, sizeof scale);
    }
  });
}

float scale_at(const int8_t* row, int64_t nb, int64_t b) {
  float scale;
  std::memcpy(&scale, row + nb * kBlock + 4 * b, sizeof scale);
  return scale;
}

// payload [rows, nb * (kBlock + 4)] -> out [rows, n] fp32, n <= nb * kBlock.
void dequantize_into(const at::Tensor& payload, at::Tensor& out) {
  check_rows(payload, at::kChar, "payload");
  check_rows(out, at::kFloat, "out");
  const int64_t rows = payload.size(0), nb = blocks_of_payload(payload), n = out.size(1);
  TORCH_CHECK(out.size(0) == rows && n <= nb * kBlock && n > (nb - 1) * kBlock, "quantizer: out for a payload of ",
              rows, " rows of ", nb, " blocks must be [", rows, ", n] with ", (nb - 1) * kBlock, " < n <= ",
              nb * kBlock, ", got ", out.sizes());
  const Kernels& k = *active();
  const int8_t* ps = payload.data_ptr<int8_t>();
  float* os = out.data_ptr<float>();
  const int64_t pstride = payload.stride(0), ostride = out.stride(0);
  at::parallel_for(0, rows * nb, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / nb, b = i % nb;
      const int8_t* row = ps + r * pstride;
      k.dequantize(row + b * kBlock, scale_at(row, nb, b), std::min(kBlock, n - b * kBlock),
                   os + r * ostride + b * kBlock);
    }
  });
}

// payload [rows, nb * (kBlock + 4)] -> out [n] fp32: the rows' dequantized values summed in row order.
void dequantize_sum_into(const at::Tensor& payload, at::Tensor& out) {
  check_rows(payload, at::kChar, "payload");
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kFloat && out.dim() == 1 && out.is_contiguous(),
              "quantizer: out must be a contiguous 1D fp32 CPU tensor, got ", out.scalar_type(), " ", out.sizes());
  const int64_t rows = payload.size(0), nb = blocks_of_payload(payload), n = out.size(0);
  TORCH_CHECK(rows >= 1 && n <= nb * kBlock && n > (nb - 1) * kBlock, "quantizer: out for ", nb,
              " blocks must have n elements with ", (nb - 1) * kBlock, " < n <= ", nb * kBlock, ", got ", n);
  const Kernels& k = *active();
  const int8_t* ps = payload.data_ptr<int8_t>();
  float* os = out.data_ptr<float>();
  const int64_t pstride = payload.stride(0);
  at::parallel_for(0, nb, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t len = std::min(kBlock, n - b * kBlock);
      float* dst = os + b * kBlock;
      k.dequantize(ps + b * kBlock, scale_at(ps, nb, b), len, dst);
      for (int64_t r = 1; r < rows; ++r) {
        const int8_t* row = ps + r * pstride;
        k.dequantize_add(row + b * kBlock, scale_at(row, nb, b), len, dst);
      }
    }
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Block-wise int8 quantize / dequantize / dequantize-and-sum (ZeRO++ qwZ, qgZ)";
  m.def("quantize_into", &quantize_into, "x [rows, n] fp32 -> payload [rows, nb * 260] int8", py::arg("x"),
        py::arg("payload"));
  m.def("dequantize_into", &dequantize_into, "payload [rows, nb * 260] int8 -> out [rows, n] fp32",
        py::arg("payload"), py::arg("out"));
  m.def("dequantize_sum_into", &dequantize_sum_into, "payload [rows, nb * 260] int8 -> out [n] fp32, summed",
        py::arg("payload"), py::arg("out"));
  m.def("isa", &isa, "The instruction set the kernels run on");
  m.def("set_isa", &set_isa, "Switch instruction set; returns the previous one", py::arg("name"));
  m.def("available_isas", &available_isas, "Instruction sets this CPU supports, best first");
}
