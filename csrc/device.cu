// Facts about the current device that the launchers consult on every launch.
#include <map>
#include <utility>

#include "common.cuh"

namespace mini_vllm {

int device_attribute(cudaDeviceAttr attr) {
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  // One map per host thread: no lock on the launch path, one query per
  // (thread, device, attribute).
  thread_local std::map<std::pair<int, int>, int> known;
  const auto [it, added] = known.try_emplace({device, static_cast<int>(attr)}, 0);
  if (added) {
    check_cuda(cudaDeviceGetAttribute(&it->second, attr, device), "cudaDeviceGetAttribute");
  }
  return it->second;
}

}  // namespace mini_vllm
