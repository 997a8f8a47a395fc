// Version 8: version 7's tiles, scheduled stream-K over a persistent grid.
//
// Version 7 launches one CTA per (sequence, KV head, split). When every CTA
// has the same work, they finish in waves, and the last wave leaves SMs idle:
// 128 sequences x 8 KV heads is 1,024 CTAs for 528 places (4 per SM on an
// H200), two waves, the second 6 % short. Chapter 8 measured v7's time per
// (sequence, head) pair falling by 2 % from 128 to 256 sequences, while SDPA's
// stays flat.
//
// Here the grid is as many CTAs as fit on the GPU at once, one per head group
// for each of R ranges, and the batch's tiles are cut into R equal ranges,
// whatever the batch looks like:
//
//   tiles of the batch:  [ seq 0       ][ seq 1   ][ seq 2           ]...   16 tokens each
//   ranges:              [ 0       ][ 1       ][ 2       ][ 3       ]...   equal tile counts
//   CTAs:                range r, head group h -> CTA r * groups + h
//
// Every CTA walks its range a sequence at a time (a segment). A sequence that
// lies wholly inside one range is written out directly. One cut by a range
// boundary leaves a partial softmax state (m, l, unnormalized acc) in its
// CTA's workspace slot, and the last of its CTAs to finish (an atomic counter
// per sequence and head group) merges the pieces and writes the output. No
// CTA ever waits for another, so the result does not depend on which CTAs run
// at the same time. The next segment's first tiles are issued before the
// current one's merge.
//
// Measured on an H200 (chapter 8, `kernels.py --tables v8`) it is slower than
// version 7 at every shape: the merges, fences and atomics at segment ends
// cost more than the wave tail they remove. It is kept as that lesson; the
// engine runs version 7.
#include "decode_common.cuh"
#include "dispatch.cuh"
#include "tensor_core_tile.cuh"

#include <algorithm>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "version 8 needs mma.sync m16n8k16 with bf16 and cp.async (sm_80 or newer)"
#endif

namespace mini_vllm {
namespace {

using namespace tc_tile;

// Warps per CTA and ring stages per warp: version 7's default, whose 48 KB
// fit four CTAs on an H200 SM.
constexpr int kV8Warps = 2;
constexpr int kV8Stages = 3;
// A CTA gets at least this many tiles: below it, a batch of short contexts
// would be cut into pieces whose merge costs more than it balances.
constexpr int kV8MinTilesPerCta = 32;
// The per-sequence tile offsets live in shared memory.
constexpr int kV8MaxSeqs = 4096;

// The merge area sits beside the ring (`ring_bytes`), not in it: the next
// segment's first tiles land in the ring while this one merges.
template <int HEAD_DIM, int GROUP, int WARPS>
constexpr size_t v8_merge_bytes() {
  return (sizeof(MergeSmem<HEAD_DIM, GROUP, WARPS * 32>) + 15) / 16 * 16;
}

// Bytes of dynamic shared memory: the ring, the merge area, two tables of a
// sequence's block entries (the current segment's and the next one's), the
// tile offsets of the sequences and a few ints of scratch.
template <int HEAD_DIM, int GROUP, int WARPS, int STAGES>
size_t v8_smem_bytes(int num_seqs, int max_blocks_per_seq) {
  return ring_bytes<HEAD_DIM, WARPS, STAGES>() + v8_merge_bytes<HEAD_DIM, GROUP, WARPS>() +
         sizeof(int) * (2 * static_cast<size_t>(max_blocks_per_seq) + num_seqs + 1 + WARPS + 1);
}

// --8<-- [start:scan]
// s_prefix[s] = tiles of sequences 0 .. s-1 (s_prefix[S]: all of them), one
// tile being 16 tokens of context. Each thread sums a run of sequences, a
// warp scan and the warps' totals turn the sums into offsets.
template <int NT>
__device__ __forceinline__ void scan_tiles(const int32_t* context_lens, int num_seqs, int max_ctx,
                                           int* s_prefix, int* s_warp_sums) {
  const int per = (num_seqs + NT - 1) / NT;
  const int lo = min(num_seqs, static_cast<int>(threadIdx.x) * per);
  const int hi = min(num_seqs, lo + per);
  const auto tiles = [&](int s) {
    return (max(0, min(context_lens[s], max_ctx)) + kV7Tile - 1) / kV7Tile;
  };
  int local = 0;
  for (int s = lo; s < hi; ++s) local += tiles(s);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int inclusive = local;
#pragma unroll
  for (int off = 1; off < 32; off *= 2) {
    const int v = __shfl_up_sync(0xffffffffu, inclusive, off);
    if (lane >= off) inclusive += v;
  }
  if (lane == 31) s_warp_sums[warp] = inclusive;
  __syncthreads();
  int before = 0;
  for (int w = 0; w < warp; ++w) before += s_warp_sums[w];
  int run = before + inclusive - local;
  for (int s = lo; s < hi; ++s) {
    s_prefix[s] = run;
    run += tiles(s);
  }
  if (threadIdx.x == NT - 1) s_prefix[num_seqs] = before + inclusive;
  __syncthreads();
}
// --8<-- [end:scan]

// The range that holds tile t, when range r starts at floor(r T / R): the
// largest r with floor(r T / R) <= t.
__device__ __forceinline__ int owner_range(int64_t t, int64_t total, int64_t ranges) {
  return static_cast<int>(((t + 1) * ranges + total - 1) / total - 1);
}

// --8<-- [start:kernel]
// One contiguous run of tiles of one sequence inside a CTA's range.
struct Segment {
  int seq;
  int j0, j1;      // its tiles j0 .. j1 - 1 of the sequence
  int tiles;       // the sequence's tiles
  int ctx;         // the sequence's context (clamped to its table)
  int64_t first;   // the sequence's first tile in the batch
};

__device__ __forceinline__ Segment find_segment(int64_t t, int64_t end, const int* s_prefix,
                                                const DecodeParams& p, int max_ctx) {
  int lo = 0, hi = p.num_seqs - 1;  // the last sequence whose tiles start at or before t
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (s_prefix[mid] <= t) lo = mid; else hi = mid - 1;
  }
  Segment s;
  s.seq = lo;
  s.first = s_prefix[lo];
  s.tiles = s_prefix[lo + 1] - s_prefix[lo];
  s.j0 = static_cast<int>(t - s.first);
  s.j1 = static_cast<int>(min(end, s.first + s.tiles) - s.first);
  s.ctx = min(p.context_lens[lo], max_ctx);
  return s;
}

template <typename T, int HEAD_DIM, int GROUP, int WARPS, int STAGES>
__global__ void __launch_bounds__(WARPS * 32) paged_attention_v8_kernel(DecodeParams p,
                                                                        int log2_bs) {
  static_assert(GROUP >= 1 && GROUP <= 8, "the group's heads are the 8 columns of Pᵀ");
  static_assert(STAGES >= 2, "the ring needs a stage to fill and one to read");
  constexpr int NT = WARPS * 32;
  constexpr int KC = HEAD_DIM / 16;
  constexpr uint32_t kStageBytes = 2 * kV7Tile * HEAD_DIM * 2;
  constexpr size_t RING = ring_bytes<HEAD_DIM, WARPS, STAGES>();
  constexpr size_t MERGE = v8_merge_bytes<HEAD_DIM, GROUP, WARPS>();
  extern __shared__ __align__(16) unsigned char v8_smem[];
  auto& sm = *reinterpret_cast<MergeSmem<HEAD_DIM, GROUP, NT>*>(v8_smem + RING);
  int* s_tables = reinterpret_cast<int*>(v8_smem + RING + MERGE);  // 2 x max_blocks_per_seq
  int* s_prefix = s_tables + 2 * p.max_blocks_per_seq;
  int* s_scratch = s_prefix + p.num_seqs + 1;  // WARPS sums for the scan, then a flag
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int groups = p.num_q_heads / GROUP;
  const int max_ctx = p.max_blocks_per_seq << log2_bs;
  const int64_t token_stride = static_cast<int64_t>(p.num_kv_heads) * HEAD_DIM;
  const int64_t block_stride = token_stride << log2_bs;  // token-major only
  const int offset_mask = (1 << log2_bs) - 1;
  const uint32_t ring = static_cast<uint32_t>(__cvta_generic_to_shared(v8_smem)) +
                        warp * STAGES * kStageBytes;

  // Context lengths come from the host's copy before the step's first
  // kernel, so the schedule is worked out before the wait.
  scan_tiles<NT>(p.context_lens, p.num_seqs, max_ctx, s_prefix, s_scratch);
  // The grid is `groups` CTAs per range of tiles: CTA b serves head group
  // b % groups over range b / groups, so the CTAs that read the KV heads of
  // the same tokens run side by side (as in version 7, whose grid has the
  // head group as its fastest index), and DRAM serves whole cache blocks.
  const int64_t total = s_prefix[p.num_seqs];
  const int64_t ranges = max(static_cast<int64_t>(1),
                             min(static_cast<int64_t>(gridDim.x / groups),
                                 total / kV8MinTilesPerCta));
  const int range = blockIdx.x / groups, group = blockIdx.x % groups;
  const int q_head0 = group * GROUP;
  const int kv_head = q_head0 / (p.num_q_heads / p.num_kv_heads);
  const T* k_head = static_cast<const T*>(p.k_cache) + kv_head * HEAD_DIM;
  const T* v_head = static_cast<const T*>(p.v_cache) + kv_head * HEAD_DIM;
  const int64_t begin = range * total / ranges;
  const int64_t end = range < ranges ? (range + 1) * total / ranges : begin;

  // Issue the first STAGES - 1 tiles of a segment (warp w: tiles w, w + WARPS,
  // ...), reading the block numbers straight from the global table; `early`
  // issues only those whose tiles end before the newest position, which the
  // kernel before this one may still be writing (the rule of csrc/pdl.cuh).
  const auto fill = [&](const Segment& s, bool early, int& filled) {
    const int* table = p.block_tables + static_cast<int64_t>(s.seq) * p.max_blocks_per_seq;
    const int stop = min(s.ctx, s.j1 * kV7Tile);
    const int num_tiles = s.j1 - s.j0;
#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) {
      if (st < filled) continue;
      const int tile = st * WARPS + warp;
      const int t0 = (s.j0 + tile) * kV7Tile;
      if (early && !(tile < num_tiles && t0 + kV7Tile < s.ctx && st == filled)) continue;
      if (tile < num_tiles) {
        issue_tile<T, HEAD_DIM>(ring + st * kStageBytes, t0, stop, lane, table, 0, log2_bs,
                                offset_mask, block_stride, token_stride, k_head, v_head);
      }
      cp_async_commit();
      filled = st + 1;
    }
  };
  // The segment's block entries into shared memory, for the ring's later steps.
  const auto stage_table = [&](const Segment& s, int* dst) {
    const int first_block = (s.j0 * kV7Tile) >> log2_bs;
    const int entries = (((s.j1 * kV7Tile) - 1) >> log2_bs) - first_block + 1;
    const int* table =
        p.block_tables + static_cast<int64_t>(s.seq) * p.max_blocks_per_seq + first_block;
    for (int i = threadIdx.x; i < entries; i += NT) dst[i] = table[i];
  };
  const auto load_q = [&](const Segment& s, uint32_t (&qa)[KC][2]) {
    load_q_operand<T, HEAD_DIM, GROUP>(
        qa, static_cast<const T*>(p.q) + s.seq * p.q_stride +
                static_cast<int64_t>(q_head0) * HEAD_DIM,
        lane);
  };

  Segment cur{};
  int filled = 0;
  if (begin < end) {
    cur = find_segment(begin, end, s_prefix, p, max_ctx);
    fill(cur, true, filled);
  }
  pdl_wait();
  // Sequences without context (padded batch slots) get zeros.
  for (int s = blockIdx.x; s < p.num_seqs; s += gridDim.x) {
    if (s_prefix[s + 1] == s_prefix[s]) {
      store_zeros<T, HEAD_DIM, 1, NT>(static_cast<T*>(p.out) +
                                      static_cast<int64_t>(s) * p.num_q_heads * HEAD_DIM,
                                      p.num_q_heads);
    }
  }
  if (begin >= end) {
    pdl_launch_dependents();
    return;
  }
  fill(cur, false, filled);
  uint32_t qa[KC][2];
  load_q(cur, qa);
  int* s_blocks = s_tables;
  stage_table(cur, s_blocks);
  __syncthreads();

  const float kscale = p.scale * kLog2e;
  for (;;) {
    // Version 7's ring over the segment; its first STAGES - 1 tiles are in flight.
    float m = -INFINITY, l = 0.0f, o[KC][4];
#pragma unroll
    for (int mt = 0; mt < KC; ++mt) {
#pragma unroll
      for (int j = 0; j < 4; ++j) o[mt][j] = 0.0f;
    }
    {
      const int first_block = (cur.j0 * kV7Tile) >> log2_bs;
      const int start = cur.j0 * kV7Tile, stop = min(cur.ctx, cur.j1 * kV7Tile);
      const int num_tiles = cur.j1 - cur.j0;
      const int my_tiles = warp < num_tiles ? (num_tiles - warp + WARPS - 1) / WARPS : 0;
      int read_stage = 0, write_stage = STAGES - 1;
      for (int i = 0; i < my_tiles; ++i) {
        __syncwarp();
        if (i + STAGES - 1 < my_tiles) {
          issue_tile<T, HEAD_DIM>(ring + write_stage * kStageBytes,
                                  start + ((i + STAGES - 1) * WARPS + warp) * kV7Tile, stop,
                                  lane, s_blocks, first_block, log2_bs, offset_mask,
                                  block_stride, token_stride, k_head, v_head);
        }
        cp_async_commit();
        cp_async_wait<STAGES - 1>();
        __syncwarp();
        compute_tile<T, HEAD_DIM>(ring + read_stage * kStageBytes,
                                  start + (i * WARPS + warp) * kV7Tile, stop, lane, kscale, qa,
                                  m, l, o);
        write_stage = read_stage;
        read_stage = read_stage + 1 == STAGES ? 0 : read_stage + 1;
      }
    }

    // The next segment's first tiles go out before this one's merge, so the
    // memory stays busy while the CTA does its bookkeeping.
    const int64_t next_t = cur.first + cur.j1;
    const bool has_next = next_t < end;
    Segment nxt{};
    int* next_blocks = s_blocks == s_tables ? s_tables + p.max_blocks_per_seq : s_tables;
    if (has_next) {
      nxt = find_segment(next_t, end, s_prefix, p, max_ctx);
      __syncwarp();  // every lane is done reading the stages refilled now
      int nfilled = 0;
      fill(nxt, false, nfilled);
      load_q(nxt, qa);
      stage_table(nxt, next_blocks);
    }

    // Merge the warps, then write the sequence's output or this CTA's piece of it.
    stash_warp_state(sm, warp, lane, m, l, o);
    __syncthreads();
    T* out = static_cast<T*>(p.out) +
             (static_cast<int64_t>(cur.seq) * p.num_q_heads + q_head0) * HEAD_DIM;
    const bool whole = cur.j0 == 0 && cur.j1 == cur.tiles;
    // A CTA holds at most two pieces: its first segment's (slot 0) and its last's (slot 1).
    const int64_t slot = 2 * static_cast<int64_t>(blockIdx.x) + (cur.first + cur.j0 == begin ? 0 : 1);
    for (int idx = threadIdx.x; idx < GROUP * HEAD_DIM; idx += NT) {
      const int h = idx / HEAD_DIM, d = idx % HEAD_DIM;
      const MergedState st = merge_warps<HEAD_DIM, GROUP, WARPS>(sm, h, d);
      if (whole) {
        out[idx] = TypeTraits<T>::from_float(st.acc / st.l);
      } else {
        p.part_out[slot * GROUP * HEAD_DIM + idx] = st.acc;
        if (d == 0) {
          p.part_ml[(slot * GROUP + h) * 2 + 0] = st.m;
          p.part_ml[(slot * GROUP + h) * 2 + 1] = st.l;
        }
      }
    }
    if (!whole) {
      // --8<-- [start:last_piece]
      // Publish the piece, then count it. The CTA that brings the count to
      // the number of pieces merges them all and resets the counter for the
      // next launch.
      const int64_t pair = static_cast<int64_t>(cur.seq) * groups + group;
      const int first = owner_range(cur.first, total, ranges);
      const int last = owner_range(cur.first + cur.tiles - 1, total, ranges);
      __threadfence();
      __syncthreads();
      if (threadIdx.x == 0) {
        const int arrived = atomicAdd(&p.counters[pair], 1);
        s_scratch[WARPS] = arrived == last - first;
      }
      __syncthreads();
      if (s_scratch[WARPS]) {
        __threadfence();
        // The first piece sits in slot 1 of its CTA unless the sequence starts that range.
        const int first_slot = cur.first == first * total / ranges ? 0 : 1;
        for (int idx = threadIdx.x; idx < GROUP * HEAD_DIM; idx += NT) {
          const int h = idx / HEAD_DIM;
          float mx = -INFINITY;
          for (int i = first; i <= last; ++i) {
            const int64_t sl = 2 * (static_cast<int64_t>(i) * groups + group) +
                               (i == first ? first_slot : 0);
            mx = fmaxf(mx, __ldcg(&p.part_ml[(sl * GROUP + h) * 2]));
          }
          float sum = 0.0f, acc = 0.0f;
          for (int i = first; i <= last; ++i) {
            const int64_t sl = 2 * (static_cast<int64_t>(i) * groups + group) +
                               (i == first ? first_slot : 0);
            const float pm = __ldcg(&p.part_ml[(sl * GROUP + h) * 2]);
            const float a = pm == -INFINITY ? 0.0f : exp2f(pm - mx);
            sum += __ldcg(&p.part_ml[(sl * GROUP + h) * 2 + 1]) * a;
            acc += __ldcg(&p.part_out[sl * GROUP * HEAD_DIM + idx]) * a;
          }
          out[idx] = TypeTraits<T>::from_float(acc / sum);
        }
        if (threadIdx.x == 0) p.counters[pair] = 0;
      }
      // --8<-- [end:last_piece]
    }
    __syncthreads();  // the merge area and the flag are free; the next table is staged
    if (!has_next) break;
    cur = nxt;
    s_blocks = next_blocks;
  }
  pdl_launch_dependents();
}
// --8<-- [end:kernel]

using V8Fn = void (*)(DecodeParams, int);

template <typename T, int HEAD_DIM, int GROUP>
struct LaunchV8 {
  static void run(const DecodeParams& p, cudaStream_t stream) {
    if constexpr (HEAD_DIM != 64 && HEAD_DIM != 128) {
      throw std::invalid_argument("version 8 supports head_dim 64 and 128, not " +
                                  std::to_string(HEAD_DIM));
    } else {
      if (p.part_out == nullptr || p.part_ml == nullptr || p.counters == nullptr) {
        throw std::invalid_argument("version 8 needs the part_out / part_ml / counters workspace");
      }
      if (p.block_size < kV7Tile) {
        throw std::invalid_argument("version 8 needs block_size >= 16, got " +
                                    std::to_string(p.block_size));
      }
      if (p.num_seqs > kV8MaxSeqs) {
        throw std::invalid_argument("version 8 takes at most " + std::to_string(kV8MaxSeqs) +
                                    " sequences, got " + std::to_string(p.num_seqs));
      }
      if (p.stages != 0 || p.unroll != 0) {
        throw std::invalid_argument("version 8 has one pipeline shape (no unroll / stages)");
      }
      const int log2_bs = log2_exact(p.block_size);
      constexpr V8Fn fn = paged_attention_v8_kernel<T, HEAD_DIM, GROUP, kV8Warps, kV8Stages>;
      constexpr int threads = kV8Warps * 32;
      const size_t smem =
          v8_smem_bytes<HEAD_DIM, GROUP, kV8Warps, kV8Stages>(p.num_seqs, p.max_blocks_per_seq);
      const int optin = device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin);
      if (smem > static_cast<size_t>(optin)) {
        throw std::invalid_argument(
            "version 8 keeps two block tables of " + std::to_string(p.max_blocks_per_seq) +
            " entries and " + std::to_string(p.num_seqs) + " sequence offsets in shared "
            "memory: " + std::to_string(smem) + " bytes, more than the GPU's " +
            std::to_string(optin) + " (use version 7)");
      }
      allow_dynamic_smem(reinterpret_cast<const void*>(fn), smem);
      // As many CTAs as are resident at once, no more than the workspace
      // holds, in whole ranges of one CTA per head group.
      const int groups = p.num_q_heads / GROUP;
      const int resident = resident_blocks_per_sm(reinterpret_cast<const void*>(fn), threads,
                                                  smem) *
                           device_attribute(cudaDevAttrMultiProcessorCount);
      const int ctas = std::max(1, std::min(resident, p.max_splits) / groups) * groups;
      if (resident < 1 || ctas > p.max_splits) {
        throw std::invalid_argument("version 8: " + std::to_string(smem) + " bytes of shared "
                                    "memory per CTA, or a workspace of " +
                                    std::to_string(p.max_splits) + " CTAs, fit no grid");
      }
      launch_kernel(fn, dim3(ctas), dim3(threads), smem, stream, "paged_attention_v8_kernel",
                    p, log2_bs);
    }
  }
};

}  // namespace

void paged_attention_v8(const DecodeParams& p, cudaStream_t stream) {
  dispatch_decode<LaunchV8>(p, stream);
}

}  // namespace mini_vllm
