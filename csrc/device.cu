// Facts about the current device that the launchers consult on every launch.
#include <map>
#include <tuple>
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

int resident_blocks_per_sm(const void* kernel, int threads, size_t smem) {
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  thread_local std::map<std::tuple<int, const void*, int, size_t>, int> known;
  const auto [it, added] = known.try_emplace({device, kernel, threads, smem}, 0);
  if (added) {
    check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&it->second, kernel, threads, smem),
               "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  }
  return it->second;
}

}  // namespace mini_vllm
