// Bulk copies (TMA): tensor boxes global -> shared completing on an mbarrier; plain byte ranges both ways.
#pragma once

#include "../common/types.cuh"
#include "barrier.cuh"

namespace moe_fp8::ptx {

__device__ __forceinline__ void tma_prefetch_desc(const TmaDesc* desc) {
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(desc)) : "memory");
}

// The box at (c0 inner, c1 outer) into L2 only (no shared memory, no barrier).
__device__ __forceinline__ void tma_prefetch_l2_2d(const TmaDesc* desc, int32_t c0, int32_t c1) {
    asm volatile("cp.async.bulk.prefetch.tensor.2d.L2.global.tile [%0, {%1, %2}];"
                 ::"l"(reinterpret_cast<uint64_t>(desc)), "r"(c0), "r"(c1) : "memory");
}

// Load the box at (c0 inner, c1 outer) into `dst`; out-of-bounds elements are filled with zeros and
// still count towards the barrier's transaction bytes.
__device__ __forceinline__ void tma_load_2d(void* dst, const TmaDesc* desc, uint64_t* bar, int32_t c0, int32_t c1) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(
            smem_addr(dst)),
        "l"(reinterpret_cast<uint64_t>(desc)), "r"(smem_addr(bar)), "r"(c0), "r"(c1)
        : "memory");
}

// Same box, written to the same smem offset of every CTA in `cta_mask`; each destination CTA's
// barrier at `bar`'s offset receives the bytes.
__device__ __forceinline__ void tma_load_2d_multicast(void* dst, const TmaDesc* desc, uint64_t* bar, int32_t c0,
                                                      int32_t c1, uint16_t cta_mask) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster "
        "[%0], [%1, {%3, %4}], [%2], %5;" ::"r"(smem_addr(dst)),
        "l"(reinterpret_cast<uint64_t>(desc)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "h"(cta_mask)
        : "memory");
}

// L2 eviction policies for the `.L2::cache_hint` forms: a stream read or written once goes first, so data
// that must stay in L2 (sectors filled a few bytes at a time) does not.
__device__ __forceinline__ uint64_t policy_evict_first() {
    uint64_t policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    return policy;
}

__device__ __forceinline__ uint64_t policy_evict_normal() {
    uint64_t policy;
    asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(policy));
    return policy;
}

__device__ __forceinline__ uint64_t policy_evict_last() {
    uint64_t policy;
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
    return policy;
}

// `bytes` (a multiple of 16, both addresses 16-byte aligned) from global `src` to shared `dst`, completing
// on `bar` (which must expect them).
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar, uint64_t policy) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
        ::"r"(smem_addr(dst)), "l"(reinterpret_cast<uint64_t>(src)), "r"(bytes), "r"(smem_addr(bar)), "l"(policy)
        : "memory");
}

// `bytes` (a multiple of 16, both addresses 16-byte aligned) from shared `src` to global `dst`, in the
// thread's current bulk group.
__device__ __forceinline__ void bulk_store(void* dst, const void* src, uint32_t bytes, uint64_t policy) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group.L2::cache_hint [%0], [%1], %2, %3;"
                 ::"l"(reinterpret_cast<uint64_t>(dst)), "r"(smem_addr(src)), "r"(bytes), "l"(policy)
                 : "memory");
}

// The same without an eviction policy (one register fewer where registers are scarce).
__device__ __forceinline__ void bulk_store(void* dst, const void* src, uint32_t bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                 ::"l"(reinterpret_cast<uint64_t>(dst)), "r"(smem_addr(src)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

// The thread's committed bulk stores have read their shared-memory sources (which may then be reused).
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }

// The thread's committed bulk stores are complete (their writes performed).
__device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// A 4-byte store under an L2 eviction policy.
__device__ __forceinline__ void st_global_hint_f32(float* ptr, float v, uint64_t policy) {
    asm volatile("st.global.L2::cache_hint.f32 [%0], %1, %2;" ::"l"(ptr), "f"(v), "l"(policy) : "memory");
}

}  // namespace moe_fp8::ptx
