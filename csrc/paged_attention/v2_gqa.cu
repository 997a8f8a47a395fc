// Version 2: one CTA per KV head, 16-byte loads, one pass.
//
// Changes from version 1:
//   * GQA: a CTA serves all the query heads that share one KV head, so each
//     K/V row is read from memory once instead of once per query head.
//   * 16-byte loads: a token row of one KV head is split over head_dim / 8
//     threads that each load 8 elements with one instruction.
//   * One pass: K and V of a token are loaded together and folded into a
//     running (online) softmax, so nothing is stored per token and the
//     context length is unbounded.
//   * Lanes: each group of head_dim / 8 threads ("lane") keeps its own running
//     max / sum / accumulator; lanes are merged once at the end, so the loop
//     has no barrier.
// Still one CTA per (KV head, sequence): a batch of 4 sequences with 8 KV
// heads launches 32 CTAs on a 132-SM GPU, however long the context.
#include "decode_common.cuh"
#include "dispatch.cuh"

namespace mini_vllm {
namespace {

constexpr int kV2Threads = 128;

// --8<-- [start:kernel]
template <typename T, int HEAD_DIM, int GROUP>
__global__ void __launch_bounds__(kV2Threads) paged_attention_v2_kernel(DecodeParams p, int log2_bs) {
  using Layout = DecodeLayout<HEAD_DIM, kV2Threads>;
  constexpr int TPR = Layout::kThreadsPerRow, LANES = Layout::kLanes;
  __shared__ MergeSmem<HEAD_DIM, GROUP, kV2Threads> sm;
  const int seq = blockIdx.y, q_head0 = blockIdx.x * GROUP;
  const int kv_head = q_head0 / (p.num_q_heads / p.num_kv_heads);
  const int lane = threadIdx.x / TPR, r = threadIdx.x % TPR;
  T* out = static_cast<T*>(p.out) + (static_cast<int64_t>(seq) * p.num_q_heads + q_head0) * HEAD_DIM;
  const int ctx = min(p.context_lens[seq], p.max_blocks_per_seq << log2_bs);
  if (ctx <= 0) return store_zeros<T, HEAD_DIM, GROUP, kV2Threads>(out);

  float q[GROUP][8];
  load_query<T, HEAD_DIM, GROUP>(
      static_cast<const T*>(p.q) + seq * p.q_stride + static_cast<int64_t>(q_head0) * HEAD_DIM, r,
      p.scale, q);
  float m[GROUP], l[GROUP], acc[GROUP][8];
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[g][j] = 0.0f;
  }
  const int* table = p.block_tables + static_cast<int64_t>(seq) * p.max_blocks_per_seq;
  // Address of element 8r of this KV head in token row 0; a row is num_kv_heads * HEAD_DIM.
  const int64_t token_stride = static_cast<int64_t>(p.num_kv_heads) * HEAD_DIM;
  const T* k_base = static_cast<const T*>(p.k_cache) + kv_head * HEAD_DIM + r * 8;
  const T* v_base = static_cast<const T*>(p.v_cache) + kv_head * HEAD_DIM + r * 8;

  for (int t0 = 0; t0 < ctx; t0 += LANES) {
    const int t = t0 + lane;
    const bool valid = t < ctx;
    uint4 kv = make_uint4(0, 0, 0, 0), vv = make_uint4(0, 0, 0, 0);
    if (valid) {
      const int64_t slot = static_cast<int64_t>(table[t >> log2_bs]) * p.block_size +
                           (t & (p.block_size - 1));
      kv = load_stream16(k_base + slot * token_stride);
      vv = load_stream16(v_base + slot * token_stride);
    }
    float kf[8], vf[8];
    unpack8<T>(kv, kf);
    unpack8<T>(vv, vf);
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
      float s = 0.0f;
#pragma unroll
      for (int j = 0; j < 8; ++j) s += q[g][j] * kf[j];
      s = group_sum<TPR>(s);  // the whole row's dot product, in every thread of the lane
      s = valid ? s : -INFINITY;
      const float m_new = fmaxf(m[g], s);
      const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // no token yet: avoid inf - inf
      const float alpha = exp2f(m[g] - m_use), prob = exp2f(s - m_use);
      l[g] = l[g] * alpha + prob;
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[g][j] = acc[g][j] * alpha + prob * vf[j];
      m[g] = m_new;
    }
  }
  merge_lanes_and_store<T, HEAD_DIM, GROUP, kV2Threads>(m, l, acc, sm, out, nullptr, nullptr, 0);
}
// --8<-- [end:kernel]

template <typename T, int HEAD_DIM, int GROUP>
struct LaunchV2 {
  static void run(const DecodeParams& p, cudaStream_t stream) {
    const dim3 grid(p.num_q_heads / GROUP, p.num_seqs);
    paged_attention_v2_kernel<T, HEAD_DIM, GROUP>
        <<<grid, kV2Threads, 0, stream>>>(p, log2_exact(p.block_size));
    MINI_VLLM_CHECK_LAUNCH("paged_attention_v2_kernel");
  }
};

}  // namespace

void paged_attention_v2(const DecodeParams& p, cudaStream_t stream) {
  dispatch_decode<LaunchV2>(p, stream);
}

}  // namespace mini_vllm
