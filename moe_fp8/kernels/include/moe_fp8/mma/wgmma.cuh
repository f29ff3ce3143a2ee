// wgmma plumbing: shared-memory matrix descriptors and the fence / commit / wait protocol.
#pragma once

#include "../common/types.cuh"
#include "../ptx/barrier.cuh"
#include "wgmma_fp8.cuh"

namespace moe_fp8::mma {

// Descriptor of a K-major tile whose rows are exactly 128 bytes, written by TMA with 128-byte
// swizzle: 8-row core groups are 1024 bytes apart (stride byte offset); the leading byte offset is
// unused in this mode. The tile base must be 1024-byte aligned (swizzle phase 0).
__device__ __forceinline__ uint64_t make_desc_k_major_sw128(const void* smem_ptr) {
    const uint32_t addr = ptx::smem_addr(smem_ptr);
    uint64_t desc = 0;
    desc |= static_cast<uint64_t>((addr & 0x3FFFF) >> 4);
    desc |= static_cast<uint64_t>(1) << 16;
    desc |= static_cast<uint64_t>(1024 >> 4) << 32;
    desc |= static_cast<uint64_t>(1) << 62;
    return desc;
}

// Step a K-major sw128 descriptor along K by `bytes` (the hardware applies the swizzle to the
// resulting address, so sub-row offsets are a plain add of bytes / 16).
__device__ __forceinline__ uint64_t advance_desc(uint64_t desc, uint32_t bytes) {
    return desc + (bytes >> 4);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }

__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }

template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// Keeps the compiler from moving accumulator reads/writes across the async wgmma boundary.
__device__ __forceinline__ void fence_operand(float& reg) { asm volatile("" : "+f"(reg)::"memory"); }

}  // namespace moe_fp8::mma
