// The asynchronous global -> shared copies decode attention v6 and v7 share
// (cp.async, sm_80+): each thread issues 16-byte copies that land in shared
// memory without passing through its registers, groups them, and waits for
// the groups it needs.
#pragma once

#include <cstdint>

namespace mini_vllm {

// --8<-- [start:cp_async]
// Copy 16 bytes global -> shared without passing through registers. With
// `valid` false nothing is read and the 16 bytes are zero-filled (a token
// past the end of the partition: its V row is then 0, not NaN or garbage).
__device__ __forceinline__ void cp_async16(uint32_t smem_addr, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(smem_addr),
               "l"(gmem), "r"(valid ? 16 : 0)
               : "memory");
}

// Close the group of copies issued since the last commit.
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Wait until at most N committed groups of this thread are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
// --8<-- [end:cp_async]

}  // namespace mini_vllm
