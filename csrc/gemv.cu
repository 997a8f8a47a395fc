// Skinny GEMM for decode steps (phase 9): y[M, N] = x[M, K] @ W[N, K]^T, M <= 16.
//
// In a decode step of a few sequences every linear layer multiplies a handful
// of activation rows (one per sequence) by a weight matrix of millions of
// elements. Each weight element is used M times, once per row: at M = 1 that
// is 2 FLOPs per 2-byte weight, 1 FLOP per byte, two hundred times less than
// the H200 needs per byte to be compute-bound. The product costs the time it
// takes to read the weight once. cuBLAS runs these shapes as GEMM tiles with
// split-K reductions and reaches a third of the copy bandwidth on the
// smaller matrices. This kernel is built to stream W:
//
//   - every byte of W is read once, with 16-byte loads that skip L1;
//   - x (at most 16 x K elements, a few KB) is read through L1, which keeps
//     it for all the blocks of an SM;
//   - the multiply-adds run on the tensor cores (mma.sync m16n8k16: a 16 x 16
//     tile of W times a 16 x 8 tile of x^T, summed in float32). On the CUDA
//     cores a weight element costs a conversion and M float32 FMAs; at M = 8
//     that made a first version of this kernel compute-bound, at 50-65 % of
//     the copy bandwidth. On the tensor cores M = 8 costs what M = 1 does,
//     and 9 to 16 rows take a second mma per W fragment (two column tiles);
//   - the S warps that share a tile (split-K) add their partial sums through
//     shared memory in a fixed order; each output is rounded once, as cuBLAS
//     rounds it.
//
// With SILU (GemvParams::silu_mul) W is gate_up_proj's [gate; up] and the
// kernel writes silu(s gate) * (s up) itself, s = 1 / rms(x) (the folded
// norm's row scale): a tile pairs 8 rows of gate with the same 8 rows of up,
// and each lane adds up the squares of the x it loads anyway.
//
// Work layout. A *tile* is 16 consecutive rows of W (output features), the
// M of one mma. S warps (1 to 16) share a tile, each summing an interleaved
// slice of K in chunks of 32 elements, kU chunks at a time; a block holds
// max(4, S) warps, that is max(4, S) / S tiles.
#include <string>

#include "common.cuh"
#include "gemv_params.h"
#include "mma.cuh"
#include "pdl.cuh"
#include "silu_mul.cuh"

namespace mini_vllm {
namespace {

constexpr int kTileRows = 16;  // rows of W per tile: the M of mma.m16n8k16
constexpr int kChunk = 32;     // elements of K per warp step: 4 lanes x 8 (two mma's k)
constexpr int kU = 4;          // chunks per batch: 2 kU 16-byte loads of W per lane
constexpr int kMaxSplits = 16; // warps per tile: a block of at most 512 threads

// x: a few KB read by every block. A read-only load that allocates in L1, so
// that the blocks of an SM after the first find it there (W goes around L1).
__device__ __forceinline__ uint4 load_cached16(const void* ptr) {
  return __ldg(reinterpret_cast<const uint4*>(ptr));
}

// W: read once. Around L1 like load_stream16, plus a hint that an L2 miss
// should fetch the whole 128-byte line: a warp asks for 64 bytes of each of
// its rows per chunk, and the rest of the line is the next chunk, which this
// or a neighbouring warp of the tile asks for a moment later. Whole lines
// make fewer, longer DRAM accesses; on the H200 it was worth 5-10 % on the
// large matrices.
__device__ __forceinline__ uint4 load_w16(const void* ptr) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.L2::128B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(ptr));
  return r;
}

// --8<-- [start:mma]
// One chunk of 32 elements of K: lane (g, q) holds 8 consecutive elements
// k0 .. k0 + 7 (k0 = 8 q within the chunk) of W's rows g and g + 8 and of
// x's row g. A sum over K does not care in which order the k's enter it, so
// the mma's k positions 2q, 2q + 1, 2q + 8, 2q + 9 take k0 .. k0 + 3 in the
// first mma and k0 + 4 .. k0 + 7 in the second: the same mapping for W and
// for x, which is all that matters. Each 16-byte load feeds the tensor core
// as it is, with no shuffling of registers.
template <typename T>
__device__ __forceinline__ void mma_chunk(float (&d)[4], const uint4& w_lo, const uint4& w_hi,
                                          const uint4& xv) {
  mma_16x8x16<T>(d, w_lo.x, w_hi.x, w_lo.y, w_hi.y, xv.x, xv.y);
  mma_16x8x16<T>(d, w_lo.z, w_hi.z, w_lo.w, w_hi.w, xv.z, xv.w);
}
// --8<-- [end:mma]

// --8<-- [start:gemv]
// One tile of 16 rows of W per S warps, times NT column tiles of 8 rows of x
// (NT mma's share each W fragment). Lane (g, q) = (lane / 4, lane % 4).
// SILU (GemvParams::silu_mul): W is [gate; up], n = 2 d rows; a tile takes 8
// rows of gate as its rows 0-7 and the same 8 rows of up as its rows 8-15,
// and writes silu(s gate) * (s up) for those 8 outputs, s = 1 / rms(x's row).
template <typename T, int NT, int S, bool PRELOAD, bool SILU>
__global__ void __launch_bounds__(32 * (S > 4 ? S : 4)) gemv_kernel(
    T* __restrict__ y, const T* __restrict__ x, const T* __restrict__ w, int m, int n, int k,
    int64_t x_stride, bool accumulate, float eps) {
  constexpr int NW = S > 4 ? S : 4;  // warps per block
  constexpr int G = NW / S;          // tiles per block
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, q = lane % 4;
  const int tile = blockIdx.x * G + warp / S;
  const int row0 = tile * kTileRows;  // the tile's first row of W (SILU: output 8 tile first)
  const int split = warp % S;         // this warp's slice of K
  const int num_vec = k / 8;          // 16-byte vectors per row
  const int num_chunks = (k + kChunk - 1) / kChunk;

  // Rows past n (the last tile of a ragged n) read row n - 1 again, and
  // rows of x past m read row m - 1: every load stays in bounds and the
  // loop needs no branch on them; those outputs are never stored. SILU:
  // gate row 8 t + g and up row n / 2 + 8 t + g (n / 2 is a multiple of 8;
  // a tile past the last, in a block's last group, reads the last again).
  const int t = min(tile, n / 16 - 1);
  const T* w_lo = w + static_cast<int64_t>(SILU ? 8 * t + g : min(row0 + g, n - 1)) * k;
  const T* w_hi =
      w + static_cast<int64_t>(SILU ? n / 2 + 8 * t + g : min(row0 + g + 8, n - 1)) * k;
  const T* xr[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) xr[j] = x + min(8 * j + g, m - 1) * x_stride;

  // Chunks split, split + S, ... of K, kU at a time: a batch's loads of W
  // and x come first in the program, then its mma's, so that the loads are
  // on their way together (the compiler keeps as many in flight as
  // registers let it). The lane's vector of chunk c0 + u S is
  // v = (c0 + u S) * 4 + q; past the end of the row (the last chunk of a K
  // that is not a multiple of 32, or a chunk past the end) it loads vector 0
  // instead, to stay in bounds, and uses zeros.
  uint4 a_lo[kU], a_hi[kU], b[kU][NT];
  auto load_w = [&](int c0) {
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int v = (c0 + u * S) * (kChunk / 8) + q;
      const int off = v < num_vec ? v * 8 : 0;
      a_lo[u] = load_w16(w_lo + off);
      a_hi[u] = load_w16(w_hi + off);
      if (v >= num_vec) a_lo[u] = a_hi[u] = make_uint4(0, 0, 0, 0);
    }
  };
  auto load_x = [&](int c0) {
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int v = (c0 + u * S) * (kChunk / 8) + q;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        b[u][j] = load_cached16(xr[j] + (v < num_vec ? v * 8 : 0));
        if (v >= num_vec) b[u][j] = make_uint4(0, 0, 0, 0);
      }
    }
  };

  // --8<-- [start:gemv_preload]
  // Launched with PDL (pdl.cuh): x comes from the kernel before. W depends on
  // no kernel: with PRELOAD (see launch_gemv) the first batch of it is loaded
  // before the wait, while the kernel before still runs. For Qwen3-0.6B's
  // layers that is all the W a warp reads.
  if (PRELOAD) load_w(split);
  pdl_launch_dependents();
  pdl_wait();
  float d[NT][4] = {};
  float sumsq[NT] = {};  // SILU: x row 8 j + g, this lane's elements of it
  for (int c0 = split; c0 < num_chunks; c0 += kU * S) {
    if (!PRELOAD || c0 != split) load_w(c0);
    load_x(c0);
#pragma unroll
    for (int u = 0; u < kU; ++u) {
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        mma_chunk<T>(d[j], a_lo[u], a_hi[u], b[u][j]);
        if constexpr (SILU) {
          float f[8];
          unpack8<T>(b[u][j], f);
#pragma unroll
          for (int e = 0; e < 8; ++e) sumsq[j] += f[e] * f[e];
        }
      }
    }
  }
  if constexpr (SILU) {  // the four lanes of a row: the warp's slice of K
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      sumsq[j] += __shfl_xor_sync(0xffffffffu, sumsq[j], 1);
      sumsq[j] += __shfl_xor_sync(0xffffffffu, sumsq[j], 2);
    }
  }
  // --8<-- [end:gemv_preload]

  // d[j][0], d[j][1]: W row row0 + g, x rows 8j + 2q, 8j + 2q + 1; d[j][2],
  // d[j][3]: W row row0 + g + 8. The S warps' partial tiles are added in a
  // fixed order, one column tile at a time (shared memory for one).
  if constexpr (S > 1) {
    __shared__ float4 partial[NW][32];
    __shared__ float partial_sumsq[SILU ? NW : 1][32];
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      if (j > 0) __syncthreads();
      partial[warp][lane] = make_float4(d[j][0], d[j][1], d[j][2], d[j][3]);
      if constexpr (SILU) partial_sumsq[warp][lane] = sumsq[j];
      __syncthreads();
      if (split == 0) {
#pragma unroll
        for (int s = 1; s < S; ++s) {
          const float4 p = partial[warp + s][lane];
          d[j][0] += p.x;
          d[j][1] += p.y;
          d[j][2] += p.z;
          d[j][3] += p.w;
          if constexpr (SILU) sumsq[j] += partial_sumsq[warp + s][lane];
        }
      }
    }
    if (split != 0) return;
  }
  if constexpr (SILU) {
    // d[j][i] and d[j][i + 2] (i = 0, 1): gate and up of output 8 tile + g for
    // x row 8 j + 2 q + i, whose sum of squares lane (2 q + i, *) holds.
    const int d_out = n / 2;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float scale = inv_rms(__shfl_sync(0xffffffffu, sumsq[j], 4 * (2 * q + i)), k, eps);
        const int r = 8 * j + 2 * q + i;
        if (r < m && 8 * tile < d_out) {
          y[static_cast<int64_t>(r) * d_out + 8 * tile + g] = TypeTraits<T>::from_float(
              silu_mul<T, true>(round_to<T>(d[j][i]), round_to<T>(d[j][i + 2]), scale));
        }
      }
    }
  } else {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = row0 + g + (i / 2) * 8, r = 8 * j + 2 * q + i % 2;
        if (r < m && row < n) {
          // accumulate: y += x W^T (a residual stream updated in place), one rounding.
          T* out = y + static_cast<int64_t>(r) * n + row;
          *out = TypeTraits<T>::from_float(accumulate ? d[j][i] + TypeTraits<T>::to_float(*out)
                                                      : d[j][i]);
        }
      }
    }
  }
}
// --8<-- [end:gemv]

// --8<-- [start:gemv_splits]
// Warps per tile: split K as far as it goes while every warp still has a
// whole batch (kU chunks) of it. More, shorter warps put more loads in
// flight at once and leave a shorter tail when the last ones finish; past
// one batch per warp a split only adds partial sums. Matrices of more than
// 1024 tiles (N > 16384) fill the GPU anyway: at most 8 warps per tile there,
// smaller blocks. On the H200 this picks, for Qwen3-0.6B at up to 8 rows,
// S = 8 for qkv_proj, gate_up_proj and lm_head (K = 1024) and 16 for o_proj
// and down_proj (N = 1024: 64 tiles); each was within a few % of the best S.
int choose_splits(int n, int k) {
  const int num_chunks = ceil_div(k, kChunk);
  const int max_splits = ceil_div(n, kTileRows) > 1024 ? 8 : kMaxSplits;
  int s = 1;
  while (s < max_splits && 2 * s * kU <= num_chunks) s *= 2;
  return s;
}
// --8<-- [end:gemv_splits]

// --8<-- [start:gemv_launch]
// The first batch of W is loaded before the wait only when every block is
// resident from the start: blocks of a later wave start after the kernel
// before has finished, so they gain nothing, while the first wave's early
// loads take bandwidth from that kernel's last blocks (back-to-back calls of
// the 0.6B LM head, 9,496 blocks, were slower with them). Qwen3-0.6B's
// layers are one wave or less.
template <typename T, int NT, int S, bool SILU>
void launch_gemv(const GemvParams& p, cudaStream_t stream) {
  constexpr int NW = S > 4 ? S : 4;
  // SILU: a tile of 8 outputs for 8 rows of gate and 8 of up, the same count.
  const int blocks = ceil_div(ceil_div(p.n, kTileRows), NW / S);
  const auto early = gemv_kernel<T, NT, S, true, SILU>;
  const int wave = resident_blocks_per_sm(reinterpret_cast<const void*>(early), 32 * NW, 0) *
                   device_attribute(cudaDevAttrMultiProcessorCount);
  launch_kernel(blocks <= wave ? early : gemv_kernel<T, NT, S, false, SILU>, dim3(blocks),
                dim3(32 * NW), 0, stream, "gemv", static_cast<T*>(p.y),
                static_cast<const T*>(p.x), static_cast<const T*>(p.w), p.m, p.n, p.k,
                p.x_stride, p.accumulate, p.silu_eps);
}
// --8<-- [end:gemv_launch]

// Column tiles of 8 rows of x: one up to 8 rows, two up to 16.
template <typename T, int S>
void launch_gemv_nt(const GemvParams& p, int nt, cudaStream_t stream) {
  if (p.silu_mul) {
    switch (nt) {
      case 1: return launch_gemv<T, 1, S, true>(p, stream);
      case 2: return launch_gemv<T, 2, S, true>(p, stream);
      default: throw std::invalid_argument("gemv: column tiles must be 1 or 2");
    }
  }
  switch (nt) {
    case 1: return launch_gemv<T, 1, S, false>(p, stream);
    case 2: return launch_gemv<T, 2, S, false>(p, stream);
    default: throw std::invalid_argument("gemv: column tiles must be 1 or 2");
  }
}

template <typename T>
void launch_gemv_t(const GemvParams& p, int nt, int splits, cudaStream_t stream) {
  switch (splits) {
    case 1: return launch_gemv_nt<T, 1>(p, nt, stream);
    case 2: return launch_gemv_nt<T, 2>(p, nt, stream);
    case 4: return launch_gemv_nt<T, 4>(p, nt, stream);
    case 8: return launch_gemv_nt<T, 8>(p, nt, stream);
    case 16: return launch_gemv_nt<T, 16>(p, nt, stream);
    default: throw std::invalid_argument("gemv: splits must be 0, 1, 2, 4, 8 or 16");
  }
}

bool aligned16(const void* ptr) { return reinterpret_cast<std::uintptr_t>(ptr) % 16 == 0; }

}  // namespace

void gemv(const GemvParams& p, cudaStream_t stream) {
  if (p.n == 0) return;
  if (p.m < 1 || p.m > kGemvMaxRows) {
    throw std::invalid_argument("gemv: rows of x must be 1 to " + std::to_string(kGemvMaxRows));
  }
  if (p.n < 0 || p.k <= 0 || p.k % 8) {
    throw std::invalid_argument("gemv: k must be a positive multiple of 8 and n >= 0");
  }
  if (p.x_stride % 8 || !aligned16(p.x) || !aligned16(p.w)) {
    throw std::invalid_argument("gemv: x and w must be 16-byte aligned (x's row stride too)");
  }
  if (p.silu_mul && (p.n % 16 || p.accumulate)) {
    throw std::invalid_argument(
        "gemv: silu_mul needs n a multiple of 16 ([gate; up]) and no accumulate");
  }
  const int nt = p.m <= 8 ? 1 : 2;
  const int splits = p.splits ? p.splits : choose_splits(p.n, p.k);
  switch (p.dtype) {
    case DType::kBFloat16: return launch_gemv_t<__nv_bfloat16>(p, nt, splits, stream);
    case DType::kFloat16: return launch_gemv_t<__half>(p, nt, splits, stream);
    default: throw std::invalid_argument("gemv: dtype must be float16 or bfloat16");
  }
}

}  // namespace mini_vllm
