// mbarrier and named-barrier wrappers (PTX ISA 8.0+, sm_90).
#pragma once

#include "../common/types.cuh"

namespace moe_fp8::ptx {

__device__ __forceinline__ uint32_t smem_addr(const void* ptr) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t arrive_count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(arrive_count));
}

// Makes barrier initialisation visible to the async proxy (TMA) and to the rest of the cluster.
__device__ __forceinline__ void fence_barrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// Arrive on the barrier at the same offset in CTA `cta_id` of the cluster.
// NOTE: the default (.release.cta) semantics suffice for pipeline slots: the only data this publishes
// is the slot's smem, read by wgmma and waited for already. An explicit .release.cluster costs a
// cluster-wide fence per arrive, measured at ~3x the whole GEMM's time on H100 with 2-CTA multicast.
// kReleaseCluster publishes this thread's prior shared-memory writes to the whole cluster (for data
// peers read through DSMEM, once per tile); pair it with mbar_wait<true>.
template <bool kReleaseCluster = false>
__device__ __forceinline__ void mbar_arrive_cluster(uint64_t* bar, uint32_t cta_id) {
    uint32_t remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_addr(bar)), "r"(cta_id));
    if constexpr (kReleaseCluster)
        asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
    else
        asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
}

__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
                 : "memory");
}

// Spin until the phase with parity `phase` of the barrier has completed; kAcquireCluster makes the
// writes peers released with mbar_arrive_cluster<true> visible.
template <bool kAcquireCluster = false>
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t phase) {
    if constexpr (kAcquireCluster)
        asm volatile(
            "{\n.reg .pred done;\n"
            "LAB_WAIT:\n"
            "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n"
            "@!done bra LAB_WAIT;\n}\n" ::"r"(smem_addr(bar)),
            "r"(phase)
            : "memory");
    else
        asm volatile(
            "{\n.reg .pred done;\n"
            "LAB_WAIT:\n"
            "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
            "@!done bra LAB_WAIT;\n}\n" ::"r"(smem_addr(bar)),
            "r"(phase)
            : "memory");
}

// bar.sync on a hardware named barrier shared by `num_threads` threads (a multiple of 32).
__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t num_threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(num_threads) : "memory");
}

// Arrive without waiting: the arriving thread's prior shared-memory writes are visible to the
// threads that complete the barrier with named_barrier_sync.
__device__ __forceinline__ void named_barrier_arrive(uint32_t id, uint32_t num_threads) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(num_threads) : "memory");
}

__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

__device__ __forceinline__ uint32_t cluster_cta_rank() {
    uint32_t rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    return rank;
}

}  // namespace moe_fp8::ptx
