// K-split last wave (scheduler/gemm.cuh, TailSplit): a tile's K pieces run at the same time on
// consecutive CTAs c0 .. c0 + parts - 1 and add their FP32 partial tiles in piece order (the same order
// whoever finishes first), through a workspace of kKSplitFlagWords flags, then one slot of
// BLOCK_M x BLOCK_N floats per CTA. Two forms:
// - reduce-scatter (the plain bf16 epilogue of 128-row tiles): every piece publishes its partial, waits
//   for all of them, then sums and stores its share of the tile's 8-column chunks. Flags: arrivals
//   counted at workspace[c0], departures at workspace[c0 + 1] (tiles' CTA ranges do not overlap and hold
//   two pieces or more); the last to depart lowers both for the next launch.
// - gather (the fused SiLU·mul + quant epilogue, whose quantization groups span a tile's 128 columns, and
//   64-row tiles, where it measured faster at decode: fp8_gemm.cuh): pieces 1.. publish and raise
//   workspace[their CTA]; piece 0 waits for them, adds the partials, lowers the flags and stores the
//   whole tile.
// NOTE: piece 0 of the gather read three 128 KB partials of a 128x256 tile alone, ~3 us at one SM's L2
// read rate (session 21 ncu); reduce-scatter spreads it over the pieces (session 22).
// Waiting is safe: a piece is its CTA's last unit, and the persistent grid (at most one CTA per SM) is
// resident at once.
#pragma once

#include "../common/types.cuh"
#include "../ptx/barrier.cuh"
#include "../ptx/misc.cuh"
#include "store.cuh"

namespace moe_fp8::epi {

constexpr uint32_t kKSplitFlagWords = 1024;  // the grid's CTAs, at most (the host checks)

// CTA `cta`'s slot, fragment-major: floats 4q..4q+3 of math thread t at float4 q * kNumMathThreads + t,
// so each warp access covers 512 contiguous bytes.
template <uint32_t kNumAccum, uint32_t kNumMathThreads>
__device__ __forceinline__ float* k_split_slot(uint32_t* workspace, uint32_t cta) {
    return reinterpret_cast<float*>(workspace + kKSplitFlagWords) + cta * kNumAccum * kNumMathThreads;
}

// This CTA's partial (`total`: the math thread's D fragment, kNumAccum floats) into its slot, visible
// GPU-wide once the calling math threads pass `bar_id` (the caller's thread 0 then signals).
template <uint32_t kNumAccum, uint32_t kNumMathThreads>
__device__ __forceinline__ void write_partial(uint32_t* workspace, const float* total, uint32_t bar_id) {
    static_assert(kNumAccum % 4 == 0, "whole float4s per thread");
    float* slot = k_split_slot<kNumAccum, kNumMathThreads>(workspace, blockIdx.x) + 4 * threadIdx.x;
#pragma unroll
    for (uint32_t q = 0; q < kNumAccum / 4; ++q)
        ptx::st_global_cg_v4(slot + 4 * q * kNumMathThreads, total[4 * q], total[4 * q + 1], total[4 * q + 2],
                             total[4 * q + 3]);
    ptx::fence_acq_rel_gpu();  // each thread's partial before the signal, raised after every thread's fence
    ptx::named_barrier_sync(bar_id, kNumMathThreads);
}

// ---- reduce-scatter ----

// Publish this piece's partial and wait until every piece of the tile has.
template <uint32_t kNumAccum, uint32_t kNumMathThreads>
__device__ __forceinline__ void publish_and_wait(uint32_t* workspace, const float* total, uint32_t c0, uint32_t parts,
                                                 uint32_t bar_id) {
    write_partial<kNumAccum, kNumMathThreads>(workspace, total, bar_id);
    if (threadIdx.x == 0) {
        ptx::red_release_gpu_add_u32(workspace + c0, 1);
        while (ptx::ld_acquire_gpu_u32(workspace + c0) < parts) __nanosleep(32);
    }
    ptx::named_barrier_sync(bar_id, kNumMathThreads);  // thread 0's acquire orders every thread's loads
}

// Chunks [j0, j1) of this warpgroup's rows (`wg_row0`): the pieces' partials summed in piece order (this
// piece's own from `total`), as bf16 into the staging tile.
template <uint32_t BLOCK_N, uint32_t kNumAccum, uint32_t kNumMathThreads, uint32_t kMaxPieces>
__device__ __forceinline__ void sum_share_to_smem(uint32_t* workspace, const float* total, uint8_t* smem_d,
                                                  uint32_t wg_row0, uint32_t c0, uint32_t parts, uint32_t piece,
                                                  uint32_t j0, uint32_t j1) {
    uint8_t* base = fragment_smem_base<BLOCK_N>(smem_d, wg_row0);
    const float* slot0 = k_split_slot<kNumAccum, kNumMathThreads>(workspace, c0) + 4 * threadIdx.x;
    constexpr uint32_t kSlotFloats = kNumAccum * kNumMathThreads;
#pragma unroll
    for (uint32_t j = 0; j < kNumAccum / 4; ++j) {  // (compile-time j: `total` stays in registers)
        if (j < j0 || j >= j1) continue;
        float v[4];
#pragma unroll  // (the loads of a chunk's pieces in flight together)
        for (uint32_t p = 0; p < kMaxPieces; ++p) {
            if (p >= parts) break;
            float x[4];
            if (p == piece) {
                x[0] = total[4 * j], x[1] = total[4 * j + 1], x[2] = total[4 * j + 2], x[3] = total[4 * j + 3];
            } else {
                ptx::ld_global_cg_v4(slot0 + p * kSlotFloats + 4 * j * kNumMathThreads, x[0], x[1], x[2], x[3]);
            }
#pragma unroll
            for (uint32_t i = 0; i < 4; ++i) v[i] = p == 0 ? x[i] : v[i] + x[i];
        }
        write_chunk_to_smem<BLOCK_N>(base, j, v[0], v[1], v[2], v[3]);
    }
}

// After every math thread is done with the others' partials: the last piece to leave lowers the flags.
__device__ __forceinline__ void depart(uint32_t* workspace, uint32_t c0, uint32_t parts) {
    if (atomicAdd(workspace + c0 + 1, 1u) == parts - 1) {
        workspace[c0] = 0;
        workspace[c0 + 1] = 0;
    }
}

// ---- gather (the fused epilogue) ----

template <uint32_t kNumAccum, uint32_t kNumMathThreads>
__device__ __forceinline__ void publish_partial(uint32_t* workspace, const float* total, uint32_t bar_id) {
    write_partial<kNumAccum, kNumMathThreads>(workspace, total, bar_id);
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
