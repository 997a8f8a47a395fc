// Version 5 (the one the engine uses): the next step's loads fly while this
// step computes.
//
// Changes from version 4:
//   * Double buffering in registers: while the scores and V sums of step i
//     are computed, the K/V loads of step i+1 are already in flight. In
//     version 4 a warp stops loading while it computes, so each SM keeps HBM
//     busy only part of the time; here it always has a step outstanding.
//   * The prologue overlaps its reads: the context length, the block-table
//     entries this partition could need and the query are loaded together,
//     instead of one after the other (a table entry past the context is
//     padding, which is safe to read and never used).
//
//   time ->   warp w:  [load 0][load 1 | math 0][load 2 | math 1] ... [math n]
#include "decode_common.cuh"
#include "dispatch.cuh"

#include <algorithm>
#include <type_traits>

namespace mini_vllm {
namespace {

constexpr int kV5Threads = 128;
// Tokens per lane per step. Two buffers of 2 * UNROLL 16-byte vectors live in
// registers next to GROUP queries and accumulators, so wider groups step
// shorter to keep several CTAs per SM.
template <int GROUP>
constexpr int kV5Unroll = GROUP >= 4 ? 2 : 4;

// Issue the K/V loads of one step: UNROLL rows per lane, zeros past `end`.
template <typename T, int UNROLL, int LANES>
__device__ __forceinline__ void load_step(uint4 (&kv)[UNROLL], uint4 (&vv)[UNROLL], int t0,
                                          int end, int lane, const int* s_blocks,
                                          int first_block, int log2_bs, int offset_mask,
                                          int64_t token_stride, const T* k_base,
                                          const T* v_base) {
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    const int t = t0 + u * LANES + lane;
    kv[u] = vv[u] = make_uint4(0, 0, 0, 0);
    if (t < end) {
      const int64_t slot = (static_cast<int64_t>(s_blocks[(t >> log2_bs) - first_block])
                            << log2_bs) + (t & offset_mask);
      kv[u] = load_stream16(k_base + slot * token_stride);
      vv[u] = load_stream16(v_base + slot * token_stride);
    }
  }
}

// Fold one step's UNROLL rows into the lane's online-softmax state.
template <typename T, int HEAD_DIM, int GROUP, int UNROLL, int LANES>
__device__ __forceinline__ void compute_step(const uint4 (&kv)[UNROLL], const uint4 (&vv)[UNROLL],
                                             int t0, int end, int lane,
                                             const float (&q)[GROUP][8], float (&m)[GROUP],
                                             float (&l)[GROUP], float (&acc)[GROUP][8]) {
  constexpr int TPR = HEAD_DIM / 8;
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
      s[u][g] = exp2f(s[u][g] - m_use);
      l[g] += s[u][g];
    }
    m[g] = m_new;
  }
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

// --8<-- [start:kernel]
template <typename T, int HEAD_DIM, int GROUP, int UNROLL>
__global__ void __launch_bounds__(kV5Threads) paged_attention_v5_kernel(DecodeParams p, int log2_bs) {
  using Layout = DecodeLayout<HEAD_DIM, kV5Threads>;
  constexpr int TPR = Layout::kThreadsPerRow, LANES = Layout::kLanes;
  constexpr int STEP = LANES * UNROLL;  // tokens per step of the CTA
  __shared__ MergeSmem<HEAD_DIM, GROUP, kV5Threads> sm;
  extern __shared__ int s_blocks[];  // table_entries = max(1, partition_size / block_size)
  const int seq = blockIdx.z, split = blockIdx.y, q_head0 = blockIdx.x * GROUP;
  const int kv_head = q_head0 / (p.num_q_heads / p.num_kv_heads);
  const int lane = threadIdx.x / TPR, r = threadIdx.x % TPR;
  const int start = split * p.partition_size;
  // Launched with PDL: everything below reads what earlier kernels wrote.
  pdl_launch_dependents();
  pdl_wait();

  // Prologue: the three independent reads go out together.
  const int first_block = start >> log2_bs;
  const int table_entries = min(max(p.partition_size >> log2_bs, 1),
                                p.max_blocks_per_seq - first_block);
  const int* table = p.block_tables + static_cast<int64_t>(seq) * p.max_blocks_per_seq + first_block;
  for (int i = threadIdx.x; i < table_entries; i += kV5Threads) s_blocks[i] = table[i];
  float q[GROUP][8];
  load_query<T, HEAD_DIM, GROUP>(
      static_cast<const T*>(p.q) + seq * p.q_stride + static_cast<int64_t>(q_head0) * HEAD_DIM, r,
      p.scale, q);
  const int64_t out_row = static_cast<int64_t>(seq) * p.num_q_heads + q_head0;
  T* out = static_cast<T*>(p.out) + out_row * HEAD_DIM;
  const int ctx = min(min(p.context_lens[seq], p.max_blocks_per_seq << log2_bs),
                      p.max_splits * p.partition_size);
  if (ctx <= 0) {
    if (split == 0) store_zeros<T, HEAD_DIM, GROUP, kV5Threads>(out);
    return;
  }
  if (start >= ctx) return;
  const int end = min(ctx, start + p.partition_size);
  const int num_splits = (ctx + p.partition_size - 1) / p.partition_size;

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
  const int offset_mask = (1 << log2_bs) - 1;
  __syncthreads();  // s_blocks is ready

  // Two register buffers, used alternately; the loop body is unrolled twice
  // so that each buffer is named at compile time (no local memory).
  uint4 ka[UNROLL], va[UNROLL], kb[UNROLL], vb[UNROLL];
  load_step<T, UNROLL, LANES>(ka, va, start, end, lane, s_blocks, first_block, log2_bs,
                              offset_mask, token_stride, k_base, v_base);
  for (int t0 = start;; t0 += 2 * STEP) {
    const bool more_b = t0 + STEP < end;  // the same in every thread: no divergence
    if (more_b) {
      load_step<T, UNROLL, LANES>(kb, vb, t0 + STEP, end, lane, s_blocks, first_block, log2_bs,
                                  offset_mask, token_stride, k_base, v_base);
    }
    compute_step<T, HEAD_DIM, GROUP, UNROLL, LANES>(ka, va, t0, end, lane, q, m, l, acc);
    if (!more_b) break;
    const bool more_a = t0 + 2 * STEP < end;
    if (more_a) {
      load_step<T, UNROLL, LANES>(ka, va, t0 + 2 * STEP, end, lane, s_blocks, first_block,
                                  log2_bs, offset_mask, token_stride, k_base, v_base);
    }
    compute_step<T, HEAD_DIM, GROUP, UNROLL, LANES>(kb, vb, t0 + STEP, end, lane, q, m, l, acc);
    if (!more_a) break;
  }
  const int64_t part = out_row * p.max_splits + split;
  merge_lanes_and_store<T, HEAD_DIM, GROUP, kV5Threads>(
      m, l, acc, sm, num_splits == 1 ? out : nullptr, p.part_out + part * HEAD_DIM,
      p.part_ml + part * 2, p.max_splits);
}
// --8<-- [end:kernel]

template <typename T, int HEAD_DIM, int GROUP>
struct LaunchV5 {
  static void run(const DecodeParams& p, cudaStream_t stream) {
    if (p.max_splits > 1 && (p.part_out == nullptr || p.part_ml == nullptr)) {
      throw std::invalid_argument("split-K needs the part_out / part_ml workspace");
    }
    if (p.partition_size & (p.partition_size - 1)) {
      throw std::invalid_argument("partition_size must be a power of two");
    }
    const int log2_bs = log2_exact(p.block_size);
    const int table_entries = std::max(1, p.partition_size >> log2_bs);
    const size_t smem = static_cast<size_t>(std::min(table_entries, p.max_blocks_per_seq) + 1) *
                        sizeof(int);
    if (smem > 32 * 1024) {
      throw std::invalid_argument("partition_size / block_size is too large for version 5");
    }
    const dim3 grid(p.num_q_heads / GROUP, p.max_splits, p.num_seqs);
    // The other depth (2 or 4) is built for bf16 / head_dim 128 only, for tuning.
    constexpr bool kTunable = std::is_same_v<T, __nv_bfloat16> && HEAD_DIM == 128;
    constexpr int kDefault = kV5Unroll<GROUP>;
    constexpr int kOther = kTunable ? 6 - kDefault : kDefault;
    void (*kernel)(DecodeParams, int) = nullptr;
    if (p.unroll == 0 || p.unroll == kDefault) {
      kernel = paged_attention_v5_kernel<T, HEAD_DIM, GROUP, kDefault>;
    } else if (kTunable && p.unroll == kOther) {
      kernel = paged_attention_v5_kernel<T, HEAD_DIM, GROUP, kOther>;
    } else {
      throw std::invalid_argument("unroll " + std::to_string(p.unroll) + " is not built");
    }
    if (p.cluster > 1) {
      if (grid.x % p.cluster != 0) {
        throw std::invalid_argument("cluster must divide num_q_heads / heads per CTA");
      }
      cudaLaunchConfig_t cfg = {};
      cfg.gridDim = grid;
      cfg.blockDim = dim3(kV5Threads);
      cfg.dynamicSmemBytes = smem;
      cfg.stream = stream;
      cudaLaunchAttribute attr[1];
      attr[0].id = cudaLaunchAttributeClusterDimension;
      attr[0].val.clusterDim.x = p.cluster;
      attr[0].val.clusterDim.y = 1;
      attr[0].val.clusterDim.z = 1;
      cfg.attrs = attr;
      cfg.numAttrs = 1;
      check_cuda(cudaLaunchKernelEx(&cfg, kernel, p, log2_bs), "cudaLaunchKernelEx");
    } else {
      launch_kernel(kernel, grid, dim3(kV5Threads), smem, stream, "paged_attention_v5_kernel",
                    p, log2_bs);
    }
    MINI_VLLM_CHECK_LAUNCH("paged_attention_v5_kernel");
    launch_combine<T, HEAD_DIM>(p, stream);
  }
};

}  // namespace

void paged_attention_v5(const DecodeParams& p, cudaStream_t stream) {
  dispatch_decode<LaunchV5>(p, stream);
}

}  // namespace mini_vllm
