// Version 4: several loads in flight, block table in shared memory.
//
// Changes from version 3:
//   * Each lane handles UNROLL tokens per step and issues all 2 * UNROLL of its
//     16-byte K and V loads before it uses any of them, so every thread keeps
//     UNROLL * 32 bytes in flight instead of 32: the latency of one trip to
//     HBM is paid once per UNROLL tokens.
//   * The running max is updated once per step (not once per token), so the
//     accumulator is rescaled UNROLL times less often.
//   * The CTA first copies its partition's block-table entries into shared
//     memory with one coalesced read; the address of a K row then depends on
//     a shared-memory load, not on a global one.
//
//   step over the tokens of a partition (head_dim 128: 8 lanes, UNROLL 4):
//     tokens t0 .. t0+31:  lane i loads rows t0+i, t0+8+i, t0+16+i, t0+24+i
#include "decode_common.cuh"
#include "dispatch.cuh"

#include <algorithm>
#include <type_traits>

namespace mini_vllm {
namespace {

constexpr int kV4Threads = 128;
constexpr int kV4Unroll = 4;

// --8<-- [start:kernel]
template <typename T, int HEAD_DIM, int GROUP, int UNROLL>
__global__ void __launch_bounds__(kV4Threads) paged_attention_v4_kernel(DecodeParams p, int log2_bs) {
  using Layout = DecodeLayout<HEAD_DIM, kV4Threads>;
  constexpr int TPR = Layout::kThreadsPerRow, LANES = Layout::kLanes;
  __shared__ MergeSmem<HEAD_DIM, GROUP, kV4Threads> sm;
  extern __shared__ int s_blocks[];  // this partition's block-table entries
  const int seq = blockIdx.z, split = blockIdx.y, q_head0 = blockIdx.x * GROUP;
  const int kv_head = q_head0 / (p.num_q_heads / p.num_kv_heads);
  const int lane = threadIdx.x / TPR, r = threadIdx.x % TPR;
  const int64_t out_row = static_cast<int64_t>(seq) * p.num_q_heads + q_head0;
  T* out = static_cast<T*>(p.out) + out_row * HEAD_DIM;
  const int ctx = min(min(p.context_lens[seq], p.max_blocks_per_seq << log2_bs),
                      p.max_splits * p.partition_size);
  if (ctx <= 0) {
    if (split == 0) store_zeros<T, HEAD_DIM, GROUP, kV4Threads>(out);
    return;
  }
  const int start = split * p.partition_size;
  if (start >= ctx) return;
  const int end = min(ctx, start + p.partition_size);
  const int num_splits = (ctx + p.partition_size - 1) / p.partition_size;

  // Stage the block-table entries of tokens [start, end).
  const int first_block = start >> log2_bs;
  const int num_blocks = ((end - 1) >> log2_bs) - first_block + 1;
  const int* table = p.block_tables + static_cast<int64_t>(seq) * p.max_blocks_per_seq + first_block;
  for (int i = threadIdx.x; i < num_blocks; i += kV4Threads) s_blocks[i] = table[i];

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
  const int64_t token_stride = static_cast<int64_t>(p.num_kv_heads) * HEAD_DIM;
  const T* k_base = static_cast<const T*>(p.k_cache) + kv_head * HEAD_DIM + r * 8;
  const T* v_base = static_cast<const T*>(p.v_cache) + kv_head * HEAD_DIM + r * 8;
  const int offset_mask = p.block_size - 1;
  __syncthreads();  // s_blocks is ready

  for (int t0 = start; t0 < end; t0 += LANES * UNROLL) {
    // Issue every load of this step first ...
    uint4 kv[UNROLL], vv[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int t = t0 + u * LANES + lane;
      kv[u] = vv[u] = make_uint4(0, 0, 0, 0);
      if (t < end) {
        const int64_t slot = static_cast<int64_t>(s_blocks[(t >> log2_bs) - first_block]) *
                                 p.block_size + (t & offset_mask);
        kv[u] = load_stream16(k_base + slot * token_stride);
        vv[u] = load_stream16(v_base + slot * token_stride);
      }
    }
    // ... then the scores of the UNROLL tokens for every query head ...
    float s[UNROLL][GROUP];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      float kf[8];
      unpack8<T>(kv[u], kf);
      const bool valid = t0 + u * LANES + lane < end;
#pragma unroll
      for (int g = 0; g < GROUP; ++g) {
        float x = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; ++j) x += q[g][j] * kf[j];
        x = group_sum<TPR>(x);
        s[u][g] = valid ? x : -INFINITY;
      }
    }
    // ... one rescale of the running state per step ...
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
      float m_new = m[g];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) m_new = fmaxf(m_new, s[u][g]);
      const float m_use = m_new == -INFINITY ? 0.0f : m_new;
      const float alpha = exp2f(m[g] - m_use);
      l[g] *= alpha;
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[g][j] *= alpha;
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        s[u][g] = exp2f(s[u][g] - m_use);  // now the probability (0 for masked tokens)
        l[g] += s[u][g];
      }
      m[g] = m_new;
    }
    // ... and the weighted V rows.
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      float vf[8];
      unpack8<T>(vv[u], vf);
#pragma unroll
      for (int g = 0; g < GROUP; ++g) {
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[g][j] += s[u][g] * vf[j];
      }
    }
  }
  const int64_t part = out_row * p.max_splits + split;
  merge_lanes_and_store<T, HEAD_DIM, GROUP, kV4Threads>(
      m, l, acc, sm, num_splits == 1 ? out : nullptr, p.part_out + part * HEAD_DIM,
      p.part_ml + part * 2, p.max_splits);
}
// --8<-- [end:kernel]

template <typename T, int HEAD_DIM, int GROUP>
struct LaunchV4 {
  static void run(const DecodeParams& p, cudaStream_t stream) {
    if (p.max_splits > 1 && (p.part_out == nullptr || p.part_ml == nullptr)) {
      throw std::invalid_argument("split-K needs the part_out / part_ml workspace");
    }
    const int log2_bs = log2_exact(p.block_size);
    // A partition spans at most partition_size / block_size blocks (both are
    // powers of two and partitions start at multiples of partition_size), or
    // one block when the partition is smaller than a block.
    const int table_entries = std::max(1, std::min(p.partition_size >> log2_bs,
                                                   p.max_blocks_per_seq));
    const size_t smem = static_cast<size_t>(table_entries) * sizeof(int);
    if (smem > 32 * 1024) {
      throw std::invalid_argument("partition_size / block_size is too large for version 4");
    }
    if (p.partition_size & (p.partition_size - 1)) {
      throw std::invalid_argument("partition_size must be a power of two");
    }
    const dim3 grid(p.num_q_heads / GROUP, p.max_splits, p.num_seqs);
    // Other unroll depths are built for bf16 / head_dim 128 only, for tuning.
    constexpr bool kTunable = std::is_same_v<T, __nv_bfloat16> && HEAD_DIM == 128;
    if (p.unroll == 0 || p.unroll == kV4Unroll) {
      paged_attention_v4_kernel<T, HEAD_DIM, GROUP, kV4Unroll>
          <<<grid, kV4Threads, smem, stream>>>(p, log2_bs);
    } else if (kTunable && p.unroll == 2) {
      paged_attention_v4_kernel<T, HEAD_DIM, GROUP, kTunable ? 2 : kV4Unroll>
          <<<grid, kV4Threads, smem, stream>>>(p, log2_bs);
    } else if (kTunable && p.unroll == 8) {
      paged_attention_v4_kernel<T, HEAD_DIM, GROUP, kTunable ? 8 : kV4Unroll>
          <<<grid, kV4Threads, smem, stream>>>(p, log2_bs);
    } else {
      throw std::invalid_argument("unroll " + std::to_string(p.unroll) + " is not built");
    }
    MINI_VLLM_CHECK_LAUNCH("paged_attention_v4_kernel");
    launch_combine<T, HEAD_DIM>(p, stream);
  }
};

}  // namespace

void paged_attention_v4(const DecodeParams& p, cudaStream_t stream) {
  dispatch_decode<LaunchV4>(p, stream);
}

}  // namespace mini_vllm
