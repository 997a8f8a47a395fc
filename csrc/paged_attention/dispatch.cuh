// Turn the run-time (dtype, head_dim, query heads per CTA) of a launch into
// template arguments. A launcher is a class template L<T, HEAD_DIM, GROUP>
// with a static run(params, stream).
#pragma once

#include <stdexcept>
#include <string>

#include "../common.cuh"

namespace mini_vllm {

// Query heads one CTA serves: as asked, or the largest of 8, 4, 2, 1 that
// divides the number of query heads per KV head (Qwen3: 2 for 16/8 heads,
// 4 for 32/8). CTAs that share a KV head read it once from HBM and once
// more from L2.
inline int heads_per_cta(const DecodeParams& p) {
  const int g = p.num_q_heads / p.num_kv_heads;
  if (p.heads_per_cta != 0) {
    const int h = p.heads_per_cta;
    if ((h != 1 && h != 2 && h != 4 && h != 8) || g % h != 0) {
      throw std::invalid_argument("heads_per_cta must be 1, 2, 4 or 8 and divide the GQA group");
    }
    return h;
  }
  return g % 8 == 0 ? 8 : g % 4 == 0 ? 4 : g % 2 == 0 ? 2 : 1;
}

template <template <typename, int, int> class L, typename T, int D>
void dispatch_group(const DecodeParams& p, cudaStream_t s) {
  switch (heads_per_cta(p)) {
    case 8: return L<T, D, 8>::run(p, s);
    case 4: return L<T, D, 4>::run(p, s);
    case 2: return L<T, D, 2>::run(p, s);
    default: return L<T, D, 1>::run(p, s);
  }
}

template <template <typename, int, int> class L, typename T>
void dispatch_head_dim(const DecodeParams& p, cudaStream_t s) {
  switch (p.head_dim) {
    case 32: return dispatch_group<L, T, 32>(p, s);
    case 64: return dispatch_group<L, T, 64>(p, s);
    case 128: return dispatch_group<L, T, 128>(p, s);
    default:
      throw std::invalid_argument("head_dim " + std::to_string(p.head_dim) +
                                  " is not supported (32, 64, 128)");
  }
}

template <template <typename, int, int> class L>
void dispatch_decode(const DecodeParams& p, cudaStream_t s) {
  switch (p.dtype) {
    case DType::kFloat16: return dispatch_head_dim<L, __half>(p, s);
    case DType::kBFloat16: return dispatch_head_dim<L, __nv_bfloat16>(p, s);
    default: throw std::invalid_argument("decode attention supports float16 and bfloat16");
  }
}

}  // namespace mini_vllm
