// K-split last wave (scheduler/gemm.cuh, TailSplit): a tile's K pieces run at the same time on
// consecutive CTAs. Every piece but the first publishes its FP32 partial tile in its CTA's workspace
// slot and raises the CTA's flag; the first piece waits for the flags, adds the partials in piece order
// (the same order whoever finishes first) and stores the tile.
// Workspace: kKSplitFlagWords flags (zero between launches: the gatherer lowers them), then one slot
// of BLOCK_M x BLOCK_N floats per CTA. Waiting is safe: a publishing piece is its CTA's last unit and
// waits on nothing, and the persistent grid (at most one CTA per SM) is resident at once.
#pragma once

#include "../common/types.cuh"
#include "../ptx/barrier.cuh"
#include "../ptx/misc.cuh"

namespace moe_fp8::epi {

constexpr uint32_t kKSplitFlagWords = 1024;  // the grid's CTAs, at most (the host checks)

// CTA `cta`'s slot, fragment-major: floats 4q..4q+3 of math thread t at float4 q * kNumMathThreads + t,
// so each warp access covers 512 contiguous bytes.
template <uint32_t kNumAccum, uint32_t kNumMathThreads>
__device__ __forceinline__ float* k_split_slot(uint32_t* workspace, uint32_t cta) {
    return reinterpret_cast<float*>(workspace + kKSplitFlagWords) + cta * kNumAccum * kNumMathThreads;
}

// `total`: this math thread's D fragment (kNumAccum floats); `bar_id`: a named barrier of the math threads.
template <uint32_t kNumAccum, uint32_t kNumMathThreads>
__device__ __forceinline__ void publish_partial(uint32_t* workspace, const float* total, uint32_t bar_id) {
    static_assert(kNumAccum % 4 == 0, "whole float4s per thread");
    float* slot = k_split_slot<kNumAccum, kNumMathThreads>(workspace, blockIdx.x) + 4 * threadIdx.x;
#pragma unroll
    for (uint32_t q = 0; q < kNumAccum / 4; ++q)
        ptx::st_global_cg_v4(slot + 4 * q * kNumMathThreads, total[4 * q], total[4 * q + 1], total[4 * q + 2],
                             total[4 * q + 3]);
    ptx::fence_acq_rel_gpu();  // each thread's partial before the flag, raised after every thread's fence
    ptx::named_barrier_sync(bar_id, kNumMathThreads);
    if (threadIdx.x == 0) ptx::st_release_gpu_u32(workspace + blockIdx.x, 1);
}

// total += the partials of CTAs blockIdx.x + 1 .. last_cta, in that order.
template <uint32_t kNumAccum, uint32_t kNumMathThreads>
__device__ __forceinline__ void gather_partials(uint32_t* workspace, float* total, uint32_t last_cta,
                                                uint32_t bar_id) {
    if (threadIdx.x == 0) {
        for (uint32_t cta = blockIdx.x + 1; cta <= last_cta; ++cta) {
            while (!ptx::ld_acquire_gpu_u32(workspace + cta)) __nanosleep(64);
            workspace[cta] = 0;  // for the next launch, whose publishers stream order puts after this kernel
        }
    }
    ptx::named_barrier_sync(bar_id, kNumMathThreads);  // thread 0's acquires order every thread's loads
#pragma unroll 1
    for (uint32_t cta = blockIdx.x + 1; cta <= last_cta; ++cta) {
        const float* slot = k_split_slot<kNumAccum, kNumMathThreads>(workspace, cta) + 4 * threadIdx.x;
#pragma unroll
        for (uint32_t q = 0; q < kNumAccum / 4; ++q) {
            float x, y, z, w;
            ptx::ld_global_cg_v4(slot + 4 * q * kNumMathThreads, x, y, z, w);
            total[4 * q] += x, total[4 * q + 1] += y, total[4 * q + 2] += z, total[4 * q + 3] += w;
        }
    }
}

}  // namespace moe_fp8::epi
