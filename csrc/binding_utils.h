// Conversions shared by the binding files: Python ints -> device pointers,
// CUDA streams and element types.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include <cuda_runtime_api.h>

#include "params.h"

namespace mini_vllm {

template <typename P>
inline P* as_ptr(std::uintptr_t p) {
  return reinterpret_cast<P*>(p);
}

inline cudaStream_t as_stream(std::uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

inline DType as_dtype(int code) {
  if (code < 0 || code > 2) throw std::invalid_argument("unknown dtype code " + std::to_string(code));
  return static_cast<DType>(code);
}

}  // namespace mini_vllm
