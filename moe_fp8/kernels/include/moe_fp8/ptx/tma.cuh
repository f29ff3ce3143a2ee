// Bulk tensor copies (TMA), global -> shared, completing on an mbarrier.
#pragma once

#include "../common/types.cuh"
#include "barrier.cuh"

namespace moe_fp8::ptx {

__device__ __forceinline__ void tma_prefetch_desc(const TmaDesc* desc) {
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(desc)) : "memory");
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

}  // namespace moe_fp8::ptx
