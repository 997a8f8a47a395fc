// Host side of programmatic dependent launch (see pdl.cuh).
#include "pdl.cuh"

namespace mini_vllm {

std::atomic<bool>& programmatic_launch_flag() {
  static std::atomic<bool> enabled{true};
  return enabled;
}

bool programmatic_launch_supported() {
  // Per device: 0 not asked yet, 1 no, 2 yes (sm_90+). Asked once per device.
  constexpr int kMaxDevices = 64;
  static std::atomic<int> known[kMaxDevices];
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  if (device < 0 || device >= kMaxDevices) return false;
  int state = known[device].load(std::memory_order_relaxed);
  if (state == 0) {
    int major = 0;
    check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
               "cudaDeviceGetAttribute");
    state = major >= 9 ? 2 : 1;
    known[device].store(state, std::memory_order_relaxed);
  }
  return state == 2;
}

}  // namespace mini_vllm
