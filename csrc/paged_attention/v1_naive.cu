// Version 1: the textbook kernel.
//
// One CTA per (query head, sequence). Three passes over the context:
//   1. scores s_t = q . k_t * scale for every token, into shared memory
//   2. softmax over the scores (block-wide max, exp, block-wide sum)
//   3. out[d] = sum_t p_t * v_t[d], one thread per output element
// Every load is a single 2-byte element, every query head re-reads its KV
// head (query heads that share a KV head read it again), and one CTA walks the
// whole context however long it is. It is correct and easy to check, and the
// versions after it remove each of those costs in turn.
#include "../common.cuh"

namespace mini_vllm {
namespace {

constexpr int kV1Threads = 128;

// --8<-- [start:kernel]
template <typename T>
__global__ void __launch_bounds__(kV1Threads) paged_attention_v1_kernel(DecodeParams p, int log2_bs) {
  extern __shared__ float smem[];
  const int head = blockIdx.x, seq = blockIdx.y, D = p.head_dim;
  const int kv_head = head / (p.num_q_heads / p.num_kv_heads);
  // Never past the table nor past the scores buffer (both are caller's bounds).
  const int ctx = min(min(p.context_lens[seq], p.max_blocks_per_seq << log2_bs), p.max_context_len);
  float* q_s = smem;               // [head_dim]
  float* scores = smem + D;        // [max_context_len]
  float* scratch = scores + p.max_context_len;  // [32]
  const T* q = static_cast<const T*>(p.q) + seq * p.q_stride + static_cast<int64_t>(head) * D;
  T* out = static_cast<T*>(p.out) + (static_cast<int64_t>(seq) * p.num_q_heads + head) * D;
  const T* k_cache = static_cast<const T*>(p.k_cache);
  const T* v_cache = static_cast<const T*>(p.v_cache);
  const int* table = p.block_tables + static_cast<int64_t>(seq) * p.max_blocks_per_seq;
  const int64_t token_stride = static_cast<int64_t>(p.num_kv_heads) * D;

  for (int d = threadIdx.x; d < D; d += kV1Threads) q_s[d] = TypeTraits<T>::to_float(q[d]);
  __syncthreads();

  // Pass 1: one thread per token computes a whole dot product.
  float local_max = -INFINITY;
  for (int t = threadIdx.x; t < ctx; t += kV1Threads) {
    const int64_t slot = static_cast<int64_t>(table[t >> log2_bs]) * p.block_size +
                         (t & (p.block_size - 1));
    const T* k = k_cache + slot * token_stride + static_cast<int64_t>(kv_head) * D;
    float s = 0.0f;
    for (int d = 0; d < D; ++d) s += q_s[d] * TypeTraits<T>::to_float(k[d]);
    s *= p.scale;
    scores[t] = s;
    local_max = fmaxf(local_max, s);
  }
  // Pass 2: softmax.
  const float max_s = block_max(local_max, scratch);
  float local_sum = 0.0f;
  for (int t = threadIdx.x; t < ctx; t += kV1Threads) {
    const float e = __expf(scores[t] - max_s);
    scores[t] = e;
    local_sum += e;
  }
  const float sum = block_sum(local_sum, scratch);
  // Pass 3: one thread per output element walks every token's V.
  for (int d = threadIdx.x; d < D; d += kV1Threads) {
    float o = 0.0f;
    for (int t = 0; t < ctx; ++t) {
      const int64_t slot = static_cast<int64_t>(table[t >> log2_bs]) * p.block_size +
                           (t & (p.block_size - 1));
      o += scores[t] * TypeTraits<T>::to_float(v_cache[slot * token_stride + kv_head * D + d]);
    }
    out[d] = TypeTraits<T>::from_float(ctx > 0 ? o / sum : 0.0f);
  }
}
// --8<-- [end:kernel]

template <typename T>
void launch_v1(const DecodeParams& p, cudaStream_t stream) {
  const size_t smem = (p.head_dim + p.max_context_len + 32) * sizeof(float);
  int device = 0, max_smem = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  check_cuda(cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
             "cudaDeviceGetAttribute");
  if (smem > static_cast<size_t>(max_smem)) {
    throw std::invalid_argument("version 1 keeps all scores in shared memory: max_context_len " +
                                std::to_string(p.max_context_len) + " is too long");
  }
  auto kernel = paged_attention_v1_kernel<T>;
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(smem)),
             "cudaFuncSetAttribute");
  kernel<<<dim3(p.num_q_heads, p.num_seqs), kV1Threads, smem, stream>>>(p, log2_exact(p.block_size));
  MINI_VLLM_CHECK_LAUNCH("paged_attention_v1_kernel");
}

}  // namespace

void paged_attention_v1(const DecodeParams& p, cudaStream_t stream) {
  switch (p.dtype) {
    case DType::kFloat16: return launch_v1<__half>(p, stream);
    case DType::kBFloat16: return launch_v1<__nv_bfloat16>(p, stream);
    default: throw std::invalid_argument("decode attention supports float16 and bfloat16");
  }
}

}  // namespace mini_vllm
