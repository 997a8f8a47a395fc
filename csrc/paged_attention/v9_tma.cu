// Version 9: version 7's tiles, copied by the Tensor Memory Accelerator (sm_90).
//
// Version 7 copies a tile of 16 tokens (K and V of one KV head, 8 KB) with
// 16 cp.async instructions per lane: 512 copies of 16 bytes, each an address
// the SM computes, issues and tracks. Hopper has a copy engine for this, the
// TMA: one lane describes a whole tile as a box of a tensor map over the
// cache, viewed as
//
//   [slots = num_blocks x block_size][kv heads][head_dim / 64][64]
//
// (a box: 16 consecutive slots x 1 head x all of head_dim, in pieces of 128
// bytes), issues two copies (K and V) and counts the tile's 8 KB on an
// mbarrier of its stage; the other lanes wait on that barrier. The copy
// engine writes each group of 8 pieces with the 128-byte swizzle (16-byte
// chunk c of piece r at chunk c ^ (r % 8)). At head_dim 64 that is v7's
// hand-made swizzle; at 128, where a token is two pieces, the 8 tokens one
// ldmatrix reads fall on 4 patterns, a two-way bank conflict that the kernel,
// waiting on HBM, does not feel. The mma.sync products and the online softmax
// are v7's, unchanged (`compute_tile` with this layout). The
// rest, from the partition and the split-K bookkeeping to the early copies
// before the PDL wait, is v7's too. The question it answers: does the copy
// engine get more out of HBM than 512 cp.async per tile? (Measured on an
// H200, chapter 8: no, it is as fast, and 7 % slower when its fetches are
// promoted to 256 bytes in L2.)
//
// Rows past the context's end are copied like the others (their slots lie in
// the tile's block, which the sequence owns, but may hold anything); their
// scores are masked as in v7, and their V rows are zeroed in shared memory
// before the P·V product, so that a stale NaN cannot reach the output.
#include "decode_common.cuh"
#include "dispatch.cuh"
#include "tensor_core_tile.cuh"
#include "../tma.cuh"

#include <algorithm>
#include <type_traits>

namespace mini_vllm {
namespace {

using namespace tc_tile;

// A stage: [K: head_dim / 64 halves of 16 rows x 128 B][V: the same].
constexpr int kV9BoxElems = 64;

// --8<-- [start:layout]
// Where the copy engine puts 16-byte chunk `chunk` of row `row` (a token) of
// a tile: the box holds, token after token, the token's head_dim / 64 pieces
// of 128 bytes, and swizzles each group of 8 such pieces.
template <int HEAD_DIM>
struct TmaSwizzle {
  __device__ __forceinline__ static uint32_t offset(int row, int chunk) {
    const int piece = row * (HEAD_DIM / kV9BoxElems) + (chunk >> 3);
    return static_cast<uint32_t>(piece * 128 + (((chunk & 7) ^ (piece & 7)) << 4));
  }
};
// --8<-- [end:layout]

constexpr int kV9Warps = 2;
constexpr int kV9Stages = 3;
constexpr int kV9WideWarps = 4;
constexpr int kV9WideStages = 2;
constexpr int kV9WideMinCtasPerSm = 12;
// The 128-byte swizzle repeats every 1,024 bytes and is applied to shared
// addresses: the ring starts on such a boundary.
constexpr uint32_t kV9Align = 1024;

// Shared memory: [alignment slack][ring, later the merge][mbarriers][table].
template <int HEAD_DIM, int GROUP, int WARPS, int STAGES>
constexpr size_t v9_fixed_bytes() {
  return kV9Align + ring_or_merge_bytes<HEAD_DIM, GROUP, WARPS, STAGES>() + WARPS * STAGES * 8;
}

// One lane issues a tile: its bytes on the stage's barrier, then the K and V boxes.
template <int HEAD_DIM>
__device__ __forceinline__ void issue_tile_tma(uint32_t stage, uint32_t bar, int t0,
                                               const int* s_blocks, int first_block,
                                               int log2_bs, int offset_mask, int kv_head,
                                               const CUtensorMap* k_map,
                                               const CUtensorMap* v_map) {
  constexpr uint32_t kTileBytes = kV7Tile * HEAD_DIM * 2;
  const int slot0 = (s_blocks[(t0 >> log2_bs) - first_block] << log2_bs) + (t0 & offset_mask);
  mbarrier_arrive_expect_tx(bar, 2 * kTileBytes);
  tma_load_4d(stage, k_map, bar, 0, 0, kv_head, slot0);
  tma_load_4d(stage + kTileBytes, v_map, bar, 0, 0, kv_head, slot0);
}

// --8<-- [start:kernel]
template <typename T, int HEAD_DIM, int GROUP, int WARPS, int STAGES>
__global__ void __launch_bounds__(WARPS * 32)
    paged_attention_v9_kernel(DecodeParams p, int log2_bs,
                              const __grid_constant__ CUtensorMap k_map,
                              const __grid_constant__ CUtensorMap v_map) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  static_assert(GROUP >= 1 && GROUP <= 8, "the group's heads are the 8 columns of Pᵀ");
  static_assert(STAGES >= 2, "the ring needs a stage to fill and one to read");
  static_assert(HEAD_DIM % kV9BoxElems == 0, "head_dim is copied in pieces of 64");
  constexpr int NT = WARPS * 32;
  constexpr int KC = HEAD_DIM / 16;
  constexpr int CPR = HEAD_DIM / 8;
  constexpr uint32_t kTileBytes = kV7Tile * HEAD_DIM * 2;
  constexpr uint32_t kStageBytes = 2 * kTileBytes;
  constexpr size_t PIPE = ring_or_merge_bytes<HEAD_DIM, GROUP, WARPS, STAGES>();
  using Layout = TmaSwizzle<HEAD_DIM>;
  extern __shared__ __align__(16) unsigned char v9_smem[];
  const uint32_t smem0 = static_cast<uint32_t>(__cvta_generic_to_shared(v9_smem));
  const uint32_t pad = (kV9Align - smem0 % kV9Align) % kV9Align;
  unsigned char* pipe = v9_smem + pad;
  const uint32_t bars = smem0 + pad + static_cast<uint32_t>(PIPE);
  int* s_blocks = reinterpret_cast<int*>(pipe + PIPE + WARPS * STAGES * 8);

  const int seq = p.seq_order != nullptr ? p.seq_order[blockIdx.z] : blockIdx.z;
  const int split = blockIdx.y, q_head0 = blockIdx.x * GROUP;
  const int kv_head = q_head0 / (p.num_q_heads / p.num_kv_heads);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int start = split * p.partition_size;

  const int first_block = start >> log2_bs;
  const int table_entries = min(max(p.partition_size >> log2_bs, 1),
                                p.max_blocks_per_seq - first_block);
  const int* table = p.block_tables + static_cast<int64_t>(seq) * p.max_blocks_per_seq + first_block;
  for (int i = threadIdx.x; i < table_entries; i += NT) s_blocks[i] = table[i];
  const int ctx_entry = p.context_lens[seq];
  const int ctx = min(min(ctx_entry, p.max_blocks_per_seq << log2_bs),
                      p.max_splits * p.partition_size);
  const int end = min(ctx, start + p.partition_size);
  const int num_tiles = start < ctx ? (end - start + kV7Tile - 1) / kV7Tile : 0;
  const int my_tiles = warp < num_tiles ? (num_tiles - warp + WARPS - 1) / WARPS : 0;
  const int offset_mask = (1 << log2_bs) - 1;
  const uint32_t ring = smem0 + pad + warp * STAGES * kStageBytes;
  const uint32_t my_bars = bars + warp * STAGES * 8;
  if (lane == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) mbarrier_init(my_bars + 8 * s, 1);
    mbarrier_init_fence();
  }
  __syncthreads();  // s_blocks and the barriers are ready

  // As in v7: the stages whose tile ends before the newest position are
  // filled while the kernel before this one drains; the rest after the wait.
  int filled = 0;
  if (lane == 0) {
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      const int tile_start = start + (s * WARPS + warp) * kV7Tile;
      if (s == filled && s < my_tiles && tile_start + kV7Tile < ctx_entry) {
        issue_tile_tma<HEAD_DIM>(ring + s * kStageBytes, my_bars + 8 * s, tile_start,
                                 s_blocks, first_block, log2_bs, offset_mask, kv_head, &k_map,
                                 &v_map);
        ++filled;
      }
    }
  }
  pdl_wait();
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
  if (lane == 0) {
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s >= filled && s < my_tiles) {
        issue_tile_tma<HEAD_DIM>(ring + s * kStageBytes, my_bars + 8 * s,
                                 start + (s * WARPS + warp) * kV7Tile, s_blocks, first_block,
                                 log2_bs, offset_mask, kv_head, &k_map, &v_map);
      }
    }
  }
  int read_stage = 0, write_stage = STAGES - 1;
  uint32_t phases = 0;  // bit s: the parity stage s waits for next
  for (int i = 0; i < my_tiles; ++i) {
    __syncwarp();  // every lane is done reading the stage refilled now (step i - 1's)
    if (lane == 0 && i + STAGES - 1 < my_tiles) {
      fence_proxy_async_shared();
      issue_tile_tma<HEAD_DIM>(ring + write_stage * kStageBytes, my_bars + 8 * write_stage,
                               start + ((i + STAGES - 1) * WARPS + warp) * kV7Tile, s_blocks,
                               first_block, log2_bs, offset_mask, kv_head, &k_map, &v_map);
    }
    const uint32_t stage = ring + read_stage * kStageBytes;
    mbarrier_wait(my_bars + 8 * read_stage, (phases >> read_stage) & 1u);
    phases ^= 1u << read_stage;
    const int t0 = start + (i * WARPS + warp) * kV7Tile;
    if (t0 + kV7Tile > end) {
      // The partition's last tile: zero the V rows past its end.
      const int valid = end - t0;
      for (int idx = lane; idx < (kV7Tile - valid) * CPR; idx += 32) {
        const uint32_t at = stage + kTileBytes + Layout::offset(valid + idx / CPR, idx % CPR);
        asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(at), "r"(0u) : "memory");
      }
      __syncwarp();
    }
    compute_tile<T, HEAD_DIM, Layout>(stage, t0, end, lane, kscale, qa, m, l, o);
    write_stage = read_stage;
    read_stage = read_stage + 1 == STAGES ? 0 : read_stage + 1;
  }

  pdl_launch_dependents();
  __syncthreads();  // every tile has landed and been read: the ring becomes the merge area
  auto& sm = *reinterpret_cast<MergeSmem<HEAD_DIM, GROUP, NT>*>(pipe);
  stash_warp_state(sm, warp, lane, m, l, o);
  __syncthreads();
  merge_warps_and_store<T, HEAD_DIM, GROUP, WARPS>(sm, p, out, out_row, split, num_splits);
#endif
}
// --8<-- [end:kernel]

using V9Fn = void (*)(DecodeParams, int, CUtensorMap, CUtensorMap);

struct V9Kernel {
  V9Fn fn;
  int warps;
  size_t fixed_bytes;
};

template <typename T, int HEAD_DIM, int GROUP, int WARPS, int STAGES>
V9Kernel v9_kernel() {
  return {paged_attention_v9_kernel<T, HEAD_DIM, GROUP, WARPS, STAGES>, WARPS,
          v9_fixed_bytes<HEAD_DIM, GROUP, WARPS, STAGES>()};
}

template <typename T, int HEAD_DIM, int GROUP>
V9Kernel select_v9_kernel(int warps, int stages, bool many_waves) {
  if (warps == 0 && stages == 0 && many_waves) {
    return v9_kernel<T, HEAD_DIM, GROUP, kV9WideWarps, kV9WideStages>();
  }
  const int w = warps != 0 ? warps : kV9Warps;
  const int s = stages != 0 ? stages : kV9Stages;
  if (w == kV9Warps && s == kV9Stages) return v9_kernel<T, HEAD_DIM, GROUP, kV9Warps, kV9Stages>();
  if (w == kV9WideWarps && s == kV9WideStages) {
    return v9_kernel<T, HEAD_DIM, GROUP, kV9WideWarps, kV9WideStages>();
  }
  if constexpr (std::is_same_v<T, __nv_bfloat16> && HEAD_DIM == 128 &&
                (GROUP == 2 || GROUP == 4)) {
#define MINI_VLLM_V9_TUNABLE(W, S) \
  if (w == W && s == S) return v9_kernel<T, HEAD_DIM, GROUP, W, S>();
    MINI_VLLM_V9_TUNABLE(2, 2)
    MINI_VLLM_V9_TUNABLE(2, 4)
    MINI_VLLM_V9_TUNABLE(4, 3)
#undef MINI_VLLM_V9_TUNABLE
  }
  throw std::invalid_argument("version 9 with " + std::to_string(w) + " warps and " +
                              std::to_string(s) + " stages is not built");
}

template <typename T, int HEAD_DIM, int GROUP>
struct LaunchV9 {
  static void run(const DecodeParams& p, cudaStream_t stream) {
    if constexpr (HEAD_DIM != 64 && HEAD_DIM != 128) {
      throw std::invalid_argument("version 9 supports head_dim 64 and 128, not " +
                                  std::to_string(HEAD_DIM));
    } else {
      if (device_attribute(cudaDevAttrComputeCapabilityMajor) < 9) {
        throw std::invalid_argument("version 9 needs the TMA of an sm_90 GPU or newer");
      }
      if (p.num_blocks <= 0) {
        throw std::invalid_argument("version 9 needs num_blocks, the cache's size");
      }
      const int log2_bs = check_tiled_decode(p, "version 9");
      const int64_t slots = static_cast<int64_t>(p.num_blocks) * p.block_size;
      if (slots > INT32_MAX) {
        throw std::invalid_argument("version 9 addresses at most 2^31 cache slots");
      }
      // The cache as [slots][kv heads][head_dim / 64][64]; a box is 16 slots
      // of one head, all of its pieces.
      constexpr int kPieces = HEAD_DIM / kV9BoxElems;
      const uint64_t sizes[4] = {kV9BoxElems, kPieces, static_cast<uint64_t>(p.num_kv_heads),
                                 static_cast<uint64_t>(slots)};
      const uint64_t strides[3] = {kV9BoxElems * 2, HEAD_DIM * 2ull,
                                   static_cast<uint64_t>(p.num_kv_heads) * HEAD_DIM * 2};
      const uint32_t box[4] = {kV9BoxElems, kPieces, 1, kV7Tile};
      const CUtensorMap k_map = make_tensor_map(p.k_cache, p.dtype, 4, sizes, strides, box);
      const CUtensorMap v_map = make_tensor_map(p.v_cache, p.dtype, 4, sizes, strides, box);

      const dim3 grid(p.num_q_heads / GROUP, p.max_splits, p.num_seqs);
      const int64_t ctas = static_cast<int64_t>(grid.x) * grid.y * grid.z;
      const int sms = device_attribute(cudaDevAttrMultiProcessorCount);
      const V9Kernel k = select_v9_kernel<T, HEAD_DIM, GROUP>(
          p.unroll, p.stages, ctas >= static_cast<int64_t>(kV9WideMinCtasPerSm) * sms);
      const int table_entries = std::max(1, p.partition_size >> log2_bs);
      const size_t table =
          static_cast<size_t>(std::min(table_entries, p.max_blocks_per_seq) + 1) * sizeof(int);
      const size_t smem = k.fixed_bytes + table;
      const size_t allowed =
          static_cast<size_t>(device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin));
      if (smem > allowed) {
        throw std::invalid_argument(
            "version 9 with " + std::to_string(k.warps) + " warps needs " + std::to_string(smem) +
            " bytes of shared memory per CTA, more than the " + std::to_string(allowed) +
            " allowed (a shorter partition_size or fewer stages)");
      }
      allow_dynamic_smem(reinterpret_cast<const void*>(k.fn), smem);
      DecodeParams q = p;
      const int resident =
          resident_blocks_per_sm(reinterpret_cast<const void*>(k.fn), k.warps * 32, smem);
      if (ctas <= static_cast<int64_t>(resident) * sms) q.seq_order = nullptr;
      launch_kernel(k.fn, grid, dim3(k.warps * 32), smem, stream, "paged_attention_v9_kernel", q,
                    log2_bs, k_map, v_map);
      launch_combine<T, HEAD_DIM>(p, stream);
    }
  }
};

}  // namespace

void paged_attention_v9(const DecodeParams& p, cudaStream_t stream) {
  dispatch_decode<LaunchV9>(p, stream);
}

}  // namespace mini_vllm
