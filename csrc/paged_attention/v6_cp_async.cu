// Version 6: K and V stream through shared memory, several steps ahead.
//
// Change from version 5: the next steps' K/V rows are no longer loaded into
// registers but copied into a ring of STAGES shared-memory buffers with
// `cp.async` (global -> shared, no register on the way). While a warp
// computes step i, steps i+1 .. i+STAGES-1 are in flight. Version 5 could
// keep only one step ahead, because every byte in flight occupied a
// register; here the registers hold only the step being computed, so a
// thread has fewer registers, an SM holds more warps, and each warp keeps
// several times the bytes in flight.
//
// Each thread copies exactly the 16-byte pieces it later reads (the same
// thread -> (token, 16 B) mapping as versions 2-5), so `cp.async.wait_group`
// alone makes a stage visible to its reader: the loop has no barrier.
//
//   ring (dynamic shared memory), per stage:  [UNROLL][K, V][128 threads] x 16 B
//
//   step:        i          i+1        i+2        (STAGES = 3)
//   warp w:   [compute] [in flight][in flight]
//   then:     refill stage (i mod 3) with step i+3, wait for step i+1, compute it
#include "decode_common.cuh"
#include "dispatch.cuh"
#include "../cp_async.cuh"

#include <algorithm>
#include <type_traits>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "version 6 needs cp.async (sm_80 or newer)"
#endif

namespace mini_vllm {
namespace {

constexpr int kV6Threads = 128;
// Tokens per lane per step, and steps in the ring. One stage is
// UNROLL * 2 * 128 * 16 B = 8 KB at UNROLL 2: 3 stages are 24 KB per CTA and
// 8 CTAs (64 registers per thread) fit an SM. With 4 stages (32 KB) only 6
// fit, and a grid of 1024 CTAs then runs as 1.3 waves: the last 0.3 wave
// leaves most SMs with one or two CTAs, and the whole launch takes 13-17 %
// longer (measured on an H200, chapter 8).
constexpr int kV6Unroll = 2;
constexpr int kV6Stages = 3;
// The ring depth used when only the unroll is asked for.
constexpr int v6_default_stages(int unroll) {
  return unroll == kV6Unroll ? kV6Stages : unroll <= 1 ? 8 : 3;
}

// The cp.async wrappers (cp_async16, cp_async_commit, cp_async_wait) are in
// csrc/cp_async.cuh, shared with version 7.

// Issue the copies of one step into one stage of the ring: UNROLL rows of K
// and of V per lane. `stage_addr` is this thread's slot in that stage.
template <typename T, int UNROLL, int LANES>
__device__ __forceinline__ void issue_step(uint32_t stage_addr, int t0, int end, int lane,
                                           const int* s_blocks, int first_block, int log2_bs,
                                           int offset_mask, int64_t token_stride,
                                           const T* k_base, const T* v_base) {
  constexpr uint32_t kRowBytes = kV6Threads * sizeof(uint4);  // one [threads] x 16 B row
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    const int t = t0 + u * LANES + lane;
    const bool valid = t < end;
    const T* k = k_base;
    const T* v = v_base;
    if (valid) {
      const int64_t slot = (static_cast<int64_t>(s_blocks[(t >> log2_bs) - first_block])
                            << log2_bs) + (t & offset_mask);
      k += slot * token_stride;
      v += slot * token_stride;
    }
    cp_async16(stage_addr + (2 * u) * kRowBytes, k, valid);
    cp_async16(stage_addr + (2 * u + 1) * kRowBytes, v, valid);
  }
}

// Fold one step, read back from this thread's slots of a stage, into the
// lane's online-softmax state (the arithmetic of version 5).
template <typename T, int HEAD_DIM, int GROUP, int UNROLL, int LANES>
__device__ __forceinline__ void compute_step(const uint4* stage, int t0, int end, int lane,
                                             const float (&q)[GROUP][8], float (&m)[GROUP],
                                             float (&l)[GROUP], float (&acc)[GROUP][8]) {
  constexpr int TPR = HEAD_DIM / 8;
  float s[UNROLL][GROUP];
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    float kf[8];
    unpack8<T>(stage[(2 * u) * kV6Threads], kf);
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
    unpack8<T>(stage[(2 * u + 1) * kV6Threads], vf);
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[g][j] += s[u][g] * vf[j];
    }
  }
}

// Bytes of the ring, and of the dynamic shared memory before the table
// entries: the ring, reused by the end-of-CTA merge.
template <int HEAD_DIM, int GROUP>
constexpr size_t v6_ring_bytes(int unroll, int stages) {
  return static_cast<size_t>(stages) * unroll * 2 * kV6Threads * sizeof(uint4);
}
template <int HEAD_DIM, int GROUP>
constexpr size_t v6_pipe_bytes(int unroll, int stages) {
  return std::max(v6_ring_bytes<HEAD_DIM, GROUP>(unroll, stages),
                  sizeof(MergeSmem<HEAD_DIM, GROUP, kV6Threads>));
}

// --8<-- [start:kernel]
template <typename T, int HEAD_DIM, int GROUP, int UNROLL, int STAGES>
__global__ void __launch_bounds__(kV6Threads) paged_attention_v6_kernel(DecodeParams p, int log2_bs) {
  using Layout = DecodeLayout<HEAD_DIM, kV6Threads>;
  constexpr int TPR = Layout::kThreadsPerRow, LANES = Layout::kLanes;
  constexpr int STEP = LANES * UNROLL;                          // tokens per step of the CTA
  constexpr int STAGE_VECS = UNROLL * 2 * kV6Threads;           // 16-byte slots per stage
  constexpr size_t PIPE = v6_pipe_bytes<HEAD_DIM, GROUP>(UNROLL, STAGES);
  static_assert(PIPE % 16 == 0, "the table entries must start 16-byte aligned");
  // [ring: STAGES x STAGE_VECS x 16 B, later the merge][table entries]
  extern __shared__ __align__(16) unsigned char v6_smem[];
  uint4* ring = reinterpret_cast<uint4*>(v6_smem);
  int* s_blocks = reinterpret_cast<int*>(v6_smem + PIPE);
  const int seq = blockIdx.z, split = blockIdx.y, q_head0 = blockIdx.x * GROUP;
  const int kv_head = q_head0 / (p.num_q_heads / p.num_kv_heads);
  const int lane = threadIdx.x / TPR, r = threadIdx.x % TPR;
  const int start = split * p.partition_size;

  // Prologue as in version 5: table entries, query and context length together.
  const int first_block = start >> log2_bs;
  const int table_entries = min(max(p.partition_size >> log2_bs, 1),
                                p.max_blocks_per_seq - first_block);
  const int* table = p.block_tables + static_cast<int64_t>(seq) * p.max_blocks_per_seq + first_block;
  for (int i = threadIdx.x; i < table_entries; i += kV6Threads) s_blocks[i] = table[i];
  float q[GROUP][8];
  load_query<T, HEAD_DIM, GROUP>(
      static_cast<const T*>(p.q) + seq * p.q_stride + static_cast<int64_t>(q_head0) * HEAD_DIM, r,
      p.scale, q);
  const int64_t out_row = static_cast<int64_t>(seq) * p.num_q_heads + q_head0;
  T* out = static_cast<T*>(p.out) + out_row * HEAD_DIM;
  const int ctx = min(min(p.context_lens[seq], p.max_blocks_per_seq << log2_bs),
                      p.max_splits * p.partition_size);
  if (ctx <= 0) {
    if (split == 0) store_zeros<T, HEAD_DIM, GROUP, kV6Threads>(out);
    return;
  }
  if (start >= ctx) return;
  const int end = min(ctx, start + p.partition_size);
  const int num_splits = (ctx + p.partition_size - 1) / p.partition_size;
  const int num_steps = (end - start + STEP - 1) / STEP;

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
  // This thread's slot in stage 0; stage s is s * STAGE_VECS * 16 B further.
  const uint32_t my_slot = static_cast<uint32_t>(__cvta_generic_to_shared(ring + threadIdx.x));
  constexpr uint32_t kStageBytes = STAGE_VECS * sizeof(uint4);
  __syncthreads();  // s_blocks is ready

  // Fill all stages but one. A group is committed even when it is empty, so
  // that "all but the newest STAGES - 1 groups" is always "step i".
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < num_steps) {
      issue_step<T, UNROLL, LANES>(my_slot + s * kStageBytes, start + s * STEP, end, lane,
                                   s_blocks, first_block, log2_bs, offset_mask, token_stride,
                                   k_base, v_base);
    }
    cp_async_commit();
  }
  int read_stage = 0, write_stage = STAGES - 1;
  for (int i = 0; i < num_steps; ++i) {
    // Refill the stage this thread finished reading in the previous step
    // (its reads were consumed by that step's math, which came first).
    if (i + STAGES - 1 < num_steps) {
      issue_step<T, UNROLL, LANES>(my_slot + write_stage * kStageBytes,
                                   start + (i + STAGES - 1) * STEP, end, lane, s_blocks,
                                   first_block, log2_bs, offset_mask, token_stride, k_base,
                                   v_base);
    }
    cp_async_commit();
    cp_async_wait<STAGES - 1>();  // this thread's copies of step i have landed
    compute_step<T, HEAD_DIM, GROUP, UNROLL, LANES>(ring + read_stage * STAGE_VECS + threadIdx.x,
                                                    start + i * STEP, end, lane, q, m, l, acc);
    write_stage = read_stage;
    read_stage = read_stage + 1 == STAGES ? 0 : read_stage + 1;
  }
  // The merge reuses the ring: every copy has landed (only empty groups can
  // be pending) and every thread is done reading its slots.
  cp_async_wait<0>();
  __syncthreads();
  auto& sm = *reinterpret_cast<MergeSmem<HEAD_DIM, GROUP, kV6Threads>*>(v6_smem);
  const int64_t part = out_row * p.max_splits + split;
  merge_lanes_and_store<T, HEAD_DIM, GROUP, kV6Threads>(
      m, l, acc, sm, num_splits == 1 ? out : nullptr, p.part_out + part * HEAD_DIM,
      p.part_ml + part * 2, p.max_splits);
}
// --8<-- [end:kernel]

using V6Fn = void (*)(DecodeParams, int);

struct V6Kernel {
  V6Fn fn;
  int unroll;
  int stages;
};

// The kernel for (unroll, stages); 0 means the default. Other depths are
// built for bf16 / head_dim 128 with at most 2 query heads per CTA only, for
// tuning.
template <typename T, int HEAD_DIM, int GROUP>
V6Kernel select_v6_kernel(int unroll, int stages) {
  const int u = unroll != 0 ? unroll : kV6Unroll;
  const int s = stages != 0 ? stages : v6_default_stages(u);
  if (u == kV6Unroll && s == kV6Stages) {
    return {paged_attention_v6_kernel<T, HEAD_DIM, GROUP, kV6Unroll, kV6Stages>, u, s};
  }
  if constexpr (std::is_same_v<T, __nv_bfloat16> && HEAD_DIM == 128 && GROUP <= 2) {
#define MINI_VLLM_V6_TUNABLE(U, S) \
  if (u == U && s == S) return {paged_attention_v6_kernel<T, HEAD_DIM, GROUP, U, S>, U, S};
    MINI_VLLM_V6_TUNABLE(1, 8)
    MINI_VLLM_V6_TUNABLE(2, 4)
    MINI_VLLM_V6_TUNABLE(2, 6)
    MINI_VLLM_V6_TUNABLE(4, 2)
    MINI_VLLM_V6_TUNABLE(4, 3)
    MINI_VLLM_V6_TUNABLE(4, 4)
#undef MINI_VLLM_V6_TUNABLE
  }
  throw std::invalid_argument("version 6 with unroll " + std::to_string(u) + " and stages " +
                              std::to_string(s) + " is not built");
}

constexpr size_t kV6MaxTableBytes = 32 * 1024;

template <typename T, int HEAD_DIM, int GROUP>
struct LaunchV6 {
  static void run(const DecodeParams& p, cudaStream_t stream) {
    if (p.max_splits > 1 && (p.part_out == nullptr || p.part_ml == nullptr)) {
      throw std::invalid_argument("split-K needs the part_out / part_ml workspace");
    }
    if (p.partition_size & (p.partition_size - 1)) {
      throw std::invalid_argument("partition_size must be a power of two");
    }
    const int log2_bs = log2_exact(p.block_size);
    const V6Kernel k = select_v6_kernel<T, HEAD_DIM, GROUP>(p.unroll, p.stages);
    const size_t pipe = v6_pipe_bytes<HEAD_DIM, GROUP>(k.unroll, k.stages);
    const int table_entries = std::max(1, p.partition_size >> log2_bs);
    const size_t table = static_cast<size_t>(std::min(table_entries, p.max_blocks_per_seq) + 1) *
                         sizeof(int);
    if (table > kV6MaxTableBytes) {
      throw std::invalid_argument("partition_size / block_size is too large for version 6");
    }
    allow_dynamic_smem(reinterpret_cast<const void*>(k.fn), pipe + kV6MaxTableBytes);
    const dim3 grid(p.num_q_heads / GROUP, p.max_splits, p.num_seqs);
    k.fn<<<grid, kV6Threads, pipe + table, stream>>>(p, log2_bs);
    MINI_VLLM_CHECK_LAUNCH("paged_attention_v6_kernel");
    launch_combine<T, HEAD_DIM>(p, stream);
  }
};

}  // namespace

void paged_attention_v6(const DecodeParams& p, cudaStream_t stream) {
  dispatch_decode<LaunchV6>(p, stream);
}

}  // namespace mini_vllm
