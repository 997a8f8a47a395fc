// Pieces shared by the decode kernels v2..v4: how threads map onto token rows,
// the query load, the end-of-CTA merge of the per-lane softmax states, and the
// split-K combine kernel.
//
// Thread layout (head_dim 128, 128 threads): a token's K row for one KV head
// is 128 x 2 B = 256 B = 16 threads x 16 B. The CTA is 8 "lanes" of 16
// threads; each lane walks its own tokens and keeps its own online-softmax
// state, so the main loop needs no __syncthreads at all.
//
//   thread:   0 ..15 | 16..31 | 32..47 | ... | 112..127
//   lane:        0   |    1   |    2   | ... |     7
//   r (slice) 0..15: thread r of a lane holds elements [8r, 8r+8) of the row
#pragma once

#include "../common.cuh"
#include "../pdl.cuh"

namespace mini_vllm {

template <int HEAD_DIM, int NT>
struct DecodeLayout {
  static constexpr int kThreadsPerRow = HEAD_DIM / 8;  // 16 B per thread
  static constexpr int kLanes = NT / kThreadsPerRow;   // token rows per step
  static constexpr int kWarps = NT / 32;
  static_assert(kThreadsPerRow <= 32, "a token row must fit in one warp");
};

// Load this thread's 8 elements of each of the CTA's GROUP query heads, as
// floats pre-multiplied by scale * log2(e) (the kernels use exp2f).
template <typename T, int HEAD_DIM, int GROUP>
__device__ __forceinline__ void load_query(const T* q_head0, int r, float scale,
                                           float (&q)[GROUP][8]) {
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    const uint4 v = *reinterpret_cast<const uint4*>(q_head0 + g * HEAD_DIM + r * 8);
    unpack8<T>(v, q[g]);
#pragma unroll
    for (int j = 0; j < 8; ++j) q[g][j] *= scale * kLog2e;
  }
}

// Shared memory for the end-of-CTA merge: one softmax state per warp.
template <int HEAD_DIM, int GROUP, int NT>
struct MergeSmem {
  float m[NT / 32][GROUP];
  float l[NT / 32][GROUP];
  float acc[NT / 32][GROUP][HEAD_DIM];
};

// --8<-- [start:merge]
// Merge the per-lane states (m: running max in log2 units, l: sum of
// exp2(s - m), acc: sum of exp2(s - m) * v over this thread's 8 elements)
// into one result per query head, then write it: the final output when the
// sequence has one split (`out` != nullptr), else this split's normalized
// partial output and its (m, l) for the combine kernel.
template <typename T, int HEAD_DIM, int GROUP, int NT>
__device__ __forceinline__ void merge_lanes_and_store(
    float (&m)[GROUP], float (&l)[GROUP], float (&acc)[GROUP][8],
    MergeSmem<HEAD_DIM, GROUP, NT>& sm, T* out, float* part_out, float* part_ml,
    int part_head_stride) {
  using Layout = DecodeLayout<HEAD_DIM, NT>;
  constexpr int TPR = Layout::kThreadsPerRow;
  const int tid = threadIdx.x, warp = tid / 32, wl = tid % 32, r = tid % TPR;

  // 1. Lanes of one warp: butterfly over the lane bits of the thread index.
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    float mx = m[g];
#pragma unroll
    for (int off = TPR; off < 32; off *= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    const float a = mx == -INFINITY ? 0.0f : exp2f(m[g] - mx);
    float sum = l[g] * a;
#pragma unroll
    for (int off = TPR; off < 32; off *= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      float x = acc[g][j] * a;
#pragma unroll
      for (int off = TPR; off < 32; off *= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
      acc[g][j] = x;
    }
    m[g] = mx;
    l[g] = sum;
  }
  // 2. The first lane of each warp publishes the warp's state.
  if (wl < TPR) {
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
      if (r == 0) {
        sm.m[warp][g] = m[g];
        sm.l[warp][g] = l[g];
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) sm.acc[warp][g][r * 8 + j] = acc[g][j];
    }
  }
  __syncthreads();
  // 3. Warps: one thread per output element.
  for (int idx = tid; idx < GROUP * HEAD_DIM; idx += NT) {
    const int g = idx / HEAD_DIM, d = idx % HEAD_DIM;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < Layout::kWarps; ++w) mx = fmaxf(mx, sm.m[w][g]);
    float sum = 0.0f, o = 0.0f;
#pragma unroll
    for (int w = 0; w < Layout::kWarps; ++w) {
      const float a = sm.m[w][g] == -INFINITY ? 0.0f : exp2f(sm.m[w][g] - mx);
      sum += sm.l[w][g] * a;
      o += sm.acc[w][g][d] * a;
    }
    if (out != nullptr) {
      out[g * HEAD_DIM + d] = TypeTraits<T>::from_float(o / sum);
    } else {
      part_out[g * part_head_stride * HEAD_DIM + d] = o / sum;
      if (d == 0) {
        part_ml[g * part_head_stride * 2 + 0] = mx;
        part_ml[g * part_head_stride * 2 + 1] = sum;
      }
    }
  }
}
// --8<-- [end:merge]

// A sequence with no tokens (a padded batch slot) gets zeros, not garbage:
// GROUP heads, or `heads` when given.
template <typename T, int HEAD_DIM, int GROUP, int NT>
__device__ __forceinline__ void store_zeros(T* out, int heads = GROUP) {
  for (int idx = threadIdx.x; idx < heads * HEAD_DIM; idx += NT) {
    out[idx] = TypeTraits<T>::from_float(0.0f);
  }
}

// --8<-- [start:combine]
// Split-K combine: for each (sequence, query head) with more than one split,
//   M = max_i m_i,  w_i = l_i * 2^(m_i - M),  out = sum_i w_i * o_i / sum_i w_i
// where o_i is split i's normalized partial output. One CTA per (head, seq),
// one thread per output element; the (m, l) pairs are few and L1-resident.
template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(HEAD_DIM) combine_splits_kernel(DecodeParams p) {
  const int head = blockIdx.x, seq = blockIdx.y;
  pdl_launch_dependents();  // launched with PDL: wait for the partials
  pdl_wait();
  // The same clamps as the decode kernels, so both agree on the number of splits.
  const int ctx = min(min(p.context_lens[seq], p.max_blocks_per_seq * p.block_size),
                      p.max_splits * p.partition_size);
  const int num_splits = (ctx + p.partition_size - 1) / p.partition_size;
  if (num_splits <= 1) return;  // the decode kernel wrote this output itself
  const int64_t row = static_cast<int64_t>(seq) * p.num_q_heads + head;
  const float* ml = p.part_ml + row * p.max_splits * 2;
  const float* po = p.part_out + row * p.max_splits * HEAD_DIM;
  float mx = -INFINITY;
  for (int i = 0; i < num_splits; ++i) mx = fmaxf(mx, ml[2 * i]);
  const int d = threadIdx.x;
  float sum = 0.0f, o = 0.0f;
  for (int i = 0; i < num_splits; ++i) {
    const float w = ml[2 * i + 1] * exp2f(ml[2 * i] - mx);
    sum += w;
    o += w * po[i * HEAD_DIM + d];
  }
  T* out = static_cast<T*>(p.out) + row * HEAD_DIM;
  out[d] = TypeTraits<T>::from_float(o / sum);
}
// --8<-- [end:combine]

template <typename T, int HEAD_DIM>
void launch_combine(const DecodeParams& p, cudaStream_t stream) {
  if (p.max_splits <= 1) return;
  launch_kernel(combine_splits_kernel<T, HEAD_DIM>, dim3(p.num_q_heads, p.num_seqs),
                dim3(HEAD_DIM), 0, stream, "combine_splits_kernel", p);
}

}  // namespace mini_vllm
