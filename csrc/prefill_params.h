// Host-side interface of the Hopper prefill-attention kernel (csrc/flash_prefill.cu).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "params.h"

namespace mini_vllm {

// Causal varlen attention of packed sequences, grouped-query heads, head_dim 128.
//
//   q    [total_q, num_q_heads, 128]   token stride q_stride (elements), heads dense
//   k/v  [total_k, num_kv_heads, 128]  token strides k_stride / v_stride
//   cu_q [num_seqs + 1] int32          query rows of seq i: cu_q[i] .. cu_q[i + 1]
//   cu_k [num_seqs + 1] int32          key rows of seq i: cu_k[i] .. cu_k[i + 1]
//   out  [total_q, num_q_heads, 128]   contiguous
//
// Each sequence has at least as many keys as queries; query j of a sequence
// sees keys 0 .. k_len - q_len + j. max_q bounds every q_len (it sizes the grid).
//
// Paged (block_tables set): k/v are the cache [num_blocks, block_size,
// num_kv_heads, 128], contiguous, block_size a power of two from 16 to 256;
// seq i's key t lies in block block_tables[i * max_blocks_per_seq + t / block_size],
// and cu_k gives each sequence's key count only (k_stride, v_stride, total_k unused).
struct PrefillParams {
  void* out = nullptr;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const int32_t* cu_q = nullptr;
  const int32_t* cu_k = nullptr;
  int num_seqs = 0;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int total_q = 0;
  int total_k = 0;
  int64_t q_stride = 0;
  int64_t k_stride = 0;
  int64_t v_stride = 0;
  int max_q = 0;
  float scale = 1.f;
  const int32_t* block_tables = nullptr;  // null: k/v are packed rows
  int max_blocks_per_seq = 0;
  int block_size = 0;
  int64_t num_blocks = 0;
  DType dtype = DType::kBFloat16;
};

// Whether flash_prefill can run: an sm_90 GPU and a module built for sm_90a.
bool flash_prefill_supported();
void flash_prefill(const PrefillParams& p, cudaStream_t stream);

}  // namespace mini_vllm
