// Facts about the current device that the launchers consult on every launch.
#include <map>
#include <mutex>
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

void allow_dynamic_smem(const void* kernel, size_t bytes) {
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  static std::mutex mutex;
  static std::map<std::pair<int, const void*>, size_t> allowed;
  std::lock_guard<std::mutex> lock(mutex);
  const auto [it, added] = allowed.try_emplace({device, kernel}, 0);
  if (!added && it->second >= bytes) return;
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(bytes)),
             "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                  cudaSharedmemCarveoutMaxShared),
             "cudaFuncSetAttribute(PreferredSharedMemoryCarveout)");
  it->second = bytes;
}

}  // namespace mini_vllm
