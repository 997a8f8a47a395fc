// Version 3: split-K (flash-decoding).
//
// Change from version 2: the context is cut into partitions of
// `partition_size` tokens and each (KV head, partition, sequence) gets its own
// CTA, so short batches with long contexts still fill the GPU. Each CTA
// writes a normalized partial output with its running max and sum; a second,
// small kernel combines the partials with a log-sum-exp weighting. Sequences
// that fit in one partition skip the combine: their CTA writes the output.
//
//   context:  |---- split 0 ----|---- split 1 ----|-- split 2 --|
//   CTA:        (h, 0, seq)       (h, 1, seq)       (h, 2, seq)
//   partial:    o0, m0, l0        o1, m1, l1        o2, m2, l2
//   combine:    out = sum_i l_i 2^(m_i - M) o_i / sum_i l_i 2^(m_i - M)
#include "decode_common.cuh"
#include "dispatch.cuh"

namespace mini_vllm {
namespace {

constexpr int kV3Threads = 128;

// --8<-- [start:kernel]
template <typename T, int HEAD_DIM, int GROUP>
__global__ void __launch_bounds__(kV3Threads) paged_attention_v3_kernel(DecodeParams p, int log2_bs) {
  using Layout = DecodeLayout<HEAD_DIM, kV3Threads>;
  constexpr int TPR = Layout::kThreadsPerRow, LANES = Layout::kLanes;
  __shared__ MergeSmem<HEAD_DIM, GROUP, kV3Threads> sm;
  const int seq = blockIdx.z, split = blockIdx.y, q_head0 = blockIdx.x * GROUP;
  const int kv_head = q_head0 / (p.num_q_heads / p.num_kv_heads);
  const int lane = threadIdx.x / TPR, r = threadIdx.x % TPR;
  const int64_t out_row = static_cast<int64_t>(seq) * p.num_q_heads + q_head0;
  T* out = static_cast<T*>(p.out) + out_row * HEAD_DIM;
  // Clamp to the table and to the splits launched, so no write leaves the workspace.
  const int ctx = min(min(p.context_lens[seq], p.max_blocks_per_seq << log2_bs),
                      p.max_splits * p.partition_size);
  if (ctx <= 0) {
    if (split == 0) store_zeros<T, HEAD_DIM, GROUP, kV3Threads>(out);
    return;
  }
  const int start = split * p.partition_size;
  if (start >= ctx) return;  // this sequence is shorter than the longest one
  const int end = min(ctx, start + p.partition_size);
  const int num_splits = (ctx + p.partition_size - 1) / p.partition_size;

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
  const int64_t token_stride = static_cast<int64_t>(p.num_kv_heads) * HEAD_DIM;
  const T* k_base = static_cast<const T*>(p.k_cache) + kv_head * HEAD_DIM + r * 8;
  const T* v_base = static_cast<const T*>(p.v_cache) + kv_head * HEAD_DIM + r * 8;

  for (int t0 = start; t0 < end; t0 += LANES) {
    const int t = t0 + lane;
    const bool valid = t < end;
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
      s = group_sum<TPR>(s);
      s = valid ? s : -INFINITY;
      const float m_new = fmaxf(m[g], s);
      const float m_use = m_new == -INFINITY ? 0.0f : m_new;
      const float alpha = exp2f(m[g] - m_use), prob = exp2f(s - m_use);
      l[g] = l[g] * alpha + prob;
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[g][j] = acc[g][j] * alpha + prob * vf[j];
      m[g] = m_new;
    }
  }
  const int64_t part = out_row * p.max_splits + split;  // [seq, head, split] of head q_head0
  merge_lanes_and_store<T, HEAD_DIM, GROUP, kV3Threads>(
      m, l, acc, sm, num_splits == 1 ? out : nullptr, p.part_out + part * HEAD_DIM,
      p.part_ml + part * 2, p.max_splits);
}
// --8<-- [end:kernel]

template <typename T, int HEAD_DIM, int GROUP>
struct LaunchV3 {
  static void run(const DecodeParams& p, cudaStream_t stream) {
    if (p.max_splits > 1 && (p.part_out == nullptr || p.part_ml == nullptr)) {
      throw std::invalid_argument("split-K needs the part_out / part_ml workspace");
    }
    const dim3 grid(p.num_q_heads / GROUP, p.max_splits, p.num_seqs);
    paged_attention_v3_kernel<T, HEAD_DIM, GROUP>
        <<<grid, kV3Threads, 0, stream>>>(p, log2_exact(p.block_size));
    MINI_VLLM_CHECK_LAUNCH("paged_attention_v3_kernel");
    launch_combine<T, HEAD_DIM>(p, stream);
  }
};

}  // namespace

void paged_attention_v3(const DecodeParams& p, cudaStream_t stream) {
  dispatch_decode<LaunchV3>(p, stream);
}

}  // namespace mini_vllm
