// Prefill attention on Hopper (sm_90a): each sequence's new tokens attend,
// causally, to its keys (its cached prefix, then themselves), over packed
// sequences of different lengths (varlen), with grouped-query heads and
// head_dim 128: the attention of a prefill step, or of a prompt that
// continues a cached prefix (chapter 8).
//
//   q   [total_q, num_q_heads, 128]    rows of seq i: cu_q[i] .. cu_q[i + 1]
//   k/v [total_k, num_kv_heads, 128]   rows of seq i: cu_k[i] .. cu_k[i + 1]
//       or (PAGED) the paged cache [num_blocks, block_size, num_kv_heads, 128]:
//       seq i's key t in block block_tables[i][t / block_size], and its key
//       count cu_k[i + 1] - cu_k[i]
//   out [total_q, num_q_heads, 128]    contiguous
//
// Query token j of a sequence with q_len new tokens and k_len keys sits at
// key position k_len - q_len + j and sees keys 0 .. that position.
//
// The flash-attention schedule with Hopper's two engines:
//   - A CTA takes 64 query tokens of one sequence for two query heads that
//     share a KV head (GQA), one consumer warpgroup per head, so that each
//     K/V tile it copies serves both.
//   - One thread of a producer warpgroup copies Q once and then 64-token
//     tiles of K and V into a ring of stages with the TMA (128-byte swizzle),
//     counting their bytes on each stage's "full" mbarrier; the consumers
//     hand a stage back on its "empty" mbarrier.
//   - A consumer computes S = Q Kᵀ with wgmma (both operands in shared
//     memory), the online softmax on S in registers, and O += P V with wgmma
//     taking P straight from registers (the accumulator layout of S is the
//     register layout of wgmma's A) and V from shared memory as it lies,
//     dims contiguous (the "N-major" B operand). The product P V of one tile
//     runs while the next tile's Q Kᵀ is issued.
//   - Causal: a CTA reads only the tiles up to its last query's position and
//     masks the tiles that cross it; the grid starts with the last (longest)
//     query blocks of every sequence.
//   - PAGED: the producer copies a tile of keys block by block out of the
//     cache, through the block table (a prompt after a cached prefix needs no
//     gather); V's rows past the sequence's last key, whatever the cache holds
//     there, are zeroed before P V reads them.
#include <algorithm>
#include <cmath>
#include <string>

#include "common.cuh"
#include "gemv_params.h"  // wgmma_gemm_supported
#include "pdl.cuh"
#include "prefill_params.h"
#include "tma.cuh"
#include "wgmma.cuh"

namespace mini_vllm {
namespace {

constexpr int kHeadDim = 128;
constexpr int kBM = 64;     // query tokens per CTA (a consumer: one head's 64 rows)
constexpr int kBN = 64;     // keys per stage
constexpr int kStages = 4;  // K/V stages in the ring
constexpr int kConsumers = 2;
constexpr int kThreads = 128 * (1 + kConsumers);
// A tile of 64 rows by 64 of head_dim (128 bytes a row, the swizzle's width):
// a row of 128 dims is two such halves.
constexpr int kHalfBytes = 64 * 64 * 2;
constexpr int kQBytes = kConsumers * 2 * kHalfBytes;  // Q: two heads, two halves each
constexpr int kStageBytes = 4 * kHalfBytes;           // K: two halves, V: two halves
constexpr size_t kSmemBytes = 1024 + kQBytes + kStages * kStageBytes + 8 * (1 + 2 * kStages);

[[maybe_unused]] __device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// --8<-- [start:desc_mn]
// The descriptor of V's tile as the B operand of O += P V: the TMA wrote it
// as rows of keys with head_dim contiguous (two halves of 64 dims, 8 KB
// apart, each 128-byte swizzled), so for this product, whose N is head_dim
// and K the keys, it is "N-major". The leading offset is then the step from
// one 64-wide group of N to the next (the second half), the stride offset
// the step from 8 keys to the next 8 (1,024 bytes).
__device__ __forceinline__ uint64_t wgmma_desc_n_major(uint32_t smem) {
  uint64_t desc = (smem & 0x3FFFF) >> 4;
  desc |= uint64_t{kHalfBytes >> 4} << 16;  // leading offset: to the next 64 dims
  desc |= uint64_t{1024 >> 4} << 32;        // stride offset: to the next 8 keys
  desc |= uint64_t{1} << 62;                // 128-byte swizzle
  return desc;
}
// --8<-- [end:desc_mn]

// d[64 x 128] += A[64 x 16] * B, A in registers (four pairs of 16-bit values
// a thread, the layout of wgmma's accumulators for 16 columns), B the
// N-major tile of `desc_b`.
template <typename T>
__device__ __forceinline__ void wgmma_rs_n128(float (&d)[64], const uint32_t (&a)[4],
                                              uint64_t desc_b) {
#ifdef MINI_VLLM_WGMMA
#define MINI_VLLM_D(i) "+f"(d[i])
#define MINI_VLLM_D8(i)                                                                  \
  MINI_VLLM_D(i), MINI_VLLM_D(i + 1), MINI_VLLM_D(i + 2), MINI_VLLM_D(i + 3),            \
      MINI_VLLM_D(i + 4), MINI_VLLM_D(i + 5), MINI_VLLM_D(i + 6), MINI_VLLM_D(i + 7)
#define MINI_VLLM_RS_PTX(TYPE)                                                             \
  "{\n .reg .pred p;\n setp.ne.b32 p, 1, 0;\n"                                             \
  " wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " {"                       \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                 \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "       \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "       \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "      \
  "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}"
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(MINI_VLLM_RS_PTX("bf16")
                 : MINI_VLLM_D8(0), MINI_VLLM_D8(8), MINI_VLLM_D8(16), MINI_VLLM_D8(24),
                   MINI_VLLM_D8(32), MINI_VLLM_D8(40), MINI_VLLM_D8(48), MINI_VLLM_D8(56)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
  } else {
    asm volatile(MINI_VLLM_RS_PTX("f16")
                 : MINI_VLLM_D8(0), MINI_VLLM_D8(8), MINI_VLLM_D8(16), MINI_VLLM_D8(24),
                   MINI_VLLM_D8(32), MINI_VLLM_D8(40), MINI_VLLM_D8(48), MINI_VLLM_D8(56)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
  }
#undef MINI_VLLM_RS_PTX
#undef MINI_VLLM_D8
#undef MINI_VLLM_D
#else
  (void)d;
  (void)a;
  (void)desc_b;
#endif
}

// --8<-- [start:kernel]
template <typename T, bool PAGED>
__global__ void __launch_bounds__(kThreads, 1)
    flash_prefill_kernel(const __grid_constant__ CUtensorMap q_map,
                         const __grid_constant__ CUtensorMap k_map,
                         const __grid_constant__ CUtensorMap v_map, T* __restrict__ out,
                         const int32_t* __restrict__ cu_q, const int32_t* __restrict__ cu_k,
                         const int32_t* __restrict__ block_tables, int table_stride,
                         int block_shift, int out_row_stride, int group, float scale_log2) {
#ifdef MINI_VLLM_WGMMA
  extern __shared__ uint8_t smem_raw[];
  const uint32_t q_tile = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const uint32_t ring = q_tile + kQBytes;
  const uint32_t q_full = ring + kStages * kStageBytes;
  const uint32_t full = q_full + 8;
  const uint32_t empty = full + 8 * kStages;

  const int pair = blockIdx.x;  // query heads 2 pair and 2 pair + 1
  const int kv_head = 2 * pair / group;
  const int seq = blockIdx.y;
  const int block = gridDim.z - 1 - blockIdx.z;  // the last query blocks, the longest, first
  pdl_wait();  // Q, K and V are the kernels' before
  const int q_begin = cu_q[seq], q_len = cu_q[seq + 1] - q_begin;
  const int k_begin = cu_k[seq], k_len = cu_k[seq + 1] - k_begin;  // PAGED: k_begin unused
  const int q0 = block * kBM;
  if (q0 >= q_len) return;  // past this sequence's queries: the whole CTA
  const int offset = k_len - q_len;  // query j's key position: offset + j
  const int keys = min(k_len, offset + min(q_len, q0 + kBM));  // the CTA reads keys [0, keys)
  const int tiles = (keys + kBN - 1) / kBN;

  if (threadIdx.x == 0) {
    mbarrier_init(q_full, 1);
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(full + 8 * s, 1);
      mbarrier_init(empty + 8 * s, kConsumers);
    }
    mbarrier_init_fence();
  }
  __syncthreads();
  const int warpgroup = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);

  if (warpgroup == 0) {
    // The producer: one thread issues every copy.
    if (threadIdx.x == 0) {
      mbarrier_arrive_expect_tx(q_full, kQBytes);
      for (int h = 0; h < kConsumers; ++h) {
        for (int half = 0; half < 2; ++half) {
          tma_load_3d(q_tile + (2 * h + half) * kHalfBytes, &q_map, q_full, 64 * half,
                      2 * pair + h, q_begin + q0);
        }
      }
      // PAGED: a tile is `pieces` boxes of `box` keys, each inside one block.
      const int box = PAGED ? min(kBN, 1 << block_shift) : kBN;
      const int32_t* table = PAGED ? block_tables + static_cast<int64_t>(seq) * table_stride
                                   : nullptr;
      for (int j = 0; j < tiles; ++j) {
        const int s = j % kStages;
        if (j >= kStages) mbarrier_wait(empty + 8 * s, (j / kStages - 1) & 1);
        const uint32_t stage = ring + s * kStageBytes;
        if constexpr (PAGED) {
          // The boxes that hold keys of the sequence (the rest of the tile is
          // masked, and its V rows zeroed by the consumers).
          const int pieces = min(kBN, k_len - j * kBN + box - 1) / box;
          mbarrier_arrive_expect_tx(full + 8 * s, pieces * box * 128 * 2 * 2);
          for (int b = 0; b < pieces; ++b) {
            const int key = j * kBN + b * box;
            const int phys = table[key >> block_shift];
            const int in_block = key & ((1 << block_shift) - 1);
            const uint32_t row = b * box * 128;  // bytes: a key's 64 dims are 128
            for (int half = 0; half < 2; ++half) {
              tma_load_4d(stage + half * kHalfBytes + row, &k_map, full + 8 * s, 64 * half,
                          kv_head, in_block, phys);
              tma_load_4d(stage + (2 + half) * kHalfBytes + row, &v_map, full + 8 * s,
                          64 * half, kv_head, in_block, phys);
            }
          }
        } else {
          mbarrier_arrive_expect_tx(full + 8 * s, kStageBytes);
          for (int half = 0; half < 2; ++half) {
            tma_load_3d(stage + half * kHalfBytes, &k_map, full + 8 * s, 64 * half, kv_head,
                        k_begin + j * kBN);
            tma_load_3d(stage + (2 + half) * kHalfBytes, &v_map, full + 8 * s, 64 * half,
                        kv_head, k_begin + j * kBN);
          }
        }
      }
    }
    return;
  }

  // A consumer: query head 2 pair + c, 64 rows. Thread t (warp w, lane l)
  // holds rows 16 w + l / 4 and 8 below (see wgmma_m64k16).
  const int c = warpgroup - 1;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32 % 4;
  const int row0 = 16 * warp + lane / 4;
  const int col0 = 2 * (lane % 4);
  int pos[2];  // the key position of each of this thread's two rows
  pos[0] = offset + q0 + row0;
  pos[1] = pos[0] + 8;
  float o[64];  // O: 64 rows x 128 dims
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // running max (log2 units), sum
  const uint32_t my_q = q_tile + c * 2 * kHalfBytes;
  mbarrier_wait(q_full, 0);

  for (int j = 0; j < tiles; ++j) {
    const int s = j % kStages;
    const uint32_t stage = ring + s * kStageBytes;
    mbarrier_wait(full + 8 * s, (j / kStages) & 1);
    float sc[32];  // S: 64 rows x 64 keys
#pragma unroll
    for (int i = 0; i < 32; ++i) sc[i] = 0.f;
    wgmma_fence_operands(sc);
    wgmma_fence();
#pragma unroll
    for (int t = 0; t < kHeadDim / 16; ++t) {
      const uint32_t step = (t / 4) * kHalfBytes + 32 * (t % 4);
      wgmma_m64k16<T, 64>(sc, wgmma_desc(my_q + step), wgmma_desc(stage + step));
    }
    wgmma_commit();
    wgmma_wait<0>();  // this S, and the last tile's P V
    wgmma_fence_operands(sc);
    wgmma_fence_operands(o);
    if (j > 0 && threadIdx.x % 128 == 0) mbarrier_arrive(empty + 8 * ((j - 1) % kStages));

    // Mask keys past a row's position (the causal diagonal) and past the sequence.
    const int key0 = j * kBN;
    if (key0 + kBN > min(k_len, offset + q0 + 1)) {
#pragma unroll
      for (int n = 0; n < kBN / 8; ++n) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int key = key0 + 8 * n + col0 + e;
            if (key > pos[half] || key >= k_len) sc[4 * n + 2 * half + e] = -INFINITY;
          }
        }
      }
    }
    // The online softmax, row by row: the quad of four lanes holds a row.
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float mx = -INFINITY;
#pragma unroll
      for (int n = 0; n < kBN / 8; ++n) {
        mx = fmaxf(mx, fmaxf(sc[4 * n + 2 * half], sc[4 * n + 2 * half + 1]));
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m[half], mx * scale_log2);
      const float m_use = m_new == -INFINITY ? 0.f : m_new;
      const float alpha = fast_exp2(m[half] - m_use);
      float sum = 0.f;
#pragma unroll
      for (int n = 0; n < kBN / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& v = sc[4 * n + 2 * half + e];
          v = fast_exp2(v * scale_log2 - m_use);
          sum += v;
        }
      }
      l[half] = l[half] * alpha + sum;  // this lane's share; the quad is summed at the end
      m[half] = m_new;
#pragma unroll
      for (int n = 0; n < kHeadDim / 8; ++n) {
        o[4 * n + 2 * half] *= alpha;
        o[4 * n + 2 * half + 1] *= alpha;
      }
    }
    if constexpr (PAGED) {
      // V's rows past the last key hold whatever the cache (or an earlier tile)
      // left there, NaN included, and 0 x NaN is NaN: zero them, then hand the
      // writes to the async proxy. Both consumers write the same zeros to the
      // same rows, so one may still be writing while the other's products read
      // them: a benign race, every value either writes being zero. (Without
      // PAGED, rows past a sequence are the next sequence's K/V or the TMA's
      // zeros past the tensor: finite, so P's zeros cancel them.)
      const int valid = k_len - key0;
      if (valid < kBN) {
        uint8_t* v_tile = smem_raw + (stage - smem_u32(smem_raw)) + 2 * kHalfBytes;
        const int bytes = (kBN - valid) * 128;  // per half, whole rows
        for (int i = threadIdx.x % 128 * 16; i < bytes; i += 128 * 16) {
          *reinterpret_cast<uint4*>(v_tile + valid * 128 + i) = make_uint4(0, 0, 0, 0);
          *reinterpret_cast<uint4*>(v_tile + kHalfBytes + valid * 128 + i) =
              make_uint4(0, 0, 0, 0);
        }
        fence_proxy_async_shared();
        asm volatile("bar.sync %0, 128;" ::"r"(1 + c) : "memory");
      }
    }
    // P as wgmma's A operand: for keys 16 t .. 16 t + 15, this thread's
    // values of S's groups 2 t and 2 t + 1, in the order they lie.
    uint32_t p[kBN / 16][4];
#pragma unroll
    for (int t = 0; t < kBN / 16; ++t) {
#pragma unroll
      for (int r = 0; r < 4; ++r) p[t][r] = pack2<T>(sc[8 * t + 2 * r], sc[8 * t + 2 * r + 1]);
    }
    wgmma_fence_operands(o);
    wgmma_fence();
#pragma unroll
    for (int t = 0; t < kBN / 16; ++t) {
      wgmma_rs_n128<T>(o, p[t], wgmma_desc_n_major(stage + 2 * kHalfBytes + t * 16 * 128));
    }
    wgmma_commit();  // runs while the next tile's S is issued
  }
  wgmma_wait<0>();
  wgmma_fence_operands(o);
  pdl_launch_dependents();

  // O / l, rows past the sequence's queries left alone.
  T* const out_head = out + static_cast<int64_t>(q_begin + q0) * out_row_stride +
                      (2 * pair + c) * kHeadDim + col0;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float sum = l[half];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const float inv = 1.f / sum;
    const int row = row0 + 8 * half;
    if (q0 + row >= q_len) continue;
    T* dst = out_head + static_cast<int64_t>(row) * out_row_stride;
#pragma unroll
    for (int n = 0; n < kHeadDim / 8; ++n) {
      *reinterpret_cast<uint32_t*>(dst + 8 * n) =
          pack2<T>(o[4 * n + 2 * half] * inv, o[4 * n + 2 * half + 1] * inv);
    }
  }
#else
  __trap();  // built without sm_90a: the host never launches it (flash_prefill_supported)
#endif
}
// --8<-- [end:kernel]

template <typename T, bool PAGED>
void launch(const PrefillParams& p, cudaStream_t stream) {
  const void* kernel = reinterpret_cast<const void*>(flash_prefill_kernel<T, PAGED>);
  allow_dynamic_smem(kernel, kSmemBytes);
  // [tokens, heads, 128] with the token stride given: boxes of 64 dims x 1 head x 64 tokens.
  auto map = [&](const void* base, int heads, int tokens, int64_t stride) {
    const uint64_t sizes[3] = {kHeadDim, static_cast<uint64_t>(heads),
                               static_cast<uint64_t>(tokens)};
    const uint64_t strides[2] = {kHeadDim * 2, static_cast<uint64_t>(stride) * 2};
    const uint32_t box[3] = {64, 1, kBM};
    return make_tensor_map(base, p.dtype, 3, sizes, strides, box);
  };
  // PAGED: [blocks, block_size, heads, 128] contiguous, boxes of 64 dims x 1
  // head x up to 64 keys of one block.
  auto paged_map = [&](const void* base) {
    const uint64_t sizes[4] = {kHeadDim, static_cast<uint64_t>(p.num_kv_heads),
                               static_cast<uint64_t>(p.block_size),
                               static_cast<uint64_t>(p.num_blocks)};
    const uint64_t row = static_cast<uint64_t>(p.num_kv_heads) * kHeadDim * 2;
    const uint64_t strides[3] = {kHeadDim * 2, row, row * p.block_size};
    const uint32_t box[4] = {64, 1, static_cast<uint32_t>(std::min(p.block_size, kBN)), 1};
    return make_tensor_map(base, p.dtype, 4, sizes, strides, box);
  };
  const CUtensorMap q_map = map(p.q, p.num_q_heads, p.total_q, p.q_stride);
  const CUtensorMap k_map = PAGED ? paged_map(p.k) : map(p.k, p.num_kv_heads, p.total_k,
                                                         p.k_stride);
  const CUtensorMap v_map = PAGED ? paged_map(p.v) : map(p.v, p.num_kv_heads, p.total_k,
                                                         p.v_stride);
  const dim3 grid(p.num_q_heads / 2, p.num_seqs, ceil_div(p.max_q, kBM));
  launch_kernel(flash_prefill_kernel<T, PAGED>, grid, dim3(kThreads), kSmemBytes, stream,
                "flash_prefill", q_map, k_map, v_map, static_cast<T*>(p.out), p.cu_q, p.cu_k,
                p.block_tables, p.max_blocks_per_seq, PAGED ? log2_exact(p.block_size) : 0,
                p.num_q_heads * kHeadDim, p.num_q_heads / p.num_kv_heads,
                static_cast<float>(p.scale * M_LOG2E));
}

}  // namespace

// wgmma and the TMA: the same requirement as the GEMM's (an sm_90 GPU, a 90a build).
bool flash_prefill_supported() { return wgmma_gemm_supported(); }

void flash_prefill(const PrefillParams& p, cudaStream_t stream) {
  if (!flash_prefill_supported()) {
    throw std::invalid_argument(
        "flash_prefill needs an sm_90 GPU (H100/H200) and a build for the 90a target");
  }
  if (p.head_dim != kHeadDim) throw std::invalid_argument("flash_prefill: head_dim must be 128");
  if (p.num_kv_heads < 1 || p.num_q_heads % p.num_kv_heads ||
      (p.num_q_heads / p.num_kv_heads) % 2) {
    throw std::invalid_argument(
        "flash_prefill: query heads per KV head must be even (a CTA takes two)");
  }
  if (p.num_seqs < 1 || p.max_q < 1 || p.total_q < 1 || p.total_k < 1) {
    throw std::invalid_argument("flash_prefill: an empty batch");
  }
  if (p.num_seqs > 65535) throw std::invalid_argument("flash_prefill: at most 65535 sequences");
  const bool paged = p.block_tables != nullptr;
  if (paged && (p.block_size < 16 || p.block_size > 256 ||
                (p.block_size & (p.block_size - 1)) || p.num_blocks < 1)) {
    throw std::invalid_argument("flash_prefill: a paged cache needs blocks of 16 to 256 tokens, "
                                "a power of two");
  }
  if (p.dtype == DType::kBFloat16) {
    paged ? launch<__nv_bfloat16, true>(p, stream) : launch<__nv_bfloat16, false>(p, stream);
  } else if (p.dtype == DType::kFloat16) {
    paged ? launch<__half, true>(p, stream) : launch<__half, false>(p, stream);
  } else {
    throw std::invalid_argument("flash_prefill: dtype must be float16 or bfloat16");
  }
}

}  // namespace mini_vllm
