// Python bindings of the fused layer and sampling kernels, registered into
// mini_vllm._C by bindings.cpp. Same raw-pointer convention as the attention kernels.
#include <cstdint>

#include <pybind11/pybind11.h>

#include "binding_utils.h"
#include "layer_params.h"

namespace py = pybind11;

namespace mini_vllm {

void register_layer_ops(py::module_& m) {
  m.def(
      "rms_norm",
      [](std::uintptr_t out, std::uintptr_t residual, std::uintptr_t x, std::uintptr_t weight,
         int num_tokens, int hidden, int64_t x_stride, int64_t out_stride, float eps, int dtype,
         std::uintptr_t stream) {
        RmsNormParams p;
        p.out = as_ptr<void>(out);
        p.residual = as_ptr<void>(residual);
        p.x = as_ptr<const void>(x);
        p.weight = as_ptr<const void>(weight);
        p.num_tokens = num_tokens;
        p.hidden = hidden;
        p.x_stride = x_stride;
        p.out_stride = out_stride;
        p.eps = eps;
        p.dtype = as_dtype(dtype);
        rms_norm(p, as_stream(stream));
      },
      "out = w * rms_norm(x), after residual += x when residual != 0.", py::arg("out"),
      py::arg("residual"), py::arg("x"), py::arg("weight"), py::arg("num_tokens"),
      py::arg("hidden"), py::arg("x_stride"), py::arg("out_stride"), py::arg("eps"),
      py::arg("dtype"), py::arg("stream"));

  m.def(
      "qk_norm_rope",
      [](std::uintptr_t qkv, std::uintptr_t q_weight, std::uintptr_t k_weight,
         std::uintptr_t cos_sin_cache, std::uintptr_t positions, int num_tokens,
         int num_q_heads, int num_kv_heads, int head_dim, int64_t token_stride, float eps,
         int dtype, std::uintptr_t stream, std::uintptr_t k_cache, std::uintptr_t v_cache,
         std::uintptr_t slot_mapping, std::uintptr_t residual, int hidden, float residual_eps,
         int heads_per_warp) {
        QkNormRopeParams p;
        p.heads_per_warp = heads_per_warp;
        p.residual = as_ptr<const void>(residual);
        p.hidden = hidden;
        p.residual_eps = residual_eps;
        p.qkv = as_ptr<void>(qkv);
        p.k_cache = as_ptr<void>(k_cache);
        p.v_cache = as_ptr<void>(v_cache);
        p.slot_mapping = as_ptr<const int64_t>(slot_mapping);
        p.q_weight = as_ptr<const void>(q_weight);
        p.k_weight = as_ptr<const void>(k_weight);
        p.cos_sin_cache = as_ptr<const float>(cos_sin_cache);
        p.positions = as_ptr<const int64_t>(positions);
        p.num_tokens = num_tokens;
        p.num_q_heads = num_q_heads;
        p.num_kv_heads = num_kv_heads;
        p.head_dim = head_dim;
        p.token_stride = token_stride;
        p.eps = eps;
        p.dtype = as_dtype(dtype);
        qk_norm_rope(p, as_stream(stream));
      },
      "Per-head RMSNorm + neox RoPE of q and k inside a fused qkv output, in place; with "
      "slot_mapping != 0, k and v are also stored in the KV cache; with residual != 0, q, k "
      "and v are first scaled by each token's 1 / rms(residual) (norms folded into qkv_proj).",
      py::arg("qkv"), py::arg("q_weight"), py::arg("k_weight"), py::arg("cos_sin_cache"),
      py::arg("positions"), py::arg("num_tokens"), py::arg("num_q_heads"),
      py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("token_stride"), py::arg("eps"),
      py::arg("dtype"), py::arg("stream"), py::arg("k_cache") = 0, py::arg("v_cache") = 0,
      py::arg("slot_mapping") = 0, py::arg("residual") = 0, py::arg("hidden") = 0,
      py::arg("residual_eps") = 1e-6f, py::arg("heads_per_warp") = 0);

  m.def(
      "silu_and_mul",
      [](std::uintptr_t out, std::uintptr_t x, int num_tokens, int d, int dtype,
         std::uintptr_t stream, std::uintptr_t residual, int hidden, float residual_eps) {
        SiluAndMulParams p;
        p.residual = as_ptr<const void>(residual);
        p.hidden = hidden;
        p.residual_eps = residual_eps;
        p.out = as_ptr<void>(out);
        p.x = as_ptr<const void>(x);
        p.num_tokens = num_tokens;
        p.d = d;
        p.dtype = as_dtype(dtype);
        silu_and_mul(p, as_stream(stream));
      },
      "out = silu(x[:, :d]) * x[:, d:]; with residual != 0, x is first scaled by each row's "
      "1 / rms(residual) (the norm folded into gate_up_proj).",
      py::arg("out"), py::arg("x"), py::arg("num_tokens"), py::arg("d"), py::arg("dtype"),
      py::arg("stream"), py::arg("residual") = 0, py::arg("hidden") = 0,
      py::arg("residual_eps") = 1e-6f);

  m.def("sample_chunk", [] { return kSampleChunk; },
        "Tokens per chunk of sample_tokens' first level.");
  m.def(
      "sample_tokens",
      [](std::uintptr_t out, std::uintptr_t partials, std::uintptr_t logits,
         std::uintptr_t inv_temperature, std::uintptr_t seeds, int num_rows, int vocab,
         int num_chunks, int64_t row_stride, int dtype, std::uintptr_t stream) {
        SampleParams p;
        p.out = as_ptr<int64_t>(out);
        p.partials = as_ptr<float>(partials);
        p.logits = as_ptr<const void>(logits);
        p.inv_temperature = as_ptr<const float>(inv_temperature);
        p.seeds = as_ptr<const int64_t>(seeds);
        p.num_rows = num_rows;
        p.vocab = vocab;
        p.num_chunks = num_chunks;
        p.row_stride = row_stride;
        p.dtype = as_dtype(dtype);
        sample_tokens(p, as_stream(stream));
      },
      "out[r] = a sample of softmax(logits[r] * inv_temperature[r]) by a two-level "
      "Gumbel-max race (argmax when inv_temperature[r] == 0), noise keyed by seeds[r]; "
      "partials: [num_rows, num_chunks] float32, num_chunks = ceil(vocab / sample_chunk()).",
      py::arg("out"), py::arg("partials"), py::arg("logits"), py::arg("inv_temperature"),
      py::arg("seeds"), py::arg("num_rows"), py::arg("vocab"), py::arg("num_chunks"),
      py::arg("row_stride"), py::arg("dtype"), py::arg("stream"));
}

}  // namespace mini_vllm
