// A decode step's inputs, host to device, in one call (phase 9).
//
// The decode graphs read their inputs from static device buffers
// (mini_vllm/cuda_graphs.py, DecodeInputs). The host writes a step's inputs
// into a pinned mirror of them, and this function moves them:
//
//   1. the packed rows (ids, positions, slots, context lengths, the decode
//      order, the token fixes): one cudaMemcpyAsync;
//   2. the block table, compact on the host ([rows, width]) and `pitch` ints
//      wide on the device: one cudaMemcpy2DAsync into the first `width`
//      columns of each row (the copy engine strides it, no kernel);
//   3. the token fixes: ids[row] = prev[src] for each (row, src) pair, the
//      tokens the previous step sampled, which never visit the host: one
//      small kernel.
//
// From Python that is one call instead of some thirty tensor operations, each
// of which costs the host microseconds, and on the GPU two copies and a kernel
// instead of four copies and two kernels.
#include "common.cuh"
#include "params.h"

namespace mini_vllm {
namespace {

// --8<-- [start:stage_step_inputs]
__global__ void apply_token_fixes_kernel(int64_t* __restrict__ ids,
                                         const int64_t* __restrict__ fixes,
                                         const int64_t* __restrict__ prev, int num_fixes) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j < num_fixes) ids[fixes[2 * j]] = prev[fixes[2 * j + 1]];
}

}  // namespace

void stage_step_inputs(const StageParams& p, cudaStream_t stream) {
  if (p.nbytes < 0 || p.table_rows < 0 || p.table_width < 0 || p.num_fixes < 0) {
    throw std::invalid_argument("stage_step_inputs: negative size");
  }
  if (p.table_width > p.table_pitch) {
    throw std::invalid_argument("stage_step_inputs: table_width exceeds table_pitch");
  }
  if (p.num_fixes > 0 && (p.ids == nullptr || p.fixes == nullptr || p.prev == nullptr)) {
    throw std::invalid_argument("stage_step_inputs: token fixes need ids, fixes and prev");
  }
  if (p.nbytes > 0) {
    check_cuda(cudaMemcpyAsync(p.dst, p.src, p.nbytes, cudaMemcpyHostToDevice, stream),
               "stage_step_inputs: cudaMemcpyAsync");
  }
  if (p.table_rows > 0 && p.table_width > 0) {
    constexpr size_t kInt = sizeof(int32_t);
    check_cuda(cudaMemcpy2DAsync(p.table_dst, p.table_pitch * kInt, p.table_src,
                                 p.table_width * kInt, p.table_width * kInt, p.table_rows,
                                 cudaMemcpyHostToDevice, stream),
               "stage_step_inputs: cudaMemcpy2DAsync");
  }
  if (p.num_fixes > 0) {
    constexpr int kThreads = 128;
    // A plain launch (no programmatic launch): it must see the copies above complete.
    apply_token_fixes_kernel<<<ceil_div(p.num_fixes, kThreads), kThreads, 0, stream>>>(
        p.ids, p.fixes, p.prev, p.num_fixes);
    MINI_VLLM_CHECK_LAUNCH("apply_token_fixes_kernel");
  }
}
// --8<-- [end:stage_step_inputs]

}  // namespace mini_vllm
