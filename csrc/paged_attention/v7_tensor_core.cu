// Version 7: the scores and the weighted sum of V on the tensor cores.
//
// Versions 2-6 compute each score on the CUDA cores: 16 threads unpack a
// token's K row to float, multiply-add it with the query, reduce with a
// 4-step shuffle butterfly, then multiply-add the V row into 8 accumulators
// per query head. Per byte of K/V that is about four times the instructions
// cuDNN's flash kernel issues (chapter 8, "Against PyTorch"). Here a warp
// takes 16 tokens at a time and does both products as mma.sync.m16n8k16
// tiles (bf16 or fp16 in, fp32 accumulate), over the whole GQA group of one
// KV head at once:
//
//   S  = Q · Kᵀ     M: the group's query heads, padded to 16 rows with zeros
//                   N: 8 tokens (two tiles per step), K: 16 of head_dim
//   Oᵀ += Vᵀ · Pᵀ   M: 16 of head_dim, N: 8 query heads (padded), K: the 16 tokens
//
// The padding is free (the kernel waits on memory, not on the tensor cores),
// and a group of 4 or 8 heads costs what a group of 2 does. The second
// product is written transposed because then P needs no shuffle: the fp32
// scores the first mma leaves in lane (g, c) = (lane / 4, lane % 4) — head g,
// tokens 2c, 2c+1 and 2c+8, 2c+9 — are exactly the two bf16 pairs the second
// mma wants from that lane as its B operand.
//
// Memory: each warp is its own pipeline. It copies its tiles' K and V rows
// into its own ring of STAGES shared-memory stages with 16-byte cp.async
// (global -> shared, no registers on the way), and builds the mma operands
// with ldmatrix (.trans for V). The lanes of a warp read each other's copies,
// so each step has two __syncwarp(); the CTA never waits for all its warps
// until the end-of-CTA merge.
//
//   partition:  tokens [0..15][16..31][32..47][48..63] ...   (tiles of 16)
//   warp:                 0      1      0      1     ...      (WARPS = 2)
//   ring of one warp, per stage: [K: 16 rows x head_dim][V: 16 rows x head_dim]
//   step i of a warp:  refill the stage read in step i-1 with step i+STAGES-1,
//                      wait for step i's copies, compute step i
//
// Split-K, the (m, l) bookkeeping and the combine are those of versions 3-6.
#include "decode_common.cuh"
#include "dispatch.cuh"
#include "../cp_async.cuh"
#include "../mma.cuh"

#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "version 7 needs mma.sync m16n8k16 with bf16 and cp.async (sm_80 or newer)"
#endif

namespace mini_vllm {
namespace {

// Tokens per warp per step: the N of two S tiles, the K of one P·V mma. A
// tile starts at a multiple of 16 tokens, so with block_size >= 16 its 16
// rows lie in one cache block (one table lookup per tile).
constexpr int kV7Tile = 16;
// Warps per CTA and stages per warp. One stage is 16 tokens x (K + V) x
// head_dim x 2 B = 8 KB at head_dim 128, so the default ring is 2 x 3 x 8 KB
// = 48 KB: four CTAs (8 warps) fit an H200 SM, with up to 128 KB in flight,
// and a grid of 512 CTAs (64 sequences x 8 KV heads) runs as one wave.
constexpr int kV7Warps = 2;
constexpr int kV7Stages = 3;
// A grid of at least three such waves (12 CTAs per SM) runs 4 warps of 2
// stages per CTA instead: 64 KB, three CTAs and 12 warps per SM. Measured on
// an H200 (chapter 8, `kernels.py --tables v7`), that is 1-2 % faster at 256
// sequences and up to 7 % slower at 64, where the default's grid of 512 CTAs
// fits one wave and the wide one's does not.
constexpr int kV7WideWarps = 4;
constexpr int kV7WideStages = 2;
constexpr int kV7WideMinCtasPerSm = 12;

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

// Two floats -> one register of two 16-bit elements, `lo` in the low half.
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);

template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

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

// Issue the copies of one tile (16 tokens from t0, a multiple of 16) into a
// stage: K rows at `stage`, V rows one tile further. Lane l copies chunk
// l % CPR of rows l / CPR, l / CPR + 32 / CPR, ... (CPR: chunks per row), so
// a warp-wide copy instruction reads whole rows, contiguous in global memory.
template <typename T, int HEAD_DIM>
__device__ __forceinline__ void issue_tile(uint32_t stage, int t0, int end, int lane,
                                           const int* s_blocks, int first_block, int log2_bs,
                                           int offset_mask, int64_t token_stride,
                                           const T* k_head, const T* v_head) {
  constexpr int CPR = HEAD_DIM / 8;
  constexpr int ROWS_PER_COPY = 32 / CPR;
  constexpr uint32_t kTileBytes = kV7Tile * HEAD_DIM * 2;
  const int chunk = lane % CPR, row0 = lane / CPR;
  // The tile's 16 slots are consecutive: one block, one table entry.
  const int64_t slot0 = (static_cast<int64_t>(s_blocks[(t0 >> log2_bs) - first_block])
                         << log2_bs) + (t0 & offset_mask);
  const T* k = k_head + slot0 * token_stride + chunk * 8;
  const T* v = v_head + slot0 * token_stride + chunk * 8;
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
template <typename T, int HEAD_DIM>
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
      ldmatrix_x4(b, stage + tile_offset<HEAD_DIM>(8 * nt + r8, 4 * q + mat));
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
    ldmatrix_x4_trans(a, v_stage + tile_offset<HEAD_DIM>(v_row, 2 * mt + (mat & 1)));
    mma_16x8x16<T>(o[mt], a[0], a[1], a[2], a[3], pb0, pb1);
  }
}
// --8<-- [end:tile]

// The ring, and what it becomes after the loop: the end-of-CTA merge.
template <int HEAD_DIM, int GROUP, int WARPS, int STAGES>
constexpr size_t v7_pipe_bytes() {
  constexpr size_t ring = static_cast<size_t>(WARPS) * STAGES * 2 * kV7Tile * HEAD_DIM * 2;
  constexpr size_t merge = sizeof(MergeSmem<HEAD_DIM, GROUP, WARPS * 32>);
  return ring > merge ? ring : merge;
}

// --8<-- [start:kernel]
template <typename T, int HEAD_DIM, int GROUP, int WARPS, int STAGES>
__global__ void __launch_bounds__(WARPS * 32) paged_attention_v7_kernel(DecodeParams p,
                                                                        int log2_bs) {
  static_assert(GROUP >= 1 && GROUP <= 8, "the group's heads are the 8 columns of Pᵀ");
  static_assert(STAGES >= 2, "the ring needs a stage to fill and one to read");
  constexpr int NT = WARPS * 32;
  constexpr int KC = HEAD_DIM / 16;  // 16-column blocks of head_dim
  constexpr uint32_t kStageBytes = 2 * kV7Tile * HEAD_DIM * 2;
  constexpr size_t PIPE = v7_pipe_bytes<HEAD_DIM, GROUP, WARPS, STAGES>();
  static_assert(PIPE % 16 == 0, "the table entries must start 16-byte aligned");
  // [warp 0: STAGES stages][warp 1: ...] (later the merge) | table entries
  extern __shared__ __align__(16) unsigned char v7_smem[];
  int* s_blocks = reinterpret_cast<int*>(v7_smem + PIPE);
  const int seq = blockIdx.z, split = blockIdx.y, q_head0 = blockIdx.x * GROUP;
  const int kv_head = q_head0 / (p.num_q_heads / p.num_kv_heads);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane >> 2, c = lane & 3;
  const int start = split * p.partition_size;

  // Prologue: the partition's table entries and the context length first.
  const int first_block = start >> log2_bs;
  const int table_entries = min(max(p.partition_size >> log2_bs, 1),
                                p.max_blocks_per_seq - first_block);
  const int* table = p.block_tables + static_cast<int64_t>(seq) * p.max_blocks_per_seq + first_block;
  for (int i = threadIdx.x; i < table_entries; i += NT) s_blocks[i] = table[i];
  const int ctx_entry = p.context_lens[seq];
  const int ctx = min(min(ctx_entry, p.max_blocks_per_seq << log2_bs),
                      p.max_splits * p.partition_size);
  const int end = min(ctx, start + p.partition_size);
  // Tiles of the partition; warp w takes tiles w, w + WARPS, w + 2 WARPS, ...
  const int num_tiles = start < ctx ? (end - start + kV7Tile - 1) / kV7Tile : 0;
  const int my_tiles = warp < num_tiles ? (num_tiles - warp + WARPS - 1) / WARPS : 0;
  const int64_t token_stride = static_cast<int64_t>(p.num_kv_heads) * HEAD_DIM;
  const T* k_head = static_cast<const T*>(p.k_cache) + kv_head * HEAD_DIM;
  const T* v_head = static_cast<const T*>(p.v_cache) + kv_head * HEAD_DIM;
  const int offset_mask = (1 << log2_bs) - 1;
  const uint32_t ring = static_cast<uint32_t>(__cvta_generic_to_shared(v7_smem)) +
                        warp * STAGES * kStageBytes;
  __syncthreads();  // s_blocks is ready

  // Fill all stages but one. A group is committed even when empty, so that
  // "all but the newest STAGES - 1 groups" is always "step i".
  // Launched with PDL. The table and the context length come from the host's
  // copy before the step's first kernel, which no kernel writes; the K/V of
  // every position but the newest (ctx_entry - 1) was written by earlier
  // steps. So the stages whose tile ends before the newest position are
  // filled here, while the kernel before this one (which may write the newest
  // K/V) drains; the rest, and Q (that kernel's output), after the wait.
  // --8<-- [start:early_fill]
  int filled = 0;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    const int tile_start = start + (s * WARPS + warp) * kV7Tile;
    if (s == filled && s < my_tiles && tile_start + kV7Tile < ctx_entry) {
      issue_tile<T, HEAD_DIM>(ring + s * kStageBytes, tile_start, end, lane, s_blocks,
                              first_block, log2_bs, offset_mask, token_stride, k_head, v_head);
      cp_async_commit();
      ++filled;
    }
  }
  pdl_wait();
  // --8<-- [end:early_fill]
  // Q of head g (a zero row past the group) as the A operand, 2 registers per
  // kc. Lanes past the group load head 0's row too and drop it: no branches.
  uint32_t qa[KC][2];
  {
    const bool in_group = g < GROUP;
    const uint32_t* q_row = reinterpret_cast<const uint32_t*>(
        static_cast<const T*>(p.q) + seq * p.q_stride +
        static_cast<int64_t>(q_head0 + (in_group ? g : 0)) * HEAD_DIM);
#pragma unroll
    for (int kc = 0; kc < KC; ++kc) {
      const uint32_t lo = q_row[8 * kc + c], hi = q_row[8 * kc + 4 + c];  // pairs 2c, 2c + 8
      qa[kc][0] = in_group ? lo : 0u;
      qa[kc][1] = in_group ? hi : 0u;
    }
  }
  const int64_t out_row = static_cast<int64_t>(seq) * p.num_q_heads + q_head0;
  T* out = static_cast<T*>(p.out) + out_row * HEAD_DIM;
  if (ctx <= 0) {
    if (split == 0) store_zeros<T, HEAD_DIM, GROUP, NT>(out);
    return;
  }
  if (start >= ctx) return;
  const int num_splits = (ctx + p.partition_size - 1) / p.partition_size;

  float m = -INFINITY, l = 0.0f, o[KC][4];
#pragma unroll
  for (int mt = 0; mt < KC; ++mt) {
#pragma unroll
    for (int j = 0; j < 4; ++j) o[mt][j] = 0.0f;
  }
  const float kscale = p.scale * kLog2e;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s >= filled) {
      if (s < my_tiles) {
        issue_tile<T, HEAD_DIM>(ring + s * kStageBytes, start + (s * WARPS + warp) * kV7Tile,
                                end, lane, s_blocks, first_block, log2_bs, offset_mask,
                                token_stride, k_head, v_head);
      }
      cp_async_commit();
    }
  }
  int read_stage = 0, write_stage = STAGES - 1;
  for (int i = 0; i < my_tiles; ++i) {
    __syncwarp();  // every lane is done reading the stage refilled now (step i - 1's)
    if (i + STAGES - 1 < my_tiles) {
      issue_tile<T, HEAD_DIM>(ring + write_stage * kStageBytes,
                              start + ((i + STAGES - 1) * WARPS + warp) * kV7Tile, end, lane,
                              s_blocks, first_block, log2_bs, offset_mask, token_stride,
                              k_head, v_head);
    }
    cp_async_commit();
    cp_async_wait<STAGES - 1>();  // this lane's copies of step i have landed
    __syncwarp();                 // ... and every other lane's, visible to this one
    compute_tile<T, HEAD_DIM>(ring + read_stage * kStageBytes,
                              start + (i * WARPS + warp) * kV7Tile, end, lane, kscale, qa, m,
                              l, o);
    write_stage = read_stage;
    read_stage = read_stage + 1 == STAGES ? 0 : read_stage + 1;
  }

  // Only now let the next kernel be scheduled. At the top (as the other
  // kernels do) the next kernels' CTAs, each launching the one after it
  // before it waits, pile up on the SMs while this one still reads; measured
  // in chapter 9, that made the batch-1 step slower, this placement faster.
  pdl_launch_dependents();
  // Merge the warps. The ring becomes the merge area once every copy has
  // landed and every warp is done reading.
  l += __shfl_xor_sync(0xffffffffu, l, 1);  // the quad's shares -> head g's sum
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  cp_async_wait<0>();
  __syncthreads();
  auto& sm = *reinterpret_cast<MergeSmem<HEAD_DIM, GROUP, NT>*>(v7_smem);
  if (c == 0 && g < GROUP) {
    sm.m[warp][g] = m;
    sm.l[warp][g] = l;
  }
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int head = 2 * c + j;
    if (head < GROUP) {
#pragma unroll
      for (int mt = 0; mt < KC; ++mt) {
        sm.acc[warp][head][16 * mt + g] = o[mt][j];
        sm.acc[warp][head][16 * mt + g + 8] = o[mt][2 + j];
      }
    }
  }
  __syncthreads();
  const int64_t part = out_row * p.max_splits + split;
  for (int idx = threadIdx.x; idx < GROUP * HEAD_DIM; idx += NT) {
    const int h = idx / HEAD_DIM, d = idx % HEAD_DIM;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, sm.m[w][h]);
    float sum = 0.0f, acc = 0.0f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      const float a = sm.m[w][h] == -INFINITY ? 0.0f : exp2f(sm.m[w][h] - mx);
      sum += sm.l[w][h] * a;
      acc += sm.acc[w][h][d] * a;
    }
    if (num_splits == 1) {
      out[h * HEAD_DIM + d] = TypeTraits<T>::from_float(acc / sum);
    } else {
      p.part_out[(part + static_cast<int64_t>(h) * p.max_splits) * HEAD_DIM + d] = acc / sum;
      if (d == 0) {
        p.part_ml[(part + static_cast<int64_t>(h) * p.max_splits) * 2 + 0] = mx;
        p.part_ml[(part + static_cast<int64_t>(h) * p.max_splits) * 2 + 1] = sum;
      }
    }
  }
}
// --8<-- [end:kernel]

using V7Fn = void (*)(DecodeParams, int);

struct V7Kernel {
  V7Fn fn;
  int warps;
  size_t pipe_bytes;
};

template <typename T, int HEAD_DIM, int GROUP, int WARPS, int STAGES>
V7Kernel v7_kernel() {
  return {paged_attention_v7_kernel<T, HEAD_DIM, GROUP, WARPS, STAGES>, WARPS,
          v7_pipe_bytes<HEAD_DIM, GROUP, WARPS, STAGES>()};
}

// The kernel for (warps, stages); 0 and 0 pick the default, or the wide
// pipeline for a grid of many waves. Other shapes of the pipeline are built
// for bf16 / head_dim 128 with groups of 2 and 4 only (Qwen3-0.6B and 8B),
// for tuning.
template <typename T, int HEAD_DIM, int GROUP>
V7Kernel select_v7_kernel(int warps, int stages, bool many_waves) {
  if (warps == 0 && stages == 0 && many_waves) {
    return v7_kernel<T, HEAD_DIM, GROUP, kV7WideWarps, kV7WideStages>();
  }
  const int w = warps != 0 ? warps : kV7Warps;
  const int s = stages != 0 ? stages : kV7Stages;
  if (w == kV7Warps && s == kV7Stages) {
    return v7_kernel<T, HEAD_DIM, GROUP, kV7Warps, kV7Stages>();
  }
  if (w == kV7WideWarps && s == kV7WideStages) {
    return v7_kernel<T, HEAD_DIM, GROUP, kV7WideWarps, kV7WideStages>();
  }
  if constexpr (std::is_same_v<T, __nv_bfloat16> && HEAD_DIM == 128 &&
                (GROUP == 2 || GROUP == 4)) {
#define MINI_VLLM_V7_TUNABLE(W, S) \
  if (w == W && s == S) return v7_kernel<T, HEAD_DIM, GROUP, W, S>();
    MINI_VLLM_V7_TUNABLE(1, 4)
    MINI_VLLM_V7_TUNABLE(2, 2)
    MINI_VLLM_V7_TUNABLE(2, 4)
    MINI_VLLM_V7_TUNABLE(4, 3)
#undef MINI_VLLM_V7_TUNABLE
  }
  throw std::invalid_argument("version 7 with " + std::to_string(w) + " warps and " +
                              std::to_string(s) + " stages is not built");
}

constexpr size_t kV7MaxTableBytes = 32 * 1024;

// Once per kernel and device: allow the ring plus the largest table of block
// entries (as far as the GPU allows) and ask for the largest shared-memory
// carveout. Returns the dynamic shared memory the kernel may use.
size_t allow_v7_smem(V7Fn fn, size_t pipe_bytes) {
  static std::mutex mutex;
  static std::map<std::tuple<const void*, int>, size_t> allowed;
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  const auto key = std::make_tuple(reinterpret_cast<const void*>(fn), device);
  std::lock_guard<std::mutex> lock(mutex);
  const auto it = allowed.find(key);
  if (it != allowed.end()) return it->second;
  int optin = 0;
  check_cuda(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
             "cudaDeviceGetAttribute(MaxSharedMemoryPerBlockOptin)");
  const size_t bytes = std::min(pipe_bytes + kV7MaxTableBytes, static_cast<size_t>(optin));
  check_cuda(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(bytes)),
             "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
  check_cuda(cudaFuncSetAttribute(fn, cudaFuncAttributePreferredSharedMemoryCarveout,
                                  cudaSharedmemCarveoutMaxShared),
             "cudaFuncSetAttribute(PreferredSharedMemoryCarveout)");
  allowed[key] = bytes;
  return bytes;
}

template <typename T, int HEAD_DIM, int GROUP>
struct LaunchV7 {
  static void run(const DecodeParams& p, cudaStream_t stream) {
    if constexpr (HEAD_DIM != 64 && HEAD_DIM != 128) {
      throw std::invalid_argument("version 7 supports head_dim 64 and 128, not " +
                                  std::to_string(HEAD_DIM));
    } else {
      if (p.max_splits > 1 && (p.part_out == nullptr || p.part_ml == nullptr)) {
        throw std::invalid_argument("split-K needs the part_out / part_ml workspace");
      }
      if (p.partition_size & (p.partition_size - 1)) {
        throw std::invalid_argument("partition_size must be a power of two");
      }
      const int log2_bs = log2_exact(p.block_size);
      if (p.block_size < kV7Tile) {
        throw std::invalid_argument("version 7 needs block_size >= 16, got " +
                                    std::to_string(p.block_size));
      }
      if (p.max_splits > 1 && p.partition_size % kV7Tile != 0) {
        throw std::invalid_argument("version 7 needs partition_size >= 16 with split-K, got " +
                                    std::to_string(p.partition_size));
      }
      const dim3 grid(p.num_q_heads / GROUP, p.max_splits, p.num_seqs);
      const int64_t ctas = static_cast<int64_t>(grid.x) * grid.y * grid.z;
      const V7Kernel k = select_v7_kernel<T, HEAD_DIM, GROUP>(
          p.unroll, p.stages, ctas >= static_cast<int64_t>(kV7WideMinCtasPerSm) *
                                      device_attribute(cudaDevAttrMultiProcessorCount));
      const int table_entries = std::max(1, p.partition_size >> log2_bs);
      const size_t table =
          static_cast<size_t>(std::min(table_entries, p.max_blocks_per_seq) + 1) * sizeof(int);
      const size_t allowed = allow_v7_smem(k.fn, k.pipe_bytes);
      if (table > kV7MaxTableBytes || k.pipe_bytes + table > allowed) {
        throw std::invalid_argument(
            "version 7 with " + std::to_string(k.warps) + " warps needs " +
            std::to_string(k.pipe_bytes + table) + " bytes of shared memory per CTA, more "
            "than the " + std::to_string(allowed) + " it may use here (fewer warps or stages, "
            "or a shorter partition_size / block_size)");
      }
      launch_kernel(k.fn, grid, dim3(k.warps * 32), k.pipe_bytes + table, stream,
                    "paged_attention_v7_kernel", p, log2_bs);
      launch_combine<T, HEAD_DIM>(p, stream);
    }
  }
};

}  // namespace

void paged_attention_v7(const DecodeParams& p, cudaStream_t stream) {
  dispatch_decode<LaunchV7>(p, stream);
}

}  // namespace mini_vllm
