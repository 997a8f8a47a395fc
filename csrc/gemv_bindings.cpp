// Python binding of the skinny-GEMM kernel, registered into mini_vllm._C by
// bindings.cpp. Same raw-pointer convention as the attention kernels.
#include <cstdint>

#include <pybind11/pybind11.h>

#include "binding_utils.h"
#include "gemv_params.h"

namespace py = pybind11;

namespace mini_vllm {
namespace {

// Both products take the same arguments (GemvParams).
GemvParams params(std::uintptr_t y, std::uintptr_t x, std::uintptr_t w, int rows, int n, int k,
                  int64_t x_stride, int dtype, int splits, bool accumulate, bool silu_mul,
                  float silu_eps) {
  GemvParams p;
  p.y = as_ptr<void>(y);
  p.x = as_ptr<const void>(x);
  p.w = as_ptr<const void>(w);
  p.m = rows;
  p.n = n;
  p.k = k;
  p.x_stride = x_stride;
  p.dtype = as_dtype(dtype);
  p.splits = splits;
  p.accumulate = accumulate;
  p.silu_mul = silu_mul;
  p.silu_eps = silu_eps;
  return p;
}

}  // namespace

void register_gemv_ops(py::module_& m) {
  m.attr("GEMV_MAX_ROWS") = kGemvMaxRows;
  m.def(
      "gemv",
      [](std::uintptr_t y, std::uintptr_t x, std::uintptr_t w, int rows, int n, int k,
         int64_t x_stride, int dtype, std::uintptr_t stream, int splits, bool accumulate,
         bool silu_mul, float silu_eps) {
        gemv(params(y, x, w, rows, n, k, x_stride, dtype, splits, accumulate, silu_mul,
                    silu_eps),
             as_stream(stream));
      },
      "y[rows, n] = x[rows, k] @ w[n, k]^T (y += ... with accumulate; SiLU · mul of the "
      "scaled [gate; up] with silu_mul) for 1 to GEMV_MAX_ROWS rows (see GemvParams).",
      py::arg("y"), py::arg("x"), py::arg("w"), py::arg("rows"), py::arg("n"), py::arg("k"),
      py::arg("x_stride"), py::arg("dtype"), py::arg("stream"), py::arg("splits") = 0,
      py::arg("accumulate") = false, py::arg("silu_mul") = false, py::arg("silu_eps") = 0.f);

  m.attr("GEMM_MAX_ROWS") = kGemmMaxRows;
  m.def("wgmma_gemm_supported", &wgmma_gemm_supported,
        "Whether gemm_wgmma can run: an sm_90 GPU and a module built for sm_90a.");
  m.def(
      "gemm_wgmma",
      [](std::uintptr_t y, std::uintptr_t x, std::uintptr_t w, int rows, int n, int k,
         int64_t x_stride, int dtype, std::uintptr_t stream, int splits, bool accumulate,
         int rows_per_cta, int tile_n, bool silu_mul, float silu_eps) {
        GemvParams p = params(y, x, w, rows, n, k, x_stride, dtype, splits, accumulate,
                              silu_mul, silu_eps);
        p.rows_per_cta = rows_per_cta;
        p.tile_n = tile_n;
        gemm_wgmma(p, as_stream(stream));
      },
      "y[rows, n] = x[rows, k] @ w[n, k]^T (y += ... with accumulate; SiLU · mul of the "
      "scaled [gate; up] with silu_mul) for 1 to GEMM_MAX_ROWS rows on sm_90a (TMA + wgmma; "
      "see csrc/gemm_wgmma.cu).",
      py::arg("y"), py::arg("x"), py::arg("w"), py::arg("rows"), py::arg("n"), py::arg("k"),
      py::arg("x_stride"), py::arg("dtype"), py::arg("stream"), py::arg("splits") = 0,
      py::arg("accumulate") = false, py::arg("rows_per_cta") = 0, py::arg("tile_n") = 0,
      py::arg("silu_mul") = false, py::arg("silu_eps") = 0.f);
}

}  // namespace mini_vllm
