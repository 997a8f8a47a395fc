// Host-side interface of the skinny-GEMM kernel (csrc/gemv.cu).
//
// Like params.h: raw device pointers, sizes and a dtype code; no PyTorch.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "params.h"

namespace mini_vllm {

// The most activation rows one launch takes: a decode step of up to 16
// sequences. Larger batches go to cuBLAS: with four column tiles (32 rows)
// a version of this kernel made a Qwen3-0.6B decode step's linear layers
// slower than cuBLAS, its registers leaving room for too few loads in flight.
constexpr int kGemvMaxRows = 16;

// y = x @ w^T for a few rows of x, as nn.Linear computes it (no bias):
//   x  [m, k]  row stride x_stride (elements, a multiple of 8), rows dense
//   w  [n, k]  contiguous: nn.Linear's weight, [out_features, in_features]
//   y  [m, n]  contiguous
// x, w and y share one dtype (float16 or bfloat16); products are summed in
// float32 and each output is rounded once, as cuBLAS does. k is a multiple
// of 8 and x, w are 16-byte aligned: every load is a 16-byte vector.
struct GemvParams {
  void* y = nullptr;
  const void* x = nullptr;
  const void* w = nullptr;
  int m = 0;  // 1 .. kGemvMaxRows
  int n = 0;
  int k = 0;
  int64_t x_stride = 0;
  DType dtype = DType::kBFloat16;
  // Warps that share one tile of 16 output rows, each summing a slice of k
  // (1, 2, 4, 8 or 16); 0: the kernel's choice (choose_splits in gemv.cu).
  int splits = 0;
  // y += x @ w^T instead of y = x @ w^T (y read, the sum rounded once).
  bool accumulate = false;
  // gemm_wgmma only: rows of x per CTA, 128 or 256; 0: the kernel's choice.
  int rows_per_cta = 0;
  // gemm_wgmma only: output features per CTA, 64 or 128; 0: the kernel's choice.
  int tile_n = 0;
  // w is gate_up_proj's [gate; up] (n = 2 d rows, d a multiple of 8) with the
  // post-attention norm's weight folded in, and x the residual stream itself:
  // y [m, d] = silu(s * x @ gate^T) * (s * x @ up^T), s = 1 / sqrt(mean(x^2) +
  // silu_eps) per row, rounded as silu_and_mul rounds it (silu_mul.cuh).
  // Not with accumulate.
  bool silu_mul = false;
  float silu_eps = 0.f;
};

void gemv(const GemvParams& p, cudaStream_t stream);

// The same product for up to 256 rows on Hopper (csrc/gemm_wgmma.cu): the
// decode steps of 17 to 256 sequences. Takes GemvParams with 1 <= m <=
// kGemmMaxRows, n a multiple of 128, k a multiple of 64, x_stride a multiple
// of 8; `splits` is the number of CTAs of a cluster that share a tile of
// outputs, each summing a slice of k (1 to 16), `rows_per_cta` the rows of x
// a CTA takes (128 or 256) and `tile_n` its outputs (128 or 64); 0 for any:
// the kernel's choice (choose_plan, at most kGemmDefaultMaxSplits splits).
constexpr int kGemmMaxRows = 256;
constexpr int kGemmDefaultMaxSplits = 8;
bool wgmma_gemm_supported();  // an sm_90 GPU, and the module built for sm_90a
void gemm_wgmma(const GemvParams& p, cudaStream_t stream);

}  // namespace mini_vllm
