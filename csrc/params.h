// Host-side interface of the kernels: plain structs and launcher declarations.
//
// Nothing here depends on PyTorch. Every tensor arrives as a raw device pointer
// with its sizes, the dtype as a small integer code, and the CUDA stream as an
// integer, so one build of the module works with any installed PyTorch.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace mini_vllm {

// Element type of the KV cache, the queries and the outputs.
enum class DType : int {
  kFloat16 = 0,
  kBFloat16 = 1,
  kFloat32 = 2,  // cache write and gather only
};

// Everything one paged decode-attention launch needs.
//
//   q            [num_seqs, num_q_heads, head_dim]     row stride q_stride (elements)
//   k/v_cache    [num_blocks, block_size, num_kv_heads, head_dim]   contiguous, or
//                (version 7) any layout of those four dimensions with head_dim
//                dense, given by kv_block/head/token_stride
//   block_tables [num_seqs, max_blocks_per_seq]  int32
//   context_lens [num_seqs]                       int32 (tokens to attend to, >= 0)
//   out          [num_seqs, num_q_heads, head_dim] contiguous
//   part_out     [num_seqs, num_q_heads, max_splits, head_dim] float32 (split-K only)
//   part_ml      [num_seqs, num_q_heads, max_splits, 2]        float32 (split-K only)
//   counters     [num_seqs, num_q_heads / heads per CTA]     int32, zero (version 8 only)
//   seq_order    [num_seqs] int32, a permutation of 0 .. num_seqs - 1 (optional)
//
// Version 8 uses part_out / part_ml as two slots per CTA of a persistent grid
// of at most max_splits CTAs: [2 max_splits, heads per CTA, head_dim] and
// [2 max_splits, heads per CTA, 2]. Its counters must be zero before a launch
// and are zero again after it.
struct DecodeParams {
  void* out = nullptr;
  const void* q = nullptr;
  const void* k_cache = nullptr;
  const void* v_cache = nullptr;
  const int32_t* block_tables = nullptr;
  const int32_t* context_lens = nullptr;
  float* part_out = nullptr;
  float* part_ml = nullptr;
  int32_t* counters = nullptr;
  // Version 7: the order in which the grid takes the sequences when it has
  // more CTAs than fit on the GPU at once (null: 0, 1, 2, ...). The engine
  // lists the longest contexts first, so that the CTAs of the last wave are
  // the shortest (chapter 9). The output does not depend on it.
  const int32_t* seq_order = nullptr;
  // Blocks in k/v_cache (version 9 describes the whole cache to the TMA).
  int64_t num_blocks = 0;
  int num_seqs = 0;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int block_size = 0;
  int max_blocks_per_seq = 0;
  int64_t q_stride = 0;
  // Element strides of the KV cache's block, KV head and token dimensions
  // (K and V alike). 0: the contiguous layout above, token-major in a block
  // ([block][token][head][dim]). Version 7 also reads a head-major cache
  // ([block][head][token][dim]: one head's rows of a block are contiguous).
  int64_t kv_block_stride = 0;
  int64_t kv_head_stride = 0;
  int64_t kv_token_stride = 0;
  int max_context_len = 0;
  // Tokens per split (a power of two); splits = ceil(context_len / partition_size).
  int partition_size = 0;
  int max_splits = 1;
  float scale = 1.0f;
  DType dtype = DType::kBFloat16;
  // Tokens per lane per step in versions 4 and 5 (0: the built-in default);
  // warps per CTA in version 7.
  int unroll = 0;
  // Version 5 only, sm_90+: launch the CTAs of one (split, sequence) that
  // serve neighbouring KV heads as a thread-block cluster of this many CTAs,
  // so they run at the same time (0: no cluster). An experiment in locality.
  int cluster = 0;
  // Query heads one CTA serves (1, 2, 4 or 8, dividing the GQA group);
  // 0: the largest that divides the group.
  int heads_per_cta = 0;
  // Versions 6 and 7: shared-memory stages of the cp.async ring (0: default).
  int stages = 0;
};

// `p` with the KV strides filled in: those of the contiguous token-major
// cache where they are 0.
inline DecodeParams with_kv_strides(const DecodeParams& p) {
  DecodeParams q = p;
  if (q.kv_token_stride == 0 && q.kv_head_stride == 0 && q.kv_block_stride == 0) {
    q.kv_head_stride = q.head_dim;
    q.kv_token_stride = static_cast<int64_t>(q.num_kv_heads) * q.head_dim;
    q.kv_block_stride = q.kv_token_stride * q.block_size;
  }
  return q;
}

// Whether the KV cache is the contiguous token-major layout (all versions
// read it; only version 7 reads another).
inline bool kv_token_major(const DecodeParams& p) {
  const DecodeParams q = with_kv_strides(p);
  return q.kv_head_stride == q.head_dim &&
         q.kv_token_stride == static_cast<int64_t>(q.num_kv_heads) * q.head_dim &&
         q.kv_block_stride == q.kv_token_stride * q.block_size;
}

// One launcher per numbered version of the decode kernel (see the chapter).
void paged_attention_v1(const DecodeParams& p, cudaStream_t stream);
void paged_attention_v2(const DecodeParams& p, cudaStream_t stream);
void paged_attention_v3(const DecodeParams& p, cudaStream_t stream);
void paged_attention_v4(const DecodeParams& p, cudaStream_t stream);
void paged_attention_v5(const DecodeParams& p, cudaStream_t stream);
void paged_attention_v6(const DecodeParams& p, cudaStream_t stream);
void paged_attention_v7(const DecodeParams& p, cudaStream_t stream);
void paged_attention_v8(const DecodeParams& p, cudaStream_t stream);
void paged_attention_v9(const DecodeParams& p, cudaStream_t stream);

// New tokens' K and V into their cache slots (slot -1: skip).
struct CacheWriteParams {
  const void* key = nullptr;    // [num_tokens, num_kv_heads, head_dim], token stride key_stride
  const void* value = nullptr;  // same shape, token stride value_stride
  void* k_cache = nullptr;      // [num_blocks, block_size, num_kv_heads, head_dim]
  void* v_cache = nullptr;
  const int64_t* slot_mapping = nullptr;  // [num_tokens]
  int num_tokens = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int64_t key_stride = 0;
  int64_t value_stride = 0;
  DType dtype = DType::kBFloat16;
};
void reshape_and_cache(const CacheWriteParams& p, cudaStream_t stream);

// Gather each sequence's first context_len tokens of K and V out of the paged
// cache into contiguous [total_tokens, num_kv_heads, head_dim] tensors, sequence
// after sequence (the layout varlen attention wants).
struct GatherParams {
  void* k_out = nullptr;
  void* v_out = nullptr;
  const void* k_cache = nullptr;
  const void* v_cache = nullptr;
  const int32_t* block_tables = nullptr;  // [num_seqs, max_blocks_per_seq]
  const int32_t* cu_seqlens = nullptr;    // [num_seqs + 1] prefix sums of context lengths
  int num_seqs = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int block_size = 0;
  int max_blocks_per_seq = 0;
  int max_context_len = 0;
  DType dtype = DType::kBFloat16;
};
void gather_kv_cache(const GatherParams& p, cudaStream_t stream);

// A decode step's inputs from a pinned host mirror into a graph's static
// buffers (csrc/step_inputs.cu): the packed rows, the block table, then
// ids[row] = prev[src] for each (row, src) of `fixes`.
struct StageParams {
  void* dst = nullptr;          // device: the packed rows
  const void* src = nullptr;    // pinned host: the same bytes
  int64_t nbytes = 0;
  int32_t* table_dst = nullptr;        // device [table_rows, table_pitch]
  const int32_t* table_src = nullptr;  // pinned host [table_rows, table_width]
  int64_t table_rows = 0;
  int64_t table_width = 0;
  int64_t table_pitch = 0;
  int64_t* ids = nullptr;             // device: the input ids the fixes write
  const int64_t* fixes = nullptr;     // device [num_fixes, 2]: (row of ids, row of prev)
  const int64_t* prev = nullptr;      // device: the previous step's sampled ids
  int num_fixes = 0;
};
void stage_step_inputs(const StageParams& p, cudaStream_t stream);

}  // namespace mini_vllm
