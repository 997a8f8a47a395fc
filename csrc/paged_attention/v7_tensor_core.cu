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
#include "tensor_core_tile.cuh"
#include "../cp_async.cuh"
#include "../mma.cuh"

#include <algorithm>
#include <type_traits>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "version 7 needs mma.sync m16n8k16 with bf16 and cp.async (sm_80 or newer)"
#endif

namespace mini_vllm {
namespace {

using namespace tc_tile;

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

// --8<-- [start:kernel]
template <typename T, int HEAD_DIM, int GROUP, int WARPS, int STAGES>
__global__ void __launch_bounds__(WARPS * 32) paged_attention_v7_kernel(DecodeParams p,
                                                                        int log2_bs) {
  static_assert(GROUP >= 1 && GROUP <= 8, "the group's heads are the 8 columns of Pᵀ");
  static_assert(STAGES >= 2, "the ring needs a stage to fill and one to read");
  constexpr int NT = WARPS * 32;
  constexpr int KC = HEAD_DIM / 16;  // 16-column blocks of head_dim
  constexpr uint32_t kStageBytes = 2 * kV7Tile * HEAD_DIM * 2;
  constexpr size_t PIPE = ring_or_merge_bytes<HEAD_DIM, GROUP, WARPS, STAGES>();
  static_assert(PIPE % 16 == 0, "the table entries must start 16-byte aligned");
  // [warp 0: STAGES stages][warp 1: ...] (later the merge) | table entries
  extern __shared__ __align__(16) unsigned char v7_smem[];
  int* s_blocks = reinterpret_cast<int*>(v7_smem + PIPE);
  const int seq = p.seq_order != nullptr ? p.seq_order[blockIdx.z] : blockIdx.z;
  const int split = blockIdx.y, q_head0 = blockIdx.x * GROUP;
  const int kv_head = q_head0 / (p.num_q_heads / p.num_kv_heads);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
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
  const int64_t token_stride = p.kv_token_stride;
  const int64_t block_stride = p.kv_block_stride;
  const T* k_head = static_cast<const T*>(p.k_cache) + kv_head * p.kv_head_stride;
  const T* v_head = static_cast<const T*>(p.v_cache) + kv_head * p.kv_head_stride;
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
                              first_block, log2_bs, offset_mask, block_stride, token_stride,
                              k_head, v_head);
      cp_async_commit();
      ++filled;
    }
  }
  pdl_wait();
  // --8<-- [end:early_fill]
  // Q of head g (a zero row past the group) as the A operand, 2 registers per kc.
  uint32_t qa[KC][2];
  load_q_operand<T, HEAD_DIM, GROUP>(
      qa, static_cast<const T*>(p.q) + seq * p.q_stride + static_cast<int64_t>(q_head0) * HEAD_DIM,
      lane);
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
                                block_stride, token_stride, k_head, v_head);
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
                              s_blocks, first_block, log2_bs, offset_mask, block_stride,
                              token_stride, k_head, v_head);
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
  cp_async_wait<0>();
  __syncthreads();
  auto& sm = *reinterpret_cast<MergeSmem<HEAD_DIM, GROUP, NT>*>(v7_smem);
  stash_warp_state(sm, warp, lane, m, l, o);
  __syncthreads();
  merge_warps_and_store<T, HEAD_DIM, GROUP, WARPS>(sm, p, out, out_row, split, num_splits);
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
          ring_or_merge_bytes<HEAD_DIM, GROUP, WARPS, STAGES>()};
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
    MINI_VLLM_V7_TUNABLE(1, 2)
    MINI_VLLM_V7_TUNABLE(1, 3)
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

// Allow the ring plus the largest table of block entries (as far as the GPU
// allows). Returns the dynamic shared memory the kernel may use.
size_t allow_v7_smem(V7Fn fn, size_t pipe_bytes) {
  const size_t bytes =
      std::min(pipe_bytes + kV7MaxTableBytes,
               static_cast<size_t>(device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin)));
  allow_dynamic_smem(reinterpret_cast<const void*>(fn), bytes);
  return bytes;
}

template <typename T, int HEAD_DIM, int GROUP>
struct LaunchV7 {
  static void run(const DecodeParams& p, cudaStream_t stream) {
    if constexpr (HEAD_DIM != 64 && HEAD_DIM != 128) {
      throw std::invalid_argument("version 7 supports head_dim 64 and 128, not " +
                                  std::to_string(HEAD_DIM));
    } else {
      const int log2_bs = check_tiled_decode(p, "version 7");
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
      // --8<-- [start:v7_order]
      // The CTAs of a grid that fits at once all start together: their order
      // cannot shorten its tail (and longest first measured slower at 32
      // sequences, chapter 9). Past one wave, a CTA starts when another ends:
      // the longest sequences go first, so that the last CTAs are short ones.
      DecodeParams q = with_kv_strides(p);
      const int resident = resident_blocks_per_sm(reinterpret_cast<const void*>(k.fn),
                                                  k.warps * 32, k.pipe_bytes + table);
      if (ctas <= static_cast<int64_t>(resident) *
                      device_attribute(cudaDevAttrMultiProcessorCount)) {
        q.seq_order = nullptr;
      }
      launch_kernel(k.fn, grid, dim3(k.warps * 32), k.pipe_bytes + table, stream,
                    "paged_attention_v7_kernel", q, log2_bs);
      // --8<-- [end:v7_order]
      launch_combine<T, HEAD_DIM>(p, stream);
    }
  }
};

}  // namespace

void paged_attention_v7(const DecodeParams& p, cudaStream_t stream) {
  dispatch_decode<LaunchV7>(p, stream);
}

}  // namespace mini_vllm
