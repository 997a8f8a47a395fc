// KV-cache kernels: write new tokens' K and V into their slots, and gather a
// sequence's paged K and V back into contiguous rows (for prefill attention
// through a varlen attention function).
//
// Both only move bytes, so they work on 16-byte vectors whatever the element
// type: one token row of the cache (all KV heads) is
// num_kv_heads * head_dim * element_size bytes, contiguous.
#include "common.cuh"
#include "pdl.cuh"

namespace mini_vllm {
namespace {

constexpr int kCopyThreads = 128;

int element_size(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

// --8<-- [start:reshape_and_cache]
// One CTA per new token: copy its K row and V row (all KV heads) into slot
// slot_mapping[token] of the caches. Slot -1 marks a padding token: skipped.
__global__ void __launch_bounds__(kCopyThreads) reshape_and_cache_kernel(
    const uint4* __restrict__ key, const uint4* __restrict__ value, uint4* __restrict__ k_cache,
    uint4* __restrict__ v_cache, const int64_t* __restrict__ slot_mapping, int vecs_per_row,
    int64_t key_stride_vecs, int64_t value_stride_vecs) {
  const int token = blockIdx.x;
  pdl_launch_dependents();  // launched with PDL (pdl.cuh): key/value come from the kernel before
  pdl_wait();
  const int64_t slot = slot_mapping[token];
  if (slot < 0) return;
  const uint4* k_src = key + token * key_stride_vecs;
  const uint4* v_src = value + token * value_stride_vecs;
  uint4* k_dst = k_cache + slot * vecs_per_row;
  uint4* v_dst = v_cache + slot * vecs_per_row;
  for (int i = threadIdx.x; i < vecs_per_row; i += kCopyThreads) {
    k_dst[i] = k_src[i];
    v_dst[i] = v_src[i];
  }
}
// --8<-- [end:reshape_and_cache]

constexpr int kGatherTokens = 16;  // tokens per CTA

// Grid (token tiles, sequences). Output row of token t of sequence s is
// cu_seqlens[s] + t.
__global__ void __launch_bounds__(kCopyThreads) gather_kv_cache_kernel(
    uint4* __restrict__ k_out, uint4* __restrict__ v_out, const uint4* __restrict__ k_cache,
    const uint4* __restrict__ v_cache, const int32_t* __restrict__ block_tables,
    const int32_t* __restrict__ cu_seqlens, int vecs_per_row, int block_size, int log2_bs,
    int max_blocks_per_seq) {
  const int seq = blockIdx.y, t0 = blockIdx.x * kGatherTokens;
  const int row0 = cu_seqlens[seq];
  const int ctx = min(cu_seqlens[seq + 1] - row0, max_blocks_per_seq << log2_bs);
  const int tokens = min(kGatherTokens, ctx - t0);
  if (tokens <= 0) return;
  const int32_t* table = block_tables + static_cast<int64_t>(seq) * max_blocks_per_seq;
  for (int i = threadIdx.x; i < tokens * vecs_per_row; i += kCopyThreads) {
    const int t = t0 + i / vecs_per_row, v = i % vecs_per_row;
    const int64_t slot = static_cast<int64_t>(table[t >> log2_bs]) * block_size +
                         (t & (block_size - 1));
    const int64_t dst = static_cast<int64_t>(row0 + t) * vecs_per_row + v;
    k_out[dst] = k_cache[slot * vecs_per_row + v];
    v_out[dst] = v_cache[slot * vecs_per_row + v];
  }
}

void check_row_bytes(int64_t row_bytes) {
  if (row_bytes % 16 != 0) {
    throw std::invalid_argument("num_kv_heads * head_dim * element size must be a multiple of 16");
  }
}

}  // namespace

void reshape_and_cache(const CacheWriteParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return;
  const int64_t esize = element_size(p.dtype);
  const int64_t row_bytes = static_cast<int64_t>(p.num_kv_heads) * p.head_dim * esize;
  check_row_bytes(row_bytes);
  if ((p.key_stride * esize) % 16 != 0 || (p.value_stride * esize) % 16 != 0) {
    throw std::invalid_argument("key / value token strides must be multiples of 16 bytes");
  }
  launch_kernel(reshape_and_cache_kernel, dim3(p.num_tokens), dim3(kCopyThreads), 0, stream,
                "reshape_and_cache_kernel", static_cast<const uint4*>(p.key),
                static_cast<const uint4*>(p.value), static_cast<uint4*>(p.k_cache),
                static_cast<uint4*>(p.v_cache), p.slot_mapping,
                static_cast<int>(row_bytes / 16), p.key_stride * esize / 16,
                p.value_stride * esize / 16);
}

void gather_kv_cache(const GatherParams& p, cudaStream_t stream) {
  if (p.num_seqs == 0 || p.max_context_len == 0) return;
  const int64_t row_bytes =
      static_cast<int64_t>(p.num_kv_heads) * p.head_dim * element_size(p.dtype);
  check_row_bytes(row_bytes);
  const dim3 grid(ceil_div(p.max_context_len, kGatherTokens), p.num_seqs);
  gather_kv_cache_kernel<<<grid, kCopyThreads, 0, stream>>>(
      static_cast<uint4*>(p.k_out), static_cast<uint4*>(p.v_out),
      static_cast<const uint4*>(p.k_cache), static_cast<const uint4*>(p.v_cache),
      p.block_tables, p.cu_seqlens, static_cast<int>(row_bytes / 16), p.block_size,
      log2_exact(p.block_size), p.max_blocks_per_seq);
  MINI_VLLM_CHECK_LAUNCH("gather_kv_cache_kernel");
}

}  // namespace mini_vllm
