// Host-side interface of the fused layer kernels (csrc/layer_kernels.cu).
//
// Like params.h: raw device pointers, sizes and a dtype code; no PyTorch.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "params.h"

namespace mini_vllm {

// y = w * rms_norm(x); with `residual` set: residual = x + residual first
// (in place) and the norm is taken of the new residual.
//   x         [num_tokens, hidden]  row stride x_stride (elements)
//   residual  [num_tokens, hidden]  contiguous, or nullptr
//   weight    [hidden]
//   out       [num_tokens, hidden]  row stride out_stride (may alias x)
struct RmsNormParams {
  void* out = nullptr;
  void* residual = nullptr;
  const void* x = nullptr;
  const void* weight = nullptr;
  int num_tokens = 0;
  int hidden = 0;
  int64_t x_stride = 0;
  int64_t out_stride = 0;
  float eps = 1e-6f;
  DType dtype = DType::kBFloat16;
};

// Per-head RMSNorm then neox rotary embedding of the q and k heads of a fused
// qkv projection output, in place. With slot_mapping set, each token's k heads
// (as written back) and v heads are also stored in its cache slot, as
// reshape_and_cache stores them: one launch instead of two.
//   qkv            [num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim], row stride token_stride
//   q/k_weight     [head_dim]
//   cos_sin_cache  [max_position, head_dim] float32: cos in the first half, sin in the second
//   positions      [num_tokens] int64
//   k/v_cache      [num_blocks, block_size, num_kv_heads, head_dim] contiguous, qkv's dtype
//   slot_mapping   [num_tokens] int64, block * block_size + offset; < 0: not stored
//   residual       [num_tokens, hidden] contiguous, or nullptr: with the norms folded into
//                  qkv_proj, q, k and v are first multiplied by each token's
//                  1 / sqrt(mean(residual^2) + residual_eps), and v is written back too
struct QkNormRopeParams {
  void* qkv = nullptr;
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  const int64_t* slot_mapping = nullptr;  // nullptr: q and k in place only
  const void* q_weight = nullptr;
  const void* k_weight = nullptr;
  const float* cos_sin_cache = nullptr;
  const int64_t* positions = nullptr;
  const void* residual = nullptr;
  int hidden = 0;
  float residual_eps = 1e-6f;
  int num_tokens = 0;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int64_t token_stride = 0;
  float eps = 1e-6f;
  DType dtype = DType::kBFloat16;
  // Heads per warp: 1, 2 or 4; 0: the kernel's choice (2 from
  // kQkNormWideTokens tokens, else 1).
  int heads_per_warp = 0;
};
constexpr int kQkNormWideTokens = 1024;

// out = silu(x[:, :d]) * x[:, d:]
//   x         [num_tokens, 2 * d] contiguous
//   out       [num_tokens, d]     contiguous
//   residual  [num_tokens, hidden] contiguous, or nullptr: with the norm folded into
//             gate_up_proj, x is first multiplied by each row's
//             1 / sqrt(mean(residual^2) + residual_eps)
struct SiluAndMulParams {
  void* out = nullptr;
  const void* x = nullptr;
  const void* residual = nullptr;
  int hidden = 0;
  float residual_eps = 1e-6f;
  int num_tokens = 0;
  int d = 0;
  DType dtype = DType::kBFloat16;
};

// One token per row of softmax(logits[r] * inv_temperature[r]) by a two-level
// Gumbel-max race (csrc/sampling_kernels.cu); inv_temperature[r] == 0 makes row
// r greedy.
//   logits           [num_rows, vocab] row stride row_stride; -inf = excluded
//   inv_temperature  [num_rows] float32
//   seeds            [num_rows, 2] int64: the row's noise key and counter
//   partials         [num_rows, num_chunks] float32 workspace, num_chunks =
//                    ceil(vocab / kSampleChunk): each chunk's log-sum-exp of
//                    logits * inv_temperature (its maximum for a greedy row)
//   out              [num_rows] int64
constexpr int kSampleChunk = 4096;
struct SampleParams {
  int64_t* out = nullptr;
  float* partials = nullptr;
  const void* logits = nullptr;
  const float* inv_temperature = nullptr;
  const int64_t* seeds = nullptr;
  int num_rows = 0;
  int vocab = 0;
  int num_chunks = 1;
  int64_t row_stride = 0;
  DType dtype = DType::kBFloat16;
};

void rms_norm(const RmsNormParams& p, cudaStream_t stream);
void qk_norm_rope(const QkNormRopeParams& p, cudaStream_t stream);
void silu_and_mul(const SiluAndMulParams& p, cudaStream_t stream);
void sample_tokens(const SampleParams& p, cudaStream_t stream);

}  // namespace mini_vllm
