// The tensor-core tile of decode attention, shared by versions 7 and 8: how a
// warp copies 16 tokens of K and V into a shared-memory stage (cp.async, with
// a swizzle that keeps ldmatrix free of bank conflicts), and how it folds them
// into its online-softmax state with two mma.sync products. Chapter 8,
// "Version 7", explains every line.
#pragma once

#include "decode_common.cuh"
#include "../cp_async.cuh"
#include "../mma.cuh"

#include <stdexcept>
#include <string>

namespace mini_vllm {
namespace tc_tile {

// Tokens per warp per step: the N of two S tiles, the K of one P·V mma. A
// tile starts at a multiple of 16 tokens, so with block_size >= 16 its 16
// rows lie in one cache block (one table lookup per tile).
constexpr int kV7Tile = 16;

// Bytes of a ring of STAGES stages per warp, a stage being one tile's K and V.
template <int HEAD_DIM, int WARPS, int STAGES>
constexpr size_t ring_bytes() {
  return static_cast<size_t>(WARPS) * STAGES * 2 * kV7Tile * HEAD_DIM * 2;
}

// The ring of a CTA that serves one (group, split, sequence), and what it
// becomes after the loop: the end-of-CTA merge area (versions 7 and 9).
template <int HEAD_DIM, int GROUP, int WARPS, int STAGES>
constexpr size_t ring_or_merge_bytes() {
  constexpr size_t ring = ring_bytes<HEAD_DIM, WARPS, STAGES>();
  constexpr size_t merge = sizeof(MergeSmem<HEAD_DIM, GROUP, WARPS * 32>);
  return ring > merge ? ring : merge;
}

// --8<-- [start:ptx]
// cp_async16, cp_async_commit and cp_async_wait: csrc/cp_async.cuh.

// Four 8x8 matrices of 16-bit elements from shared memory. Lane l gives the
// address of row l % 8 of matrix l / 8 (16 contiguous bytes); matrix j lands
// in r[j], where lane (g, c) holds its row g, columns 2c and 2c+1 (with
// .trans: its rows 2c and 2c+1 of column g), the lower index in the low half.
// The "memory" clobber keeps the read after the barrier that publishes the
// stage (cp.async.wait_group + __syncwarp) and before the one that frees it.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t smem_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr)
               : "memory");
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t smem_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr)
               : "memory");
}

// mma_16x8x16 (d += a b on the tensor cores): csrc/mma.cuh, shared with the GEMV.
// --8<-- [end:ptx]

// pack2 (two floats -> one register of two 16-bit elements): csrc/common.cuh.

// --8<-- [start:swizzle]
// Byte offset of 16-byte chunk `chunk` of row `row` in a tile of shared
// memory. A row (one token, one head) is head_dim / 8 chunks; chunk c of row
// r is stored at position c ^ (r % 8), so the 8 rows one ldmatrix matrix
// reads at the same chunk land in 8 different groups of 4 banks:
//
//   position:  0 1 2 3 4 5 6 7 | 8 ...
//   row 0:     0 1 2 3 4 5 6 7 | 8 ...     (the chunk stored there)
//   row 1:     1 0 3 2 5 4 7 6 | 9 ...
//   row 2:     2 3 0 1 6 7 4 5 | 10 ...
template <int HEAD_DIM>
__device__ __forceinline__ uint32_t tile_offset(int row, int chunk) {
  static_assert(HEAD_DIM / 8 >= 8, "the swizzle needs at least 8 chunks per row");
  return static_cast<uint32_t>(row * HEAD_DIM * 2 + ((chunk ^ (row & 7)) << 4));
}
// --8<-- [end:swizzle]

// The layout of a stage as `compute_tile` reads it: version 7's swizzle above.
// (Version 9's copy engine writes another one; it passes its own.)
template <int HEAD_DIM>
struct RowSwizzle {
  __device__ __forceinline__ static uint32_t offset(int row, int chunk) {
    return tile_offset<HEAD_DIM>(row, chunk);
  }
};

// Issue the copies of one tile (16 tokens from t0, a multiple of 16) into a
// stage: K rows at `stage`, V rows one tile further. Lane l copies chunk
// l % CPR of rows l / CPR, l / CPR + 32 / CPR, ... (CPR: chunks per row), so
// a warp-wide copy instruction reads whole rows, contiguous in global memory.
template <typename T, int HEAD_DIM>
__device__ __forceinline__ void issue_tile(uint32_t stage, int t0, int end, int lane,
                                           const int* s_blocks, int first_block, int log2_bs,
                                           int offset_mask, int64_t block_stride,
                                           int64_t token_stride, const T* k_head,
                                           const T* v_head) {
  constexpr int CPR = HEAD_DIM / 8;
  constexpr int ROWS_PER_COPY = 32 / CPR;
  constexpr uint32_t kTileBytes = kV7Tile * HEAD_DIM * 2;
  const int chunk = lane % CPR, row0 = lane / CPR;
  // The tile's 16 tokens are consecutive: one block, one table entry.
  const int64_t row_of_tile =
      static_cast<int64_t>(s_blocks[(t0 >> log2_bs) - first_block]) * block_stride +
      (t0 & offset_mask) * token_stride + chunk * 8;
  const T* k = k_head + row_of_tile;
  const T* v = v_head + row_of_tile;
#pragma unroll
  for (int i = 0; i < kV7Tile / ROWS_PER_COPY; ++i) {
    const int row = row0 + i * ROWS_PER_COPY;
    // Rows past `end` are zero-filled; their address is still inside the
    // tile's block, which the sequence owns.
    const bool valid = t0 + row < end;
    const uint32_t dst = stage + tile_offset<HEAD_DIM>(row, chunk);
    cp_async16(dst, k + row * token_stride, valid);
    cp_async16(dst + kTileBytes, v + row * token_stride, valid);
  }
}

// --8<-- [start:tile]
// Fold one tile of 16 tokens (K and V in `stage`) into the warp's state.
//   qa: Q as mma A operand, per 16 columns kc of head_dim: rows g (and g+8,
//       always zero) -> {a0, a2} = Q[g][16kc + 2c, +1], Q[g][16kc + 8 + 2c, +1]
//   m, l: head g's running max (log2 units) and this lane's share of its sum
//   o: Oᵀ, per 16 rows mt of head_dim: o[mt] = rows 16mt + g, 16mt + g + 8,
//      columns (query heads) 2c, 2c+1
template <typename T, int HEAD_DIM, typename Layout = RowSwizzle<HEAD_DIM>>
__device__ __forceinline__ void compute_tile(uint32_t stage, int t0, int end, int lane,
                                             float kscale,
                                             const uint32_t (&qa)[HEAD_DIM / 16][2],
                                             float& m, float& l,
                                             float (&o)[HEAD_DIM / 16][4]) {
  constexpr int CPR = HEAD_DIM / 8;
  constexpr uint32_t kTileBytes = kV7Tile * HEAD_DIM * 2;
  const int c = lane & 3, r8 = lane & 7, mat = lane >> 3;

  // S = Q Kᵀ as two 16x8 tiles: s[nt] holds head g x tokens 8nt + 2c, +1.
  // B operand of column-block kc (head_dim 16kc .. 16kc+15), tokens 8nt..:
  // b0 = K[8nt + g][16kc + 2c, +1] = row g, cols 2c, 2c+1 of the 8x8 matrix
  // (tokens 8nt.., chunk 2kc); b1 = the same at chunk 2kc + 1. One ldmatrix.x4
  // reads chunks 4q .. 4q+3: b0, b1 of kc = 2q, then of kc = 2q + 1.
  float s[2][4];
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
    for (int j = 0; j < 4; ++j) s[nt][j] = 0.0f;
#pragma unroll
    for (int q = 0; q < CPR / 4; ++q) {
      uint32_t b[4];
      ldmatrix_x4(b, stage + Layout::offset(8 * nt + r8, 4 * q + mat));
      mma_16x8x16<T>(s[nt], qa[2 * q][0], 0u, qa[2 * q][1], 0u, b[0], b[1]);
      mma_16x8x16<T>(s[nt], qa[2 * q + 1][0], 0u, qa[2 * q + 1][1], 0u, b[2], b[3]);
    }
  }

  // Online softmax of head g over the tile; s[nt][2], s[nt][3] are the zero
  // rows g + 8. The four lanes of quad g hold the tile's 16 tokens.
  float x[2][2];
  float mx = -INFINITY;
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const bool valid = t0 + 8 * nt + 2 * c + j < end;
      x[nt][j] = valid ? s[nt][j] * kscale : -INFINITY;
      mx = fmaxf(mx, x[nt][j]);
    }
  }
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  const float m_new = fmaxf(m, mx);
  const float m_use = m_new == -INFINITY ? 0.0f : m_new;
  const float alpha = exp2f(m - m_use);
  m = m_new;
  float sum = 0.0f;
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      x[nt][j] = exp2f(x[nt][j] - m_use);
      sum += x[nt][j];
    }
  }
  l = l * alpha + sum;
  // Oᵀ's columns in this lane are heads 2c and 2c+1, whose factors live in
  // quads 2c and 2c+1.
  const float alpha0 = __shfl_sync(0xffffffffu, alpha, 8 * c);
  const float alpha1 = __shfl_sync(0xffffffffu, alpha, 8 * c + 4);

  // Pᵀ as B operand (k: the 16 tokens, n: heads): b0 = P[g][2c, 2c+1],
  // b1 = P[g][2c+8, 2c+9], exactly what this lane holds.
  const uint32_t pb0 = pack2<T>(x[0][0], x[0][1]);
  const uint32_t pb1 = pack2<T>(x[1][0], x[1][1]);
  // Vᵀ as A operand of rows 16mt .. 16mt+15 (head_dim): a0 = V[2c, 2c+1][16mt + g]
  // = rows 2c, 2c+1 of column g of the 8x8 matrix (tokens 0-7, chunk 2mt), read
  // with .trans; a1: chunk 2mt+1; a2, a3: tokens 8-15. Lane l addresses row
  // l % 8 + 8 (l / 16) at chunk 2mt + (l / 8) % 2.
  const uint32_t v_stage = stage + kTileBytes;
  const int v_row = r8 + 8 * (lane >> 4);
#pragma unroll
  for (int mt = 0; mt < HEAD_DIM / 16; ++mt) {
    o[mt][0] *= alpha0;
    o[mt][1] *= alpha1;
    o[mt][2] *= alpha0;
    o[mt][3] *= alpha1;
    uint32_t a[4];
    ldmatrix_x4_trans(a, v_stage + Layout::offset(v_row, 2 * mt + (mat & 1)));
    mma_16x8x16<T>(o[mt], a[0], a[1], a[2], a[3], pb0, pb1);
  }
}
// --8<-- [end:tile]

// Q of head g of the group (a zero row past it) as the A operand of the S
// product, 2 registers per 16 columns kc of head_dim: pairs 2c and 2c + 8.
// `q_group` points at the group's first head. Lanes past the group load head
// 0's row too and drop it: no branches.
template <typename T, int HEAD_DIM, int GROUP>
__device__ __forceinline__ void load_q_operand(uint32_t (&qa)[HEAD_DIM / 16][2],
                                               const T* q_group, int lane) {
  const int g = lane >> 2, c = lane & 3;
  const bool in_group = g < GROUP;
  const uint32_t* q_row =
      reinterpret_cast<const uint32_t*>(q_group + (in_group ? g : 0) * HEAD_DIM);
#pragma unroll
  for (int kc = 0; kc < HEAD_DIM / 16; ++kc) {
    const uint32_t lo = q_row[8 * kc + c], hi = q_row[8 * kc + 4 + c];
    qa[kc][0] = in_group ? lo : 0u;
    qa[kc][1] = in_group ? hi : 0u;
  }
}

// After the last tile: a warp's online-softmax state into the merge area.
// Lane (g, c) holds a quarter of head g's l (summed over its quad here), and
// Oᵀ elements of heads 2c and 2c + 1 at rows 16 mt + g and 16 mt + g + 8.
template <int HEAD_DIM, int GROUP, int NT>
__device__ __forceinline__ void stash_warp_state(MergeSmem<HEAD_DIM, GROUP, NT>& sm, int warp,
                                                 int lane, float m, float l,
                                                 const float (&o)[HEAD_DIM / 16][4]) {
  const int g = lane >> 2, c = lane & 3;
  l += __shfl_xor_sync(0xffffffffu, l, 1);  // the quad's shares -> head g's sum
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  if (c == 0 && g < GROUP) {
    sm.m[warp][g] = m;
    sm.l[warp][g] = l;
  }
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int head = 2 * c + j;
    if (head < GROUP) {
#pragma unroll
      for (int mt = 0; mt < HEAD_DIM / 16; ++mt) {
        sm.acc[warp][head][16 * mt + g] = o[mt][j];
        sm.acc[warp][head][16 * mt + g + 8] = o[mt][2 + j];
      }
    }
  }
}

// Head h's softmax state over all warps of a CTA, at head_dim element d:
// the common maximum, the sum and the weighted sum of V, each warp's share
// rescaled to that maximum.
struct MergedState {
  float m, l, acc;
};

template <int HEAD_DIM, int GROUP, int WARPS>
__device__ __forceinline__ MergedState merge_warps(const MergeSmem<HEAD_DIM, GROUP, WARPS * 32>& sm,
                                                   int h, int d) {
  MergedState r{-INFINITY, 0.0f, 0.0f};
#pragma unroll
  for (int w = 0; w < WARPS; ++w) r.m = fmaxf(r.m, sm.m[w][h]);
#pragma unroll
  for (int w = 0; w < WARPS; ++w) {
    const float a = sm.m[w][h] == -INFINITY ? 0.0f : exp2f(sm.m[w][h] - r.m);
    r.l += sm.l[w][h] * a;
    r.acc += sm.acc[w][h][d] * a;
  }
  return r;
}

// The end of a CTA of one (group, split, sequence): merge its warps' states
// (stashed in `sm`) into the group's output row `out` when the sequence has
// one split, else into its partial result and (m, l) for the combine kernel.
template <typename T, int HEAD_DIM, int GROUP, int WARPS>
__device__ __forceinline__ void merge_warps_and_store(
    const MergeSmem<HEAD_DIM, GROUP, WARPS * 32>& sm, const DecodeParams& p, T* out,
    int64_t out_row, int split, int num_splits) {
  const int64_t part = out_row * p.max_splits + split;
  for (int idx = threadIdx.x; idx < GROUP * HEAD_DIM; idx += WARPS * 32) {
    const int h = idx / HEAD_DIM, d = idx % HEAD_DIM;
    const MergedState s = merge_warps<HEAD_DIM, GROUP, WARPS>(sm, h, d);
    if (num_splits == 1) {
      out[h * HEAD_DIM + d] = TypeTraits<T>::from_float(s.acc / s.l);
    } else {
      const int64_t at = part + static_cast<int64_t>(h) * p.max_splits;
      p.part_out[at * HEAD_DIM + d] = s.acc / s.l;
      if (d == 0) {
        p.part_ml[at * 2 + 0] = s.m;
        p.part_ml[at * 2 + 1] = s.l;
      }
    }
  }
}

// The checks the launchers of v7 and v9 make (v8 ignores the partition), with
// the version's name in the message. Returns log2(block_size).
inline int check_tiled_decode(const DecodeParams& p, const char* version) {
  const std::string v = version;
  if (p.partition_size & (p.partition_size - 1)) {
    throw std::invalid_argument("partition_size must be a power of two");
  }
  const int log2_bs = log2_exact(p.block_size);
  if (p.block_size < kV7Tile) {
    throw std::invalid_argument(v + " needs block_size >= 16, got " +
                                std::to_string(p.block_size));
  }
  if (p.max_splits > 1 && (p.part_out == nullptr || p.part_ml == nullptr)) {
    throw std::invalid_argument("split-K needs the part_out / part_ml workspace");
  }
  if (p.max_splits > 1 && p.partition_size % kV7Tile != 0) {
    throw std::invalid_argument(v + " needs partition_size >= 16 with split-K, got " +
                                std::to_string(p.partition_size));
  }
  return log2_bs;
}

}  // namespace tc_tile
}  // namespace mini_vllm
