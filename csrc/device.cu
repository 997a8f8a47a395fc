// Facts about the current device that the launchers consult on every launch.
#include <map>
#include <mutex>
#include <tuple>
#include <utility>

#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled

#include "common.cuh"
#include "tma.cuh"

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

int max_active_clusters(const void* kernel, int threads, size_t smem, int cluster) {
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  thread_local std::map<std::tuple<int, const void*, int, size_t, int>, int> known;
  const auto [it, added] = known.try_emplace({device, kernel, threads, smem, cluster}, 0);
  if (added) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(cluster, 1, 1);
    cfg.blockDim = dim3(threads, 1, 1);
    cfg.dynamicSmemBytes = smem;
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = cluster;
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    check_cuda(cudaOccupancyMaxActiveClusters(&it->second, kernel, &cfg),
               "cudaOccupancyMaxActiveClusters");
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

CUtensorMap make_tensor_map(const void* base, DType dtype, int rank, const uint64_t* sizes,
                            const uint64_t* strides, const uint32_t* box) {
  // The driver's encoder, asked for once: the module links only the runtime.
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    check_cuda(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000,
                                                cudaEnableDefault, &found),
               "cudaGetDriverEntryPointByVersion(cuTensorMapEncodeTiled)");
    if (found != cudaDriverEntryPointSuccess || fn == nullptr) {
      throw std::runtime_error("the CUDA driver has no cuTensorMapEncodeTiled (too old?)");
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  if (dtype != DType::kBFloat16 && dtype != DType::kFloat16) {
    throw std::invalid_argument("tensor maps are built for float16 and bfloat16 only");
  }
  if (rank < 1 || rank > 5) throw std::invalid_argument("a tensor map has 1 to 5 dimensions");
  CUtensorMap map{};
  cuuint64_t dims[5], byte_strides[4];
  cuuint32_t box_dims[5], element_strides[5];
  for (int i = 0; i < rank; ++i) {
    dims[i] = sizes[i];
    box_dims[i] = box[i];
    element_strides[i] = 1;
    if (i > 0) byte_strides[i - 1] = strides[i - 1];
  }
  const CUresult r = encode(
      &map,
      dtype == DType::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
      static_cast<cuuint32_t>(rank), const_cast<void*>(base), dims, byte_strides, box_dims,
      element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      // No L2 promotion: fetch exactly the box. Promoting the fetches to 256 B
      // made version 9 slower than version 7 (chapter 8).
      CU_TENSOR_MAP_L2_PROMOTION_NONE,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    throw std::invalid_argument(
        "cuTensorMapEncodeTiled refused the map (error " + std::to_string(static_cast<int>(r)) +
        "): the base must be 16-byte aligned and the strides multiples of 16 bytes");
  }
  return map;
}

}  // namespace mini_vllm
