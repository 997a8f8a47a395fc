// Python binding of the skinny-GEMM kernel, registered into mini_vllm._C by
// bindings.cpp. Same raw-pointer convention as the attention kernels.
#include <cstdint>

#include <pybind11/pybind11.h>

#include "binding_utils.h"
#include "gemv_params.h"

namespace py = pybind11;

namespace mini_vllm {

void register_gemv_ops(py::module_& m) {
  m.attr("GEMV_MAX_ROWS") = kGemvMaxRows;
  m.def(
      "gemv",
      [](std::uintptr_t y, std::uintptr_t x, std::uintptr_t w, int rows, int n, int k,
         int64_t x_stride, int dtype, std::uintptr_t stream, int splits, bool accumulate) {
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
        gemv(p, as_stream(stream));
      },
      "y[rows, n] = x[rows, k] @ w[n, k]^T (y += ... with accumulate) for 1 to GEMV_MAX_ROWS "
      "rows (see GemvParams).", py::arg("y"),
      py::arg("x"), py::arg("w"), py::arg("rows"), py::arg("n"), py::arg("k"),
      py::arg("x_stride"), py::arg("dtype"), py::arg("stream"), py::arg("splits") = 0,
      py::arg("accumulate") = false);
}

}  // namespace mini_vllm
