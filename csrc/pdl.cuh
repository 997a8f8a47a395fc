// Programmatic dependent launch (PDL, sm_90+): let a kernel start while the
// kernel before it in the stream is still finishing.
//
// Normally kernel B starts only after kernel A has completed and its writes
// are flushed; the gap (A's tail, B's launch and ramp-up) is a microsecond or
// two, as long as a whole small kernel of a batch-1 decode step. Launched
// with the programmatic-serialization attribute, B may be scheduled as soon
// as every CTA of A has called `pdl_launch_dependents()` (or exited), and B
// itself calls `pdl_wait()`, which returns once A has completed and its
// writes are visible. Whatever B does before `pdl_wait()` overlaps A.
//
// Every kernel of a decode step of ours is launched this way. The rule each
// follows: before `pdl_wait()` it reads only data no kernel of the step writes
// (weights; v7 also its block table and context length, copied from the host
// before the step's first kernel, and the K/V of every position but a
// sequence's newest, written by earlier steps; q/k-norm + RoPE its tokens'
// positions and slots, copied likewise) and writes nothing. By induction every
// earlier kernel has then completed when a kernel passes its wait, so the
// stream keeps its usual order for all data.
// CUDA graphs record the attribute as a programmatic edge. Below sm_90 both
// calls compile to nothing and launches are plain.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <utility>

#include "common.cuh"

namespace mini_vllm {

// --8<-- [start:pdl]
// Let the next kernel in the stream be scheduled (it still waits in pdl_wait).
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Wait until the kernels this one depends on have completed, writes visible.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// --8<-- [end:pdl]

// On by default where the GPU supports it; `set_programmatic_launch(False)`
// turns it off (to measure what it buys, or to rule it out).
std::atomic<bool>& programmatic_launch_flag();
bool programmatic_launch_supported();  // the current device is sm_90 or newer

// Launch `kernel` on `stream` in clusters of `cluster` CTAs (1 x 1 x 1: no
// clusters), with PDL when it is on and supported.
template <typename... Params, typename... Args>
void launch_kernel_in_clusters(void (*kernel)(Params...), dim3 grid, dim3 block, dim3 cluster,
                               size_t smem, cudaStream_t stream, const char* what,
                               Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  unsigned num_attrs = 0;
  if (programmatic_launch_flag().load(std::memory_order_relaxed) &&
      programmatic_launch_supported()) {
    attr[num_attrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[num_attrs].val.programmaticStreamSerializationAllowed = 1;
    ++num_attrs;
  }
  if (cluster.x * cluster.y * cluster.z > 1) {
    attr[num_attrs].id = cudaLaunchAttributeClusterDimension;
    attr[num_attrs].val.clusterDim.x = cluster.x;
    attr[num_attrs].val.clusterDim.y = cluster.y;
    attr[num_attrs].val.clusterDim.z = cluster.z;
    ++num_attrs;
  }
  cfg.attrs = attr;
  cfg.numAttrs = num_attrs;
  check_cuda(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...), what);
}

// Launch `kernel` on `stream`, with PDL when it is on and supported.
template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                   cudaStream_t stream, const char* what, Args&&... args) {
  launch_kernel_in_clusters(kernel, grid, block, dim3(1, 1, 1), smem, stream, what,
                            std::forward<Args>(args)...);
}

}  // namespace mini_vllm
