// Split-K epilogue: the kSplitK CTAs of a cluster computed the same output tile over disjoint K
// ranges. Each publishes its FP32 partial tile in its own shared memory, then sums its share of the
// tile's 8-column chunks over every partial, read through DSMEM in rank order (so the result does not
// depend on which CTA sums it), and stages that share as bf16 for the store warps.
#pragma once

#include "../common/types.cuh"
#include "../ptx/barrier.cuh"
#include "../ptx/misc.cuh"
#include "store.cuh"

namespace moe_fp8::epi {

// `total`: this math thread's D fragment (BLOCK_N / 2 floats). `partial`: kNumMathThreads * BLOCK_N / 2
// floats of this CTA's shared memory, free now (the drained pipeline stages), laid out fragment-major
// (float i of thread t at i * kNumMathThreads + t: consecutive threads, consecutive words).
// `reduce_bar`: initialised for kSplitK * kNumMathThreads arrivals, used once.
template <uint32_t BLOCK_N, uint32_t kNumMathThreads, uint32_t kSplitK>
__device__ __forceinline__ void reduce_split_k(float* partial, uint64_t* reduce_bar, const float* total,
                                               uint8_t* smem_d, uint32_t wg_row0) {
    constexpr uint32_t kNumAccum = BLOCK_N / 2;
    constexpr uint32_t kChunks = BLOCK_N / 8 / kSplitK;  // 8-column chunks each CTA sums and stores
    const uint32_t t = threadIdx.x;
    // the partial overwrites stage buffers last written by TMA and read by wgmma (async proxy)
    ptx::fence_proxy_async_shared();
#pragma unroll
    for (uint32_t i = 0; i < kNumAccum; ++i) ptx::st_shared_f32(partial + i * kNumMathThreads + t, total[i]);
#pragma unroll
    for (uint32_t p = 0; p < kSplitK; ++p) ptx::mbar_arrive_cluster<true>(reduce_bar, p);
    ptx::mbar_wait<true>(reduce_bar, 0);

    const uint32_t chunk0 = ptx::cluster_cta_rank() * kChunks;
    uint32_t peer[kSplitK];
#pragma unroll
    for (uint32_t p = 0; p < kSplitK; ++p) peer[p] = ptx::map_shared_to_cta(partial + t, p);
    uint8_t* base = fragment_smem_base<BLOCK_N>(smem_d, wg_row0);
#pragma unroll
    for (uint32_t c = 0; c < kChunks; ++c) {
        float v[4];
#pragma unroll
        for (uint32_t e = 0; e < 4; ++e) {
            const uint32_t offset = (4 * (chunk0 + c) + e) * kNumMathThreads * sizeof(float);
            v[e] = 0.0f;
#pragma unroll
            for (uint32_t p = 0; p < kSplitK; ++p) v[e] += ptx::ld_shared_cluster_f32(peer[p] + offset);
        }
        write_chunk_to_smem<BLOCK_N>(base, chunk0 + c, v[0], v[1], v[2], v[3]);
    }
}

}  // namespace moe_fp8::epi
