// The Python module mini_vllm._C.
//
// ABI-free by design: every function takes raw device pointers (Python ints
// from tensor.data_ptr()), sizes, a dtype code and the CUDA stream as an int
// (torch.cuda.current_stream().cuda_stream). The module links only the CUDA
// runtime, never PyTorch, so one build works with any installed PyTorch.
// The checked, tensor-level API lives in mini_vllm/ops.
#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>

#include <pybind11/pybind11.h>

#include "binding_utils.h"
#include "params.h"
#include "prefill_params.h"

namespace py = pybind11;
using namespace mini_vllm;

namespace mini_vllm {
void register_layer_ops(py::module_& m);  // layer_bindings.cpp: the fused layer kernels
void register_gemv_ops(py::module_& m);   // gemv_bindings.cpp: the skinny GEMM
std::atomic<bool>& programmatic_launch_flag();  // pdl.cu
}  // namespace mini_vllm

namespace {

void decode(int version, std::uintptr_t out, std::uintptr_t q, std::uintptr_t k_cache,
            std::uintptr_t v_cache, std::uintptr_t block_tables, std::uintptr_t context_lens,
            std::uintptr_t part_out, std::uintptr_t part_ml, int num_seqs, int num_q_heads,
            int num_kv_heads, int head_dim, int block_size, int max_blocks_per_seq,
            int64_t q_stride, int max_context_len, int partition_size, int max_splits,
            float scale, int dtype, std::uintptr_t stream, int unroll, int cluster,
            int heads_per_cta, int stages, std::uintptr_t counters, std::uintptr_t seq_order,
            int64_t num_blocks, int64_t kv_block_stride, int64_t kv_head_stride,
            int64_t kv_token_stride) {
  DecodeParams p;
  p.kv_block_stride = kv_block_stride;
  p.kv_head_stride = kv_head_stride;
  p.kv_token_stride = kv_token_stride;
  p.out = as_ptr<void>(out);
  p.q = as_ptr<const void>(q);
  p.k_cache = as_ptr<const void>(k_cache);
  p.v_cache = as_ptr<const void>(v_cache);
  p.block_tables = as_ptr<const int32_t>(block_tables);
  p.context_lens = as_ptr<const int32_t>(context_lens);
  p.part_out = as_ptr<float>(part_out);
  p.part_ml = as_ptr<float>(part_ml);
  p.counters = as_ptr<int32_t>(counters);
  p.seq_order = as_ptr<const int32_t>(seq_order);
  p.num_blocks = num_blocks;
  p.num_seqs = num_seqs;
  p.num_q_heads = num_q_heads;
  p.num_kv_heads = num_kv_heads;
  p.head_dim = head_dim;
  p.block_size = block_size;
  p.max_blocks_per_seq = max_blocks_per_seq;
  p.q_stride = q_stride;
  p.max_context_len = max_context_len;
  p.partition_size = partition_size;
  p.max_splits = max_splits;
  p.scale = scale;
  p.dtype = as_dtype(dtype);
  p.unroll = unroll;
  p.cluster = cluster;
  p.heads_per_cta = heads_per_cta;
  p.stages = stages;
  if (num_seqs == 0) return;
  if (num_kv_heads <= 0 || num_q_heads % num_kv_heads != 0) {
    throw std::invalid_argument("num_q_heads must be a positive multiple of num_kv_heads");
  }
  if (partition_size <= 0 || max_splits <= 0) {
    throw std::invalid_argument("partition_size and max_splits must be positive");
  }
  if (version != 7 && !kv_token_major(p)) {
    throw std::invalid_argument("version " + std::to_string(version) +
                                " reads only the contiguous token-major KV cache");
  }
  switch (version) {
    case 1: return paged_attention_v1(p, as_stream(stream));
    case 2: return paged_attention_v2(p, as_stream(stream));
    case 3: return paged_attention_v3(p, as_stream(stream));
    case 4: return paged_attention_v4(p, as_stream(stream));
    case 5: return paged_attention_v5(p, as_stream(stream));
    case 6: return paged_attention_v6(p, as_stream(stream));
    case 7: return paged_attention_v7(p, as_stream(stream));
    case 8: return paged_attention_v8(p, as_stream(stream));
    case 9: return paged_attention_v9(p, as_stream(stream));
    default: throw std::invalid_argument("unknown kernel version " + std::to_string(version));
  }
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "mini-vllm CUDA kernels (raw-pointer interface; use mini_vllm.ops)";
  m.attr("DECODE_VERSIONS") = py::make_tuple(1, 2, 3, 4, 5, 6, 7, 8, 9);
  m.attr("CUDA_ARCHITECTURES") = MINI_VLLM_CUDA_ARCHITECTURES;
  register_layer_ops(m);
  register_gemv_ops(m);
  m.def("set_programmatic_launch",
        [](bool enabled) { programmatic_launch_flag().store(enabled); }, py::arg("enabled"),
        "Launch the kernels that support it with programmatic dependent launch (sm_90+).");
  m.def("programmatic_launch", []() { return programmatic_launch_flag().load(); },
        "Whether programmatic dependent launch is on (it applies on sm_90+ only).");

  m.def("paged_attention_decode", &decode, "Paged decode attention (see DecodeParams).",
        py::arg("version"), py::arg("out"), py::arg("q"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"),
        py::arg("part_out"), py::arg("part_ml"), py::arg("num_seqs"), py::arg("num_q_heads"),
        py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("block_size"),
        py::arg("max_blocks_per_seq"), py::arg("q_stride"), py::arg("max_context_len"),
        py::arg("partition_size"), py::arg("max_splits"), py::arg("scale"), py::arg("dtype"),
        py::arg("stream"), py::arg("unroll") = 0, py::arg("cluster") = 0,
        py::arg("heads_per_cta") = 0, py::arg("stages") = 0, py::arg("counters") = 0,
        py::arg("seq_order") = 0, py::arg("num_blocks") = 0,
        py::arg("kv_block_stride") = 0, py::arg("kv_head_stride") = 0,
        py::arg("kv_token_stride") = 0);

  m.def(
      "reshape_and_cache",
      [](std::uintptr_t key, std::uintptr_t value, std::uintptr_t k_cache, std::uintptr_t v_cache,
         std::uintptr_t slot_mapping, int num_tokens, int num_kv_heads, int head_dim,
         int64_t key_stride, int64_t value_stride, int dtype, std::uintptr_t stream) {
        CacheWriteParams p;
        p.key = as_ptr<const void>(key);
        p.value = as_ptr<const void>(value);
        p.k_cache = as_ptr<void>(k_cache);
        p.v_cache = as_ptr<void>(v_cache);
        p.slot_mapping = as_ptr<const int64_t>(slot_mapping);
        p.num_tokens = num_tokens;
        p.num_kv_heads = num_kv_heads;
        p.head_dim = head_dim;
        p.key_stride = key_stride;
        p.value_stride = value_stride;
        p.dtype = as_dtype(dtype);
        reshape_and_cache(p, as_stream(stream));
      },
      "Write new tokens' K and V into their cache slots (slot -1: skip).", py::arg("key"),
      py::arg("value"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slot_mapping"),
      py::arg("num_tokens"), py::arg("num_kv_heads"), py::arg("head_dim"),
      py::arg("key_stride"), py::arg("value_stride"), py::arg("dtype"), py::arg("stream"));

  m.def(
      "stage_step_inputs",
      [](std::uintptr_t dst, std::uintptr_t src, int64_t nbytes, std::uintptr_t table_dst,
         std::uintptr_t table_src, int64_t table_rows, int64_t table_width, int64_t table_pitch,
         std::uintptr_t ids, std::uintptr_t fixes, std::uintptr_t prev, int num_fixes,
         std::uintptr_t stream) {
        StageParams p;
        p.dst = as_ptr<void>(dst);
        p.src = as_ptr<const void>(src);
        p.nbytes = nbytes;
        p.table_dst = as_ptr<int32_t>(table_dst);
        p.table_src = as_ptr<const int32_t>(table_src);
        p.table_rows = table_rows;
        p.table_width = table_width;
        p.table_pitch = table_pitch;
        p.ids = as_ptr<int64_t>(ids);
        p.fixes = as_ptr<const int64_t>(fixes);
        p.prev = as_ptr<const int64_t>(prev);
        p.num_fixes = num_fixes;
        stage_step_inputs(p, as_stream(stream));
      },
      "A decode step's inputs from pinned host memory into a graph's buffers, then the "
      "token fixes ids[row] = prev[src].",
      py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("table_dst"),
      py::arg("table_src"), py::arg("table_rows"), py::arg("table_width"),
      py::arg("table_pitch"), py::arg("ids"), py::arg("fixes"), py::arg("prev"),
      py::arg("num_fixes"), py::arg("stream"));

  m.def(
      "gather_kv_cache",
      [](std::uintptr_t k_out, std::uintptr_t v_out, std::uintptr_t k_cache,
         std::uintptr_t v_cache, std::uintptr_t block_tables, std::uintptr_t cu_seqlens,
         int num_seqs, int num_kv_heads, int head_dim, int block_size, int max_blocks_per_seq,
         int max_context_len, int dtype, std::uintptr_t stream) {
        GatherParams p;
        p.k_out = as_ptr<void>(k_out);
        p.v_out = as_ptr<void>(v_out);
        p.k_cache = as_ptr<const void>(k_cache);
        p.v_cache = as_ptr<const void>(v_cache);
        p.block_tables = as_ptr<const int32_t>(block_tables);
        p.cu_seqlens = as_ptr<const int32_t>(cu_seqlens);
        p.num_seqs = num_seqs;
        p.num_kv_heads = num_kv_heads;
        p.head_dim = head_dim;
        p.block_size = block_size;
        p.max_blocks_per_seq = max_blocks_per_seq;
        p.max_context_len = max_context_len;
        p.dtype = as_dtype(dtype);
        gather_kv_cache(p, as_stream(stream));
      },
      "Gather paged K/V into contiguous rows, sequence after sequence.", py::arg("k_out"),
      py::arg("v_out"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"),
      py::arg("cu_seqlens"), py::arg("num_seqs"), py::arg("num_kv_heads"), py::arg("head_dim"),
      py::arg("block_size"), py::arg("max_blocks_per_seq"), py::arg("max_context_len"),
      py::arg("dtype"), py::arg("stream"));

  m.def("flash_prefill_supported", &flash_prefill_supported,
        "Whether flash_prefill can run: an sm_90 GPU and a module built for sm_90a.");
  m.def(
      "flash_prefill",
      [](std::uintptr_t out, std::uintptr_t q, std::uintptr_t k, std::uintptr_t v,
         std::uintptr_t cu_q, std::uintptr_t cu_k, int num_seqs, int num_q_heads,
         int num_kv_heads, int head_dim, int total_q, int total_k, int64_t q_stride,
         int64_t k_stride, int64_t v_stride, int max_q, float scale, int dtype,
         std::uintptr_t stream, std::uintptr_t block_tables, int max_blocks_per_seq,
         int block_size, int64_t num_blocks) {
        PrefillParams p;
        p.out = as_ptr<void>(out);
        p.q = as_ptr<const void>(q);
        p.k = as_ptr<const void>(k);
        p.v = as_ptr<const void>(v);
        p.cu_q = as_ptr<const int32_t>(cu_q);
        p.cu_k = as_ptr<const int32_t>(cu_k);
        p.num_seqs = num_seqs;
        p.num_q_heads = num_q_heads;
        p.num_kv_heads = num_kv_heads;
        p.head_dim = head_dim;
        p.total_q = total_q;
        p.total_k = total_k;
        p.q_stride = q_stride;
        p.k_stride = k_stride;
        p.v_stride = v_stride;
        p.max_q = max_q;
        p.scale = scale;
        p.dtype = as_dtype(dtype);
        p.block_tables = as_ptr<const int32_t>(block_tables);
        p.max_blocks_per_seq = max_blocks_per_seq;
        p.block_size = block_size;
        p.num_blocks = num_blocks;
        flash_prefill(p, as_stream(stream));
      },
      "Causal varlen prefill attention on sm_90a (TMA + wgmma), over packed K/V rows or, "
      "with block_tables, the paged cache (see PrefillParams).",
      py::arg("out"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("cu_q"),
      py::arg("cu_k"), py::arg("num_seqs"), py::arg("num_q_heads"), py::arg("num_kv_heads"),
      py::arg("head_dim"), py::arg("total_q"), py::arg("total_k"), py::arg("q_stride"),
      py::arg("k_stride"), py::arg("v_stride"), py::arg("max_q"), py::arg("scale"),
      py::arg("dtype"), py::arg("stream"), py::arg("block_tables") = 0,
      py::arg("max_blocks_per_seq") = 0, py::arg("block_size") = 0, py::arg("num_blocks") = 0);
}
