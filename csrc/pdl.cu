// Host side of programmatic dependent launch (see pdl.cuh).
#include "pdl.cuh"

namespace mini_vllm {

std::atomic<bool>& programmatic_launch_flag() {
  static std::atomic<bool> enabled{true};
  return enabled;
}

bool programmatic_launch_supported() {
  return device_attribute(cudaDevAttrComputeCapabilityMajor) >= 9;
}

}  // namespace mini_vllm
