// GEMM for decode steps of 17 to 256 sequences on Hopper (sm_90a):
// y[M, N] = x[M, K] @ W[N, K]^T, or y += ..., for M <= 256.
//
// A decode step of a few hundred sequences multiplies a few hundred rows of
// activations by each weight matrix: too many rows for the GEMV (it reads W
// once per 16 rows), too few for a GEMM's usual tiles to fill 132 SMs. cuBLAS
// spends 5 to 8 microseconds on each such product whatever M is, two to four
// times what reading W takes. This kernel is built for these shapes; the
// model uses it where it made the decode step faster than cuBLAS
// (`gemm_wgmma_pays`: Qwen3-0.6B's products at up to 128 rows, chapter 9):
//
//   - A CTA computes a tile of 128 or 64 output features (BN) by 128 rows of
//     x (a grid over the blocks of 128 rows), or by all 256 rows in one CTA;
//     W is read from HBM once and again from L2 by the second block of rows,
//     x by every tile of outputs, from L2.
//   - K is split among the CTAs of a thread-block cluster (at most 8; a
//     cluster's CTAs must share a GPC, so only 30 clusters of 4 fit on an
//     H200, not 33). The cluster adds its partial tiles through distributed
//     shared memory, in a fixed order, and each output is rounded once. The
//     host picks the tile width, the rows per CTA and the split by a rough
//     count of cycles (plan_cycles).
//   - One thread of a producer warpgroup copies 64-wide slices of K of W and
//     of x into a ring of four to eight stages with the TMA (the 128-byte
//     swizzle), counting their bytes on the stage's mbarrier. Its first W
//     tiles are issued before the wait of programmatic launch: they overlap
//     the kernel before (weights are never written by a step).
//   - Two consumer warpgroups multiply each stage with wgmma (m64n128k16 or
//     m64n64k16, both operands read from shared memory) into float32
//     registers, each taking every other block of 64 rows of x, and hand a
//     stage back on its "empty" mbarrier once the products of the next one
//     are under way. In a CTA of 64 rows or fewer the second has no rows and
//     sits out, leaving the SM's tensor cores to the first.
//   - With SILU (GemvParams::silu_mul) the product is gate_up_proj's and the
//     epilogue applies SiLU · mul: a tile's W is half gate rows, half the
//     same up rows (two TMA boxes), and the row scale of the folded norm,
//     1 / rms(x), comes from x xᵀ, each block of x multiplied by itself on
//     the tensor cores beside the product (its diagonal holds the rows' sums
//     of squares): no extra read of x, no extra instruction between a stage's
//     arrival and its products.
#include <algorithm>
#include <string>

#include "common.cuh"
#include "gemv_params.h"
#include "pdl.cuh"
#include "silu_mul.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

namespace mini_vllm {
namespace {

constexpr int kBK = 64;        // K per stage: one 128-byte row of the swizzle
constexpr int kConsumers = 2;  // consumer warpgroups
constexpr int kThreads = 128 * (1 + kConsumers);
constexpr int kXBlockBytes = 64 * kBK * 2;   // 8 KB per 64 rows of x per stage
constexpr int kMaxSplits = 16;               // the largest cluster Hopper runs
constexpr int kMaxStages = 8;

// Shared memory: [ring of stages, later the partial tile][full barriers][empty barriers]
// [SILU: the rows' sums of squares].
// A CTA takes BN output features (128 or 64: the N of the wgmma) by up to
// 128 rows of x (BLOCKS_PER_WG = 1) or 256 (2); the ring has as many stages
// as fit in 192 KB, at most 8.
template <int BLOCKS_PER_WG, int BN>
struct Layout {
  static constexpr int kXBlocks = kConsumers * BLOCKS_PER_WG;  // 2 or 4: up to 128 or 256 rows
  static constexpr int kRows = 64 * kXBlocks;
  static constexpr int kWTileBytes = BN * kBK * 2;             // 16 or 8 KB of W per stage
  static constexpr int kPartStride = BN + 4;                   // floats per row of a partial tile
  static constexpr int kStageBytes = kWTileBytes + kXBlocks * kXBlockBytes;
  static constexpr int kStages = std::min(kMaxStages, 192 * 1024 / kStageBytes);
  static constexpr int kRingBytes = kStages * kStageBytes;
  static constexpr int kPartBytes = kRows * kPartStride * 4;
  static constexpr int kDataBytes = kRingBytes > kPartBytes ? kRingBytes : kPartBytes;
  // The swizzle is applied to shared addresses: stages start on 1,024 bytes.
  // Room for 16 barriers whatever the stages, so every layout takes the same.
  // Then a float per row of x (SILU, which uses the first 128).
  static constexpr size_t kSmemBytes = 1024 + 192 * 1024 + 2 * 8 * kMaxStages + 4 * 256;
  static_assert(kDataBytes <= 192 * 1024);
};

// --8<-- [start:cluster]
// Every thread of every CTA of the cluster: writes to shared memory before
// the barrier are visible to the whole cluster after it.
[[maybe_unused]] __device__ __forceinline__ void cluster_sync() {
#ifdef MINI_VLLM_WGMMA
  asm volatile("barrier.cluster.arrive.release.aligned;\n"
               "barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

// Four floats at `addr` of this CTA's shared memory, read from the CTA of
// rank `rank` in the cluster (distributed shared memory). No memory clobber:
// the loads of all ranks can then be in flight at once (the cluster barrier
// before them orders them after the writes).
[[maybe_unused]] __device__ __forceinline__ float4 load_remote_f4(uint32_t addr, int rank) {
  float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#ifdef MINI_VLLM_WGMMA
  uint32_t remote;
  asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(remote));
#endif
  return v;
}

// The four floats at `addr` summed over the first `splits` ranks of the
// cluster, in rank order; every rank's loads are issued before the first add.
[[maybe_unused]] __device__ __forceinline__ float4 sum_over_ranks(uint32_t addr, int splits) {
  float4 part[kMaxSplits];
#pragma unroll
  for (int r = 0; r < kMaxSplits; ++r) {
    if (r < splits) part[r] = load_remote_f4(addr, r);
  }
  float4 sum = part[0];
#pragma unroll
  for (int r = 1; r < kMaxSplits; ++r) {
    if (r < splits) {
      sum.x += part[r].x;
      sum.y += part[r].y;
      sum.z += part[r].z;
      sum.w += part[r].w;
    }
  }
  return sum;
}
// --8<-- [end:cluster]

template <typename T>
__device__ __forceinline__ void store_pair(T* y, float a, float b, bool accumulate) {
  if (accumulate) {
    const float2 old = TypeTraits<T>::to_float2(*reinterpret_cast<const uint32_t*>(y));
    a += old.x;
    b += old.y;
  }
  struct alignas(4) Pair {
    T lo, hi;
  };
  *reinterpret_cast<Pair*>(y) = Pair{TypeTraits<T>::from_float(a), TypeTraits<T>::from_float(b)};
}

// --8<-- [start:silu_sumsq]
// SILU: each row's sum of squares of x, from the accumulators of x xᵀ (the
// block of 64 rows multiplied by itself on the tensor cores, beside the main
// product): row r's sum is the diagonal element (r, r). The thread that holds
// it (wgmma_m64k16's layout) stores it to `sumsq[r]`; every index into the
// accumulators is a constant, so they stay in registers.
__device__ __forceinline__ void store_diagonal(const float (&xxt)[32], float* sumsq) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32 % 4;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int row = 16 * warp + lane / 4 + 8 * half, col = 8 * j + 2 * (lane % 4) + e;
        if (row == col) sumsq[row] = xxt[4 * j + 2 * half + e];
      }
    }
  }
}
// --8<-- [end:silu_sumsq]

// --8<-- [start:kernel]
// SILU: W is gate_up_proj's [gate; up] (N = 2 d rows) and x the residual
// stream; a CTA's tile holds BN / 2 rows of gate and the same rows of up, and
// it writes silu(s gate) * (s up), s = 1 / rms(x's row), as y [m, d].
template <typename T, int BLOCKS_PER_WG, int BN, bool SILU>
__global__ void __launch_bounds__(kThreads, 1)
    gemm_wgmma_kernel(const __grid_constant__ CUtensorMap x_map,
                      const __grid_constant__ CUtensorMap w_map, T* __restrict__ y, int m, int n,
                      int chunks_per_split, int num_chunks, bool accumulate, float eps) {
#ifdef MINI_VLLM_WGMMA
  using L = Layout<BLOCKS_PER_WG, BN>;
  constexpr int kStages = L::kStages;
  constexpr int kWTileBytes = L::kWTileBytes;
  constexpr int kPartStride = L::kPartStride;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t ring = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const uint32_t full = ring + L::kDataBytes;  // a stage's bytes have landed
  const uint32_t empty = full + kStages * 8;   // the busy consumers are done with it
  // SILU: the sums of squares of x's rows, past the barriers (the split's
  // partial tile reuses the ring, not this).
  float* const row_sumsq = reinterpret_cast<float*>(
      smem_raw + (ring - smem_u32(smem_raw)) + L::kDataBytes + 2 * 8 * kMaxStages);
  // The same in every lane (the shuffle tells the compiler so): branches on it
  // do not diverge within a warpgroup, and its wgmma's stay asynchronous.
  const int warpgroup = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);
  const int n0 = blockIdx.x * BN;
  const int split = blockIdx.y;  // the cluster spans the splits: also its rank
  const int splits = gridDim.y;
  const int m0 = blockIdx.z * L::kRows;  // this CTA's rows: [m0, m0 + m_cta)
  const int m_cta = min(m - m0, L::kRows);
  // --8<-- [start:busy]
  // A consumer whose blocks of rows all lie past the CTA's rows (the second
  // one, when the CTA has 64 rows or fewer) has nothing to multiply: it skips
  // the main loop and leaves the SM's tensor cores to the other, and the
  // stages' "empty" barriers count only the consumers that work.
  const int busy_consumers = min(kConsumers, (m_cta + 63) / 64);
  // --8<-- [end:busy]
  const int c_begin = split * chunks_per_split;
  const int chunks = min(num_chunks, c_begin + chunks_per_split) - c_begin;
  // Every CTA copies the same box of rows (the TMA fills rows past m with zeros).
  const uint32_t stage_bytes = kWTileBytes + min((m + 63) / 64, L::kXBlocks) * kXBlockBytes;
  auto stage = [&](int s) { return ring + s * L::kStageBytes; };
  // W's tile of slice c into stage s: BN rows from n0, or (SILU) BN / 2 rows
  // of gate and the same rows of up, one under the other.
  auto load_w = [&](int s, int c) {
    if constexpr (SILU) {
      const int row0 = blockIdx.x * (BN / 2);
      tma_load_2d(stage(s), &w_map, full + 8 * s, c * kBK, row0);
      tma_load_2d(stage(s) + kWTileBytes / 2, &w_map, full + 8 * s, c * kBK, n / 2 + row0);
    } else {
      tma_load_2d(stage(s), &w_map, full + 8 * s, c * kBK, n0);
    }
  };

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(full + 8 * s, 1);
      mbarrier_init(empty + 8 * s, busy_consumers);
    }
    mbarrier_init_fence();
  }
  __syncthreads();

  float acc[BLOCKS_PER_WG][BN / 2];
  // SILU: x xᵀ of each of this warpgroup's blocks of rows, for the rows' sums of squares.
  float xxt[BLOCKS_PER_WG][SILU ? 32 : 1];
  // Where this thread's accumulators sit in the tile (see wgmma_m64k16).
  const int lane = threadIdx.x % 32;
  const int row_in_block = (threadIdx.x / 32) % 4 * 16 + lane / 4;
  const int col_in_pair = 2 * (lane % 4);
  if (warpgroup == 0) {
    // The producer: one thread issues every copy.
    if (threadIdx.x == 0) {
      const int first = min(chunks, kStages);
      for (int s = 0; s < first; ++s) {
        mbarrier_arrive_expect_tx(full + 8 * s, stage_bytes);
        load_w(s, c_begin + s);
      }
      pdl_wait();  // x is the previous kernel's output
      for (int s = 0; s < first; ++s) {
        tma_load_2d(stage(s) + kWTileBytes, &x_map, full + 8 * s, (c_begin + s) * kBK, m0);
      }
      for (int c = kStages; c < chunks; ++c) {
        const int s = c % kStages;
        mbarrier_wait(empty + 8 * s, (c / kStages - 1) & 1);
        mbarrier_arrive_expect_tx(full + 8 * s, stage_bytes);
        load_w(s, c_begin + c);
        tma_load_2d(stage(s) + kWTileBytes, &x_map, full + 8 * s, (c_begin + c) * kBK, m0);
      }
    }
    __syncwarp();
  } else {
    // A consumer: blocks wg, wg + 2 (of 64 rows of x) times the stage's W tile.
    const int wg = warpgroup - 1;
#pragma unroll
    for (int i = 0; i < BLOCKS_PER_WG; ++i)
#pragma unroll
      for (int r = 0; r < BN / 2; ++r) acc[i][r] = 0.f;
#pragma unroll
    for (int i = 0; i < BLOCKS_PER_WG; ++i)
#pragma unroll
      for (int r = 0; r < (SILU ? 32 : 1); ++r) xxt[i][r] = 0.f;
    pdl_wait();  // the epilogue may read y
    const bool busy = wg < busy_consumers;  // the same in the whole warpgroup
    for (int c = 0; busy && c < chunks; ++c) {
      const int s = c % kStages;
      mbarrier_wait(full + 8 * s, (c / kStages) & 1);
      const uint32_t w_tile = stage(s);
      const uint32_t x_tile = w_tile + kWTileBytes;
#pragma unroll
      for (int i = 0; i < BLOCKS_PER_WG; ++i) {
        wgmma_fence_operands(acc[i]);
        if constexpr (SILU) wgmma_fence_operands(xxt[i]);
      }
      wgmma_fence();
#pragma unroll
      for (int k16 = 0; k16 < kBK / 16; ++k16) {
        const uint64_t desc_w = wgmma_desc(w_tile + 32 * k16);
        // Every block, even past the rows the copy filled (their sums are
        // never stored): a branch here would make the compiler fence the
        // products from each other.
#pragma unroll
        for (int i = 0; i < BLOCKS_PER_WG; ++i) {
          const int blk = wg + kConsumers * i;
          const uint64_t desc_x = wgmma_desc(x_tile + blk * kXBlockBytes + 32 * k16);
          wgmma_m64k16<T, BN>(acc[i], desc_x, desc_w);
          // SILU: the block times itself, x xᵀ, whose diagonal is each row's sum of squares.
          if constexpr (SILU) wgmma_m64k16<T, 64>(xxt[i], desc_x, desc_x);
        }
      }
      wgmma_commit();
      // Keep this stage's products running while the last stage's finish:
      // the tensor cores never wait on the hand-over between two stages.
      wgmma_wait<1>();
#pragma unroll
      for (int i = 0; i < BLOCKS_PER_WG; ++i) {
        wgmma_fence_operands(acc[i]);
        if constexpr (SILU) wgmma_fence_operands(xxt[i]);
      }
      if (c > 0 && threadIdx.x % 128 == 0) mbarrier_arrive(empty + 8 * ((c - 1) % kStages));
    }
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < BLOCKS_PER_WG; ++i) {
      wgmma_fence_operands(acc[i]);
      if constexpr (SILU) {
        wgmma_fence_operands(xxt[i]);
        if (busy) store_diagonal(xxt[i], row_sumsq + (wg + kConsumers * i) * 64);
      }
    }
    // SILU: this warpgroup's rows' sums are in row_sumsq (barrier 2 or 3: its own).
    // Each row's sum is read by lanes of the warp that wrote it, so a __syncwarp
    // would do as well.
    if constexpr (SILU) asm volatile("bar.sync %0, 128;" ::"r"(2 + wg) : "memory");
  }
  pdl_launch_dependents();

  // SILU writes BN / 2 outputs a tile into rows of n / 2.
  const int y_cols = SILU ? n / 2 : n;
  T* const y_tile = y + static_cast<int64_t>(m0) * y_cols + (SILU ? n0 / 2 : n0);
  const int hidden = num_chunks * kBK;  // SILU: x's row length, for its rms

  if (splits == 1) {
    if (warpgroup == 0) return;
#pragma unroll
    for (int i = 0; i < BLOCKS_PER_WG; ++i) {
      const int blk = warpgroup - 1 + kConsumers * i;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = blk * 64 + row_in_block + 8 * half;
        if (row >= m_cta) continue;
        T* y_row = y_tile + static_cast<int64_t>(row) * y_cols + col_in_pair;
        if constexpr (SILU) {
          // Gate's columns are the tile's first BN / 2, up's the next: the
          // same thread holds column c of both (groups j and j + BN / 16).
          const float scale = inv_rms(row_sumsq[row], hidden, eps);
#pragma unroll
          for (int j = 0; j < BN / 16; ++j) {
            const float* g = &acc[i][4 * j + 2 * half];
            const float* u = &acc[i][4 * (j + BN / 16) + 2 * half];
            store_pair(y_row + 8 * j,
                       silu_mul<T, true>(round_to<T>(g[0]), round_to<T>(u[0]), scale),
                       silu_mul<T, true>(round_to<T>(g[1]), round_to<T>(u[1]), scale), false);
          }
        } else {
#pragma unroll
          for (int j = 0; j < BN / 8; ++j) {
            store_pair(y_row + 8 * j, acc[i][4 * j + 2 * half], acc[i][4 * j + 2 * half + 1],
                       accumulate);
          }
        }
      }
    }
    return;
  }

  // Split K: each CTA leaves its partial tile in its own shared memory (the
  // ring is free once both consumers are past their last stage) ...
  if (warpgroup > 0) {
    asm volatile("bar.sync 1, %0;" ::"n"(128 * kConsumers) : "memory");
    float* part = reinterpret_cast<float*>(smem_raw + (ring - smem_u32(smem_raw)));
#pragma unroll
    for (int i = 0; i < BLOCKS_PER_WG; ++i) {
      const int blk = warpgroup - 1 + kConsumers * i;
      if (blk * 64 >= m_cta) continue;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float* p = part + (blk * 64 + row_in_block + 8 * half) * kPartStride + col_in_pair;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
          *reinterpret_cast<float2*>(p + 8 * j) =
              make_float2(acc[i][4 * j + 2 * half], acc[i][4 * j + 2 * half + 1]);
        }
        // SILU: the row's partial sum of squares in its padding (lane % 4 == 0: p is
        // the row's first column).
        if (SILU && lane % 4 == 0) p[BN] = row_sumsq[blk * 64 + row_in_block + 8 * half];
      }
    }
  }
  cluster_sync();
  // ... and CTA r of the cluster sums rows [r * rows, (r + 1) * rows) of the
  // tile over all of them, in rank order, four columns per thread.
  const int rows = (m_cta + splits - 1) / splits;
  const int row0 = split * rows;
  constexpr int kOutCols = SILU ? BN / 2 : BN;  // outputs of a row of the tile
  const int items = max(0, min(m_cta, row0 + rows) - row0) * (kOutCols / 4);
  for (int it = threadIdx.x; it < items; it += kThreads) {
    const int row = row0 + it / (kOutCols / 4);
    const int col = it % (kOutCols / 4) * 4;
    const uint32_t addr = ring + (row * kPartStride + col) * 4;
    if constexpr (SILU) {
      // Gate's four columns, up's four (BN / 2 further) and the row's sum of squares.
      const float4 g = sum_over_ranks(addr, splits);
      const float4 u = sum_over_ranks(addr + BN / 2 * 4, splits);
      const float scale =
          inv_rms(sum_over_ranks(ring + (row * kPartStride + BN) * 4, splits).x, hidden, eps);
      auto out = [&](float gv, float uv) {
        return silu_mul<T, true>(round_to<T>(gv), round_to<T>(uv), scale);
      };
      T* y_out = y_tile + static_cast<int64_t>(row) * y_cols + col;
      store_pair(y_out, out(g.x, u.x), out(g.y, u.y), false);
      store_pair(y_out + 2, out(g.z, u.z), out(g.w, u.w), false);
    } else {
      const float4 sum = sum_over_ranks(addr, splits);
      T* out = y_tile + static_cast<int64_t>(row) * y_cols + col;
      store_pair(out, sum.x, sum.y, accumulate);
      store_pair(out + 2, sum.z, sum.w, accumulate);
    }
  }
  cluster_sync();  // no CTA leaves while another still reads its tile
#else
  __trap();  // built without sm_90a: the host never launches it (wgmma_gemm_supported)
#endif
}
// --8<-- [end:kernel]

// --8<-- [start:plan]
// How a product is cut into CTAs: tiles of `bn` outputs (128 or 64) by
// `rows` rows of x (128, or 256 in one CTA), each tile's K split among the
// `splits` CTAs of a cluster.
struct Plan {
  int rows = 128;
  int splits = 1;
  int bn = 128;
};

// A rough time of a plan, in SM cycles: the waves of clusters times what one
// CTA does. Per 64-wide slice of K a CTA copies BN x 64 of W (16 or 8 KB,
// counted at 64 bytes a cycle) and 8 KB per 64 rows of x (mostly from L2,
// counted at four times that rate), while its products are counted at 1.5 BN
// cycles per block of 64 rows, and 1.5 x 64 more with SILU (x xᵀ). A consumer
// multiplies each of its blocks, filled or not, unless it has no rows at all
// (the second, in a CTA of 64 rows or fewer). A split adds the sum of the
// partial tiles through distributed shared memory. The constants were fitted by hand
// to a sweep of every plan on an H200 (benchmarks/kernels.py --tables
// gemm_plans silu_plans): at Qwen3-0.6B's shapes up to 128 rows the plan they
// pick is the sweep's fastest, but for down_proj at 32 and 64 rows, 0.67 and
// 0.34 us behind it (there a split of K over clusters of 8 with tiles of 128
// wins; no setting of these constants we tried picks that without a worse plan
// elsewhere).
double plan_cycles(const Plan& plan, int m, int n, int num_chunks, int clusters_at_once,
                   bool silu) {
  const int m_tiles = ceil_div(m, plan.rows);
  const int waves = ceil_div(n / plan.bn * m_tiles, std::max(clusters_at_once, 1));
  const int x_blocks = std::min(ceil_div(m, 64), plan.rows / 64);
  const int chunks = ceil_div(num_chunks, plan.splits);
  const int busy_blocks = std::min(x_blocks, kConsumers) * (plan.rows / 128);
  const double copy = 2.0 * plan.bn + 32.0 * x_blocks;
  const double multiply = 1.5 * (plan.bn + (silu ? 64.0 : 0.0)) * busy_blocks;
  const double per_chunk = std::max(copy, multiply);
  const double reduce = plan.splits > 1 ? 600.0 + 24.0 * std::min(m, plan.rows) * plan.bn / 128 +
                                              400.0 * plan.splits
                                        : 0.0;
  return waves * (500.0 + chunks * per_chunk + reduce);
}

// The cheapest plan by plan_cycles: tiles of 128 or 64 outputs, 128-row
// tiles (and 256 in one CTA when m > 128), every split of up to
// kGemmDefaultMaxSplits that cuts K evenly; or the tile width, rows and
// splits the caller forced (0: not forced).
// A cluster's CTAs must sit on SMs of one GPC: at one CTA per SM, an H200
// runs 30 clusters of 4, not 132 / 4 = 33 (max_active_clusters says how many).
Plan choose_plan(const void* kernel, size_t smem, int m, int n, int num_chunks,
                 int forced_rows, int forced_splits, int forced_bn, bool silu) {
  Plan best;
  double best_cycles = 0.0;
  for (const int bn : {128, 64}) {
    if (forced_bn && bn != forced_bn) continue;
    for (const int rows : {128, 256}) {
      if (forced_rows ? rows != forced_rows : rows == 256 && m <= 128) continue;
      for (int splits = 1; splits <= std::min(kMaxSplits, num_chunks); ++splits) {
        const bool even = ceil_div(num_chunks, ceil_div(num_chunks, splits)) == splits;
        if (forced_splits ? splits != std::min(forced_splits, num_chunks)
                          : !even || splits > kGemmDefaultMaxSplits) {
          continue;
        }
        const Plan plan{rows, ceil_div(num_chunks, ceil_div(num_chunks, splits)), bn};
        const double cycles = plan_cycles(
            plan, m, n, num_chunks, max_active_clusters(kernel, kThreads, smem, plan.splits),
            silu);
        if (best_cycles == 0.0 || cycles < best_cycles) {
          best = plan;
          best_cycles = cycles;
        }
      }
    }
  }
  return best;
}
// --8<-- [end:plan]

// The kernel for 64 * kConsumers * BLOCKS_PER_WG rows per CTA, set up for
// its shared memory and for clusters of up to 16.
template <typename T, int BLOCKS_PER_WG, int BN, bool SILU>
const void* prepared_kernel() {
  const void* kernel =
      reinterpret_cast<const void*>(gemm_wgmma_kernel<T, BLOCKS_PER_WG, BN, SILU>);
  static const bool large_clusters = [&] {
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1),
               "gemm_wgmma: allow clusters of 16");
    return true;
  }();
  (void)large_clusters;
  allow_dynamic_smem(kernel, Layout<BLOCKS_PER_WG, BN>::kSmemBytes);
  return kernel;
}

template <typename T, int BLOCKS_PER_WG, int BN, bool SILU>
void launch(const GemvParams& p, int splits, cudaStream_t stream) {
  using L = Layout<BLOCKS_PER_WG, BN>;
  prepared_kernel<T, BLOCKS_PER_WG, BN, SILU>();
  const int tiles = p.n / BN;
  const int num_chunks = p.k / kBK;
  const int per = ceil_div(num_chunks, splits);

  const int box_rows = std::min(ceil_div(p.m, 64) * 64, L::kRows);
  const uint64_t x_sizes[2] = {static_cast<uint64_t>(p.k), static_cast<uint64_t>(p.m)};
  const uint64_t x_strides[1] = {static_cast<uint64_t>(p.x_stride) * 2};
  const uint32_t x_box[2] = {kBK, static_cast<uint32_t>(box_rows)};
  const uint64_t w_sizes[2] = {static_cast<uint64_t>(p.k), static_cast<uint64_t>(p.n)};
  const uint64_t w_strides[1] = {static_cast<uint64_t>(p.k) * 2};
  const uint32_t w_box[2] = {kBK, SILU ? BN / 2 : BN};  // SILU: gate's rows, then up's
  const CUtensorMap x_map = make_tensor_map(p.x, p.dtype, 2, x_sizes, x_strides, x_box);
  const CUtensorMap w_map = make_tensor_map(p.w, p.dtype, 2, w_sizes, w_strides, w_box);

  launch_kernel_in_clusters(gemm_wgmma_kernel<T, BLOCKS_PER_WG, BN, SILU>,
                            dim3(tiles, splits, ceil_div(p.m, L::kRows)), dim3(kThreads),
                            dim3(1, splits, 1), L::kSmemBytes, stream, "gemm_wgmma", x_map,
                            w_map, static_cast<T*>(p.y), p.m, p.n, per, num_chunks,
                            p.accumulate, p.silu_eps);
}

template <typename T, bool SILU>
void dispatch(const GemvParams& p, cudaStream_t stream) {
  // Every layout takes the same shared memory: the same clusters fit at once.
  static_assert(Layout<1, 128>::kSmemBytes == Layout<2, 64>::kSmemBytes);
  // SILU takes 128 rows a CTA: at 256 with tiles of 128 outputs, x xᵀ's
  // accumulators beside the product's spill out of the registers.
  const Plan plan =
      choose_plan(prepared_kernel<T, 1, 128, SILU>(), Layout<1, 128>::kSmemBytes, p.m, p.n,
                  p.k / kBK, SILU ? 128 : p.rows_per_cta, p.splits, p.tile_n, SILU);
  if constexpr (SILU) {
    plan.bn == 128 ? launch<T, 1, 128, true>(p, plan.splits, stream)
                   : launch<T, 1, 64, true>(p, plan.splits, stream);
  } else if (plan.bn == 128) {
    plan.rows == 128 ? launch<T, 1, 128, false>(p, plan.splits, stream)
                     : launch<T, 2, 128, false>(p, plan.splits, stream);
  } else {
    plan.rows == 128 ? launch<T, 1, 64, false>(p, plan.splits, stream)
                     : launch<T, 2, 64, false>(p, plan.splits, stream);
  }
}

}  // namespace

bool wgmma_gemm_supported() {
#ifdef MINI_VLLM_HAS_SM90A
  return device_attribute(cudaDevAttrComputeCapabilityMajor) == 9 &&
         device_attribute(cudaDevAttrComputeCapabilityMinor) == 0;
#else
  return false;
#endif
}

void gemm_wgmma(const GemvParams& p, cudaStream_t stream) {
  if (!wgmma_gemm_supported()) {
    throw std::invalid_argument(
        "gemm_wgmma needs an sm_90 GPU (H100/H200) and a build for the 90a target");
  }
  if (p.m < 1 || p.m > kGemmMaxRows) {
    throw std::invalid_argument("gemm_wgmma: m must be 1 to " + std::to_string(kGemmMaxRows));
  }
  if (p.n <= 0 || p.n % 128 || p.k <= 0 || p.k % kBK) {
    throw std::invalid_argument("gemm_wgmma: n must be a multiple of 128 and k of 64");
  }
  if (p.splits < 0 || p.splits > kMaxSplits) {
    throw std::invalid_argument("gemm_wgmma: splits must be 0 (the kernel's choice) to 16");
  }
  if (p.rows_per_cta != 0 && p.rows_per_cta != 128 && p.rows_per_cta != 256) {
    throw std::invalid_argument("gemm_wgmma: rows_per_cta must be 0 (the kernel's choice), 128 or 256");
  }
  if (p.tile_n != 0 && p.tile_n != 64 && p.tile_n != 128) {
    throw std::invalid_argument("gemm_wgmma: tile_n must be 0 (the kernel's choice), 64 or 128");
  }
  if (p.silu_mul && (p.accumulate || p.rows_per_cta == 256)) {
    throw std::invalid_argument(
        "gemm_wgmma: silu_mul writes a new output (no accumulate), 128 rows per CTA");
  }
  if (p.dtype == DType::kBFloat16) {
    p.silu_mul ? dispatch<__nv_bfloat16, true>(p, stream)
               : dispatch<__nv_bfloat16, false>(p, stream);
  } else if (p.dtype == DType::kFloat16) {
    p.silu_mul ? dispatch<__half, true>(p, stream) : dispatch<__half, false>(p, stream);
  } else {
    throw std::invalid_argument("gemm_wgmma: dtype must be float16 or bfloat16");
  }
}

}  // namespace mini_vllm
